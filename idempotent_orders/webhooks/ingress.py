"""Receive a provider's event (verify, store, queue) and consume it as a message, once.

:func:`receive` is the view's work: verify the signature over the raw body,
store the event (one row per provider event id) and queue its consumption
through the outbox in the same transaction, so a stored event is always
consumed. :func:`process_event` consumes it: the event id is the message id,
so a provider's retry, a second worker or an operator's replay is a duplicate
in the inbox and never applies twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Now

from idempotent_orders import otel
from idempotent_orders.conf import conf
from idempotent_orders.consuming.envelope import parse_envelope, valid_message_id
from idempotent_orders.consuming.failures import TRANSIENT, MessageFailed, describe
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import Outcome, ProcessedMessage, WebhookEvent, WebhookStatus
from idempotent_orders.outbox import publish_on_commit
from idempotent_orders.webhooks.config import Provider, provider
from idempotent_orders.webhooks.signing import (
    SignatureError,
    verify_hmac,
    verify_standard,
    verify_stripe,
)

__all__ = ["REUSED", "Receipt", "process_event", "receive"]

logger = logging.getLogger("idempotent_orders")

#: The Celery task that consumes a stored event (idempotent_orders.tasks).
TASK = "idempotent_orders.consume_webhook_event"
#: Characters of a refused request's body kept for operators (a signed event whose id
#: was reused for another event is kept whole: it is a payment to look at).
REFUSED_BODY_EXCERPT = 2000
#: Characters of a refused request's claimed id and event type kept.
REFUSED_FIELD_EXCERPT = 255
#: The problem code of a signed event whose id the provider already used for another event.
REUSED = "webhook-event-id-reused"
#: Deepest nesting of objects and arrays an event may have (a provider's events have
#: a handful of levels; deeper ones would only exhaust the stack further on).
MAX_DEPTH = 64
#: Top-level fields a provider changes between deliveries of one event (Stripe counts
#: ``pending_webhooks`` down): never part of what the event says.
DELIVERY_FIELDS = frozenset({"pending_webhooks"})


@dataclass
class Receipt:
    """What the view answers: a status, and a problem code and detail when refused."""

    status: int
    code: str = ""
    title: str = ""
    detail: str = ""
    event: WebhookEvent | None = None
    body: dict[str, Any] = field(default_factory=dict)
    #: Seconds to send as ``Retry-After`` (a 429), None for none.
    retry_after: int | None = None


def storable(text: str, limit: int) -> str:
    """``text`` as any database column stores it: at most ``limit`` characters, a NUL
    and an unpaired UTF-16 surrogate written as backslash escapes."""
    text = text[:limit].replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:limit]


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
    whole: bool = False,
    order_id: Any = None,
) -> Receipt:
    kept = body if whole else body[:REFUSED_BODY_EXCERPT]
    text = storable(kept.decode("utf-8", "replace"), len(kept))
    event = WebhookEvent.objects.create(
        provider=name[:64],
        event_id=None,
        claimed_id=storable(claimed_id, REFUSED_FIELD_EXCERPT),
        event_type=storable(event_type, REFUSED_FIELD_EXCERPT),
        status=WebhookStatus.REJECTED,
        body=text,
        error=storable(f"{code}: {detail}", 2000),
        attempts=0,
        order_id=_existing_order(order_id),
    )
    logger.warning("refused webhook for %s: %s (%s)", name, code, detail)
    return Receipt(status, code, title, detail, event)


def _refuse_unsigned(
    p: Provider, address: str, body: bytes, status: int, code: str, title: str, detail: str
) -> Receipt:
    """Refuse a request not (or not yet) known to come from the provider: counted per
    provider and client address, kept as a row until ``WEBHOOK_REFUSED_RATE`` such
    requests in a window, answered 429 and not kept past it."""
    wait = _count_refused(p.name, address)
    if wait is None:
        return _refuse(p.name, body, status, code, title, detail)
    return Receipt(
        429,
        "webhook-too-many-refused",
        "Too many refused requests",
        f"more than {conf.WEBHOOK_REFUSED_RATE} refused requests for {p.name!r} from this "
        f"address in {conf.WEBHOOK_REFUSED_RATE_WINDOW} seconds; this one ({code}) is not "
        "recorded",
        retry_after=wait,
    )


def _count_refused(name: str, address: str) -> int | None:
    """Count one refused request of ``address`` for provider ``name``; the seconds until its
    window ends when it is past ``WEBHOOK_REFUSED_RATE``, else None.

    A fixed window per (provider, address) in the ``LOCK_CACHE`` cache. Should the cache
    fail, the request is refused and kept as under the limit (logged).
    """
    from django.core.cache import caches

    window = conf.WEBHOOK_REFUSED_RATE_WINDOW
    now = time.time()
    slot = int(now) // window
    who = hashlib.sha256(f"{name}\n{address or 'unknown'}".encode()).hexdigest()[:32]
    key = f"idempotent_orders:webhook-refused:{who}:{slot}"
    try:
        cache = caches[conf.LOCK_CACHE]
        cache.add(key, 0, timeout=window + 1)
        try:
            count = int(cache.incr(key))
        except ValueError:  # expired between add and incr
            cache.add(key, 1, timeout=window + 1)
            count = 1
    except Exception as exc:  # the limit is a guard, never a reason to fail
        logger.warning("cannot count refused webhook requests: %r", exc)
        return None
    if count <= conf.WEBHOOK_REFUSED_RATE:
        return None
    if count == conf.WEBHOOK_REFUSED_RATE + 1:
        logger.warning(
            "webhook %s: more than %s refused requests from %s in %ss; no longer recorded",
            name, conf.WEBHOOK_REFUSED_RATE, address, window,
        )  # fmt: skip
    return max(1, (slot + 1) * window - int(now))


def _verify(p: Provider, body: bytes, headers: Mapping[str, str]) -> None:
    if p.scheme == "stripe":
        verify_stripe(body, headers.get("Stripe-Signature"), p.secrets, tolerance=p.tolerance)
    elif p.scheme == "standard":
        verify_standard(
            body,
            headers.get("webhook-id"),
            headers.get("webhook-timestamp"),
            headers.get("webhook-signature"),
            p.secrets,
            tolerance=p.tolerance,
        )
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


def _shown(value: Any) -> str:
    """``value`` as a problem's detail shows it: escaped (invisible characters visible), short."""
    text = ascii(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


@otel.traced_receive
def receive(
    name: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    address: str = "",
    length: int | None = None,
) -> Receipt:
    """Verify, store and queue one webhook request of provider ``name``.

    ``body`` is the raw body (for a body over ``MAX_REQUEST_BYTES``, the part read:
    ``length`` is the size the request declared). Refusals (unknown provider aside) are
    stored as ``rejected`` rows and answered 4xx with a problem code; an accepted event
    is answered 200 once stored and queued (or, for an ``INLINE`` provider, done). A
    retry of a stored event counts a delivery and is answered 200; another event under
    a stored event's id is refused (409 ``webhook-event-id-reused``) and kept, flagged.
    Requests refused before the signature is verified are counted per provider and
    ``address``: past ``WEBHOOK_REFUSED_RATE`` they are answered 429 and not kept.
    """
    p = provider(name)
    if p is None:
        return Receipt(404, "webhook-provider-unknown", "Unknown webhook provider", name[:64])
    size = max(len(body), length or 0)
    if size > conf.MAX_REQUEST_BYTES:
        return _refuse_unsigned(
            p, address, body, 413, "webhook-body-too-large", "Body too large",
            f"{size} bytes; at most {conf.MAX_REQUEST_BYTES} (MAX_REQUEST_BYTES)",
        )  # fmt: skip
    try:
        _verify(p, body, headers)
    except SignatureError as exc:
        return _refuse_unsigned(
            p, address, body, 400, exc.code, "Signature not accepted", exc.detail
        )
    # Signed by the provider from here on.
    try:
        event = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        return _refuse(name, body, 400, "webhook-body-invalid", "Body not JSON", "not UTF-8")
    except RecursionError:
        return _refuse(
            name, body, 400, "webhook-body-invalid", "Body not JSON", "nested too deeply to read"
        )  # fmt: skip
    except ValueError:
        return _refuse(name, body, 400, "webhook-body-invalid", "Body not JSON", "not valid JSON")
    if not isinstance(event, dict):
        return _refuse(
            name, body, 400, "webhook-body-invalid", "Body not a JSON object",
            f"the body must be a JSON object, got {type(event).__name__}",
        )  # fmt: skip
    if _deeper_than(event, MAX_DEPTH):
        return _refuse(
            name, body, 400, "webhook-body-invalid", "Body nested too deeply",
            f"nested deeper than {MAX_DEPTH} levels",
        )  # fmt: skip
    if p.scheme == "standard":
        # The id is the signed webhook-id header (a Standard Webhooks body has none).
        raw_id: Any = headers.get("webhook-id", "")
        event_id = str(raw_id)
    else:
        raw_id = event.get(p.id_field)
        event_id = _text_field(event, p.id_field)
    event_type = _text_field(event, p.type_field)
    # The consumer's rule for a message id, so an accepted event can always be consumed.
    id_name = "webhook-id" if p.scheme == "standard" else p.id_field
    if not valid_message_id(event_id):
        return _refuse(
            name, body, 400, "webhook-event-id-invalid", "No usable event id",
            f"the event needs a string {id_name!r} a message id can be: non-empty, "
            f"printable, at most {conf.MAX_MESSAGE_ID_LENGTH} characters, no surrounding "
            f"spaces; got {_shown(raw_id)}",
            claimed_id=event_id, event_type=event_type,
        )  # fmt: skip
    message_type = p.event_types.get(event_type)
    if message_type is None:
        return _refuse(
            name, body, 422, "webhook-event-type-unknown", "Event type not handled",
            f"event type {_shown(event_type)} maps to no message type; "
            f"handled: {', '.join(sorted(p.event_types))}",
            claimed_id=event_id, event_type=event_type,
        )  # fmt: skip
    stored, created = _store(p, event_id, event_type, message_type, body, event)
    if stored.event_id is None:  # the id's first event says something else
        return Receipt(
            409, REUSED, "Event id reused for another event", stored.error.partition(": ")[2],
            stored,
        )  # fmt: skip
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


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` levels (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def identity(p: Provider, event: Mapping[str, Any]) -> str:
    """What ``event`` says, to compare two events sent under one id: its type and its
    object (``data.object``; ``data`` when there is no object; else the event without
    the fields a provider changes between deliveries), never its bytes."""
    data = event.get("data")
    if isinstance(data, Mapping):
        said: Any = data.get("object", data)
    else:
        said = {k: v for k, v in event.items() if k not in DELIVERY_FIELDS}
    return json.dumps(
        [event.get(p.type_field), said], sort_keys=True, ensure_ascii=True, default=repr
    )


def _stored_identity(p: Provider, body: str) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return identity(p, data) if isinstance(data, dict) else None


def _store(
    p: Provider,
    event_id: str,
    event_type: str,
    message_type: str,
    body: bytes,
    event: Mapping[str, Any],
) -> tuple[WebhookEvent, bool]:
    """The event's row: inserted with its consumption queued (one transaction), or the
    stored one with one more delivery (a failed one queued again); or, when the stored
    event under this id says something else, a refused row flagged ``REUSED``."""
    text = body.decode("utf-8")
    try:
        with transaction.atomic():
            stored = WebhookEvent.objects.create(
                provider=p.name,
                event_id=event_id,
                event_type=event_type,
                message_type=message_type,
                status=WebhookStatus.RECEIVED,
                body=text,
            )
            if not p.inline:
                _queue(stored)
        return stored, True
    except IntegrityError:
        pass
    # The stored event's body never changes: it is compared without a lock. (Keeping the
    # row locked while a flagged row is inserted next to it in the unique index deadlocks
    # on MariaDB with the deliveries waiting to insert the same id.)
    said = identity(p, event)
    stored = WebhookEvent.objects.get(provider=p.name, event_id=event_id)
    first = _stored_identity(p, stored.body)
    if first is not None and first != said:
        return _reused(p, stored, event_id, event_type, body, event, said), False
    with transaction.atomic():
        stored = WebhookEvent.objects.select_for_update().get(pk=stored.pk)
        WebhookEvent.objects.filter(pk=stored.pk).update(
            deliveries=F("deliveries") + 1, last_delivery_at=Now()
        )
        stored.deliveries += 1
        if stored.status == WebhookStatus.FAILED and not p.inline:
            _queue(stored)
    return stored, False


def _reused(
    p: Provider,
    first: WebhookEvent,
    event_id: str,
    event_type: str,
    body: bytes,
    event: Mapping[str, Any],
    said: str,
) -> WebhookEvent:
    """Keep a signed event sent under the id of another, stored, event: a refused row,
    whole, flagged ``REUSED`` for the operator; its own retries count deliveries on it
    (two deliveries at the very same moment may keep a row each). The first event's
    effect stands; this one is never consumed."""
    flagged = WebhookEvent.objects.filter(
        provider=p.name,
        event_id=None,
        claimed_id=event_id,
        status=WebhookStatus.REJECTED,
        error__startswith=f"{REUSED}:",
    ).order_by("id")
    for row in flagged:
        if _stored_identity(p, row.body) == said:
            WebhookEvent.objects.filter(pk=row.pk).update(
                deliveries=F("deliveries") + 1, last_delivery_at=Now()
            )
            row.deliveries += 1
            return row
    try:
        order_id, _ = p.to_message(event)
    except Exception:  # only to show the operator which order it names
        order_id = None
    receipt = _refuse(
        p.name, body, 409, REUSED, "Event id reused for another event",
        f"event id {_shown(event_id)} was first received as event row {first.pk} "
        f"(order {first.order_id or '?'}, {first.status}) saying something else; that "
        "first event's effect stands and this one is not consumed: look at both",
        claimed_id=event_id, event_type=event_type, whole=True, order_id=order_id,
    )  # fmt: skip
    assert receipt.event is not None
    return receipt.event


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
        parse_envelope(message, consumer=p.consumer)
    except InvalidMessage as exc:
        invalid = str(exc)  # the consumer rejects it, for this reason
    else:
        invalid = ""
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
    if value == Outcome.REJECTED and not error:
        # Every rejection says why (a message the inbox keeps under another id, too).
        error = invalid or f"rejected by the {p.consumer!r} consumer without a reason"
    _mark(pk, WebhookStatus.PROCESSED, outcome=value, error=error, order_id=order_id)
    return str(value)


def _mark(
    pk: int, status: str, *, outcome: str = "", error: str = "", order_id: Any = None
) -> None:
    values: dict[str, Any] = {"status": status, "error": error[:2000]}
    if outcome:
        values["outcome"] = outcome
    if status == WebhookStatus.PROCESSED:
        # The first consumption's time stays (a replay is a duplicate, not a new one).
        values["processed_at"] = Coalesce(F("processed_at"), Now())
    found = _existing_order(order_id)
    if found is not None:
        values["order_id"] = found
    WebhookEvent.objects.filter(pk=pk).update(**values)


def _existing_order(order_id: Any) -> int | None:
    """``order_id`` when it is the primary key of an existing order, else None."""
    if isinstance(order_id, str) and order_id.isdigit() and len(order_id) < 19:
        order_id = int(order_id)
    if not isinstance(order_id, int) or isinstance(order_id, bool) or order_id <= 0:
        return None
    from idempotent_orders import get_order_model

    if get_order_model()._default_manager.filter(pk=order_id).exists():
        return order_id
    return None
