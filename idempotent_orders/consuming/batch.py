"""Consuming many messages at once: one multi-row inbox insert decides every duplicate.

:func:`consume_batch` gives each message the outcome :func:`consume_message`
would, in far fewer statements. In one transaction it

1. claims the batch's message ids with one ``INSERT ... ON CONFLICT DO NOTHING
   RETURNING`` (``INSERT IGNORE ... RETURNING`` on MariaDB): the rows returned
   are new, every other id is a duplicate — the unique index stays the only
   authority;
2. locks the batch's orders (``SELECT ... FOR UPDATE``, by primary key so two
   batches never deadlock on each other) and decides each new message with
   :func:`idempotent_orders.consuming.decision.decide` — the single path's own decision —
   in arrival order, against the order as the batch's earlier messages left it;
3. writes every changed order with one conditional ``UPDATE`` (``WHERE id=:id
   AND version=:v`` per row), parks early messages and records the outcomes.
   Where the model's ``save()`` runs the project's code (an override, receivers,
   history packages), each transition is instead committed by the model's own
   ``save()`` when it is taken, in the message's savepoint, as the single path
   commits it; its UPDATE waits for the chunk's next text
   (:class:`~idempotent_orders.consuming.held.HeldSaves`).

After commit it releases parked successors and only then writes the fast-path
keys, as the single path does.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.db import OperationalError, connection, transaction
from django.db.models import Model
from django_fsm.signals import pre_transition

from idempotent_orders import dedup, get_order_model, otel
from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.chunk import (
    Item,
    Waiting,
    as_read,
    claim,
    claim_postgres,
    field_names,
    lock_orders,
    parked_before,
    record_outcomes,
    record_released,
    settle,
    update_orders,
)
from idempotent_orders.consuming.decision import (
    Verdict,
    announce_many,
    decide,
    parked_twice,
    unknown_order,
)
from idempotent_orders.consuming.envelope import Envelope, consuming, parse_envelope, serialise
from idempotent_orders.consuming.failures import (
    TRANSIENT,
    MessageFailed,
    is_retryable,
    redelivered,
)
from idempotent_orders.consuming.graph import TransitionResult, TransitionStatus, state_field
from idempotent_orders.consuming.held import HeldSaves
from idempotent_orders.consuming.payments import Reservation, payment_id, record_spent, spend
from idempotent_orders.consuming.running import (
    Ran,
    advance,
    call_transition,
    commit,
    keeps_parked_flag,
    runs_user_code,
    save_hooks,
    still_committable,
    transition_heard,
    transition_starting,
    transitions_written,
    written_values,
)
from idempotent_orders.consuming.savepoints import Savepoints, guarded
from idempotent_orders.consuming.single import consume_message, release_parked
from idempotent_orders.consuming.writing import (
    Conflict,
    Spent,
    on_error_reason,
    park,
    spent_verdict,
)
from idempotent_orders.exceptions import InvalidMessage, UnknownTransition
from idempotent_orders.models import (
    SETTLED_OUTCOMES,
    AbstractOrder,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)

__all__ = ["consume_batch"]


logger = logging.getLogger("idempotent_orders")

#: Messages per transaction; a longer batch is consumed in chunks of this size.
CHUNK = 500
#: Messages per transaction where each one writes in a savepoint of its own (the model's
#: ``save()`` runs the project's code). PostgreSQL keeps 64 subtransactions of a
#: transaction in shared memory; past that, while the transaction runs, every other
#: session's visibility checks look its subtransactions up in ``pg_subtrans``, and so do
#: the replicas.
SAVEPOINT_CHUNK = 60
#: Times a chunk is run again after its transaction was chosen as a deadlock victim.
DEADLOCK_RETRIES = 5


@otel.traced_batch
def consume_batch(messages: Sequence[Any], *, consumer: str) -> list[Outcome]:
    """Consume ``messages`` exactly once each; the outcomes come back in input order.

    The effect on every order is the one :func:`~idempotent_orders.consuming.single.consume_message`
    would have for the same messages in the same order, and each message gets
    the outcome the single path would give it — except that messages parked
    before or within the batch are released after the batch commits, so when
    two messages of one batch drive the same transition, the one recorded as
    ``applied`` may differ (the order still moves once). A message repeated
    within the batch is a duplicate from its second copy on.
    Database errors propagate and roll back the whole chunk, so the batch can
    be retried as it is. Where the order model's ``save()`` runs the project's code
    (:func:`~idempotent_orders.consuming.running.save_hooks`), every transition is a
    ``save()`` of its own, in arrival order, in the chunk's one transaction, and a chunk
    holds at most :data:`SAVEPOINT_CHUNK` messages.
    """
    outcomes: list[Outcome | None] = [None] * len(messages)
    size = SAVEPOINT_CHUNK if save_hooks(get_order_model()) else CHUNK
    for start in range(0, len(messages), size):
        chunk = messages[start : start + size]
        for offset, outcome in _consume_chunk(chunk, consumer).items():
            outcomes[start + offset] = outcome
    return [o if o is not None else Outcome.DUPLICATE for o in outcomes]


def _consume_chunk(messages: Sequence[Any], consumer: str) -> dict[int, Outcome]:
    outcomes: dict[int, Outcome] = {}
    items: dict[str, Item] = {}
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
        items[envelope.message_id] = Item(index=index, envelope=envelope)
    model = get_order_model()
    user = _runs_user_code(model, items.values())
    if user is None:
        # A message type bound to a transition the model lacks: the single path says why.
        outcomes.update(_one_by_one(messages, _indexes(items, repeats), consumer))
        return outcomes
    # Where the model's save() runs the project's code (history, audit, receivers), each
    # transition is a save() of its own: the project's code, in a savepoint.
    user = user or bool(save_hooks(model))
    # One look at the fast path for the whole chunk (one Redis command at most).
    if items:
        layers = dedup.lookup_many(consumer, list(items))
        known: list[tuple[Envelope, Outcome, str]] = []
        for message_id, layer in layers.items():
            if layer in dedup.KNOWN:
                item = items.pop(message_id)
                known.append((item.envelope, Outcome.DUPLICATE, "fast path: already processed"))
                outcomes[item.index] = Outcome.DUPLICATE
        announce_many(consumer, known)

    claimed: list[Item] = []
    settled: set[int] = set()
    if items:
        # A deadlock victim's transaction was rolled back whole, so the chunk
        # can simply run again (inside a caller's transaction, the caller retries).
        attempts = 1 if connection.in_atomic_block else DEADLOCK_RETRIES
        for attempt in range(attempts):
            # A retry starts from items as parsed: the failed attempt changed its own.
            fresh = (
                items
                if attempt == 0
                else {m: Item(index=i.index, envelope=i.envelope) for m, i in items.items()}
            )
            try:
                claimed, settled = _transact(consumer, fresh, user)
            except OperationalError as exc:
                if attempt + 1 == attempts or not is_retryable(exc):
                    raise
                time.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
            except TRANSIENT:
                raise
            except Exception:
                # A validator raised (or the database refused a row) where no project
                # code ran (a chunk that runs some keeps each message's failure in a
                # savepoint of its own): the chunk rolled back whole. Each message goes
                # alone, so the bad one is recorded as failed and the good ones commit.
                logger.warning(
                    "a batch of %d rolled back on an error; consuming its messages one by one",
                    len(items),
                    exc_info=True,
                )
                outcomes.update(_one_by_one(messages, _indexes(items, repeats), consumer))
                return outcomes
            else:
                items = fresh
                break

    claimed_ids = {item.envelope.message_id for item in claimed}
    unclaimed = [m for m in items if m not in claimed_ids]
    dead: set[str] = set()
    if unclaimed:
        # Failed deliveries of these messages (or requeued dead letters): run again.
        # Dead letters are not run, and not remembered (their requeue must reach us).
        # A message whose id was used before for another message goes there too (kept
        # and flagged by the single path, never counted a duplicate).
        found = redelivered(consumer, unclaimed)
        dead = {m for m, (retry, _) in found.items() if retry is None}
        again = {
            m
            for m, (retry, fingerprint) in found.items()
            if retry
            or (m not in dead and fingerprint and fingerprint != items[m].envelope.fingerprint)
        }
        if again:
            retried = sorted(items[m].index for m in again)
            outcomes.update(_one_by_one(messages, retried, consumer))
            for message_id in again:
                items.pop(message_id)
    reports: list[tuple[Envelope, Outcome, str]] = []
    for item in items.values():
        if item.envelope.message_id in claimed_ids:
            outcomes[item.index] = item.outcome
            reports.append((item.envelope, item.outcome, item.reason))
            if item.recorded_outcome is not None and item.outcome is Outcome.PARKED:
                # Parked, then released within the batch: the release is reported too,
                # as ``release_parked`` reports it.
                reports.append((item.envelope, item.recorded_outcome, item.reason))
            if Outcome.FAILED in (item.outcome, item.recorded_outcome):
                dead.add(item.envelope.message_id)  # its redelivery must reach the inbox
        else:
            outcomes[item.index] = Outcome.DUPLICATE
            reports.append((item.envelope, Outcome.DUPLICATE, "already in the inbox"))
    for index, envelope in repeats:
        outcomes[index] = Outcome.DUPLICATE
        reports.append((envelope, Outcome.DUPLICATE, "repeated within the batch"))
    announce_many(consumer, reports)

    # Every message may unblock a parked successor, a duplicate too: it may be
    # the redelivery of a batch whose release was cut short (see consume_message).
    # One query finds the orders that have any. Orders the chunk locked and
    # found without parked messages are skipped, as the single path skips an
    # order whose flag it read false: a message parked since sets the flag
    # only after our commit (the row was locked) and then re-checks itself.
    touched = {i.envelope.order_id for i in items.values() if i.order_exists}
    touched |= {envelope.order_id for _, envelope in repeats}
    touched -= settled
    if touched:
        waiting = (
            ParkedMessage.objects.filter(order_id__in=touched)
            .values_list("order_id", flat=True)
            .distinct()
        )
        for order_id in sorted(set(waiting)):
            release_parked(order_id)
    # Remembered last, as the single path does: a worker that dies before this
    # point leaves no fast-path key, so the redelivery reaches the database.
    remembered = [m for m in items if m not in dead]
    kept = [m for m in remembered if m in claimed_ids and items[m].outcome in SETTLED_OUTCOMES]
    transaction.on_commit(lambda: dedup.remember_many(consumer, remembered, settled=kept))
    return outcomes


def _runs_user_code(model: type[Model], items: Any) -> bool | None:
    """Whether a message of the chunk drives a transition with something of the
    project's to run: a body, an fsm-2 receiver (see ``runs_user_code``); None when
    one names a transition the model lacks.
    """
    names = {item.envelope.handler.transition for item in items}
    try:
        return any(runs_user_code(model, name) for name in names)
    except UnknownTransition:
        return None


def _indexes(items: dict[str, Item], repeats: list[tuple[int, Envelope]]) -> list[int]:
    """The positions of the chunk's parsed messages, repeats included, in arrival order."""
    return sorted([i.index for i in items.values()] + [index for index, _ in repeats])


