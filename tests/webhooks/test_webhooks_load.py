"""A loaded webhook run: concurrent senders against a live server on a real database.

Three sender threads POST signed bodies to ``/webhooks/fakepay/`` of pytest-django's
live server (a real threaded WSGI server) at once: valid payments, events reusing
another event's id, refunds ahead of their payment and hostile bodies, each sent one
to three times, the copies shuffled across the senders. At the end every valid
payment applied once, every other request is kept with its reason, and nothing was
answered 5xx.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from idempotent_orders import get_order_model
from idempotent_orders.models import (
    OutboxMessage,
    ParkedMessage,
    ProcessedMessage,
    SpentPayment,
    WebhookEvent,
    WebhookStatus,
)
from idempotent_orders.webhooks import ingress
from idempotent_orders.webhooks.signing import stripe_signature
from tests.webhooks.test_webhooks import SECRET, URL, provider_settings

SEED = 20261203
SENDERS = 3
#: Distinct events each sender's share of the run holds (each sent one to three times).
EVENTS_PER_SENDER = 200
#: A sender's bound on the whole run (seconds): it gives up rather than hang.
DEADLINE = 180
#: The share of events sent more than once whose copies are sent at the same moment.
BURSTS = 0.4
PROBLEM = "application/problem+json"


@dataclass
class Planned:
    """One distinct event of the run and what it must come to."""

    kind: str  # valid | reused | refund | hostile
    name: str
    body: bytes = b""
    #: The payload to sign at each send (None: ``body`` as it is).
    payload: dict[str, Any] | None = None
    #: A hostile body's signing secret (None: the provider's).
    secret: str | None = None
    order: Any = None
    payment_id: str = ""
    event_id: str = ""
    #: The expected answer of each copy: (status, problem code or "").
    expect: tuple[int, str] = (200, "")
    #: A reused id's first event: sent only once that one is stored.
    original: Planned | None = None
    copies: int = 1
    #: Its copies sent at the same moment by different senders (else one at a time).
    together: threading.Barrier | None = None
    stored: threading.Event = field(default_factory=threading.Event)
    sends: Iterator[int] = field(default_factory=itertools.count)
    answers: list[tuple[int, str, str]] = field(default_factory=list)

    def signed(self) -> tuple[bytes, str]:
        if self.payload is None:
            body = self.body
        else:
            payload = self.payload
            if "pending_webhooks" in payload:
                # Stripe counts it down between deliveries: a retry all the same.
                payload = {**payload, "pending_webhooks": 3 - next(self.sends)}
            body = json.dumps(payload).encode()
        return body, stripe_signature(self.secret or SECRET, body)


def _payment(event_id: str, order: Any, payment_id: str) -> dict[str, Any]:
    return {
        "id": event_id,
        "type": "payment_intent.succeeded",
        "pending_webhooks": 3,
        "data": {
            "object": {
                "id": payment_id,
                "amount_received": 1250,
                "currency": "cny",
                "metadata": {"order_id": str(order.pk)},
            }
        },
    }


def _said(payload: Any) -> Any:
    """An event without the field its deliveries change."""
    return {k: v for k, v in payload.items() if k != "pending_webhooks"}


def _refund(event_id: str, order: Any, payment_id: str, *, named: bool) -> dict[str, Any]:
    # Named: the charge's metadata names the order (parked until it is paid); else the
    # order is the one its payment intent paid, and none has been paid by it yet.
    metadata = {"order_id": str(order.pk)} if named else {}
    return {
        "id": event_id,
        "type": "charge.refunded",
        "data": {
            "object": {
                "id": f"ch_{event_id}",
                "payment_intent": payment_id,
                "amount": 1250,
                "amount_refunded": 1250,
                "currency": "cny",
                "metadata": metadata,
            }
        },
    }


#: Hostile bodies: how each is built from a unique marker, and the answer it must get.
#: The marker is in the body's first 2,000 characters, so the kept excerpt names it.
HOSTILE: dict[str, tuple[Callable[[str], bytes], str | None, tuple[int, str]]] = {
    "bad-json": (
        lambda m: f'{{"id": "{m}", "type": '.encode(),
        None,
        (400, "webhook-body-invalid"),
    ),
    "non-object": (lambda m: json.dumps([m, 1, 2]).encode(), None, (400, "webhook-body-invalid")),
    "nul-id": (
        lambda m: json.dumps({"id": f"{m}\x00", "type": "payment_intent.succeeded"}).encode(),
        None,
        (400, "webhook-event-id-invalid"),
    ),
    "deeper-than-64": (
        lambda m: f'{{"id": "{m}", "data": '.encode() + b"[" * 65 + b"]" * 65 + b"}",
        None,
        (400, "webhook-body-invalid"),
    ),
    "too-deep-to-read": (
        lambda m: f'{{"id": "{m}", "data": '.encode() + b"[" * 20_000 + b"]" * 20_000 + b"}",
        None,
        (400, "webhook-body-invalid"),
    ),
    "bad-signature": (
        lambda m: json.dumps({"id": m, "type": "payment_intent.succeeded"}).encode(),
        "whsec_forged",
        (400, "webhook-signature-invalid"),
    ),
    "unknown-type": (
        lambda m: json.dumps({"id": m, "type": "customer.created"}).encode(),
        None,
        (422, "webhook-event-type-unknown"),
    ),
}


def _plan(rng: random.Random, make_order: Callable[..., Any]) -> list[Planned]:
    total = SENDERS * EVENTS_PER_SENDER
    kinds = rng.choices(["valid", "reused", "refund", "hostile"], [50, 15, 10, 25], k=total)
    plan: list[Planned] = []
    for i, kind in enumerate(kinds):
        name = f"load{i:04d}"
        if kind == "valid" or kind == "reused":
            # A reused id needs a first event: a valid one, planned just before it.
            order = make_order()
            first = Planned(
                "valid",
                f"{name}v",
                event_id=f"evt_{name}",
                order=order,
                payment_id=f"pi_{name}",
                payload=_payment(f"evt_{name}", order, f"pi_{name}"),
            )
            plan.append(first)
            if kind == "reused":
                other = make_order()
                plan.append(
                    Planned(
                        "reused",
                        f"{name}r",
                        event_id=first.event_id,
                        order=other,
                        payment_id=f"pi_{name}_other",
                        payload=_payment(first.event_id, other, f"pi_{name}_other"),
                        expect=(409, ingress.REUSED),
                        original=first,
                    )
                )
        elif kind == "refund":
            order = make_order()
            named = rng.random() < 0.5
            plan.append(
                Planned(
                    "refund",
                    f"{name}{'n' if named else 'u'}",
                    event_id=f"evt_{name}",
                    order=order,
                    payment_id=f"pi_{name}",
                    payload=_refund(f"evt_{name}", order, f"pi_{name}", named=named),
                )
            )
        else:
            hostile = rng.choice(sorted(HOSTILE))
            build, secret, expect = HOSTILE[hostile]
            marker = f"hostile_{hostile}_{name}"
            plan.append(
                Planned("hostile", marker, body=build(marker), secret=secret, expect=expect)
            )
    for planned in plan:
        planned.copies = rng.randint(1, 3)
        if planned.copies > 1 and planned.kind != "reused" and rng.random() < BURSTS:
            planned.together = threading.Barrier(planned.copies, timeout=DEADLINE / 3)
    return plan


def _queues(rng: random.Random, plan: list[Planned]) -> list[deque[Planned]]:
    """The senders' queues: every copy, shuffled, on a random sender; the copies of a
    burst on distinct senders. Bursts are in one order on every queue, so the senders
    meeting at one never wait for each other in a cycle."""
    units: list[list[Planned]] = []
    for planned in plan:
        if planned.together is not None:
            units.append([planned] * planned.copies)
        else:
            units.extend([planned] for _ in range(planned.copies))
    rng.shuffle(units)
    queues: list[deque[Planned]] = [deque() for _ in range(SENDERS)]
    for unit in units:
        for q in rng.sample(range(SENDERS), len(unit)):
            queues[q].append(unit[0])
    return queues


def _send(base: str, planned: Planned) -> tuple[int, str, str]:
    body, signature = planned.signed()
    request = urllib.request.Request(
        base + URL,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Stripe-Signature": signature},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return (
                response.status,
                response.headers.get("Content-Type", ""),
                response.read().decode(),
            )
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers.get("Content-Type", ""), error.read().decode()


def _sender(base: str, queue: deque[Planned], failures: list[BaseException]) -> None:
    """POST each copy of the queue; a reused id's copy waits (at the back) for its first
    event to be stored, so which event came first is known."""
    deadline = time.monotonic() + DEADLINE
    try:
        waited = 0
        while queue:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(queue)} copies left unsent")
            planned = queue.popleft()
            if planned.original is not None and not planned.original.stored.is_set():
                queue.append(planned)
                waited += 1
                if waited >= len(queue):  # only waiting copies left: let the others send
                    time.sleep(0.01)
                    waited = 0
                continue
            waited = 0
            if planned.together is not None:
                planned.together.wait()
            answer = _send(base, planned)
            planned.answers.append(answer)
            if answer[0] == 200:
                planned.stored.set()
    except BaseException as exc:  # reported by the test
        failures.append(exc)


def _drain() -> None:
    """What the workers do with the queued consumptions: three at once, each queued
    consumption run by the documented task, in shuffled order."""
    from idempotent_orders.tasks import consume_webhook_event

    rows = list(
        OutboxMessage.objects.filter(task_name=ingress.TASK).values_list("payload", flat=True)
    )
    random.Random(SEED).shuffle(rows)
    failures: list[BaseException] = []

    def work(share: list[dict[str, Any]]) -> None:
        try:
            for payload in share:
                consume_webhook_event(payload)
        except BaseException as exc:  # reported by the test
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(rows[i::SENDERS],)) for i in range(SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not failures, failures


# A long run of real concurrency: PostgreSQL's heavy leg and MariaDB's leg of the first
# Django run it; the Django 6 legs leave it out (nothing in it depends on Django's version).
@pytest.mark.heavy
@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inline", [False, True], ids=["queued", "inline"])
def test_a_loaded_run_applies_each_valid_event_once_and_keeps_every_other_with_a_reason(
    live_server: Any, make_order: Callable[..., Any], inline: bool
) -> None:
    """3 concurrent senders x 200 events (600 distinct events, each sent 1-3 times:
    about 1,400 requests), seeded: valid payments for distinct orders, events reusing a
    valid event's id with another order and payment, refunds ahead of their payment
    (named by metadata: parked; found by payment: failed, no order paid by it) and
    hostile bodies (bad JSON, not an object, a NUL in the id, nested past 64 levels or
    too deep to read, a forged signature, an unmapped type). The copies are shuffled
    across the senders; the copies of 40% of the events sent more than once are sent
    by several senders at the same moment.

    Queued, the stored events are then consumed by three workers at once; inline, the
    endpoint consumed them itself. The refused-request limit is raised: the run is
    about correctness (tests/webhooks/test_webhooks.py tests the limit).
    """
    rng = random.Random(SEED)
    plan = _plan(rng, make_order)
    queues = _queues(rng, plan)
    copies = [p for q in queues for p in q]
    config = provider_settings(
        EVENT_TYPES={
            "payment_intent.succeeded": "payment.succeeded",
            "charge.refunded": "payment.refunded",
        },
        TO_MESSAGE="idempotent_orders.webhooks.stripe.to_message",
        INLINE=inline,
    )
    config["WEBHOOK_REFUSED_RATE"] = 1_000_000
    failures: list[BaseException] = []
    started = time.monotonic()
    with override_settings(IDEMPOTENT_ORDERS=config):
        senders = [
            threading.Thread(target=_sender, args=(live_server.url, q, failures)) for q in queues
        ]
        for t in senders:
            t.start()
        for t in senders:
            t.join(DEADLINE + 10)
        assert not [t for t in senders if t.is_alive()], "a sender hung"
        assert not failures, failures
        sent = time.monotonic() - started
        if not inline:
            _drain()
    took = time.monotonic() - started
    print(f"\n{len(copies)} requests sent in {sent:.1f}s; all done in {took:.1f}s")

    # Every copy was answered, never with a 5xx.
    answers = [a for p in plan for a in p.answers]
    assert len(answers) == len(copies)
    assert not [a for a in answers if a[0] >= 500], [a for a in answers if a[0] >= 500][:5]
    by_kind = Counter(p.kind for p in plan)
    assert min(by_kind.values()) >= 30, by_kind

    order_model = get_order_model()
    orders = {o.pk: o for o in order_model._default_manager.all()}
    events = list(WebhookEvent.objects.all())
    stored = {e.event_id: e for e in events if e.event_id is not None}
    refused = [e for e in events if e.event_id is None]
    inbox = Counter(
        ProcessedMessage.objects.filter(consumer="payments").values_list("message_id", "outcome")
    )
    spent = {s.payment_id: s for s in SpentPayment.objects.all()}
    parked = {p.message_id: p for p in ParkedMessage.objects.all()}

    for p in plan:
        got = [(status, kind if status == 200 else json.loads(body)["code"])
               for status, kind, body in p.answers]  # fmt: skip
        if p.kind == "valid":
            # Paid exactly once, by its own payment; one applied inbox row; one spent payment.
            assert got == [(200, "application/json")] * p.copies, (p.name, got)
            order = orders[p.order.pk]
            assert (order.status, order.version, order.payment_id) == ("paid", 1, p.payment_id)
            assert inbox[(p.event_id, "applied")] == 1, p.name
            assert sum(n for (mid, _), n in inbox.items() if mid == p.event_id) == 1, p.name
            assert spent[p.payment_id].order_id == order.pk
            row = stored[p.event_id]
            assert (row.status, row.outcome, row.order_id) == (
                WebhookStatus.PROCESSED, "applied", order.pk,
            ), p.name  # fmt: skip
            assert row.deliveries == p.copies, p.name
        elif p.kind == "reused":
            # The documented 409 problem; kept whole and flagged; its order untouched.
            assert [(a[0], a[1]) for a in p.answers] == [(409, PROBLEM)] * p.copies, p.name
            assert got == [(409, ingress.REUSED)] * p.copies, (p.name, got)
            flagged = [
                e for e in refused
                if e.claimed_id == p.event_id and e.error.startswith(f"{ingress.REUSED}: ")
            ]  # fmt: skip
            # (Two deliveries at the very same moment may keep a row each.)
            assert 1 <= len(flagged) <= p.copies, p.name
            assert sum(e.deliveries for e in flagged) == p.copies, p.name
            assert all(e.status == WebhookStatus.REJECTED for e in flagged)
            assert all(e.order_id == p.order.pk for e in flagged), p.name
            assert all(_said(json.loads(e.body)) == _said(p.payload) for e in flagged), p.name
            order = orders[p.order.pk]
            assert (order.status, order.version) == ("pending_payment", 0), p.name
            assert p.payment_id not in spent
            # The first event's effect stands.
            assert stored[p.event_id].order_id == p.original.order.pk  # type: ignore[union-attr]
        elif p.kind == "refund":
            # Ahead of its payment: kept, with why; nothing applied to the order.
            assert [a[0] for a in p.answers] == [200] * p.copies, (p.name, got)
            row = stored[p.event_id]
            assert row.deliveries == p.copies, p.name
            assert row.error, p.name
            if p.name.endswith("n"):  # named by metadata: parked until the order is paid
                assert (row.status, row.outcome) == (WebhookStatus.PROCESSED, "parked"), p.name
                assert "not possible yet" in row.error, (p.name, row.error)
                assert inbox[(p.event_id, "parked")] == 1, p.name
                assert parked[p.event_id].reason, p.name
            else:  # found by its payment, which has paid no order
                assert row.status == WebhookStatus.FAILED, (p.name, row.status, row.error)
                assert "no order paid by" in row.error, (p.name, row.error)
                assert not [k for k in inbox if k[0] == p.event_id], p.name
            order = orders[p.order.pk]
            assert (order.status, order.version) == ("pending_payment", 0), p.name
        else:
            # A 4xx problem per copy, each copy kept as its own row with its reason.
            assert got == [p.expect] * p.copies, (p.name, got)
            assert all(a[1] == PROBLEM for a in p.answers), p.name
            kept = [e for e in refused if p.name in e.body]
            assert len(kept) == p.copies, (p.name, len(kept))
            for e in kept:
                assert e.status == WebhookStatus.REJECTED
                assert e.error.startswith(f"{p.expect[1]}: "), (p.name, e.error)
                assert e.error.partition(": ")[2], p.name

    # Nothing else was stored, paid or spent.
    assert set(stored) == {p.event_id for p in plan if p.kind in ("valid", "refund")}
    hostile_copies = sum(p.copies for p in plan if p.kind == "hostile")
    reused_rows = [e for e in refused if e.error.startswith(f"{ingress.REUSED}: ")]
    assert len(refused) == hostile_copies + len(reused_rows)
    assert Counter(e.error.partition(":")[0] for e in refused if e not in reused_rows) == Counter(
        p.expect[1] for p in plan if p.kind == "hostile" for _ in range(p.copies)
    )
    valid = [p for p in plan if p.kind == "valid"]
    assert sorted(spent) == sorted(p.payment_id for p in valid)
    paid = sorted(pk for pk, o in orders.items() if o.status != "pending_payment")
    assert paid == sorted(p.order.pk for p in valid)
