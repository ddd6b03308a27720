"""The road for what the roads without a read cannot take: two texts.

A transition with a body, ``conditions=`` or fsm-2 receivers cannot be decided in
SQL (PostgreSQL's :mod:`~idempotent_orders.consuming.backends.postgresql.one_statement`,
MariaDB's :mod:`~idempotent_orders.consuming.backends.at_once`): the model's own method
must run on the order as read. Nor can a message whose validator is the project's own,
or whose transition has several sources on PostgreSQL, though nothing of the project's
runs (:func:`~idempotent_orders.consuming.unread.fits` says which the backend's road
without a read takes; a message it took, or declined for what the order held, is never
claimed here). The usual road reads the order, then begins, claims the message, updates
the order, queues the follow-up and commits, one round trip each. Here the same
statements travel in two texts, the backend's :class:`Texts` (its ``two_texts``) saying
how:

1. the transaction's opening, the claim of the message (and its spent payment) and the
   read of the order; then, in Python,
   :func:`~idempotent_orders.consuming.decision.decide` on the order as read and the
   model's own transition (conditions, body, fsm-2's signals and whatever their
   receivers send, in this transaction);
2. the conditional UPDATE (pk, state, version and the usual road's conditions), the
   follow-up's outbox row and ``COMMIT``: an order that moved since the read stops the
   text before ``COMMIT``, the transaction rolls back and the usual road decides again.

- PostgreSQL (:mod:`~idempotent_orders.consuming.backends.postgresql.texts`): ``BEGIN;
  <claim and spend>; <read>``, then ``WITH moved AS (UPDATE ...), queued AS (INSERT
  <outbox> ...) SELECT 1 / count(moved) ...; COMMIT`` (the division fails when the
  UPDATE matched nothing), as prepared statements of the session;
- MariaDB/MySQL (:mod:`~idempotent_orders.consuming.backends.mysql`): ``START
  TRANSACTION; SELECT <order> ... FOR UPDATE; INSERT <inbox>; [INSERT <spent>]``, then
  ``UPDATE ...; <guard>; [INSERT IGNORE <outbox>]; COMMIT`` (the guard fails when the
  UPDATE matched nothing), one multi-statement text each.

Where the model's ``save()`` runs the project's code
(:func:`~idempotent_orders.consuming.running.save_hooks`: an override, ``pre_save``/
``post_save`` receivers, a history package, triggers), the first text is the same and
the write is the usual road's:
:func:`~idempotent_orders.consuming.writing.settle`, the model's own ``save()`` with the
version guard and whatever its receivers write; then the follow-up's outbox row and
``COMMIT`` go in one text (:meth:`Texts.queue`), where the one follow-up hands its row
over (else Django's ``COMMIT`` after the follow-ups' own writes). The project's code runs
as on the usual road, in the transaction; ``on_commit`` callbacks run after the commit.
Where the app keeps no ``has_parked`` flag (triggers watch the order), the caller looks
for parked successors after commit, as after the usual road.

The claim comes before the decision (the usual road decides first), so it is an
applied message's row; any other decision (a duplicate, a message to park or reject,
a spent payment, an order with parked messages) rolls it back, and the usual road
reads, decides, writes and says why, as ever. Where more than those writes is needed
(fsm-2's ``on_error``, a receiver that saved the order, a follow-up that does not
hand its row over, a value only the ORM can write), the second text is
the conditional UPDATE alone, or :func:`~idempotent_orders.consuming.writing.settle`,
and Django's ``atomic`` commits as usual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
from django.db.models import Field, Model

from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.decision import decide
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.failures import is_retryable
from idempotent_orders.consuming.graph import TransitionResult, TransitionStatus, state_field
from idempotent_orders.consuming.payments import payment_id
from idempotent_orders.consuming.running import (
    FollowUp,
    FollowUpRow,
    Ran,
    call_transition,
    follow_up_rows,
    guarded_update_sql,
    keeps_parked_flag,
    save_hooks,
    transition_written,
)
from idempotent_orders.consuming.sql import build, compiled_read, handed_over
from idempotent_orders.consuming.unread import fits
from idempotent_orders.consuming.writing import Conflict, settle
from idempotent_orders.models import PLAIN_TYPES, AbstractOrder, Outcome
from idempotent_orders.vendors import vendor

__all__ = ["Conflict", "Declined", "FirstText", "Texts", "can_claim_and_run", "claim_and_run"]


class Declined(Exception):
    """Not this road's message after all: roll back, the usual road takes it."""


@dataclass(frozen=True)
class FirstText:
    """What the first text claims and reads."""

    #: The inbox row's per-message fields.
    inbox: dict[str, Any]
    #: The spent payment's row (payment, order, consumer, message id); None: no payment.
    spent: list[Any] | None
    #: The order's read and its arguments.
    read: str
    read_args: Sequence[Any]