def _one_by_one(messages: Sequence[Any], indexes: list[int], consumer: str) -> dict[int, Outcome]:
    """The single path for the messages at ``indexes``, in order; a failure is kept and
    does not stop the rest."""
    outcomes: dict[int, Outcome] = {}
    for index in indexes:
        try:
            outcomes[index] = consume_message(messages[index], consumer=consumer)
        except MessageFailed:
            outcomes[index] = Outcome.FAILED
    return outcomes


def _transact(consumer: str, items: dict[str, Item], user: bool) -> tuple[list[Item], set[int]]:
    """Claim, decide and write one chunk in one transaction (``user``: the project's code
    runs, each message's in a savepoint).

    Returns the claimed items and the orders it locked that have no parked
    message when it commits (``has_parked`` false).
    """
    with transaction.atomic():
        order_ids = {i.envelope.order_id for i in items.values()}
        # MariaDB checks a foreign key at once, share-locking the order row the
        # inbox row points to; locking the orders first keeps two batches from
        # each holding a share lock the other's FOR UPDATE waits on. PostgreSQL
        # checks at commit, so it claims first and locks only the orders of
        # new messages.
        chosen = backend()
        lock_first = chosen.locks_orders_first
        if chosen.arrays:
            # The claim itself says which orders exist (one statement, not two).
            new_ids = claim_postgres(consumer, list(items.values()))
            known = {items[m].envelope.order_id for m in new_ids if items[m].order_exists}
        else:
            if lock_first:
                orders = lock_orders(order_ids)
                known = set(orders)
            else:
                known = set(
                    get_order_model()
                    ._default_manager.filter(pk__in=order_ids)
                    .values_list("pk", flat=True)
                )
            new_ids = claim(consumer, list(items.values()), known)
        claimed = [items[m] for m in sorted(new_ids, key=lambda m: items[m].index)]
        for item in claimed:
            item.pk = new_ids[item.envelope.message_id]
        if not lock_first:
            orders = lock_orders({i.envelope.order_id for i in claimed} & known)
        _decide_and_write(consumer, claimed, orders, user)
    if not keeps_parked_flag(get_order_model()):
        return claimed, set()  # no flag says which orders have none
    return claimed, {pk for pk, order in orders.items() if not order.has_parked}


