"""A batch chunk's rows and statements: the message item, the claim of the chunk's inbox
rows, the lock of its orders and their parked messages, the one conditional UPDATE of
every order it changed, and the outcomes recorded in the inbox
(:mod:`~idempotent_orders.consuming.batch` decides between them).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import (
    Case,
    F,
    Field,
    Model,
    Q,
    Value,
    When,
)
from django.utils import timezone

from idempotent_orders import dedup, get_order_model
from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.backends.postgresql import arrays
from idempotent_orders.consuming.decision import Verdict, consumed, unknown_order
from idempotent_orders.consuming.envelope import BODY_EXCERPT, Envelope, parse_envelope, serialise
from idempotent_orders.consuming.failures import describe, failed_body, log_failure
from idempotent_orders.consuming.sql import (
    InboxTemplate,
    inbox_template,
    insert_inbox_values,
)
from idempotent_orders.exceptions import ConcurrentUpdate, InvalidMessage
from idempotent_orders.models import (
    AbstractOrder,
    InboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.signals import message_released

__all__ = [
    "Item",
    "Waiting",
    "as_read",
    "claim",
    "claim_postgres",
    "field_names",
    "lock_orders",
    "parked_before",
    "record_outcomes",
    "record_released",
    "settle",
    "update_orders",
]


@dataclass
class Item:
    index: int
    envelope: Envelope
    pk: int = 0
    #: The outcome this delivery reports (what the single path returns for it).
    outcome: Outcome = Outcome.APPLIED
    reason: str = ""
    #: The outcome its inbox row ends with, when it differs: a message parked
    #: and released within the batch reports ``parked`` and records the release.
    recorded_outcome: Outcome | None = None
    #: The inbox row as inserted is final (an applied message, or an unknown order).
    recorded: bool = True
    #: The order exists: its parked successors are worth a look after commit.
    order_exists: bool = True
    #: The inbox row's body when it keeps more than an excerpt (a failed message, or
    #: one whose body raised under ``on_error``: the whole envelope).
    body: str | None = None


def as_read(order: AbstractOrder, attnames: list[str]) -> None:
    """Set ``attnames`` of ``order`` to what reading the row back would give: ``1``, not
    ``Level.SUBMITTED``; ``"paid"``, not ``ShopState.PAID``."""
    fields = _by_attname(type(order))
    state = order.__dict__
    for attname in attnames:
        value = state.get(attname)
        if value is None:
            continue
        value = fields[attname].to_python(value)
        state[attname] = value.value if isinstance(value, enum.Enum) else value


@functools.cache
def _by_attname(model: type[Model]) -> dict[str, Field[Any, Any]]:
    """The model's concrete fields by attname (the model's fields are fixed once loaded)."""
    return {f.attname: f for f in model._meta.concrete_fields}


def claim(consumer: str, items: list[Item], known: set[int]) -> dict[str, int]:
    """Insert an inbox row per message; return ``{message_id: pk}`` of the rows that are new.

    Rows go in sorted by message id, so concurrent batches take the unique
    index's locks in one order and cannot deadlock on each other.
    """
    now = timezone.now()
    template = inbox_template()
    rows = []
    for item in sorted(items, key=lambda i: i.envelope.message_id):
        env = item.envelope
        if env.order_id in known:
            status, outcome, error, body = InboxStatus.DONE, Outcome.APPLIED, "", ""
            order_id: int | None = env.order_id
        else:  # decided now: nothing else can change an unknown order's verdict
            item.outcome, item.reason = Outcome.REJECTED, unknown_order(env).reason
            item.order_exists = False
            status, outcome, error = InboxStatus.REJECTED, Outcome.REJECTED, item.reason
            body = serialise(env.as_dict())[:BODY_EXCERPT]
            order_id = None
        rows.append(
            _inbox_row(template, consumer, env, now, status, outcome, order_id, error, body)
        )
    return insert_inbox_values(template.fields, rows)


def _inbox_row(
    template: InboxTemplate,
    consumer: str,
    env: Envelope,
    now: Any,
    status: InboxStatus = InboxStatus.DONE,
    outcome: Outcome = Outcome.APPLIED,
    order_id: int | None = None,
    error: str = "",
    body: str = "",
) -> list[Any]:
    """The prepared values of ``env``'s inbox row (:meth:`~.sql.InboxTemplate.params`)."""
    values = env.inbox_fields(consumer)
    values.update(
        status=str(status), outcome=str(outcome), order_id=order_id, error=error, body=body
    )
    return template.params(values, now)


