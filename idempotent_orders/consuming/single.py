"""Idempotent writes: consuming a payment or shipping message exactly once."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    connection,
    transaction,
)
from django.utils import timezone

from idempotent_orders import dedup, get_order_model, otel
from idempotent_orders.conf import conf
from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.decision import (
    announce,
    announce_known,
    consumed,
    unknown_order,
)
from idempotent_orders.consuming.envelope import (
    BODY_EXCERPT,
    Envelope,
    consuming,
    has_nul,
    parse_envelope,
    serialise,
    synthetic_id,
    valid_message_id,
)
from idempotent_orders.consuming.failures import (
    RETRYABLE,
    TRANSIENT,
    MessageFailed,
    describe,
    is_retryable,
    record_failure,
    retryable,
)
from idempotent_orders.consuming.running import keeps_parked_flag
from idempotent_orders.consuming.sql import read_order
from idempotent_orders.consuming.writing import (
    Conflict,
    Duplicate,
    MissingOrder,
    StillParked,
    apply,
)
from idempotent_orders.exceptions import ConcurrentUpdate, InvalidMessage
from idempotent_orders.models import (
    SETTLED_OUTCOMES,
    AbstractOrder,
    InboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.signals import (
    dedup_answered,
    message_released,
    parked_overdue,
)

__all__ = [
    "Envelope",
    "MessageFailed",
    "Outcome",
    "consume_message",
    "parse_envelope",
    "read_back",
    "redeliver",
    "release_parked",
    "surface_overdue_parked",
]

logger = logging.getLogger("idempotent_orders")


@otel.traced_consume
def consume_message(message: Any, *, consumer: str) -> Outcome:
    """Apply one payment/shipping message to its order, exactly once.

    Never raises for bad input: a malformed or inapplicable message is recorded
    as ``rejected`` with its reason. Database errors (lost connection,
    serialization failure) propagate so the caller can retry the delivery.
    Parked successors that this message unblocks are released before returning.
    """
    raw_id = message.get("message_id") if isinstance(message, Mapping) else None
    layer = dedup.ask(consumer, str(raw_id)) if valid_message_id(raw_id) else None
    # The fast path is the road's first step: a copy of a message handled under this id
    # is answered from the id alone, the rest of the message unread. Only this process's
    # memory of a message it settled, or a Redis key written after the whole message was
    # handled (its transaction and the releases below), answers without the database.
    if layer in dedup.KNOWN:
        dedup.announce(layer, consumer, str(raw_id))
        announce_known(
            consumer,
            str(raw_id),
            Outcome.DUPLICATE,
            "fast path: already processed",
            lambda: _described(message, consumer),
        )
        return Outcome.DUPLICATE
    try:
        envelope = parse_envelope(message, consumer=consumer)
    except InvalidMessage as exc:
        # Any other answer is announced only for a valid envelope.
        message_id = raw_id if valid_message_id(raw_id) and not has_nul(raw_id) else None
        message_id = message_id or synthetic_id(message)
        outcome = _reject(
            consumer=consumer,
            message_id=message_id,
            message_type=_excerpt(message.get("type")) if isinstance(message, Mapping) else "",
            order=None,
            seq=None,
            reason=exc.message,
            body=serialise(message)[:BODY_EXCERPT],
        )
        dedup.remember_on_commit(consumer, message_id, settled=outcome in SETTLED_OUTCOMES)
        return outcome

    if layer is None:  # not reached: parse_envelope takes no id that valid_message_id refuses
        layer = dedup.ask(consumer, envelope.message_id)
    dedup.announce(layer, consumer, envelope.message_id)

    waiting: list[bool] = []
    dead: list[bool] = []
    began = timezone.now()
    try:
        with consuming(envelope, consumer):
            applied = None
            # Where the database can, the message is applied before its order is read;
            # each such road declines (writing nothing) what it cannot take.
            for road in backend().roads_without_read():
                applied = road(envelope, consumer, get_order_model())
                if applied is not None:
                    break
            if applied is None:
                outcome = _consume(envelope, consumer, waiting=waiting, dead=dead)
        if applied is not None:
            announce(consumer, envelope, applied, "")
            if keeps_parked_flag(get_order_model()):
                dedup.remember_on_commit(
                    consumer, envelope.message_id, settled=applied in SETTLED_OUTCOMES
                )
                return applied
            # No flag says whether a message waits for this one (database triggers watch
            # the order): look below, as after the usual road.
            outcome = applied
            waiting.append(True)
    except TRANSIENT as exc:
        # Nothing was written, or the connection dropped while the message committed
        # (in doubt): the inbox row, read back on a new connection, says which.
        settled = read_back(envelope, consumer, exc, since=began)
        if settled is None:
            raise  # nothing of this delivery was committed: it is retried as it is
        announce(consumer, envelope, settled, "read back after the connection dropped")
        release_parked(envelope.order_id)
        dedup.remember_on_commit(consumer, envelope.message_id, settled=settled in SETTLED_OUTCOMES)
        return settled
    except Exception as exc:
        # A bug in a body, condition, receiver or validator, or a constraint the
        # database refused: the transaction rolled back. Keep the message, say why.
        failure = record_failure(
            consumer,
            message_id=envelope.message_id,
            message_type=envelope.message_type,
            order_id=envelope.order_id,
            seq=envelope.seq,
            envelope=envelope.as_dict(),
            exc=exc,
            fingerprint=envelope.fingerprint,
        )
        consumed(
            consumer,
            envelope.message_id,
            Outcome.FAILED,
            message_type=envelope.message_type,
            order_id=envelope.order_id,
            reason=failure.reason,
        )
        raise failure from exc
    if outcome is Outcome.PARKED or any(waiting):
        # Every outcome may unblock a successor: an applied message fills a gap,
        # a duplicate may be the redelivery of one whose worker died before
        # releasing, and a parked one re-checks because its predecessor may
        # have committed while it was parking (the lost wake-up). Orders that
        # never had a parked message are skipped: their ``has_parked`` was read
        # false and the write was conditional on it (see writing._write), so a message
        # parked concurrently either made our write conflict and re-read, or
        # committed after us and re-checks itself.
        release_parked(envelope.order_id)
    # Remembered last: a worker that dies before this point leaves no fast-path
    # key, so the redelivery reaches the database and releases successors itself.
    # A dead letter is not remembered: its requeue must reach the database.
    if not dead:
        dedup.remember_on_commit(consumer, envelope.message_id, settled=outcome in SETTLED_OUTCOMES)
    return outcome


def read_back(
    envelope: Envelope, consumer: str, error: Exception, *, since: datetime
) -> Outcome | None:
    """After ``error``: the outcome this delivery committed, read on a new connection; None
    when it committed nothing or that cannot be told yet (the delivery is then retried).

    Only a lost connection can hide a commit: the COMMIT, or on PostgreSQL the one
    statement of the road without a read, was sent and no answer came back. Any other error (a
    deadlock, a serialization failure, a timeout) rolled back, and so does a caller's
    transaction around us (its commit is the caller's). The row is this delivery's when it
    was written since ``since`` with this payload; an older one is a copy's, which the
    retry answers as a duplicate.
    """
    if connection.in_atomic_block or not backend().connection_lost(error):
        return None
    try:
        connection.close()
        row = (
            ProcessedMessage.objects.filter(consumer=consumer, message_id=envelope.message_id)
            .values_list("outcome", "updated_at", "fingerprint")
            .first()
        )
    except DatabaseError:
        return None
    if row is None:
        return None
    outcome, updated_at, fingerprint = row
    if not outcome or updated_at < since or fingerprint != envelope.fingerprint:
        return None
    return Outcome(outcome)


def _database_conflict(consumer: str, message_id: str) -> None:
    dedup_answered.send(
        sender=dedup.Layer,
        layer=dedup.Layer.DATABASE_CONFLICT,
        consumer=consumer,
        message_id=message_id,
    )


def _described(message: Mapping[str, Any], consumer: str) -> tuple[str, Any]:
    """A copy's type and order as its envelope has them (as the message gives its type,
    and no order, when it is not a valid one)."""
    try:
        envelope = parse_envelope(message, consumer=consumer)
    except InvalidMessage:
        return _excerpt(message.get("type")), None
    return envelope.message_type, envelope.order_id


def _excerpt(value: Any) -> str:
    return value[:64] if isinstance(value, str) and "\x00" not in value else ""


def _reject(
    *,
    consumer: str,
    message_id: str,
    message_type: str,
    order: AbstractOrder | None,
    seq: int | None,
    reason: str,
    body: str,
    order_id: Any = None,
) -> Outcome:
    if order_id is not None and order is None:
        order = get_order_model()._default_manager.filter(pk=order_id).first()
    try:
        with transaction.atomic():
            ProcessedMessage.objects.create(
                consumer=consumer,
                message_id=message_id,
                message_type=message_type,
                status=InboxStatus.REJECTED,
                outcome=Outcome.REJECTED,
                order_id=order.pk if order is not None else None,
                seq=seq,
                error=reason,
                body=body,
            )
    except IntegrityError:
        outcome, reason = Outcome.DUPLICATE, "already recorded"
        _database_conflict(consumer, message_id)
    else:
        outcome = Outcome.REJECTED
        logger.warning(
            "rejected message %s (%s): %s",
            message_id,
            consumer,
            reason,
            extra={"message_id": message_id, "order_id": order.pk if order else None},
        )
    consumed(
        consumer,
        message_id,
        outcome,
        message_type=message_type,
        order_id=order.pk if order else None,
        reason=reason,
    )
    return outcome


def _consume(
    envelope: Envelope,
    consumer: str,
    parked: ParkedMessage | None = None,
    *,
    waiting: list[bool] | None = None,
    dead: list[bool] | None = None,
) -> Outcome:
    """Claim, read, decide and write in one transaction (:func:`writing.apply`); again
    while other writers win the race.

    With ``parked`` set, the message is being released: its inbox row exists
    and is updated rather than inserted, and the parked row is claimed by
    deleting it first. ``waiting`` receives the ``has_parked`` flag of the
    order as last read (nothing when there is no order).
    """
    retrying = False
    model = get_order_model()
    for _attempt in range(conf.CONFLICT_RETRIES):
        try:
            outcome, order, verdict = apply(envelope, consumer, model, parked, retrying=retrying)
        except MissingOrder:
            if parked is not None:  # the order was deleted; its parked rows went with it
                return Outcome.PARKED
            return _reject(
                consumer=consumer,
                message_id=envelope.message_id,
                message_type=envelope.message_type,
                order=None,
                seq=envelope.seq,
                reason=unknown_order(envelope).reason,
                body=serialise(envelope.as_dict())[:BODY_EXCERPT],
            )
        except StillParked:
            return Outcome.PARKED  # still waiting; the parked row is left alone
        except Duplicate:
            again: bool | None = None if parked is not None or retrying else False
            if parked is None and not retrying:
                again, stored = retryable(consumer, envelope.message_id)
                if stored and stored != envelope.fingerprint:
                    # The id was used before for another message: not a duplicate.
                    return _reused(envelope, consumer)
            if again:
                # A failed delivery of this message (or one an operator requeued):
                # run it again, claiming its row instead of inserting one.
                retrying = True
                continue
            if again is None and parked is None and dead is not None:
                dead.append(True)  # a dead letter: not run, and not remembered
            if parked is None:
                _database_conflict(consumer, envelope.message_id)
                announce(consumer, envelope, Outcome.DUPLICATE, "already in the inbox")
                if waiting is not None:
                    # A copy may be the redelivery of one whose worker died before it
                    # released the messages waiting for it.
                    read = read_order(model, envelope.order_id)
                    waiting[:] = [read is not None and _waited_for(read)]
            return Outcome.DUPLICATE
        except Conflict:
            continue
        except OperationalError as exc:
            if not is_retryable(exc):
                raise
            # The database rolled the whole transaction back (a deadlock); run it again.
            continue
        if waiting is not None:
            waiting[:] = [_waited_for(order)]
        if parked is not None:
            message_released.send(
                sender=ParkedMessage,
                consumer=consumer,
                message_id=envelope.message_id,
                order_id=envelope.order_id,
                outcome=outcome,
            )
        announce(consumer, envelope, outcome, verdict.reason)
        return outcome
    raise ConcurrentUpdate(
        f"order {envelope.order_id}: gave up after {conf.CONFLICT_RETRIES} conflicting writes"
    )


def _waited_for(order: Any) -> bool:
    """Whether messages may wait for ``order`` (as read): its flag, or where the app keeps
    none (triggers watch the order), always."""
    return bool(order.has_parked) or not keeps_parked_flag(type(order))


def reused_id(envelope: Envelope) -> str:
    """The inbox id under which a message reusing another's id is kept."""
    digest = hashlib.sha256(f"{envelope.message_id}\x00{envelope.fingerprint}".encode())
    return f"reused:{digest.hexdigest()}"


