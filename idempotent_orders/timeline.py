"""One order's story for an operator: every row that mentions it, in time order.

:func:`timeline` reads, for one order of the configured order model:

- its **inbox rows** (``ProcessedMessage``): each message with its outcome and
  reason, and for an applied one the order's transition it ran; failed and dead
  rows with the exception they keep; a leased step's row (the fulfilment call)
  with its lease, attempts and last heartbeat;
- the **attempts** of its leased steps (``LeaseAttempt``): each call and its answer
  (refused, unverified, stalled, completed), kept after the step finished;
- its **parked messages**, with the reason they wait *now*: decided again
  against the order as it is (:func:`idempotent_orders.consuming.decision.decide`, pure),
  not the text stored when the message was parked;
- the **audit entries** of operator actions on it or on its messages (who, what,
  the result, why);
- the **outbox rows** queued for it (``order_key`` is its id or business key),
  with their trace id.

Nothing here writes. What the rows do not keep is not shown: a redelivery that
the inbox answered as a duplicate leaves no row (a row's ``attempts`` counts the
times it was handled), and a message released from parking keeps the time it
arrived, not the time it was released.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Model, Q
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from idempotent_orders import leases
from idempotent_orders.consuming.decision import REFUND
from idempotent_orders.consuming.registry import get_handler
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import (
    AuditEntry,
    InboxStatus,
    LeaseAttempt,
    OutboxMessage,
    OutboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)

__all__ = ["Event", "held_reason", "inbox_fix", "timeline"]

#: Seconds in every time an operator reads: "what happened first" is often within a minute.
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def at(value: datetime | None) -> str:
    """A time as the admin shows it: local, with seconds; "" for none."""
    return "" if value is None else timezone.localtime(value).strftime(TIME_FORMAT)


@dataclass(frozen=True)
class Event:
    """One line of an order's timeline."""

    at: datetime
    #: ``message``, ``lease``, ``parked``, ``operator``, ``outbox``, ``order``.
    kind: str
    #: What it is, in a few words: the message type and id, the operator's action.
    title: str
    #: The outcome or status: applied, parked, failed, dead, requeued, sent, ...
    outcome: str
    #: Why, or what happened, in words.
    text: str
    #: Who: the consumer, the operator, the outbox task.
    who: str = ""
    #: The admin page of the row.
    link: str = ""
    #: W3C traceparent and/or correlation id, where the row keeps one.
    trace: str = ""
    #: Needs an operator (failed, dead, stuck, held, money to give back).
    attention: bool = False
    #: ``(label, url)`` of the one-row confirmation page that fixes it, if any.
    fix: tuple[str, str] | None = None

    @property
    def when(self) -> str:
        return at(self.at)


def _change_url(obj: Model) -> str:
    opts = obj._meta
    try:
        return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
    except NoReverseMatch:
        return ""


def inbox_fix(row: ProcessedMessage, now: datetime | None = None) -> str:
    """The operator's way out for an inbox row, by name: ``retry``, ``requeue_dead`` or ""."""
    now = now or timezone.now()
    if row.status == InboxStatus.DEAD:
        return "requeue_dead"
    if row.status == InboxStatus.FAILED:
        return "retry"
    if row.status == InboxStatus.PROCESSING and (
        row.lease_expires_at is not None and row.lease_expires_at < now
    ):
        return "retry"
    return ""


def _row_fix(row: ProcessedMessage, now: datetime) -> tuple[str, str] | None:
    verb = inbox_fix(row, now)
    if not verb:
        return None
    try:
        url = reverse("admin:idempotent_orders_processedmessage_confirm", args=[row.pk, verb])
    except NoReverseMatch:
        return None
    return ("Requeue…" if verb == "requeue_dead" else "Retry…"), url