def claim_postgres(consumer: str, items: list[Item]) -> dict[str, int]:
    """:func:`claim` on PostgreSQL, in one statement that also looks the orders up
    (:func:`~idempotent_orders.consuming.backends.postgresql.arrays.claim`); a message
    whose order does not exist is marked rejected here, recorded by :func:`record_outcomes`."""
    ordered = sorted(items, key=lambda i: i.envelope.message_id)
    first = ordered[0].envelope
    row = _inbox_row(inbox_template(), consumer, first, timezone.now(), order_id=first.order_id)
    by_id = {i.envelope.message_id: i for i in items}
    new: dict[str, int] = {}
    for pk, message_id, order_id in arrays.claim(consumer, [i.envelope for i in ordered], row):
        new[message_id] = pk
        if order_id is None:
            item = by_id[message_id]
            item.outcome, item.reason = Outcome.REJECTED, unknown_order(item.envelope).reason
            item.order_exists, item.recorded = False, False
    return new


def lock_orders(order_ids: set[int]) -> dict[int, AbstractOrder]:
    """The orders, locked in primary key order so that concurrent batches queue, never deadlock."""
    if not order_ids:
        return {}
    model = get_order_model()
    locked = model._default_manager.select_for_update().filter(backend().pk_in(model, order_ids))
    return {o.pk: o for o in locked.order_by("pk")}


def update_orders(changed: Mapping[int, dict[str, Any]], read_version: Mapping[int, int]) -> None:
    """One conditional UPDATE of every changed order: ``WHERE (id=:id AND version=:v) OR ...``."""
    model = get_order_model()
    names = sorted({name for values in changed.values() for name in values})
    rows = backend().update_orders(model, changed, read_version, names)
    if rows is None:  # the ORM writes it
        assignments: dict[str, Any] = {
            name: Case(
                *(
                    When(pk=pk, then=Value(values[name]))
                    for pk, values in changed.items()
                    if name in values
                ),
                default=F(name),
                output_field=_concrete(model, name),
            )
            for name in names
        }
        condition = Q()
        for pk in changed:
            condition |= Q(pk=pk, version=read_version[pk])
        rows = model._default_manager.filter(condition).update(**assignments)
    if rows != len(changed):
        # The rows are locked, so this means a writer ignored the lock (or a
        # database without row locks let one through): start the batch again.
        raise ConcurrentUpdate(f"{len(changed) - rows} of {len(changed)} orders changed under us")


def _concrete(model: type[Model], name: str) -> Field[Any, Any]:
    found = model._meta.get_field(name)
    assert isinstance(found, Field)
    return found


@dataclass
class Waiting:
    """A parked message of a locked order: parked earlier (``row``) or earlier in this batch."""

    consumer: str
    envelope: Envelope | None
    row: ParkedMessage | None = None
    item: Item | None = None
    #: Why it cannot be read (a handler was unregistered since it was parked).
    unreadable: str = ""


def parked_before(orders: Mapping[int, AbstractOrder], flag: bool) -> dict[int, list[Waiting]]:
    """The parked messages of the locked orders that have any, as ``release_parked`` reads them
    (``flag``: the orders' ``has_parked`` says which may have any; else all are looked at)."""
    flagged = [pk for pk, order in orders.items() if order.has_parked or not flag]
    waiting: dict[int, list[Waiting]] = {}
    if not flagged:
        return waiting
    for row in ParkedMessage.objects.filter(order_id__in=flagged).order_by("seq", "id"):
        try:
            envelope: Envelope | None = parse_envelope(row.envelope, consumer=row.consumer)
            unreadable = ""
        except InvalidMessage as exc:
            envelope, unreadable = None, exc.message
        waiting.setdefault(row.order_id, []).append(
            Waiting(row.consumer, envelope, row=row, unreadable=unreadable)
        )
    return waiting


