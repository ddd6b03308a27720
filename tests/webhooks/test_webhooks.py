"""Webhook ingress: signatures, durable storage, one consumption per event id, replay, checks."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.test import Client, override_settings

from idempotent_orders.models import (
    AuditEntry,
    OutboxMessage,
    ProcessedMessage,
    WebhookEvent,
    WebhookStatus,
)
from idempotent_orders.webhooks import ingress
from idempotent_orders.webhooks.signing import (
    SignatureError,
    sign_hmac,
    standard_signature,
    stripe_signature,
    verify_hmac,
    verify_standard,
    verify_stripe,
)
from tests.demo.test_shop_customer import token_of

SECRET = "whsec_test_secret"
URL = "/webhooks/fakepay/"


def provider_settings(**extra: Any) -> dict[str, Any]:
    return {
        **settings.IDEMPOTENT_ORDERS,
        "WEBHOOKS": {
            "fakepay": {
                "SCHEME": "stripe",
                "SECRET": SECRET,
                "EVENT_TYPES": {"payment_intent.succeeded": "payment.succeeded"},
                "TO_MESSAGE": "idempotent_orders.webhooks.stripe.payment_intent",
                **extra,
            },
            "generic": {
                "SCHEME": "hmac",
                "SECRETS": ["old", "new"],
                "EVENT_TYPES": {"paid": "payment.succeeded"},
                "TO_MESSAGE": "idempotent_orders.webhooks.stripe.payment_intent",
                "TIMESTAMP_HEADER": "X-Timestamp",
                "INLINE": True,
            },
        },
    }


@pytest.fixture
def fakepay(request: pytest.FixtureRequest) -> Iterator[bool]:
    inline = getattr(request, "param", False)
    with override_settings(IDEMPOTENT_ORDERS=provider_settings(INLINE=inline)):
        yield inline


def event(order: Any, *, event_id: str, payment_id: str, amount: int = 1250) -> dict[str, Any]:
    return {
        "id": event_id,
        "type": "payment_intent.succeeded",
        "data": {
            "object": {
                "id": payment_id,
                "amount_received": amount,
                "currency": "cny",
                "metadata": {"order_id": str(order.pk)},
            }
        },
    }


def post(client: Client, body: bytes, signature: str | None, url: str = URL) -> Any:
    headers = {"HTTP_STRIPE_SIGNATURE": signature} if signature else {}
    return client.post(url, data=body, content_type="application/json", **headers)


def signed_post(client: Client, payload: dict[str, Any], **kw: Any) -> Any:
    body = json.dumps(payload).encode()
    return post(client, body, stripe_signature(SECRET, body, **kw))


def run_queued() -> None:
    """What a worker does with the queued consumptions: each one, in any order, twice."""
    rows = list(OutboxMessage.objects.filter(task_name=ingress.TASK))
    random.shuffle(rows)
    for row in rows * 2:
        ingress.process_event(row.payload["event"])


# -- signatures ------------------------------------------------------------------------


def test_stripe_signature_checks_body_secret_and_age() -> None:
    body = b'{"id": "evt_1"}'
    now = int(time.time())
    verify_stripe(body, stripe_signature(SECRET, body, timestamp=now), [SECRET])
    # A rotated secret: either may have signed; several v1 entries are allowed.
    header = f"{stripe_signature('other', body, timestamp=now)},v1=deadbeef"
    verify_stripe(body, header, ["nope", "other"])
    old = now - 301
    cases: list[tuple[bytes, str | None, str]] = [
        (body + b" ", stripe_signature(SECRET, body, timestamp=now), "webhook-signature-invalid"),
        (body, stripe_signature("wrong", body, timestamp=now), "webhook-signature-invalid"),
        (body, stripe_signature(SECRET, body, timestamp=old), "webhook-timestamp-outside-tolerance"),  # noqa: E501
        (body, None, "webhook-signature-missing"),
        (body, "v1=abc", "webhook-signature-malformed"),
        (body, f"t=x,v1={'0' * 64}", "webhook-signature-malformed"),
    ]  # fmt: skip
    for raw, header_value, code in cases:
        with pytest.raises(SignatureError) as caught:
            verify_stripe(raw, header_value, [SECRET], tolerance=300)
        assert caught.value.code == code


def test_generic_hmac_signs_the_body_and_the_timestamp() -> None:
    body = b"{}"
    verify_hmac(body, sign_hmac("s", body), ["s"])
    now = int(time.time())
    verify_hmac(body, sign_hmac("s", body, timestamp=now), ["x", "s"], timestamp=str(now))
    with pytest.raises(SignatureError, match="does not match"):
        verify_hmac(body, sign_hmac("s", body, timestamp=now), ["s"], timestamp=str(now + 1))
    with pytest.raises(SignatureError) as caught:
        verify_hmac(
            body, sign_hmac("s", body, timestamp=now - 900), ["s"], timestamp=str(now - 900)
        )
    assert caught.value.code == "webhook-timestamp-outside-tolerance"


# -- the endpoint ----------------------------------------------------------------------


@pytest.mark.django_db
def test_refused_requests_get_a_problem_and_are_recorded(
    fakepay: bool, make_order: Callable[..., Any]
) -> None:
    client = Client()
    order = make_order()
    payload = event(order, event_id="evt_bad", payment_id="pi_1")
    body = json.dumps(payload).encode()
    answers = [
        post(client, body, stripe_signature("forged", body)),
        post(client, body, stripe_signature(SECRET, body, timestamp=int(time.time()) - 3600)),
        post(client, body, None),
        signed_post(client, {**payload, "type": "customer.created"}),
        signed_post(client, {"type": "payment_intent.succeeded"}),
        post(client, body, stripe_signature(SECRET, body), url="/webhooks/nobody/"),
    ]
    got = [(r.status_code, r["Content-Type"], r.json()["code"]) for r in answers]
    problem = "application/problem+json"
    assert got == [
        (400, problem, "webhook-signature-invalid"),
        (400, problem, "webhook-timestamp-outside-tolerance"),
        (400, problem, "webhook-signature-missing"),
        (422, problem, "webhook-event-type-unknown"),
        (400, problem, "webhook-event-id-invalid"),
        (404, problem, "webhook-provider-unknown"),
    ]
    refused = list(WebhookEvent.objects.order_by("id"))
    assert [e.status for e in refused] == [WebhookStatus.REJECTED] * 5
    assert all(e.event_id is None for e in refused)  # none occupies the real event's slot
    assert refused[3].claimed_id == "evt_bad"
    assert refused[3].event_type == "customer.created"
    assert refused[0].error.startswith("webhook-signature-invalid")
    assert not ProcessedMessage.objects.exists()
    order.refresh_from_db()
    assert order.status == "pending_payment"
    # The real event still gets in after the forgeries.
    assert signed_post(client, payload).status_code == 200


PROBLEM = "application/problem+json"


@pytest.mark.django_db
@pytest.mark.parametrize("fakepay", [False, True], indirect=True, ids=["queued", "inline"])
@pytest.mark.parametrize(
    "event_id",
    [
        "evt_trailing ",
        " evt_leading",
        "evt_zero\u200bwidth",
        "evt_c1\x85control",
        "evt_rtl\u202eoverride",
        "evt_nul\x00",
        "evt_surrogate\ud800",
        "evt_tab\tinside",
        "x" * 256,
        "",
    ],
    ids=["trailing", "leading", "zwsp", "c1", "rlo", "nul", "surrogate", "tab", "long", "empty"],
)
def test_an_event_id_the_consumer_cannot_take_is_refused_at_the_door_with_its_reason(
    fakepay: bool, event_id: str, make_order: Callable[..., Any]
) -> None:
    order = make_order()
    response = signed_post(Client(), event(order, event_id=event_id, payment_id="pi_id"))
    assert (response.status_code, response["Content-Type"]) == (400, PROBLEM)
    assert response.json()["code"] == "webhook-event-id-invalid"
    assert "printable" in response.json()["detail"]
    (kept,) = WebhookEvent.objects.all()
    assert (kept.status, kept.event_id) == (WebhookStatus.REJECTED, None)
    assert kept.error.startswith("webhook-event-id-invalid: the event needs a string 'id'")
    assert ascii(event_id)[:40] in kept.error
    assert "\x00" not in kept.claimed_id
    assert not OutboxMessage.objects.filter(task_name=ingress.TASK).exists()
    assert not ProcessedMessage.objects.exists()
    order.refresh_from_db()
    assert order.status == "pending_payment"


def test_the_door_and_the_consumer_share_one_rule_for_an_id() -> None:
    from idempotent_orders.consuming import envelope

    assert ingress.valid_message_id is envelope.valid_message_id


@pytest.mark.django_db
def test_a_rejection_by_the_consumer_always_carries_its_reason(
    fakepay: bool, make_order: Callable[..., Any]
) -> None:
    # An event stored before the door checked ids (or by an older version): the consumer
    # keeps its inbox row under another id; the event still says why it was rejected.
    order = make_order()
    body = json.dumps(event(order, event_id="evt_old ", payment_id="pi_o"))
    stored = WebhookEvent.objects.create(
        provider="fakepay",
        event_id="evt_old ",
        event_type="payment_intent.succeeded",
        message_type="payment.succeeded",
        status=WebhookStatus.RECEIVED,
        body=body,
    )
    assert ingress.process_event(stored.pk) == "rejected"
    stored.refresh_from_db()
    assert (stored.status, stored.outcome) == (WebhookStatus.PROCESSED, "rejected")
    assert stored.error.startswith("message_id must be a non-empty printable string")


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "status", "code", "detail"),
    [
        (_nested(50_000), 400, "webhook-body-invalid", "nested too deeply to read"),
        (
            b'{"id": "evt_d", "data": ' + _nested(65) + b"}",
            400,
            "webhook-body-invalid",
            "nested deeper than 64 levels",
        ),
        (b"not json", 400, "webhook-body-invalid", "not valid JSON"),
        (b'{"id": "evt_\xff"}', 400, "webhook-body-invalid", "not UTF-8"),
        (b"[1, 2]", 400, "webhook-body-invalid", "must be a JSON object, got list"),
        (b'"evt"', 400, "webhook-body-invalid", "must be a JSON object, got str"),
        (b"", 400, "webhook-body-invalid", "not valid JSON"),
        (
            b'{"id": "evt_t", "type": "payment\\u0000"}',
            422,
            "webhook-event-type-unknown",
            "'payment\\x00'",
        ),
        (
            b'{"id": "evt_s", "type": "payment\\ud800"}',
            422,
            "webhook-event-type-unknown",
            "'payment\\ud800'",
        ),
        (b'{"id": ["evt"], "type": "x"}', 400, "webhook-event-id-invalid", "got ['evt']"),
    ],
    ids=["deep", "deeper-than-64", "not-json", "not-utf8", "array", "string", "empty", "nul-type",
         "surrogate-type", "list-id"],
)  # fmt: skip
def test_every_bad_signed_body_is_a_4xx_problem_with_a_kept_row_never_a_500(
    fakepay: bool, body: bytes, status: int, code: str, detail: str
) -> None:
    response = post(Client(), body, stripe_signature(SECRET, body))
    assert (response.status_code, response["Content-Type"]) == (status, PROBLEM)
    assert response.json()["code"] == code
    assert detail in response.json()["detail"]
    (kept,) = WebhookEvent.objects.all()
    assert kept.status == WebhookStatus.REJECTED
    assert kept.error.startswith(f"{code}: ")
    assert len(kept.body) <= ingress.REFUSED_BODY_EXCERPT
    assert "\x00" not in kept.event_type


@pytest.mark.django_db
@pytest.mark.parametrize("fakepay", [False, True], indirect=True, ids=["queued", "inline"])
@pytest.mark.parametrize("bad", ["pi_\x00", "pi_\ud800"], ids=["nul", "surrogate"])
def test_a_signed_event_whose_payment_says_nonsense_is_rejected_with_why_never_a_500(
    fakepay: bool, bad: str, make_order: Callable[..., Any]
) -> None:
    order = make_order()
    response = signed_post(Client(), event(order, event_id="evt_bad_pi", payment_id=bad))
    assert response.status_code == 200
    if not fakepay:
        run_queued()
    stored = WebhookEvent.objects.get()
    assert (stored.status, stored.outcome) == (WebhookStatus.PROCESSED, "rejected")
    assert stored.error  # the consumer's reason, never empty
    order.refresh_from_db()
    assert order.status == "pending_payment"


@pytest.mark.django_db
@pytest.mark.parametrize("size", [10 * 1024 * 1024, 1024 * 1024 + 1], ids=["10MB", "1MB+1"])
def test_an_oversize_body_gets_the_apps_413_before_djangos_limit_and_is_recorded(
    fakepay: bool, size: int
) -> None:
    body = b'{"id": "evt_big", "pad": "' + b"x" * (size - 28) + b'"}'
    assert len(body) == size
    response = post(Client(), body, stripe_signature(SECRET, body))
    assert (response.status_code, response["Content-Type"]) == (413, PROBLEM)
    assert response.json()["code"] == "webhook-body-too-large"
    assert response.json()["detail"] == f"{size} bytes; at most 1048576 (MAX_REQUEST_BYTES)"
    (kept,) = WebhookEvent.objects.all()
    assert kept.status == WebhookStatus.REJECTED
    assert kept.body.startswith('{"id": "evt_big"')
    assert len(kept.body) <= ingress.REFUSED_BODY_EXCERPT


@pytest.mark.django_db
def test_the_apps_limit_not_djangos_decides_a_webhook_bodys_size(
    fakepay: bool, make_order: Callable[..., Any]
) -> None:
    order = make_order()
    payload = {**event(order, event_id="evt_pad", payment_id="pi_pad"), "pad": "x" * 4000}
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024):
        assert signed_post(Client(), payload).status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("fakepay", [False, True], indirect=True, ids=["queued", "inline"])
def test_an_event_id_reused_for_another_payment_is_flagged_and_the_first_stands(
    fakepay: bool, make_order: Callable[..., Any], staff: Client
) -> None:
    first_order, second_order = make_order(), make_order()
    client = Client()
    first = {**event(first_order, event_id="evt_X", payment_id="pi_1"), "pending_webhooks": 2}
    assert signed_post(client, first).status_code == 200
    # Stripe's retry of the same event: pending_webhooks changed, the object did not.
    retry = {**first, "pending_webhooks": 1}
    assert signed_post(client, retry).json()["id"] == "evt_X"
    other = event(second_order, event_id="evt_X", payment_id="pi_2")
    answers = [signed_post(client, other) for _ in range(2)]  # refused, and retried
    for response in answers:
        assert (response.status_code, response["Content-Type"]) == (409, PROBLEM)
        assert response.json()["code"] == "webhook-event-id-reused"
        assert "first event's effect stands" in response.json()["detail"]
    if not fakepay:
        run_queued()
    stored = WebhookEvent.objects.get(event_id="evt_X")
    assert (stored.deliveries, stored.outcome, stored.order_id) == (2, "applied", first_order.pk)
    (flagged,) = WebhookEvent.objects.filter(event_id=None)
    assert (flagged.status, flagged.claimed_id, flagged.order_id) == (
        WebhookStatus.REJECTED, "evt_X", second_order.pk,
    )  # fmt: skip
    assert flagged.deliveries == 2
    assert json.loads(flagged.body) == other  # kept whole: a payment to look at
    assert flagged.error.startswith("webhook-event-id-reused: ")
    first_order.refresh_from_db()
    second_order.refresh_from_db()
    assert (first_order.status, first_order.payment_id) == ("paid", "pi_1")
    assert second_order.status == "pending_payment"
    assert ProcessedMessage.objects.filter(consumer="payments").count() == 1

    # The operator sees it: a warning on the list, a flag filter, a flag column.
    changelist = "/admin/idempotent_orders/webhookevent/"
    page = staff.get(changelist)
    assert b"1 signed event(s) reuse the id of another event" in page.content
    only = staff.get(changelist, {"flag": "reused"})
    assert list(only.context["cl"].result_list) == [flagged]
    assert b"event id reused for another event: the first event" in only.content


@pytest.mark.django_db
def test_refused_unsigned_requests_are_rate_limited_per_provider_and_address(
    fakepay: bool, make_order: Callable[..., Any]
) -> None:
    order = make_order()
    body = json.dumps(event(order, event_id="evt_rl", payment_id="pi_rl")).encode()
    forged = stripe_signature("forged", body)
    config = {**provider_settings(), "WEBHOOK_REFUSED_RATE": 3}
    attacker = Client(REMOTE_ADDR=f"attacker-{uuid.uuid4().hex}")
    neighbour = Client(REMOTE_ADDR=f"neighbour-{uuid.uuid4().hex}")
    with override_settings(IDEMPOTENT_ORDERS=config):
        answers = [post(attacker, body, forged) for _ in range(5)]
        assert [r.status_code for r in answers] == [400, 400, 400, 429, 429]
        assert answers[-1]["Content-Type"] == PROBLEM
        assert answers[-1].json()["code"] == "webhook-too-many-refused"
        assert 1 <= int(answers[-1]["Retry-After"]) <= 60
        # Another address is counted on its own.
        assert post(neighbour, body, forged).status_code == 400
        # Another provider too.
        other = post(attacker, body, "sha256=00", url="/webhooks/generic/")
        assert other.status_code == 400
        # Only refusals under the limit are kept: the table cannot be filled from outside.
        assert WebhookEvent.objects.filter(status=WebhookStatus.REJECTED).count() == 5
        # The provider's signed event from the same address is never held back.
        assert post(attacker, body, stripe_signature(SECRET, body)).status_code == 200
    assert WebhookEvent.objects.filter(event_id="evt_rl").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("fakepay", [False, True], indirect=True, ids=["queued", "inline"])
@pytest.mark.parametrize(
    "deliveries", [["A", "B", "A", "A"], ["B", "A", "A", "A"], ["A", "A", "B", "A"]]
)
def test_one_event_sent_three_times_among_another_pays_the_order_once(
    fakepay: bool, deliveries: list[str], make_order: Callable[..., Any]
) -> None:
    order = make_order()
    events = {
        "A": event(order, event_id="evt_A", payment_id="pi_A"),
        # Another payment for the same order (a customer who paid twice).
        "B": event(order, event_id="evt_B", payment_id="pi_B"),
    }
    client = Client()
    answers = [signed_post(client, events[name]).status_code for name in deliveries]
    assert answers == [200] * 4
    if not fakepay:
        run_queued()
    order.refresh_from_db()
    # Inline, the first delivery wins; queued, whichever consumption runs first.
    first = order.payment_id.removeprefix("pi_")
    assert first in ("A", "B")
    assert first == deliveries[0] or not fakepay
    assert (order.status, order.version) == ("paid", 1)
    stored = {e.event_id: e for e in WebhookEvent.objects.all()}
    assert sorted(stored) == ["evt_A", "evt_B"]
    assert stored["evt_A"].deliveries == 3
    other = "B" if first == "A" else "A"
    assert stored[f"evt_{first}"].outcome == "applied"
    assert stored[f"evt_{other}"].outcome == "rejected"
    inbox = {m.message_id: m for m in ProcessedMessage.objects.filter(consumer="payments")}
    assert sorted(inbox) == ["evt_A", "evt_B"]
    # Rejected by the payment validator: a second payment for a paid order.
    assert f"differs from the order's payment 'pi_{first}'" in inbox[f"evt_{other}"].error
    assert all(e.status == WebhookStatus.PROCESSED for e in stored.values())


@pytest.mark.django_db
def test_a_stored_event_is_queued_with_its_row(
    fakepay: bool, make_order: Callable[..., Any]
) -> None:
    order = make_order()
    response = signed_post(Client(), event(order, event_id="evt_q", payment_id="pi_q"))
    assert response.json() == {"id": "evt_q", "status": "received"}
    stored = WebhookEvent.objects.get()
    (queued,) = OutboxMessage.objects.filter(task_name=ingress.TASK)
    assert queued.payload["event"] == stored.pk
    order.refresh_from_db()
    assert order.status == "pending_payment"  # answered before consuming


@pytest.mark.django_db
def test_an_event_that_cannot_become_a_message_is_kept_failed_and_replayable(
    fakepay: bool, make_order: Callable[..., Any], staff: Client
) -> None:
    order = make_order()
    broken = event(order, event_id="evt_nometa", payment_id="pi_x")
    del broken["data"]["object"]["metadata"]
    assert signed_post(Client(), broken).status_code == 200
    run_queued()
    stored = WebhookEvent.objects.get()
    assert stored.status == WebhookStatus.FAILED
    assert "KeyError" in stored.error
    assert not ProcessedMessage.objects.exists()  # the inbox slot stays free for a fixed replay

    # The admin's replay: confirm first, then consume once and audit.
    changelist = "/admin/idempotent_orders/webhookevent/"
    ask = staff.post(changelist, {"action": "replay_events", "_selected_action": [stored.pk]})
    assert ask.status_code == 200
    assert b"Replay webhook events: are you sure?" in ask.content
    assert not AuditEntry.objects.exists()
    done = staff.post(
        changelist, {"action": "replay_events", "_selected_action": [stored.pk], "post": "yes"}
    )
    assert done.status_code == 302
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.result, entry.username) == ("webhook:replay", "failed", "operator")


@pytest.mark.django_db
def test_replaying_a_consumed_event_is_a_duplicate(
    fakepay: bool, make_order: Callable[..., Any], staff: Client
) -> None:
    order = make_order()
    signed_post(Client(), event(order, event_id="evt_r", payment_id="pi_r"))
    run_queued()
    stored = WebhookEvent.objects.get()
    changelist = "/admin/idempotent_orders/webhookevent/"
    ask = staff.post(changelist, {"action": "replay_events", "_selected_action": [stored.pk]})
    assert b"duplicate: already applied" in ask.content
    staff.post(
        changelist, {"action": "replay_events", "_selected_action": [stored.pk], "post": "yes"}
    )
    entry = AuditEntry.objects.get()
    # Audited as a replay that changed nothing, not as the first application.
    assert (entry.action, entry.target, entry.object_id, entry.result) == (
        "webhook:replay",
        "idempotent_orders.webhookevent",
        str(stored.pk),
        "duplicate",
    )
    assert entry.detail == (
        "replay of an event already applied by its first consumption; nothing ran again"
    )
    assert (entry.message_id, entry.order_pk) == ("evt_r", str(order.pk))
    order.refresh_from_db()
    assert order.version == 1
    assert ProcessedMessage.objects.count() == 1
    fresh = WebhookEvent.objects.get()
    assert (fresh.outcome, fresh.processed_at) == ("applied", stored.processed_at)


@pytest.mark.django_db
def test_generic_hmac_provider_consumes_inline(
    fakepay: bool, make_order: Callable[..., Any]
) -> None:
    order = make_order()
    payload = {**event(order, event_id="g-1", payment_id="pi_g"), "type": "paid"}
    body = json.dumps(payload).encode()
    now = int(time.time())
    response = Client().post(
        "/webhooks/generic/",
        data=body,
        content_type="application/json",
        HTTP_X_SIGNATURE=sign_hmac("new", body, timestamp=now),
        HTTP_X_TIMESTAMP=str(now),
    )
    assert response.status_code == 200, response.content
    assert response.json() == {"id": "g-1", "outcome": "applied"}
    order.refresh_from_db()
    assert order.status == "paid"


# -- checks ----------------------------------------------------------------------------


def _ids(**config: Any) -> list[str]:
    with override_settings(IDEMPOTENT_ORDERS={**provider_settings(), **config}):
        found = (m.id or "" for m in run_checks())
        return sorted(
            i for i in found if i.startswith(("idempotent_orders.E05", "idempotent_orders.W05"))
        )


def test_checks_hold_the_inbox_to_the_providers_retry_horizon() -> None:
    assert _ids() == []
    # Stripe retries for three days; an inbox kept for two forgets events it will see again.
    assert _ids(DEDUP_RETENTION=2 * 24 * 3600) == ["idempotent_orders.E051"]
    broken = {"x": {"SCHEME": "nope", "EVENT_TYPES": {"a": "no.such.type"}, "TO_MESSAGE": "x.y"}}
    assert set(_ids(WEBHOOKS=broken)) == {"idempotent_orders.E050"}
    assert _ids(PAYMENT_TIMEOUT=60, PAYMENT_TIMEOUT_TRANSITION="evaporate") == [
        "idempotent_orders.E052"
    ]


def test_a_check_warns_when_webhook_events_go_before_the_providers_retries() -> None:
    # Stripe retries for three days: a reused id is caught only while the first is kept.
    assert _ids(WEBHOOK_RETENTION=2 * 24 * 3600) == ["idempotent_orders.W051"]
    assert _ids(WEBHOOK_RETENTION=4 * 24 * 3600) == []


# -- the demo --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_demo_payment_page_pays_the_order_by_a_signed_webhook(
    live_server: Any, staff: Client, make_order: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from demo_project import payments

    real = payments.deliver
    sent: list[int] = []

    def to_live_server(url: str, body: bytes, headers: dict[str, str]) -> int:
        status = real(live_server.url + urlparse(url).path, body, headers)
        sent.append(status)
        return status

    monkeypatch.setattr(payments, "deliver", to_live_server)
    order = make_order()
    with override_settings(IDEMPOTENT_ORDERS=provider_settings(INLINE=True)):
        page = staff.get(f"/shop/orders/{order.pk}/pay/")
        assert page.status_code == 200
        assert b"FakePay" in page.content
        form = {"deliveries": "3", "idempotency_token": token_of(page.content.decode())}
        paid = staff.post(f"/shop/orders/{order.pk}/pay/", form)
    assert paid.status_code == 303
    assert sent == [200, 200, 200]
    order.refresh_from_db()
    assert (order.status, order.version) == ("paid", 1)
    (stored,) = WebhookEvent.objects.all()
    assert (stored.deliveries, stored.outcome) == (3, "applied")


# -- Stripe event types routed to message types ------------------------------------------


def routed_settings() -> dict[str, Any]:
    return provider_settings(
        EVENT_TYPES={
            "payment_intent.succeeded": "payment.succeeded",
            "payment_intent.canceled": "order.cancelled",
            "charge.refunded": "payment.refunded",
        },
        TO_MESSAGE="idempotent_orders.webhooks.stripe.to_message",
        INLINE=True,
    )


def stripe_event(event_id: str, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"id": event_id, "type": kind, "data": {"object": obj}}


@pytest.mark.django_db
def test_stripe_event_types_are_routed_to_their_message_types_by_one_to_message(
    make_order: Callable[..., Any],
) -> None:
    paid, unpaid = make_order(), make_order()
    client = Client()
    with override_settings(IDEMPOTENT_ORDERS=routed_settings()):
        answers = [
            signed_post(client, event(paid, event_id="evt_pay", payment_id="pi_9")),
            # The charge of that intent refunded in full; the order found by its payment.
            signed_post(
                client,
                stripe_event(
                    "evt_refund",
                    "charge.refunded",
                    {"id": "ch_9", "payment_intent": "pi_9", "amount": 1250,
                     "amount_refunded": 1250, "currency": "cny", "metadata": {}},
                ),
            ),
            signed_post(
                client,
                stripe_event(
                    "evt_cancel",
                    "payment_intent.canceled",
                    {"id": "pi_u", "metadata": {"order_id": str(unpaid.pk)}},
                ),
            ),
        ]  # fmt: skip
    assert [r.json() for r in answers] == [
        {"id": "evt_pay", "outcome": "applied"},
        {"id": "evt_refund", "outcome": "applied"},
        {"id": "evt_cancel", "outcome": "applied"},
    ]
    paid.refresh_from_db()
    unpaid.refresh_from_db()
    assert (paid.status, unpaid.status) == ("refunded", "cancelled")
    types = dict(ProcessedMessage.objects.values_list("message_id", "message_type"))
    assert types == {
        "evt_pay": "payment.succeeded",
        "evt_refund": "payment.refunded",
        "evt_cancel": "order.cancelled",
    }


@pytest.mark.django_db
def test_the_dispute_converter_names_the_paid_order_and_the_dispute(
    make_order: Callable[..., Any],
) -> None:
    from idempotent_orders.webhooks import stripe

    order = make_order()
    type(order)._default_manager.filter(pk=order.pk).update(payment_id="pi_d")
    dispute = {
        "id": "dp_1", "charge": "ch_1", "payment_intent": "pi_d", "amount": 1250,
        "currency": "jpy", "reason": "fraudulent",
    }  # fmt: skip
    assert stripe.to_message(stripe_event("evt_d", "charge.dispute.created", dispute)) == (
        order.pk,
        {
            "payment_id": "pi_d",
            "dispute_id": "dp_1",
            "amount": "1250",
            "currency": "JPY",
            "reason": "fraudulent",
        },
    )
    with pytest.raises(LookupError, match="no order paid by 'pi_other'"):
        stripe.charge_dispute_created(
            stripe_event(
                "evt_e", "charge.dispute.created", {**dispute, "payment_intent": "pi_other"}
            )
        )
    with pytest.raises(KeyError, match=r"no Stripe converter for event type 'customer\.created'"):
        stripe.to_message(stripe_event("evt_c", "customer.created", {}))


# -- Standard Webhooks 1.0 -----------------------------------------------------------------

#: The standardwebhooks package's own test vector (libraries/python/tests of the spec).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_PAYLOAD = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
#: The package's "invalid signature" case: one character off.
VECTOR_WRONG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OA="


def test_standard_signature_matches_the_reference_vector_and_package() -> None:
    from datetime import UTC, datetime

    from standardwebhooks import Webhook

    assert (
        standard_signature(VECTOR_SECRET, VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_PAYLOAD)
        == VECTOR_SIGNATURE
    )
    # The package signs, our code verifies; and the other way round, with and without
    # the whsec_ prefix, among other versions and a wrong v1 in the header.
    now = int(time.time())
    theirs = Webhook(VECTOR_SECRET).sign(
        VECTOR_ID, datetime.fromtimestamp(now, tz=UTC), VECTOR_PAYLOAD.decode()
    )
    header = f"v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= v2,abc {theirs}"
    verify_standard(VECTOR_PAYLOAD, VECTOR_ID, str(now), header, ["whsec_b3RoZXI=", VECTOR_SECRET])
    ours = standard_signature(VECTOR_SECRET.removeprefix("whsec_"), VECTOR_ID, now, VECTOR_PAYLOAD)
    headers = {"webhook-id": VECTOR_ID, "webhook-timestamp": str(now), "webhook-signature": ours}
    assert Webhook(VECTOR_SECRET).verify(VECTOR_PAYLOAD, headers) == {"test": 2432232314}


@pytest.mark.parametrize(
    ("msg_id", "stamp", "header", "code"),
    [
        (VECTOR_ID, 0, VECTOR_WRONG, "webhook-signature-invalid"),
        ("msg_other", 0, None, "webhook-signature-invalid"),
        (VECTOR_ID, -301, None, "webhook-timestamp-outside-tolerance"),
        (VECTOR_ID, 301, None, "webhook-timestamp-outside-tolerance"),
        (VECTOR_ID, 0, "v2,abc", "webhook-signature-malformed"),
        (VECTOR_ID, 0, "", "webhook-signature-missing"),
        ("", 0, None, "webhook-signature-missing"),
    ],
    ids=["wrong-sig", "other-id", "old", "future", "no-v1", "no-header", "no-id"],
)  # fmt: skip
def test_standard_signature_refusals_agree_with_the_package(
    msg_id: str, stamp: int, header: str | None, code: str
) -> None:
    from standardwebhooks import Webhook, WebhookVerificationError

    now = int(time.time())
    signed_at = now + stamp
    if header is None:
        header = standard_signature(VECTOR_SECRET, VECTOR_ID, signed_at, VECTOR_PAYLOAD)
    with pytest.raises(SignatureError) as caught:
        verify_standard(VECTOR_PAYLOAD, msg_id, str(signed_at), header, [VECTOR_SECRET])
    assert caught.value.code == code
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(signed_at),
        "webhook-signature": header,
    }
    with pytest.raises(WebhookVerificationError):
        Webhook(VECTOR_SECRET).verify(VECTOR_PAYLOAD, headers)


@pytest.mark.django_db
def test_a_standard_webhooks_provider_takes_the_event_id_from_the_signed_header(
    make_order: Callable[..., Any],
) -> None:
    order = make_order()
    config = provider_settings()
    config["WEBHOOKS"]["std"] = {
        "SCHEME": "standard",
        "SECRET": VECTOR_SECRET,
        "EVENT_TYPES": {"payment_intent.succeeded": "payment.succeeded"},
        "TO_MESSAGE": "idempotent_orders.webhooks.stripe.payment_intent",
        "INLINE": True,
    }
    body_of = event(order, event_id="ignored", payment_id="pi_std")
    del body_of["id"]
    body = json.dumps(body_of).encode()

    def send(msg_id: str) -> Any:
        now = int(time.time())
        return Client().post(
            "/webhooks/std/",
            data=body,
            content_type="application/json",
            HTTP_WEBHOOK_ID=msg_id,
            HTTP_WEBHOOK_TIMESTAMP=str(now),
            HTTP_WEBHOOK_SIGNATURE=standard_signature(VECTOR_SECRET, msg_id, now, body),
        )

    with override_settings(IDEMPOTENT_ORDERS=config):
        assert _ids() == []
        bad = send("msg_1 ")
        assert (bad.status_code, bad.json()["code"]) == (400, "webhook-event-id-invalid")
        assert "'webhook-id'" in bad.json()["detail"]
        assert send("msg_1").json() == {"id": "msg_1", "outcome": "applied"}
        assert send("msg_1").json() == {"id": "msg_1", "status": "duplicate"}  # a retry
    order.refresh_from_db()
    assert (order.status, order.payment_id, order.version) == ("paid", "pi_std", 1)
    assert WebhookEvent.objects.get(event_id="msg_1").deliveries == 2


def test_a_standard_webhooks_secret_must_be_base64() -> None:
    broken = {
        "std": {
            "SCHEME": "standard",
            "SECRET": "whsec_not base64!",
            "EVENT_TYPES": {"a": "payment.succeeded"},
            "TO_MESSAGE": "idempotent_orders.webhooks.stripe.to_message",
        }
    }
    assert _ids(WEBHOOKS=broken) == ["idempotent_orders.E050"]


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_two_events_under_one_id_at_once_one_stands_the_other_is_flagged(
    make_order: Callable[..., Any],
) -> None:
    from tests.webhooks.test_timers import _run_together

    orders = [make_order(), make_order()]
    bodies = [
        event(orders[0], event_id="evt_race", payment_id="pi_r0"),
        event(orders[1], event_id="evt_race", payment_id="pi_r1"),
    ]
    with override_settings(IDEMPOTENT_ORDERS=provider_settings(INLINE=True)):
        answers = _run_together(
            *[lambda b=b: signed_post(Client(), b).status_code for b in bodies * 2]
        )
    # The first stored wins: its two deliveries are 200, the other event's two are 409.
    assert not [a for a in answers if isinstance(a, BaseException)], answers
    assert sorted(answers) == [200, 200, 409, 409], answers
    (stored,) = WebhookEvent.objects.exclude(event_id=None)
    flagged = list(WebhookEvent.objects.filter(event_id=None))
    # (Two deliveries of the other event at the very same moment may keep a row each.)
    assert len(flagged) in (1, 2)
    assert all(f.error.startswith("webhook-event-id-reused: ") for f in flagged)
    assert {f.order_id for f in flagged} == {o.pk for o in orders} - {stored.order_id}
    assert (stored.deliveries, sum(f.deliveries for f in flagged)) == (2, 2)
    paid = [o for o in orders if type(o)._default_manager.get(pk=o.pk).status == "paid"]
    assert [o.pk for o in paid] == [stored.order_id]