class Texts:
    """How one database sends the two texts (a backend's ``two_texts``)."""

    def transaction(self, conn: Any) -> AbstractContextManager[Any]:
        """Django's ``atomic`` block of the road, and the cursor both texts go through."""
        raise NotImplementedError

    def claim_and_read(self, conn: Any, cursor: Any, first: FirstText) -> Sequence[Any]:
        """The first text: open the transaction, claim the message as applied and spend its
        payment, read the order (:class:`FirstText`); the order's row. Raises
        :class:`Declined` for a duplicate, a spent payment, an unknown order, a value a
        column refuses."""
        raise NotImplementedError

    def compile(self, conn: Any, update: str, queued: bool, commit: bool) -> Any:
        """The second text of one shape of transition: the conditional ``update``
        (:func:`~idempotent_orders.consuming.running.guarded_update_sql`), the follow-up's
        outbox row when ``queued``, ``COMMIT`` when ``commit``; it stops before ``COMMIT``
        when the UPDATE matched no row."""
        raise NotImplementedError

    def write(
        self, conn: Any, cursor: Any, update: Any, args: list[Any], queued: dict[str, Any] | None
    ) -> int | None:
        """Send ``update`` (from :meth:`compile`) with the UPDATE's ``args`` and the
        follow-up's ``queued`` fields; the outbox row's id (None: none written, its
        message id was queued already). Raises :class:`Conflict` when the order moved."""
        raise NotImplementedError

    def queue(self, conn: Any, cursor: Any, queued: dict[str, Any]) -> int | None:
        """Send the follow-up's outbox row of ``queued`` fields and ``COMMIT`` as one text,
        the order written already by the model's own ``save()``; the row's id (None: its
        message id was queued already). An insert that fails stops the text before
        ``COMMIT``."""
        raise NotImplementedError


def can_claim_and_run(conn: Any) -> bool:
    """Whether :func:`claim_and_run` may run on ``conn`` now: a backend with two texts
    whose driver runs several statements a text, outside any transaction."""
    texts = backend(conn).texts()
    if texts is None or conn.in_atomic_block or not conn.get_autocommit():
        return False
    return vendor(conn).several_statements(conn)


def claim_and_run(envelope: Envelope, consumer: str, model: type[Model]) -> Outcome | None:
    """Apply ``envelope`` in two round trips when the backend's road without a read cannot
    take its kind (:func:`~idempotent_orders.consuming.unread.fits`); None: nothing was
    written, take the usual road.

    On APPLIED (or REJECTED: the body raised under fsm-2's ``on_error``, as the usual
    road keeps it) the message is committed and announced inside the transaction as the
    usual road announces it; the caller announces the outcome. An exception from the
    project's code propagates after the rollback, as on the usual road.
    """
    name = envelope.handler.transition
    alias, plan = compiled_read(model, "pk")
    if plan is None or alias != DEFAULT_DB_ALIAS:
        return None
    conn = connections[alias]
    chosen = backend(conn)
    # at_once tests the state against several sources; one_statement against one.
    if fits(envelope, model, several=chosen.at_once):
        # The road without a read's kind: it took the message, or declined it for a
        # reason the order gave (its state, a duplicate, parked messages, a rule's test).
        return None
    # The backend's texts, looked up once for the message (as can_claim_and_run does).
    texts = chosen.texts()
    if texts is None or conn.in_atomic_block or not conn.get_autocommit():
        return None
    if not vendor(conn).several_statements(conn):
        return None
    payment = payment_id(envelope)
    try:
        # One cursor for both texts (the project's code in between may use its own).
        with texts.transaction(conn) as cursor:
            order = _claim_and_read(envelope, consumer, model, conn, cursor, texts, plan, payment)
            verdict = decide(order, envelope)
            if verdict.outcome is not Outcome.APPLIED:
                raise Declined
            # The usual road's conditions (writing.write): the flag as read, where the app
            # keeps it (elsewhere the caller looks for parked successors after commit).
            conditions: dict[str, Any] = {"has_parked": False} if keeps_parked_flag(model) else {}
            if envelope.seq is not None:
                conditions["last_seq"] = envelope.seq - 1
            version: int = order.version
            ran = call_transition(order, name, verdict.kwargs, fields=verdict.values)
            # Where the project's code runs on save(), the model's own save() commits it
            # (running.commit), as on the usual road; the follow-up's row goes with COMMIT.
            if save_hooks(model) or not _finish(
                order, ran, version, conditions, conn, cursor, texts
            ):
                last = partial(_queue_and_commit, conn, cursor, texts)
                return settle(envelope, consumer, order, ran, version, conditions, last=last)
            return Outcome.APPLIED
    except (Declined, Conflict):
        return None
    except OperationalError as exc:
        if not is_retryable(exc):
            raise
        return None  # rolled back whole (a deadlock, say): the usual road runs it again


def _claim_and_read(
    envelope: Envelope,
    consumer: str,
    model: type[Model],
    conn: Any,
    cursor: Any,
    texts: Texts,
    plan: Any,
    payment: str | None,
) -> AbstractOrder:
    """The first text: claim the message as applied (and spend its payment), read the
    order. Raises Declined for a duplicate, a spent payment, an unknown order, or an
    order with parked messages (the usual road answers those)."""
    pk = model._meta.pk
    assert pk is not None
    read_args = [pk.get_db_prep_value(envelope.order_id, conn)]
    inbox = envelope.inbox_fields(consumer)
    spent = None if payment is None else [payment, envelope.order_id, consumer, envelope.message_id]
    row = texts.claim_and_read(conn, cursor, FirstText(inbox, spent, plan.sql, read_args))
    order = build(model, conn.alias, plan, row)
    if order.has_parked:  # type: ignore[attr-defined]
        raise Declined  # released after the write by the usual road
    return order  # type: ignore[return-value]