def _inbox_event(row: ProcessedMessage, now: datetime) -> Event:
    handler = get_handler(row.message_type) if row.message_type else None
    leased = leases.get_step(row.consumer) is not None or row.fencing_token is not None
    kind = "lease" if leased else "message"
    title = f"{row.message_type or row.consumer} {row.message_id}"
    if row.seq is not None:
        title += f" (seq {row.seq})"
    outcome = row.outcome or row.status
    handled = f"handled {row.attempts} times; " if row.attempts > 1 and not leased else ""
    attention = False
    if row.status == InboxStatus.PROCESSING:
        outcome = "processing"
        if row.lease_expires_at is None:
            text = f"waits for its next delivery after a failed run: {row.error or 'no error'}"
            attention = True
        elif row.lease_expires_at < now and row.error:
            outcome = "refused"
            text = (
                f"attempt {row.attempts} was answered: {row.error}; the reconciler tries "
                "again (no worker stalled)"
            )
            attention = True
        elif row.lease_expires_at < now:
            outcome = "stuck"
            text = (
                f"lease ran out at {at(row.lease_expires_at)} with no word from its worker "
                f"(attempt {row.attempts}, last heartbeat {at(row.heartbeat_at) or 'none'})"
            )
            attention = True
        else:
            text = (
                f"a worker holds its lease until {at(row.lease_expires_at)} "
                f"(attempt {row.attempts}, last heartbeat {at(row.heartbeat_at) or 'none'})"
            )
    elif row.status == InboxStatus.FAILED:
        outcome = "failed"
        text = f"{handled}failed: {row.error}"
        attention = True
    elif row.status == InboxStatus.DEAD:
        outcome = "dead"
        text = f"dead since {at(row.dead_at)} after {row.attempts} attempts: {row.error}"
        attention = True
    elif row.outcome == Outcome.APPLIED:
        ran = handler.transition if handler is not None else ""
        if leased and not ran:
            ran = "its step"
        text = f"{handled}ran {ran or 'its transition'}"
        if row.error:
            text += f" ({row.error})"
    else:
        text = f"{handled}{row.error}" if row.error else handled.removesuffix("; ")
        attention = row.outcome == Outcome.REJECTED and row.error.endswith(REFUND)
    if row.updated_at and row.created_at and (row.updated_at - row.created_at).total_seconds() >= 1:
        text += f" — last change {at(row.updated_at)}"
    return Event(
        at=row.created_at,
        kind=kind,
        title=title,
        outcome=outcome,
        text=text,
        who=row.consumer,
        link=_change_url(row),
        attention=attention,
        fix=_row_fix(row, now),
    )


def _attempt_event(attempt: LeaseAttempt) -> Event:
    return Event(
        at=attempt.at,
        kind="attempt",
        title=f"{attempt.consumer} {attempt.message_id} attempt {attempt.attempt}",
        outcome=attempt.result,
        text=attempt.answer or attempt.result,
        who=attempt.via,
    )


def held_reason(parked: ParkedMessage, order: Any = None) -> tuple[bool, str]:
    """Whether ``parked`` still has to wait, and why, judged against the order as it is now.

    The stored ``reason`` is what was true when it was parked; the order may
    have moved since (its predecessor arrived, the order was cancelled). Pure:
    nothing is released or written here.
    """
    from idempotent_orders.consuming.decision import decide
    from idempotent_orders.consuming.envelope import parse_envelope

    if order is None:
        order = parked.order
    try:
        envelope = parse_envelope(parked.envelope, consumer=parked.consumer)
    except InvalidMessage as exc:
        return False, f"can no longer be read ({exc.message}); the next release rejects it"
    verdict = decide(order, envelope)
    last = getattr(order, "last_seq", None)
    where = f" (the order is at seq {last})" if last is not None else ""
    if verdict.outcome is Outcome.PARKED:
        return True, f"{verdict.reason}{where}"
    return False, (
        f"can go ahead now: would be {verdict.outcome.value}"
        f"{': ' + verdict.reason if verdict.reason else ''}{where}; "
        "the next message for the order or the overdue sweep releases it"
    )


