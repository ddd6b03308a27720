"""Receive a provider's event (verify, store, queue) and consume it as a message, once.

:func:`receive` is the view's work: verify the signature over the raw body,
store the event (one row per provider event id) and queue its consumption
through the outbox in the same transaction, so a stored event is always
consumed. :func:`process_event` consumes it: the event id is the message id,
so a provider's retry, a second worker or an operator's replay is a duplicate
in the inbox and never applies twice.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now

from idempotent_orders.conf import conf
from idempotent_orders.consuming.failures import TRANSIENT, MessageFailed, describe
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome, ProcessedMessage, WebhookEvent, WebhookStatus
from idempotent_orders.outbox import publish_on_commit
from idempotent_orders.webhooks.config import Provider, provider
from idempotent_orders.webhooks.signing import SignatureError, verify_hmac, verify_stripe

__all__ = ["Receipt", "process_event", "receive"]

logger = logging.getLogger("idempotent_orders")

#: The Celery task that consumes a stored event (idempotent_orders.tasks).
TASK = "idempotent_orders.consume_webhook_event"
#: Characters of a refused request's body kept for operators.
REFUSED_BODY_EXCERPT = 2000


@dataclass
class Receipt:
    """What the view answers: a status, and a problem code and detail when refused."""

    status: int
    code: str = ""
    title: str = ""
    detail: str = ""
    event: WebhookEvent | None = None
    body: dict[str, Any] = field(default_factory=dict)


def _refuse(
    name: str,
    body: bytes,
    status: int,
    code: str,
    title: str,
    detail: str,
    *,
    claimed_id: str = "",
    event_type: str = "",
) -> Receipt:
    text = body[:REFUSED_BODY_EXCERPT].decode("utf-8", "replace").replace("\x00", "\ufffd")
    event = WebhookEvent.objects.create(
        provider=name[:64],
        event_id=None,
        claimed_id=claimed_id[:255],
        event_type=event_type[:255],
        status=WebhookStatus.REJECTED,
        body=text,
        error=f"{code}: {detail}",
        attempts=0,
    )
    logger.warning("refused webhook for %s: %s (%s)", name, code, detail)
    return Receipt(status, code, title, detail, event)


def _verify(p: Provider, body: bytes, headers: Mapping[str, str]) -> None:
    if p.scheme == "stripe":
        verify_stripe(body, headers.get("Stripe-Signature"), p.secrets, tolerance=p.tolerance)
    else:
        verify_hmac(
            body,
            headers.get(p.signature_header),
            p.secrets,
            timestamp=headers.get(p.timestamp_header) if p.timestamp_header else None,
            tolerance=p.tolerance,
        )
        if p.timestamp_header and not headers.get(p.timestamp_header):
            raise SignatureError("webhook-signature-missing", f"no {p.timestamp_header} header")


def _text_field(event: Any, name: str) -> str:
    value = event.get(name) if isinstance(event, dict) else None
    if isinstance(value, str | int) and not isinstance(value, bool):
        return str(value)
    return ""


def receive(name: str, body: bytes, headers: Mapping[str, str]) -> Receipt:
    """Verify, store and queue one webhook request of provider ``name``.

    Refusals (unknown provider aside) are stored as ``rejected`` rows and
    answered 4xx with a problem code; an accepted event is answered 200 once
    it is stored and its consumption queued (or, for an ``INLINE`` provider,
    done). A retry of a stored event counts a delivery and is answered 200.
    """
    p = provider(name)
    if p is None:
        return Receipt(404, "webhook-provider-unknown", "Unknown webhook provider", name[:64])
    if len(body) > conf.MAX_REQUEST_BYTES:
        return _refuse(
            name, body, 413, "webhook-body-too-large", "Body too large",
            f"{len(body)} bytes; at most {conf.MAX_REQUEST_BYTES}",
        )  # fmt: skip
    try:
        _verify(p, body, headers)
    except SignatureError as exc:
        return _refuse(name, body, 400, exc.code, "Signature not accepted", exc.detail)
    try:
        event = json.loads(body)
    except ValueError:
        return _refuse(name, body, 400, "webhook-body-invalid", "Body not JSON", "not valid JSON")
    event_id = _text_field(event, p.id_field)
    event_type = _text_field(event, p.type_field)
    if not event_id or len(event_id) > conf.MAX_MESSAGE_ID_LENGTH:
        return _refuse(
            name, body, 400, "webhook-event-id-invalid", "No usable event id",
            f"the event needs a string {p.id_field!r} of 1 to "
            f"{conf.MAX_MESSAGE_ID_LENGTH} characters",
            event_type=event_type,
        )  # fmt: skip
    message_type = p.event_types.get(event_type)
    if message_type is None:
        return _refuse(
            name, body, 422, "webhook-event-type-unknown", "Event type not handled",
            f"event type {event_type[:80]!r} maps to no message type; "
            f"handled: {', '.join(sorted(p.event_types))}",
            claimed_id=event_id, event_type=event_type,
        )  # fmt: skip
    stored, created = _store(p, event_id, event_type, message_type, body)
    if p.inline and (created or stored.status == WebhookStatus.FAILED):
        try:
            outcome = process_event(stored.pk)
        except MessageFailed as exc:
            # Kept as failed; the provider's retry (or an operator's replay) runs it again.
            return Receipt(
                500, "webhook-consume-failed", "Event stored, consuming it failed", exc.reason,
                stored,
            )  # fmt: skip
        return Receipt(200, event=stored, body={"id": event_id, "outcome": outcome or "failed"})
    state = "received" if created else "duplicate"
    return Receipt(200, event=stored, body={"id": event_id, "status": state})


def _store(
    p: Provider, event_id: str, event_type: str, message_type: str, body: bytes
) -> tuple[WebhookEvent, bool]:
    """The event's row: inserted with its consumption queued (one transaction), or the
    stored one with one more delivery (a failed one queued again)."""
    text = body.decode("utf-8", "replace")
    try:
        with transaction.atomic():
            event = WebhookEvent.objects.create(
                provider=p.name,
                event_id=event_id,
                event_type=event_type,
                message_type=message_type,
                status=WebhookStatus.RECEIVED,
                body=text,
            )
            if not p.inline:
                _queue(event)
        return event, True
    except IntegrityError:
        pass
    with transaction.atomic():
        event = WebhookEvent.objects.select_for_update().get(provider=p.name, event_id=event_id)
        WebhookEvent.objects.filter(pk=event.pk).update(
            deliveries=F("deliveries") + 1, last_delivery_at=Now()
        )
        event.deliveries += 1
        if event.status == WebhookStatus.FAILED and not p.inline:
            _queue(event)
    return event, False


def _queue(event: WebhookEvent) -> None:
    """Queue the event's consumption in the caller's transaction (the outbox)."""
    # A fresh id each time: each queued consumption is its own outbox row; the inbox,
    # keyed by the event id, is what makes them one.
    message_id = f"webhook-{event.pk}-{uuid.uuid4().hex}"
    publish_on_commit(TASK, {"message_id": message_id, "event": event.pk}, message_id=message_id)


def queue_replay(event: WebhookEvent) -> None:
    """Queue the event's consumption again (an operator's replay)."""
    with transaction.atomic():
        fresh = WebhookEvent.objects.select_for_update().get(pk=event.pk)
        _queue(fresh)


def message_for(event: WebhookEvent, p: Provider) -> dict[str, Any]:
    """The message consuming ``event`` means: its event id is the message id."""
    data = json.loads(event.body)
    order_id, payload = p.to_message(data)
    return {
        "message_id": event.event_id,
        "type": event.message_type,
        "order_id": order_id,
        "payload": payload,
    }


def process_event(pk: int) -> str | None:
    """Consume stored event ``pk`` through the inbox; return the outcome value it got.

    The inbox row of ``(consumer, event id)`` decides: a second call, from a
    retried task or a replay, is a duplicate and the event keeps the outcome
    its first consumption had. A provider's event that cannot be turned into a
    message (the project's ``TO_MESSAGE`` raised) is kept as ``failed`` and
    None returned; a failure while consuming raises
    :class:`~idempotent_orders.consuming.failures.MessageFailed` after keeping it as
    ``failed`` too. Database errors propagate (the task retries).
    """
    event = WebhookEvent.objects.get(pk=pk)
    if event.status == WebhookStatus.REJECTED or not event.event_id:
        return None
    WebhookEvent.objects.filter(pk=pk).update(attempts=F("attempts") + 1)
    p = provider(event.provider)
    if p is None:
        _mark(pk, WebhookStatus.FAILED, error=f"provider {event.provider!r} is not configured")
        return None
    try:
        message = message_for(event, p)
    except TRANSIENT:
        raise
    except Exception as exc:
        _mark(pk, WebhookStatus.FAILED, error=f"TO_MESSAGE raised: {describe(exc)}")
        logger.warning("webhook event %s cannot become a message: %r", event.event_id, exc)
        return None
    try:
        outcome = consume_message(message, consumer=p.consumer)
    except MessageFailed as exc:
        _mark(pk, WebhookStatus.FAILED, error=exc.reason, order_id=message["order_id"])
        raise
    first = (
        ProcessedMessage.objects.filter(consumer=p.consumer, message_id=event.event_id)
        .values_list("outcome", "order_id", "error")
        .first()
    )
    value, order_id, error = first if first else (outcome.value, None, "")
    if value in ("", Outcome.FAILED):
        value = outcome.value
    _mark(pk, WebhookStatus.PROCESSED, outcome=value, error=error, order_id=order_id)
    return str(value)


def _mark(
    pk: int, status: str, *, outcome: str = "", error: str = "", order_id: Any = None
) -> None:
    values: dict[str, Any] = {"status": status, "error": error[:2000]}
    if outcome:
        values["outcome"] = outcome
    if status == WebhookStatus.PROCESSED:
        values["processed_at"] = Now()
    if isinstance(order_id, int) and not isinstance(order_id, bool):
        from idempotent_orders import get_order_model

        if get_order_model()._default_manager.filter(pk=order_id).exists():
            values["order_id"] = order_id
    WebhookEvent.objects.filter(pk=pk).update(**values)