def _reused(envelope: Envelope, consumer: str) -> Outcome:
    """Keep a message whose id was used before for another message, rejected and flagged."""
    reason = (
        f"message id {envelope.message_id} was used before with another payload; "
        "this message is kept here and not applied"
    )
    return _reject(
        consumer=consumer,
        message_id=reused_id(envelope),
        message_type=envelope.message_type,
        order=None,
        seq=envelope.seq,
        reason=reason,
        body=serialise(envelope.as_dict())[:BODY_EXCERPT],
        order_id=envelope.order_id,
    )


def release_parked(order_id: int) -> list[Outcome]:
    """Decide again every parked message of an order that can now go ahead, in order.

    Each release runs in its own transaction; a message still waiting stays
    parked. Safe to call from several workers at once: a parked row is claimed
    by deleting it, so only one of them releases it.
    """
    outcomes: list[Outcome] = []
    progressed = True
    while progressed:
        progressed = False
        waiting = list(ParkedMessage.objects.filter(order_id=order_id).order_by("seq", "id"))
        for parked in waiting:
            try:
                envelope = parse_envelope(parked.envelope, consumer=parked.consumer)
            except InvalidMessage as exc:  # a handler was unregistered meanwhile
                envelope = None
                reason = exc.message
            if envelope is None:
                _leave_park(
                    parked, outcome=Outcome.REJECTED, status=InboxStatus.REJECTED, error=reason
                )
                continue
            try:
                with consuming(envelope, parked.consumer):
                    outcome = _consume(envelope, parked.consumer, parked=parked)
            except TRANSIENT:
                raise
            except Exception as exc:
                # The parked message's own code raised: it leaves the park as failed
                # (kept, with why and its envelope), and the others go on.
                _release_failed(parked, envelope, exc)
                progressed = True
                break
            if outcome is not Outcome.PARKED:
                outcomes.append(outcome)
                progressed = True
                break  # the order changed: read the waiting list again, in order
    return outcomes