def _parked_event(parked: ParkedMessage, order: Any, now: datetime) -> Event:
    waiting, why = held_reason(parked, order)
    seq = f" (seq {parked.seq})" if parked.seq is not None else ""
    mark = f"; overdue since {at(parked.overdue_at)}" if parked.overdue_at else ""
    return Event(
        at=parked.parked_at,
        kind="parked",
        title=f"{parked.envelope.get('type', '') or parked.consumer} {parked.message_id}{seq}",
        outcome="held" if waiting else "releasable",
        text=f"held since {at(parked.parked_at)}: {why}{mark}",
        who=parked.consumer,
        link=_change_url(parked),
        attention=True,
    )


def _audit_event(entry: AuditEntry) -> Event:
    about = f" {entry.message_id}" if entry.message_id else ""
    return Event(
        at=entry.created_at,
        kind="operator",
        title=f"{entry.action}{about}",
        outcome=entry.result,
        text=entry.detail,
        who=entry.username or "(deleted user)",
        link=_change_url(entry),
    )


def _outbox_event(row: OutboxMessage) -> Event:
    # The trace id (what tracing tools search by), and the correlation id where one is kept.
    trace_id = row.traceparent.split("-")[1] if row.traceparent.count("-") == 3 else ""
    trace = " ".join(t for t in (trace_id, row.correlation_id) if t)
    if row.status == OutboxStatus.SENT:
        text = f"sent at {at(row.sent_at)}"
    elif row.status == OutboxStatus.DEAD:
        text = f"dead since {at(row.dead_at)} after {row.attempts} attempts: {row.last_error}"
    else:
        text = f"{row.status}, {row.attempts} attempts"
        if row.last_error:
            text += f"; last error: {row.last_error}"
    return Event(
        at=row.created_at,
        kind="outbox",
        title=f"{row.task_name} {row.message_id}",
        outcome=row.status,
        text=text,
        who="outbox",
        link=_change_url(row),
        trace=trace,
        attention=row.status == OutboxStatus.DEAD,
    )


def outbox_rows(order: Any) -> Any:
    """The outbox rows queued for ``order``: ``order_key`` is its id or its business key."""
    keys = [str(order.pk)]
    business_key = getattr(order, "business_key", "")
    if business_key:
        keys.append(str(business_key))
    return OutboxMessage.objects.filter(order_key__in=keys)


def timeline(order: Any, *, outbox: Any = None) -> list[Event]:
    """Every row about ``order``, oldest first (see the module docstring).

    ``outbox``: the order's outbox rows, when a project keys them otherwise
    (default :func:`outbox_rows`).
    """
    now = timezone.now()
    inbox = list(ProcessedMessage.objects.filter(order_id=order.pk).order_by("created_at", "id"))
    events = [_inbox_event(row, now) for row in inbox]
    leased = [(row.consumer, row.message_id) for row in inbox if row.fencing_token is not None]
    if leased:
        attempts = LeaseAttempt.objects.filter(
            Q.create([Q(consumer=c, message_id=m) for c, m in leased], connector=Q.OR)
        ).order_by("at", "id")
        events += [_attempt_event(a) for a in attempts]
    events += [
        _parked_event(p, order, now)
        for p in ParkedMessage.objects.filter(order_id=order.pk).order_by("parked_at", "id")
    ]
    label = order._meta.label_lower
    audit = AuditEntry.objects.filter(
        Q(order_pk=str(order.pk))
        | Q(target=label, object_id=str(order.pk))
        | Q(
            target=ProcessedMessage._meta.label_lower,
            object_id__in=[str(row.pk) for row in inbox],
        )
    ).order_by("created_at", "id")
    events += [_audit_event(e) for e in audit]
    rows = outbox_rows(order) if outbox is None else outbox
    events += [_outbox_event(r) for r in rows.order_by("created_at", "id")]
    created = getattr(order, "created_at", None)
    if isinstance(created, datetime):
        events.append(
            Event(at=created, kind="order", title=f"order {order.pk} created", outcome="", text="")
        )
    first = {
        "order": 0,
        "message": 1,
        "lease": 1,
        "attempt": 2,
        "parked": 3,
        "outbox": 4,
        "operator": 5,
    }
    return sorted(events, key=lambda e: (e.at, first.get(e.kind, 9)))