def _waiting_key(nulls_last: bool) -> Callable[[tuple[int, Waiting]], tuple[Any, ...]]:
    """The order ``release_parked`` takes parked rows in: ``ORDER BY seq, id`` as the
    database sorts it (``nulls_last``: NULL after every value), batch items last.
    """

    def key(entry: tuple[int, Waiting]) -> tuple[Any, ...]:
        position, waiting = entry
        seq = waiting.envelope.seq if waiting.envelope is not None else None
        if seq is None and waiting.row is not None:
            seq = waiting.row.seq
        return ((seq is None) == nulls_last, seq or 0, position)

    return key


def _decide_and_write(
    consumer: str, claimed: list[Item], orders: dict[int, AbstractOrder], user: bool
) -> None:
    """Decide each claimed message with the engine, in arrival order, then write them all.

    The single path releases an order's parked messages after each message it
    consumes; so does this loop, in memory, before the next message of the
    batch is decided: messages parked before the batch and messages of the
    batch itself that can now go ahead are decided in ``release_parked``'s
    order. What is still waiting at the end is parked.

    ``user``: the project's code runs (a body, a condition, a receiver). Each
    message's decision and transition then run in a savepoint of their own, so
    one that raises is kept as failed and rolls back only its own writes, as the
    single path keeps it, and no other message's code runs again.
    """
    live = [i for i in claimed if i.order_exists]
    if not live:
        record_outcomes(claimed)
        return
    chunk = _Chunk(consumer, orders, live, user)
    holder = chunk.savepoints.holder
    if holder is None:
        for item in live:
            chunk.decide(item)
        chunk.write(claimed)
        if user:
            still_committable(chunk.conn)
        return
    # The save() road: each save()'s UPDATE held for the next text (installed before any
    # message's savepoint, so it sees each statement first), and settled before COMMIT.
    wrappers = chunk.conn.execute_wrappers
    wrappers.append(holder)
    try:
        for item in live:
            chunk.decide(item)
        chunk.write(claimed)
        holder.settle()
        still_committable(chunk.conn)
    finally:
        wrappers.remove(holder)