def _leave_park(parked: ParkedMessage, **recorded: Any) -> None:
    """Take ``parked`` out of the park (unless another worker did) and write ``recorded`` on
    its inbox row, in one transaction."""
    with transaction.atomic():
        if ParkedMessage.objects.filter(pk=parked.pk).delete()[0]:
            ProcessedMessage.objects.filter(
                consumer=parked.consumer, message_id=parked.message_id
            ).update(**recorded)


def _release_failed(parked: ParkedMessage, envelope: Envelope, exc: Exception) -> None:
    """A parked message whose release raised: out of the park, its inbox row ``failed``."""
    reason = describe(exc)
    _leave_park(
        parked,
        status=InboxStatus.FAILED,
        outcome="",
        error=reason,
        body=json.dumps(envelope.as_dict(), ensure_ascii=True, default=repr),
        updated_at=timezone.now(),
    )
    dedup.forget(parked.consumer, parked.message_id)  # its redelivery must reach us
    logger.error(
        "parked message %s (%s) failed on release: %s",
        parked.message_id,
        parked.consumer,
        reason,
        extra={"message_id": parked.message_id, "order_id": parked.order_id},
        exc_info=exc,
    )
    consumed(
        parked.consumer,
        parked.message_id,
        Outcome.FAILED,
        message_type=envelope.message_type,
        order_id=envelope.order_id,
        reason=reason,
    )


