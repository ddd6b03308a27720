"""The demo's own order model: its transitions' bodies record what the messages carry, and
its admin answers.

A consumed message runs the transition with the payload's entries its parameters name
(:func:`body_kwargs`); these tests call the bodies directly, the reference the consume
road is compared against.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from demo_project.management.commands.run_demo import build_messages
from demo_project.models import ShopOrder, ShopState
from tests.support.services import ROOT


def body_kwargs(method: Callable[..., Any], payload: Mapping[str, Any]) -> dict[str, Any]:
    """The payload's entries whose names are parameters of ``method`` (all with ``**kwargs``)."""
    params = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(payload)
    names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    return {k: v for k, v in payload.items() if k in names}


def make_shop_order(**kwargs: Any) -> ShopOrder:
    kwargs.setdefault("business_key", "demo-order-1")
    kwargs.setdefault("amount", Decimal("88.00"))
    kwargs.setdefault("currency", "CNY")
    return ShopOrder.objects.create(**kwargs)


@pytest.mark.django_db
def test_mark_paid_records_the_payment() -> None:
    order = make_shop_order()
    before = timezone.now()
    order.mark_paid(payment_id="PAY-1", amount="88.00")
    order.save()
    saved = ShopOrder.objects.get(pk=order.pk)
    assert saved.state == ShopState.PAID
    assert saved.payment_id == "PAY-1"
    assert saved.amount_paid == Decimal("88.00")
    assert saved.amount == Decimal("88.00")  # the price is not touched
    assert saved.paid_at is not None
    assert before <= saved.paid_at <= timezone.now()


@pytest.mark.django_db
def test_mark_paid_refuses_another_currency() -> None:
    order = make_shop_order()
    with pytest.raises(ValueError, match="USD"):
        order.mark_paid(payment_id="PAY-1", amount="88.00", currency="USD")
    assert order.state == ShopState.AWAITING_PAYMENT
    assert (order.payment_id, order.amount_paid, order.paid_at) == ("", None, None)


@pytest.mark.django_db
def test_the_demo_messages_payloads_feed_the_bodies() -> None:
    """The demo's own messages (run_demo) name every parameter the bodies need."""
    order = make_shop_order()
    payloads = {body["type"]: body["payload"] for _, body in build_messages(order)}

    pay = payloads["payment.succeeded"]
    assert body_kwargs(order.mark_paid, pay) == {
        "payment_id": f"PAY-{order.pk}",
        "amount": "88.00",
        "currency": "CNY",
    }
    order.mark_paid(**body_kwargs(order.mark_paid, pay))
    order.save()
    dispatched = payloads["shipment.dispatched"]
    assert body_kwargs(order.dispatch, dispatched) == dispatched
    order.dispatch(**body_kwargs(order.dispatch, dispatched))
    order.save()
    delivered = payloads["shipment.delivered"]
    assert body_kwargs(order.deliver, delivered) == {}
    order.deliver(**body_kwargs(order.deliver, delivered))
    order.save()

    saved = ShopOrder.objects.get(pk=order.pk)
    assert saved.state == ShopState.DELIVERED
    assert saved.payment_id == f"PAY-{order.pk}"
    assert saved.amount_paid == Decimal("88.00")
    assert saved.paid_at is not None
    assert saved.tracking_number == f"SF{order.pk:08d}"
    assert saved.carrier == "sf-express"


ADMIN_PAGES = """
from decimal import Decimal
from pathlib import Path
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import setup_test_environment
from demo_project.models import ShopOrder

setup_test_environment()
user = get_user_model().objects.create_superuser("operator", "op@example.com", "pw")
order = ShopOrder.objects.create(business_key="k-1", amount=Decimal("88.00"), currency="CNY")
client = Client()
client.force_login(user)
listing = client.get("/admin/demo_project/shoporder/")
change = client.get(f"/admin/demo_project/shoporder/{order.pk}/change/")
actions = [name for name, _ in listing.context["action_form"].fields["action"].choices]
print("changelist", listing.status_code)
print("change", change.status_code)
print("actions", " ".join(sorted(a for a in actions if a.startswith("transition_"))))
print("editable", " ".join(sorted(change.context["adminform"].form.fields)))
"""


@pytest.mark.backends("sqlite")
def test_demo_admin_pages_answer_for_a_superuser(tmp_path: Path) -> None:
    """Under the demo's settings (ShopOrder is the order model), in a process of its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
    }
    env.update(DJANGO_SETTINGS_MODULE="demo_project.settings", DEMO_STATE_DIR=str(tmp_path))

    def manage(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    manage("migrate", "-v0")
    out = dict(
        line.split(" ", 1) for line in manage("shell", "-v0", "-c", ADMIN_PAGES).splitlines()
    )
    assert out["changelist"] == "200"
    assert out["change"] == "200"
    assert out["actions"].split() == [
        f"transition_{name}"
        for name in (
            "cancel",
            "deliver",
            "dispatch",
            "expire",
            "mark_paid",
            "pack",
            "refund",
            "start_picking",
        )
    ]
    # What the bodies record is read-only, like the state; the price is editable while unpaid.
    assert out["editable"].split() == ["amount", "currency", "customer", "seen", "seen_version"]
