"""A 0.1.0 database upgrades in place: its orders, inbox and parked rows survive and work."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.services import ROOT

pytestmark = pytest.mark.backends("sqlite")  # its own database files; one leg is enough

WRITE = """
import django; django.setup()
from decimal import Decimal
from idempotent_orders.models import Order, ProcessedMessage
# The rows are written by today's code: leave out the inbox columns added since
# 0.1.0 (dead_at, migration 0003; fingerprint, 0007), as 0.1.0's model did, or the
# INSERT fails; and the spent-payment record (0006), which 0.1.0 did not keep.
import dataclasses
from idempotent_orders import handlers
opts = ProcessedMessage._meta
for name in ("concrete_fields", "local_concrete_fields", "db_returning_fields"):
    opts.__dict__[name] = tuple(
        f for f in getattr(opts, name) if f.name not in ("dead_at", "fingerprint")
    )
pays = handlers.get_handler("payment.succeeded")
handlers._registry["payment.succeeded"] = dataclasses.replace(pays, money=False)
from idempotent_orders.consuming.single import consume_message
order = Order.objects.create(business_key="legacy-1", amount=Decimal("12.50"), currency="CNY")
pay = {"message_id": "p-1", "type": "payment.succeeded", "order_id": order.pk, "seq": 1,
       "payload": {"payment_id": "PAY-1", "amount": "12.50", "currency": "CNY"}}
done = {"message_id": "c-1", "type": "shipment.delivered", "order_id": order.pk, "seq": 3,
        "payload": {"tracking_number": "TRK1", "carrier": "sf"}}
# In a transaction of the caller's: the road that writes through the ORM, whose trimmed
# fields stand for 0.1.0's model (the one-transaction road writes every column).
from django.db import transaction
with transaction.atomic():
    print(consume_message(pay, consumer="payments").value)
with transaction.atomic():
    print(consume_message(done, consumer="shipping").value)
"""

CHECK = """
import django; django.setup()
from idempotent_orders import get_order_model
from idempotent_orders.models import ParkedMessage, ProcessedMessage
from idempotent_orders.consuming.single import consume_message
order = get_order_model().objects.get(business_key="legacy-1")
print(order.status, order.version, order.last_seq, order.payment_id, ParkedMessage.objects.count())
print(sorted(ProcessedMessage.objects.values_list("message_id", "outcome")))
ship = {"message_id": "d-1", "type": "shipment.dispatched", "order_id": order.pk, "seq": 2,
        "payload": {"tracking_number": "TRK1", "carrier": "sf"}}
print(consume_message(ship, consumer="shipping").value)
order.refresh_from_db()
print(order.status, order.version, order.last_seq, ParkedMessage.objects.count())
"""


def run(settings: str, args: list[str], db_name: str) -> str:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings,
        "IO_TEST_DATABASE": "sqlite",
        "IO_WORKER_DB": "1",
        "IO_TEST_DB_NAME": db_name,
    }
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_0_1_0_database_upgrades_with_no_data_loss(tmp_path: Path) -> None:
    db_name = f"upgrade_{uuid.uuid4().hex[:8]}"
    try:
        run("tests.upgrade.settings", ["manage.py", "migrate", "-v0"], db_name)
        assert run("tests.upgrade.settings", ["-c", WRITE], db_name).split() == [
            "applied",
            "parked",
        ]
        run("tests.settings", ["manage.py", "migrate", "-v0"], db_name)
        plan = run("tests.settings", ["manage.py", "migrate", "--plan"], db_name)
        assert "No planned migration operations" in plan
        lines = run("tests.settings", ["-c", CHECK], db_name).splitlines()
        assert lines[0] == "paid 1 1 PAY-1 1"  # the 0.1.0 rows, as written
        assert lines[1] == "[('c-1', 'parked'), ('p-1', 'applied')]"
        assert lines[2] == "applied"
        assert lines[3] == "completed 3 3 0"  # the parked delivery was released
    finally:
        for suffix in ("", "-wal", "-shm"):
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{db_name}.sqlite3{suffix}"
            path.unlink(missing_ok=True)
