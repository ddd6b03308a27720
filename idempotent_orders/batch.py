"""Consuming many messages at once: one multi-row inbox insert decides every duplicate.

:func:`consume_batch` gives each message the outcome :func:`consume_message`
would, in far fewer round trips. In one transaction it

1. claims the batch's message ids with one ``INSERT ... ON CONFLICT DO NOTHING
   RETURNING`` (``INSERT IGNORE ... RETURNING`` on MariaDB): the rows returned
   are new, every other id is a duplicate — the unique index stays the only
   authority;
2. locks the batch's orders (``SELECT ... FOR UPDATE``, by primary key so two
   batches never deadlock on each other) and decides each new message with the
   single path's own rules, in arrival order, against the order as the
   previous messages of the batch left it;
3. writes every changed order with one conditional ``UPDATE`` (``WHERE id=:id
   AND version=:v`` per row), parks early messages and records the outcomes.

After commit it releases parked successors, as the single path does.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import Case, F, Field, Model, Q, Value, When
from django.db.models.expressions import DatabaseDefault
from django.utils import timezone

from idempotent_orders import dedup
from idempotent_orders.exceptions import ConcurrentUpdate, InvalidMessage
from idempotent_orders.models import InboxStatus, Order, Outcome, ParkedMessage, ProcessedMessage
from idempotent_orders.services import (
    _BODY_EXCERPT,
    Envelope,
    _announce,
    _decide,
    _Decision,
    _serialise,
    consume_message,
    parse_envelope,
    release_parked,
)
from idempotent_orders.signals import order_transitioned
from idempotent_orders.transitions import _state_field, edge

__all__ = ["consume_batch"]

logger = logging.getLogger("idempotent_orders")

#: Messages per transaction; a longer batch is consumed in chunks of this size.
CHUNK = 500
#: Times a chunk is run again after its transaction was chosen as a deadlock victim.
DEADLOCK_RETRIES = 5


@dataclass
class _Item:
    index: int
    envelope: Envelope
    pk: int = 0
    outcome: Outcome = Outcome.APPLIED
    reason: str = ""
    #: The inbox row as inserted is final (an applied message, or an unknown order).
    recorded: bool = True
    #: The order exists: its parked successors are worth a look after commit.
    order_exists: bool = True
    transitions: list[tuple[str, str, str, int]] = field(default_factory=list)


def consume_batch(messages: Sequence[Any], *, consumer: str) -> list[Outcome]:
    """Consume ``messages`` exactly once each; the outcomes come back in input order.

    The effect on every order is the one :func:`~idempotent_orders.services.consume_message`
    would have for the same messages in the same order, and each message gets
    the outcome the single path would give it — except that messages parked
    before or within the batch are released after the batch commits, so when
    two messages of one batch drive the same transition, the one recorded as
    ``applied`` may differ (the order still moves once). A message repeated
    within the batch is a duplicate from its second copy on.
    Database errors propagate and roll back the whole chunk, so the batch can
    be retried as it is.
    """
    outcomes: list[Outcome | None] = [None] * len(messages)
    for start in range(0, len(messages), CHUNK):
        chunk = messages[start : start + CHUNK]
        for offset, outcome in _consume_chunk(chunk, consumer).items():
            outcomes[start + offset] = outcome
    return [o if o is not None else Outcome.DUPLICATE for o in outcomes]


def _consume_chunk(messages: Sequence[Any], consumer: str) -> dict[int, Outcome]:
    outcomes: dict[int, Outcome] = {}
    items: dict[str, _Item] = {}
    repeats: list[tuple[int, Envelope]] = []
    id_length = ProcessedMessage._meta.get_field("message_id").max_length or 255
    for index, message in enumerate(messages):
        try:
            envelope = parse_envelope(message, consumer=consumer)
        except InvalidMessage:
            envelope = None
        if envelope is None or len(envelope.message_id) > id_length:
            # Rare: the single path records the rejection with its reason.
            outcomes[index] = consume_message(message, consumer=consumer)
            continue
        if envelope.message_id in items:
            repeats.append((index, envelope))
            continue
        if dedup.seen(consumer, envelope.message_id):
            _announce(consumer, envelope, Outcome.DUPLICATE, "fast path: already processed")
            outcomes[index] = Outcome.DUPLICATE
            continue
        items[envelope.message_id] = _Item(index=index, envelope=envelope)

    claimed: list[_Item] = []
    if items:
        # A deadlock victim's transaction was rolled back whole, so the chunk
        # can simply run again (inside a caller's transaction, the caller retries).
        attempts = 1 if connection.in_atomic_block else DEADLOCK_RETRIES
        for attempt in range(attempts):
            fresh = {m: _Item(index=i.index, envelope=i.envelope) for m, i in items.items()}
            try:
                claimed = _transact(consumer, fresh)
            except OperationalError as exc:
                if attempt + 1 == attempts or not _is_deadlock(exc):
                    raise
                time.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
            else:
                items = fresh
                break

    claimed_ids = {item.envelope.message_id for item in claimed}
    for item in items.values():
        if item.envelope.message_id in claimed_ids:
            outcomes[item.index] = item.outcome
            transaction.on_commit(
                functools.partial(dedup.remember, consumer, item.envelope.message_id)
            )
            _announce(consumer, item.envelope, item.outcome, item.reason)
        else:
            outcomes[item.index] = Outcome.DUPLICATE
            _announce(consumer, item.envelope, Outcome.DUPLICATE, "already in the inbox")
    for index, envelope in repeats:
        outcomes[index] = Outcome.DUPLICATE
        _announce(consumer, envelope, Outcome.DUPLICATE, "repeated within the batch")

    # Every message may unblock a parked successor, a duplicate too: it may be
    # the redelivery of a batch whose release was cut short (see consume_message).
    # One query finds the orders that have any.
    touched = {i.envelope.order_id for i in items.values() if i.order_exists}
    touched |= {envelope.order_id for _, envelope in repeats}
    if touched:
        waiting = (
            ParkedMessage.objects.filter(order_id__in=touched)
            .values_list("order_id", flat=True)
            .distinct()
        )
        for order_id in sorted(set(waiting)):
            release_parked(order_id)
    return outcomes


def _transact(consumer: str, items: dict[str, _Item]) -> list[_Item]:
    """Claim, decide and write one chunk in one transaction; return the claimed items."""
    with transaction.atomic():
        order_ids = {i.envelope.order_id for i in items.values()}
        # MariaDB checks a foreign key at once, share-locking the order row the
        # inbox row points to; locking the orders first keeps two batches from
        # each holding a share lock the other's FOR UPDATE waits on. PostgreSQL
        # checks at commit, so it claims first and locks only the orders of
        # new messages.
        lock_first = connection.vendor == "mysql"
        if lock_first:
            orders = _lock_orders(order_ids)
            known = set(orders)
        else:
            known = set(Order.objects.filter(pk__in=order_ids).values_list("pk", flat=True))
        new_ids = _claim(consumer, list(items.values()), known)
        claimed = [items[m] for m in sorted(new_ids, key=lambda m: items[m].index)]
        for item in claimed:
            item.pk = new_ids[item.envelope.message_id]
        if not lock_first:
            orders = _lock_orders({i.envelope.order_id for i in claimed} & known)
        _decide_and_write(consumer, claimed, orders)
    return claimed


def _is_deadlock(exc: OperationalError) -> bool:
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "40P01" or (
        bool(exc.args) and exc.args[0] == 1213  # MySQL/MariaDB ER_LOCK_DEADLOCK
    )


def _unknown(order_id: int) -> str:
    return f"unknown order {order_id}"


def _claim(consumer: str, items: list[_Item], known: set[int]) -> dict[str, int]:
    """Insert an inbox row per message; return ``{message_id: pk}`` of the rows that are new.

    Rows go in sorted by message id, so concurrent batches take the unique
    index's locks in one order and cannot deadlock on each other.
    """
    now = timezone.now()
    rows = []
    for item in sorted(items, key=lambda i: i.envelope.message_id):
        env = item.envelope
        if env.order_id in known:
            status, outcome, error, body = InboxStatus.DONE, Outcome.APPLIED, "", ""
        else:  # decided now: nothing else can change an unknown order's verdict
            item.outcome, item.reason = Outcome.REJECTED, _unknown(env.order_id)
            item.order_exists = False
            status, outcome, error = InboxStatus.REJECTED, Outcome.REJECTED, item.reason
            body = _serialise(env.as_dict())[:_BODY_EXCERPT]
        rows.append(
            ProcessedMessage(
                consumer=consumer,
                message_id=env.message_id,
                message_type=env.message_type,
                status=status,
                outcome=outcome,
                order_id=env.order_id if env.order_id in known else None,
                seq=env.seq,
                error=error,
                body=body,
                created_at=now,
                updated_at=now,
            )
        )
    return _insert_ignoring_conflicts(rows)


def _insert_ignoring_conflicts(rows: list[ProcessedMessage]) -> dict[str, int]:
    meta = ProcessedMessage._meta
    qn = connection.ops.quote_name
    # Every column the model would write, except the key and the columns left
    # to their database default; prepared by the fields themselves (auto_now too).
    fields = [
        f
        for f in meta.concrete_fields
        if not f.primary_key and not isinstance(getattr(rows[0], f.attname), DatabaseDefault)
    ]
    columns = ", ".join(qn(str(f.column)) for f in fields)
    placeholder = "(" + ", ".join(["%s"] * len(fields)) + ")"
    params: list[Any] = []
    for row in rows:
        params.extend(f.get_db_prep_save(f.pre_save(row, True), connection) for f in fields)
    table = qn(meta.db_table)
    pk = qn(str(meta.pk.column if meta.pk else "id"))
    message_id = qn(str(_concrete(ProcessedMessage, "message_id").column))
    returning = f"RETURNING {pk}, {message_id}"
    if connection.vendor == "mysql":
        # MariaDB >= 10.5 returns only the rows IGNORE let through. Nothing else
        # is ignored in practice: ids longer than the column never get here.
        head, tail = f"INSERT IGNORE INTO {table}", returning
    else:
        unique = ", ".join(
            qn(str(_concrete(ProcessedMessage, name).column)) for name in ("consumer", "message_id")
        )
        head, tail = f"INSERT INTO {table}", f"ON CONFLICT ({unique}) DO NOTHING {returning}"
    new: dict[str, int] = {}
    with connection.cursor() as cursor:
        if connection.features.can_return_rows_from_bulk_insert:
            values = ", ".join([placeholder] * len(rows))
            cursor.execute(f"{head} ({columns}) VALUES {values} {tail}", params)
            new.update((mid, pk_) for pk_, mid in cursor.fetchall())
        else:  # an old SQLite without RETURNING: one row at a time, same semantics
            width = len(fields)
            for n, row in enumerate(rows):
                cursor.execute(
                    f"{head} ({columns}) VALUES {placeholder} {tail}",
                    params[n * width : (n + 1) * width],
                )
                found = cursor.fetchall()
                if found:
                    new[row.message_id] = found[0][0]
    return new


def _lock_orders(order_ids: set[int]) -> dict[int, Order]:
    """The orders, locked in primary key order so that concurrent batches queue, never deadlock."""
    if not order_ids:
        return {}
    return {
        o.pk: o for o in Order.objects.select_for_update().filter(pk__in=order_ids).order_by("pk")
    }


def _decide_and_write(consumer: str, claimed: list[_Item], orders: dict[int, Order]) -> None:
    live = [i for i in claimed if i.order_exists]
    if not live:
        return
    read_version = {pk: o.version for pk, o in orders.items()}
    changed: dict[int, dict[str, Any]] = {}
    parked: list[_Item] = []
    state_field = _state_field(Order)
    for item in live:
        env = item.envelope
        order = orders.get(env.order_id)
        if order is None:  # deleted between the two reads
            item.outcome, item.reason = Outcome.REJECTED, _unknown(env.order_id)
            item.order_exists, item.recorded = False, False
            continue
        try:
            fields = env.handler.validate(order, env.payload)
        except InvalidMessage as exc:
            decision, fields = _Decision(Outcome.REJECTED, exc.message), {}
        else:
            decision = _decide(order, env)
        item.outcome = decision.outcome or Outcome.APPLIED
        item.reason = decision.reason
        item.recorded = item.outcome is Outcome.APPLIED
        in_sequence = env.seq is not None and env.seq == order.last_seq + 1
        if decision.outcome is None:
            transition = edge(Order, env.handler.transition)
            source = order.status
            meta = getattr(Order, transition.name)._django_fsm
            if not meta.conditions_met(order, source):
                raise ConcurrentUpdate(
                    f"order {order.pk}: a condition of {transition.name} does not hold"
                )
            if env.seq is not None:
                fields = {**fields, "last_seq": env.seq}
            state_field.set_state(order, transition.target)
            order.version += 1
            for name, value in fields.items():
                setattr(order, name, value)
            changed.setdefault(order.pk, {}).update(
                fields, status=transition.target, version=order.version
            )
            item.transitions.append((transition.name, source, transition.target, order.version))
        elif item.outcome is Outcome.PARKED:
            parked.append(item)
        elif in_sequence:
            order.last_seq = env.seq or 0
            changed.setdefault(order.pk, {})["last_seq"] = env.seq

    if changed:
        _update_orders(changed, read_version)
    for item in parked:
        _park(consumer, item)
    flag = {i.envelope.order_id for i in parked if i.outcome is Outcome.PARKED}
    flag = {pk for pk in flag if not orders[pk].has_parked}
    if flag:
        # The single path skips its look for parked successors on orders whose
        # flag it read false; the orders are locked, so this lands before any
        # such consumer's conditional write.
        Order.objects.filter(pk__in=flag).update(has_parked=True)
        for pk in flag:
            orders[pk].has_parked = True
    _record_outcomes(claimed)
    for item in live:
        for name, source, target, version in item.transitions:
            order = orders[item.envelope.order_id]
            transaction.on_commit(
                functools.partial(
                    order_transitioned.send,
                    sender=Order,
                    order=order,
                    transition=name,
                    source=source,
                    target=target,
                    version=version,
                )
            )


def _update_orders(changed: Mapping[int, dict[str, Any]], read_version: Mapping[int, int]) -> None:
    """One conditional UPDATE of every changed order: ``WHERE (id=:id AND version=:v) OR ...``."""
    now = timezone.now()
    names = sorted({name for values in changed.values() for name in values})
    if connection.vendor == "postgresql":
        _update_orders_from_values(changed, read_version, names, now)
        return
    assignments: dict[str, Any] = {
        name: Case(
            *(
                When(pk=pk, then=Value(values[name]))
                for pk, values in changed.items()
                if name in values
            ),
            default=F(name),
            output_field=_concrete(Order, name),
        )
        for name in names
    }
    condition = Q()
    for pk in changed:
        condition |= Q(pk=pk, version=read_version[pk])
    rows = Order.objects.filter(condition).update(**assignments, updated_at=now)
    if rows != len(changed):
        # The rows are locked, so this means a writer ignored the lock (or a
        # database without row locks let one through): start the batch again.
        raise ConcurrentUpdate(f"{len(changed) - rows} of {len(changed)} orders changed under us")


def _update_orders_from_values(
    changed: Mapping[int, dict[str, Any]],
    read_version: Mapping[int, int],
    names: list[str],
    now: Any,
) -> None:
    """PostgreSQL: the same conditional UPDATE as ``UPDATE ... FROM (VALUES ...)``.

    NULL in a row means "unchanged": none of the columns a transition writes is nullable.

    Building a CASE per column per order costs more in Python than the
    statement costs the database; a VALUES list costs next to nothing.
    """
    qn = connection.ops.quote_name
    fields = [_concrete(Order, name) for name in names]
    columns = [str(f.column) for f in fields]
    row = "(%s, %s, " + ", ".join("%s" for _ in fields) + ")"
    params: list[Any] = []
    for pk, values in changed.items():
        params += [pk, read_version[pk]]
        params += [
            f.get_db_prep_save(values[f.name], connection) if f.name in values else None
            for f in fields
        ]
    table = qn(Order._meta.db_table)
    sets = ", ".join(f"{qn(c)} = COALESCE(v.{qn('new_' + c)}, o.{qn(c)})" for c in columns)
    aliases = ", ".join(qn("new_" + c) for c in columns)
    # The first row carries the column types; later rows follow them.
    types = {str(f.column): f.db_type(connection) for f in fields}
    first = "(%s::bigint, %s::bigint, " + ", ".join(f"%s::{types[c]}" for c in columns) + ")"
    values_sql = ", ".join([first] + [row] * (len(changed) - 1))
    sql = (
        f"UPDATE {table} AS o SET {sets}, {qn('updated_at')} = %s"
        f" FROM (VALUES {values_sql}) AS v(id, read_version, {aliases})"
        f" WHERE o.{qn('id')} = v.id AND o.{qn('version')} = v.read_version"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [now, *params])
        rows = cursor.rowcount
    if rows != len(changed):
        raise ConcurrentUpdate(f"{len(changed) - rows} of {len(changed)} orders changed under us")


def _concrete(model: type[Model], name: str) -> Field[Any, Any]:
    found = model._meta.get_field(name)
    assert isinstance(found, Field)
    return found


def _park(consumer: str, item: _Item) -> None:
    env = item.envelope
    try:
        with transaction.atomic():
            ParkedMessage.objects.create(
                consumer=consumer,
                message_id=env.message_id,
                order_id=env.order_id,
                seq=env.seq,
                envelope=env.as_dict(),
                reason=item.reason[:255],
            )
    except IntegrityError:
        # Another message already waits with this (order, seq): a producer bug.
        item.outcome = Outcome.REJECTED
        item.reason = f"another message is already parked with seq {env.seq}"


def _record_outcomes(claimed: list[_Item]) -> None:
    """Correct the inbox rows whose outcome is not the ``applied`` they were inserted with."""
    rows = [
        ProcessedMessage(
            pk=item.pk,
            outcome=item.outcome,
            status=InboxStatus.REJECTED if item.outcome is Outcome.REJECTED else InboxStatus.DONE,
            error=item.reason,
            body=(
                _serialise(item.envelope.as_dict())[:_BODY_EXCERPT]
                if item.outcome is Outcome.REJECTED
                else ""
            ),
        )
        for item in claimed
        if not item.recorded
    ]
    if rows:
        ProcessedMessage.objects.bulk_update(rows, ["outcome", "status", "error", "body"])