class _Chunk:
    """One chunk's decisions, made in memory in arrival order, and its writes."""

    def __init__(
        self, consumer: str, orders: dict[int, AbstractOrder], live: list[Item], user: bool
    ) -> None:
        self.consumer = consumer
        self.orders = orders
        self.user = user
        self.model = model = get_order_model()
        field = state_field(model)
        self.state_name, self.state_attname = field.name, field.attname
        self.names = field_names(model)
        self.read_version = {pk: o.version for pk, o in orders.items()}
        #: Per order, the new value of each field the chunk changed (one UPDATE at the end).
        self.changed: dict[int, dict[str, Any]] = {}
        self.transitions: list[tuple[AbstractOrder, str, TransitionResult]] = []
        #: The app keeps the orders' ``has_parked`` flag (not where triggers watch them).
        self.flag = keeps_parked_flag(model)
        self.waiting = parked_before(orders, self.flag)
        self.released: list[tuple[Waiting, Verdict | Exception]] = []
        # The connection itself: Django's ``connection`` proxy looks it up again on every use.
        self.conn = transaction.get_connection()
        self.savepoints = Savepoints(self.conn)
        self.order_key = _waiting_key(backend(self.conn).nulls_last)
        # ``updated_at`` (when the model has one): one moment for the whole chunk,
        # the moment of its one UPDATE.
        self.stamp = written_values(model, {})
        #: ``(payment id, order id, message id)`` of the chunk's payments, where no project
        #: code runs.
        self.spends: list[tuple[str, Any, str]] = []
        # Where the project's code runs, the chunk's payment ids are spent before it does.
        self.reservation = (
            Reservation(
                consumer,
                [
                    (payment, i.envelope.order_id, i.envelope.message_id)
                    for i in live
                    if (payment := payment_id(i.envelope)) is not None
                ],
            )
            if user
            else None
        )
        #: Messages whose body raised under fsm-2's ``on_error`` (kept as rejected).
        self.errored: set[str] = set()
        #: The model's ``save()`` runs the project's code: each transition is committed
        #: by it when taken (:meth:`_save`), not by the chunk's one UPDATE.
        self.saves = bool(save_hooks(model))
        if self.saves and self.user:
            # Each save()'s UPDATE waits for the next text on the connection.
            self.savepoints.holder = HeldSaves.arm(self.conn)
        #: Per order, its ``last_seq`` as the row holds it (moved on in memory by a
        #: message without a transition, it is written by the next save() or the UPDATE).
        self.held_seq = {pk: o.last_seq for pk, o in orders.items()}

    def take(self, order: AbstractOrder, verdict: Verdict, env: Envelope) -> Verdict:
        """The verdict's effect on the order, in memory (written by one UPDATE later);
        the verdict it ends with (a payment spent already, a body's ``on_error``)."""
        payment = payment_id(env) if verdict.transition else None
        paid = None
        reservation = self.reservation
        if payment is not None and reservation is not None:
            # Spent first, as the single path does: a payment spent already runs no body.
            known, owner = reservation.owner(payment)
            if not known:  # not among the chunk's own (a message parked before it)
                owner = spend(payment, order.pk, self.consumer, env.message_id)
            if owner is not None:
                verdict = spent_verdict(env, order, Spent(payment, owner))
            else:
                paid = payment
        elif payment is not None:
            self.spends.append((payment, order.pk, env.message_id))
        if (
            verdict.transition
            and self.user
            and (self.saves or runs_user_code(self.model, verdict.transition))
        ):
            verdict = self._run(order, verdict, env)
        elif verdict.transition:
            if pre_transition.receivers:  # nobody connected: nothing to send
                transition_starting(order, verdict.transition)
            values = {**self.stamp, **verdict.values}
            result = advance(order, verdict.transition, values)
            self.changed.setdefault(order.pk, {}).update(
                values, **{self.state_name: result.target, "version": result.version}
            )
            self.transitions.append((order, verdict.transition, result))
        elif verdict.outcome is not Outcome.PARKED and verdict.advance_to is not None:
            order.last_seq = verdict.advance_to
            self.changed.setdefault(order.pk, {})["last_seq"] = verdict.advance_to
        if paid is not None and reservation is not None:
            reservation.used(paid, order.pk, env.message_id)
        return verdict

    def _run(self, order: AbstractOrder, verdict: Verdict, env: Envelope) -> Verdict:
        """The model's own method (conditions, body and fsm-2's signals), as a direct call."""
        assert verdict.transition is not None
        version: int = order.version
        ran = call_transition(order, verdict.transition, verdict.kwargs, fields=verdict.values)
        if self.saves:
            self._save(order, ran, version)
            # The next message of the chunk meets the order as a read would give it back,
            # as on the single path, which reads it again.
            as_read(order, [self.state_attname, *ran.values])
            return self._ran(order, verdict, env, ran, version)
        if ran.saved:
            # A receiver saved the order in this transaction: the row holds its version.
            self.read_version[order.pk] = version
        order.version = version + 1
        # The next message of the chunk meets the order as a read would give it back.
        as_read(order, [self.state_attname, *ran.values])
        values = {self.names.get(k, k): v for k, v in ran.values.items()}
        self.changed.setdefault(order.pk, {}).update(
            values, **self.stamp, **{self.state_name: ran.target, "version": version + 1}
        )
        return self._ran(order, verdict, env, ran, version)

    def _ran(
        self, order: AbstractOrder, verdict: Verdict, env: Envelope, ran: Ran, version: int
    ) -> Verdict:
        """The transition ``ran`` taken (to be announced); the verdict it ends with."""
        assert verdict.transition is not None
        result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
        self.transitions.append((order, verdict.transition, result))
        if ran.error is None:
            return verdict
        reason = on_error_reason(env, self.consumer, order, verdict.transition, ran)
        self.errored.add(env.message_id)
        return Verdict(Outcome.REJECTED, reason)

    def _save(self, order: AbstractOrder, ran: Ran, version: int) -> None:
        """Commit the transition ``ran`` through the model's own ``save()``, as the single
        path does (:func:`~idempotent_orders.consuming.running.commit`): its override and
        receivers run now, in the message's savepoint. The row then holds every field of
        the order as the chunk left it in memory, so nothing of it is left to the UPDATE."""
        conditions = {"last_seq": self.held_seq[order.pk]}
        if not commit(order, ran, version, conditions, self.savepoints.holder):
            # The chunk holds the order's lock: the row is as the chunk left it.
            raise Conflict(f"order {order.pk} changed under the batch's lock")
        self.changed.pop(order.pk, None)
        self.read_version[order.pk] = order.version
        self.held_seq[order.pk] = order.last_seq

    def judge(self, order: AbstractOrder, env: Envelope) -> Verdict | Exception:
        """``decide`` and, unless the message must wait, ``take``; what raised, returned."""

        def step() -> Verdict:
            with consuming(env, self.consumer):
                verdict = decide(order, env)
                if verdict.outcome is Outcome.PARKED:
                    return verdict
                return self.take(order, verdict, env)

        return guarded(order, step, self.savepoints) if self.user else step()

    def release(self, order: AbstractOrder) -> None:
        """``release_parked`` for one order: the first that can go ahead, again and again."""
        queue = self.waiting.get(order.pk)
        progressed = True
        while queue and progressed:
            progressed = False
            for position, entry in sorted(enumerate(queue), key=self.order_key):
                verdict: Verdict | Exception
                if entry.envelope is None:
                    verdict = Verdict(Outcome.REJECTED, entry.unreadable)
                else:
                    verdict = self.judge(order, entry.envelope)
                    if isinstance(verdict, Verdict) and verdict.outcome is Outcome.PARKED:
                        continue
                del queue[position]
                if entry.item is not None:  # parked earlier in this batch: its row is final
                    settle(self.consumer, entry.item, verdict)
                else:
                    self.released.append((entry, verdict))
                progressed = True
                break

    def decide(self, item: Item) -> None:
        """One claimed message, against its order as the chunk's earlier messages left it;
        then what it lets go ahead."""
        env = item.envelope
        order = self.orders.get(env.order_id)
        if order is None:  # deleted between the two reads
            item.outcome, item.reason = Outcome.REJECTED, unknown_order(env).reason
            item.order_exists, item.recorded = False, False
            return
        judged = self.judge(order, env)
        if isinstance(judged, Exception):
            settle(self.consumer, item, judged)
            item.outcome, item.recorded_outcome = Outcome.FAILED, None
            return
        verdict = judged
        item.outcome, item.reason = verdict.outcome, verdict.reason
        item.recorded = item.outcome is Outcome.APPLIED
        if verdict.outcome is Outcome.PARKED:
            queue = self.waiting.setdefault(order.pk, [])
            if env.seq is not None and any(
                w.envelope is not None and w.envelope.seq == env.seq for w in queue
            ):
                item.outcome, item.reason = Outcome.REJECTED, parked_twice(env).reason
                return
            queue.append(Waiting(self.consumer, env, item=item))
        self.release(order)

    def write(self, claimed: list[Item]) -> None:
        """The chunk's writes: its payments, one UPDATE of its orders, what stays parked,
        the outcomes of its messages and of those it released; then the announcements."""
        consumer, orders, model = self.consumer, self.orders, self.model
        if self.reservation is not None:
            self.reservation.settle()
        if self.spends:
            # A payment id spent already (or twice in this chunk) fails the insert: the
            # chunk rolls back and its messages go one by one, each told why.
            record_spent(consumer, self.spends)
        if self.changed:
            update_orders(self.changed, self.read_version)
        parked = [w.item for queue in self.waiting.values() for w in queue if w.item is not None]
        for item in parked:
            if not park(consumer, item.envelope, orders[item.envelope.order_id], item.reason):
                item.outcome = item.recorded_outcome = Outcome.REJECTED
                item.reason = parked_twice(item.envelope).reason
        flag = {i.envelope.order_id for i in parked if i.outcome is Outcome.PARKED}
        flag = {pk for pk in flag if not orders[pk].has_parked}
        if flag and self.flag:
            # The single path skips its look for parked successors on orders whose
            # flag it read false; the orders are locked, so this lands before any
            # such consumer's conditional write.
            model._default_manager.filter(pk__in=flag).update(has_parked=True)
            for pk in flag:
                orders[pk].has_parked = True
        for item in claimed:
            if item.envelope.message_id in self.errored:
                # Rejected by its body under on_error: the row keeps the whole envelope.
                item.body = serialise(item.envelope.as_dict())
        record_released(self.released, self.errored)
        record_outcomes(claimed)
        # Nothing to announce when nobody listens and no follow-up wants the target.
        # The follow-ups of the whole chunk are written together (the fulfilment
        # follow-up: one multi-row outbox INSERT, one hand-off to the publisher).
        targets = {r.target for _, _, r in self.transitions}
        heard = {t: transition_heard(model, t) for t in targets}
        announced = [entry for entry in self.transitions if heard[entry[2].target]]
        # fsm-2's post_transition: sent by the model's own methods where they ran; a
        # transition committed without them has no receiver (``runs_user_code``).
        transitions_written(announced, fsm_sent=True)