def _follow_up(
    model: type[Model], pk: Any, ran: Ran
) -> tuple[bool, tuple[FollowUp, FollowUpRow] | None]:
    """Whether ``COMMIT`` may go with the last text (no follow-up writes on its own after
    it), and the one follow-up whose outbox row that text writes, if any."""
    rows = follow_up_rows(model, pk, ran.name, ran.target)
    handed: tuple[FollowUp, FollowUpRow] | None = None
    if rows and len(rows) == 1 and handed_over(rows[0][1].fields):
        handed = rows[0]
    return rows is not None and (not rows or handed is not None), handed


def _queue_and_commit(
    conn: Any, cursor: Any, texts: Texts, order: AbstractOrder, ran: Ran
) -> tuple[FollowUp, ...] | None:
    """After the model's ``save()`` and its receivers: the follow-up's outbox row and
    ``COMMIT`` in one text (:meth:`Texts.queue`); the follow-up it wrote, or None with
    nothing sent (several follow-ups, or one that writes its own row: Django commits)."""
    _, handed = _follow_up(type(order), order.pk, ran)
    if handed is None:
        return None
    queued_id = texts.queue(conn, cursor, dict(handed[1].fields))
    if queued_id is not None:  # None: the message was queued already
        handed[1].written(conn.alias, queued_id)
    return (handed[0],)


_updates: dict[tuple[Any, ...], Any] = {}


@cache
def _by_attname(model: type[Model]) -> dict[str, Field[Any, Any]]:
    return {f.attname: f for f in model._meta.concrete_fields}


def _compile(
    conn: Any,
    model: type[Model],
    values: Sequence[str],
    conditions: Sequence[str],
    queued: bool,
    commit: bool,
) -> Any:
    """The backend's second text for ``values`` and ``conditions`` (attnames) as
    :func:`running.commit` writes them; None when a column is not a plain one of the
    model's own table (the ORM writes it)."""
    concrete = model._meta.concrete_model
    assert concrete is not None
    meta = concrete._meta  # a proxy's table is its concrete model's
    by_attname = {f.attname: f for f in meta.concrete_fields}
    fields = [by_attname.get(name) for name in (*values, *conditions)]
    if meta.parents or any(f is None or f.model is not concrete or f.primary_key for f in fields):
        return None  # a parent's column (multi-table inheritance): the ORM writes it
    if any(hasattr(f, "get_placeholder") for f in fields):
        return None
    texts = backend(conn).texts()
    assert texts is not None
    column = str(state_field(model).column)
    sets, tests = [by_attname[n] for n in values], [by_attname[n] for n in conditions]
    return texts.compile(conn, guarded_update_sql(conn, meta, column, sets, tests), queued, commit)


def _finish(
    order: AbstractOrder,
    ran: Ran,
    version: int,
    conditions: Mapping[str, Any],
    conn: Any,
    cursor: Any,
    texts: Texts,
) -> bool:
    """The second text: write what the transition did, queue its follow-up and commit,
    then announce it (its publish and ``order_transitioned`` run after the block). False,
    with nothing sent, where :func:`~idempotent_orders.consuming.writing.settle` must."""
    if ran.error is not None or ran.saved:
        return False
    if any(
        type(v) not in PLAIN_TYPES and (hasattr(v, "resolve_expression") or isinstance(v, Model))
        for v in ran.values.values()
    ):
        return False
    model = type(order)
    commit, handed = _follow_up(model, order.pk, ran)
    key = (conn.alias, model, tuple(ran.values), tuple(conditions), handed is not None, commit)
    try:
        update = _updates[key]
    except KeyError:
        update = _updates[key] = _compile(
            conn, model, list(ran.values), list(conditions), handed is not None, commit
        )
    if update is None:
        return False
    field = state_field(model)
    pk = model._meta.pk
    assert pk is not None
    by_attname = _by_attname(model)
    args: list[Any] = [field.get_db_prep_save(ran.target, conn)]
    args += [by_attname[n].get_db_prep_save(v, conn) for n, v in ran.values.items()]
    args += [pk.get_db_prep_value(order.pk, conn), field.get_db_prep_value(ran.source, conn)]
    args.append(version)
    args += [by_attname[n].get_db_prep_value(v, conn) for n, v in conditions.items()]
    queued_id = texts.write(
        conn, cursor, update, args, None if handed is None else dict(handed[1].fields)
    )
    order.__dict__["version"] = version + 1
    if handed is not None and queued_id is not None:  # None: the message was queued already
        handed[1].written(conn.alias, queued_id)
    result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
    transition_written(
        order, ran.name, result, fsm_sent=True, handed=() if handed is None else (handed[0],)
    )
    return True