def surface_overdue_parked(*, timeout: int | None = None) -> list[ParkedMessage]:
    """Release what can go ahead, then mark parked messages older than ``timeout`` overdue.

    The release pass is the backstop for a worker that died between a commit and
    its re-check of the parked messages (its own, or the successors of what it
    applied). A message parked for a sequence gap is released as soon as the
    order has reached the seq before it, whatever its age; one parked for a state
    (no seq) is tried again once it waited ``PARKED_ATTENTION_AFTER``. Each message
    is then marked overdue once (a conditional UPDATE), and ``parked_overdue`` is
    sent for it; operators find the rows in the admin under "overdue". Returns
    the newly marked rows.
    """
    from django.db.models import F, Q

    timeout = conf.PARKED_TIMEOUT if timeout is None else timeout
    now = timezone.now()
    cutoff = now - timedelta(seconds=timeout)
    retry_after = now - timedelta(seconds=min(timeout, conf.PARKED_ATTENTION_AFTER))
    may_go_ahead = ParkedMessage.objects.filter(overdue_at__isnull=True).filter(
        Q(seq__lte=F("order__last_seq") + 1) | Q(parked_at__lte=retry_after)
    )
    for order_id in may_go_ahead.values_list("order_id", flat=True).distinct().order_by("order_id"):
        release_parked(order_id)
    old = ParkedMessage.objects.filter(parked_at__lte=cutoff, overdue_at__isnull=True)
    marked: list[ParkedMessage] = []
    for parked in old.order_by("order_id", "seq", "id"):
        if ParkedMessage.objects.filter(pk=parked.pk, overdue_at__isnull=True).update(
            overdue_at=now
        ):
            parked.overdue_at = now
            marked.append(parked)
            waited = (now - parked.parked_at).total_seconds()
            logger.error(
                "parked message %s of order %s waited %.0fs for its predecessor: %s",
                parked.message_id,
                parked.order_id,
                waited,
                parked.reason,
                extra={"message_id": parked.message_id, "order_id": parked.order_id},
            )
            parked_overdue.send(sender=ParkedMessage, parked=parked, waited=waited)
    return marked


def redeliver(ids: Iterable[int]) -> dict[int, Outcome | str]:
    """Consume again, from the envelope they keep, the requeued messages among ``ids``.

    What an operator's requeue of a dead consumer message runs, once the cause is
    fixed: the message takes effect exactly once (the inbox row is claimed by a
    conditional update), or fails again and is kept as failed.
    """
    done: dict[int, Outcome | str] = {}
    rows = ProcessedMessage.objects.filter(RETRYABLE, pk__in=list(ids)).exclude(body="")
    for row in rows:
        try:
            message = json.loads(row.body)
        except ValueError:
            done[row.pk] = "unreadable"
            continue
        if not isinstance(message, dict) or message.get("message_id") != row.message_id:
            done[row.pk] = "unreadable"
            continue
        try:
            done[row.pk] = consume_message(message, consumer=row.consumer)
        except MessageFailed as exc:
            done[row.pk] = f"failed again: {exc.reason}"
    return done