def field_names(model: type[Model]) -> dict[str, str]:
    """Field names by attname (``kstate_id`` -> ``kstate``), as the chunk's UPDATE takes them."""
    return {f.attname: f.name for f in model._meta.concrete_fields}


def settle(consumer: str, item: Item, verdict: Verdict | Exception) -> None:
    """What a message of the batch ends with once decided in its turn; a failure is
    kept as a ``failed`` row (its outcome stays what it reported: ``parked``)."""
    item.recorded = False
    if isinstance(verdict, Exception):
        item.recorded_outcome, item.reason = Outcome.FAILED, describe(verdict)
        item.body = failed_body(item.envelope.as_dict())
        log_failure(
            consumer, item.envelope.message_id, item.envelope.order_id, 1, item.reason, verdict
        )
    else:
        item.recorded_outcome, item.reason = verdict.outcome, verdict.reason


def record_released(released: list[tuple[Waiting, Verdict | Exception]], errored: set[str]) -> None:
    """Messages parked before the batch and released in it: claim the parked row, record.

    One whose code raised leaves the park as ``failed``, as ``release_parked`` keeps it.
    """
    for entry, verdict in released:
        assert entry.row is not None
        row = entry.row
        ParkedMessage.objects.filter(pk=row.pk).delete()
        inbox = ProcessedMessage.objects.filter(consumer=entry.consumer, message_id=row.message_id)
        if isinstance(verdict, Exception):
            reason = describe(verdict)
            inbox.update(
                status=InboxStatus.FAILED,
                outcome="",
                error=reason,
                body=failed_body(row.envelope),
                updated_at=timezone.now(),
            )
            log_failure(entry.consumer, row.message_id, row.order_id, 1, reason, verdict)
            transaction.on_commit(
                functools.partial(_released, entry.consumer, row, Outcome.FAILED, reason)
            )
            continue
        body = {"body": serialise(row.envelope)} if row.message_id in errored else {}
        inbox.update(
            outcome=verdict.outcome,
            status=verdict.inbox_status,
            error=verdict.reason,
            attempts=F("attempts") + 1,
            **body,
        )
        transaction.on_commit(
            functools.partial(_released, entry.consumer, row, verdict.outcome, verdict.reason)
        )


def _released(consumer: str, row: ParkedMessage, outcome: Outcome, reason: str) -> None:
    """After commit: a parked message released by the chunk, reported as ``release_parked``
    reports it; one that failed is forgotten by the fast path (its redelivery must reach
    the inbox)."""
    if outcome is Outcome.FAILED:
        dedup.forget(consumer, row.message_id)
    else:
        message_released.send(
            sender=ParkedMessage,
            consumer=consumer,
            message_id=row.message_id,
            order_id=row.order_id,
            outcome=outcome,
        )
    envelope = row.envelope if isinstance(row.envelope, dict) else {}
    consumed(
        consumer,
        row.message_id,
        outcome,
        message_type=str(envelope.get("type", "")),
        order_id=row.order_id,
        reason=reason,
    )


def record_outcomes(claimed: list[Item]) -> None:
    """Correct the inbox rows whose outcome is not the ``applied`` they were inserted with."""
    rows = []
    for item in claimed:
        if item.recorded:
            continue
        outcome = item.recorded_outcome or item.outcome
        if outcome is Outcome.FAILED:
            status, recorded = InboxStatus.FAILED, ""
        else:
            status = InboxStatus.REJECTED if outcome is Outcome.REJECTED else InboxStatus.DONE
            recorded = outcome
        body = item.body
        if body is None:
            body = (
                serialise(item.envelope.as_dict())[:BODY_EXCERPT]
                if outcome is Outcome.REJECTED
                else ""
            )
        rows.append(
            ProcessedMessage(
                pk=item.pk, outcome=recorded, status=status, error=item.reason, body=body
            )
        )
    if rows:
        ProcessedMessage.objects.bulk_update(rows, ["outcome", "status", "error", "body"])
