"""The fulfilment step (paid -> processing): a leased warehouse call, then a fenced transition.

The step drives the order model's ``FULFILMENT_TRANSITION`` (``start_processing``
on the default model); on a model without that transition there is no step.

The warehouse client and the reconciler's verifier are chosen by dotted path
(``FULFILMENT_CLIENT``, ``FULFILMENT_VERIFIER``). The inbox row is
``("fulfilment", "fulfil-<order id>")``, so the warehouse is asked once per order
with the idempotency key :func:`idempotent_orders.leases.idempotency_key` of it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Model
from django.utils.module_loading import import_string

from idempotent_orders import get_order_model, leases
from idempotent_orders.conf import conf
from idempotent_orders.consuming.decision import consumed
from idempotent_orders.consuming.graph import (
    TransitionResult,
    TransitionStatus,
    classify,
    current_state,
    edge,
    has_transition,
)
from idempotent_orders.consuming.running import FollowUpRow, apply_transition, keeps_parked_flag
from idempotent_orders.consuming.single import release_parked
from idempotent_orders.leases import ClaimState, Lease, LeasedStep, StepResult, Verification
from idempotent_orders.models import AbstractOrder, InboxStatus, Outcome, ProcessedMessage

__all__ = [
    "CONSUMER",
    "ClientVerifier",
    "FulfilmentStep",
    "NullWarehouse",
    "Verifier",
    "WarehouseClient",
    "WarehouseError",
    "fulfil",
    "fulfilment_message_id",
    "get_client",
    "get_verifier",
]

logger = logging.getLogger("idempotent_orders")

CONSUMER = "fulfilment"


def transition(model: type[Model] | None = None) -> str | None:
    """The transition the step drives on ``model`` (the order model), or None when it has none."""
    name = conf.FULFILMENT_TRANSITION
    return name if name and has_transition(model or get_order_model(), name) else None


class WarehouseError(Exception):
    """The warehouse refused or could not be reached; the effect is unknown."""


class WarehouseClient(ABC):
    """The other system of the fulfilment step. Subclass and name it in ``FULFILMENT_CLIENT``."""

    @abstractmethod
    def reserve(self, order: AbstractOrder, *, idempotency_key: str) -> None:
        """Ask the warehouse to fulfil ``order``; the same key must never fulfil twice.

        Raise on any failure, including a timeout whose outcome is unknown.
        """

    @abstractmethod
    def lookup(self, idempotency_key: str) -> bool | None:
        """True if the warehouse has the request with this key, False if not, None if unknown."""


class NullWarehouse(WarehouseClient):
    """The default: no warehouse. Fulfilment only moves the order to ``processing``."""

    def reserve(self, order: AbstractOrder, *, idempotency_key: str) -> None:
        return None

    def lookup(self, idempotency_key: str) -> bool | None:
        return False  # nothing can have happened; performing again is free


class Verifier(ABC):
    """Tells the reconciler whether a stalled fulfilment reached the warehouse."""

    @abstractmethod
    def verify(self, lease: Lease) -> Verification: ...


class ClientVerifier(Verifier):
    """Asks the configured warehouse client's :meth:`~WarehouseClient.lookup`."""

    def verify(self, lease: Lease) -> Verification:
        found = get_client().lookup(lease.idempotency_key)
        if found is None:
            return Verification.UNKNOWN
        return Verification.DONE if found else Verification.NOT_DONE


def get_client() -> WarehouseClient:
    client: WarehouseClient = import_string(conf.FULFILMENT_CLIENT)()
    return client


def get_verifier() -> Verifier:
    verifier: Verifier = import_string(conf.FULFILMENT_VERIFIER)()
    return verifier


def fulfilment_message_id(order_id: int) -> str:
    return f"fulfil-{order_id}"


class FulfilmentStep(LeasedStep):
    consumer = CONSUMER

    def perform(self, lease: Lease) -> None:
        order = get_order_model()._default_manager.get(pk=_order_id(lease))
        get_client().reserve(order, idempotency_key=lease.idempotency_key)

    def verify(self, lease: Lease) -> Verification:
        return get_verifier().verify(lease)

    def finish(self, lease: Lease) -> StepResult:
        """Record the warehouse's effect: the transition at the fencing token's version."""
        model = get_order_model()
        name = transition(model)
        if name is None:
            return self._fail(lease, f"{model._meta.label} has no fulfilment transition")
        for _attempt in range(conf.CONFLICT_RETRIES):
            order = model._default_manager.filter(pk=_order_id(lease)).first()
            if order is None:
                return self._fail(lease, "the order was deleted after the warehouse call")
            status = classify(model, name, current_state(order))
            if status is TransitionStatus.APPLIED and order.version == lease.token:
                if leases.complete(
                    lease,
                    outcome=Outcome.APPLIED,
                    apply=lambda order=order: apply_transition(order, name).applied,  # type: ignore[misc]
                ):
                    self._announce(lease, Outcome.APPLIED, "")
                    # Messages parked until this step (read after our commit, so a
                    # message parked meanwhile is seen here or re-checks itself).
                    if not keeps_parked_flag(model) or (
                        model._default_manager.filter(pk=order.pk, has_parked=True).exists()
                    ):
                        release_parked(order.pk)
                    return StepResult.COMPLETED
                if not _held(lease):
                    return StepResult.SKIPPED
                continue  # the order moved between our read and our write: decide again
            if status in (TransitionStatus.AT_TARGET, TransitionStatus.PAST_TARGET):
                # The warehouse may ship before we record `processing`; nothing left to do.
                reason = f"order is already {current_state(order)}"
                if leases.complete(lease, outcome=Outcome.STALE, error=reason):
                    self._announce(lease, Outcome.STALE, reason)
                    return StepResult.COMPLETED
                return StepResult.SKIPPED
            return self._fail(
                lease,
                f"order is {current_state(order)} (v{order.version}, claimed at v{lease.token}); "
                "the warehouse was asked to fulfil it: check and undo by hand",
            )
        return StepResult.SKIPPED

    def _fail(self, lease: Lease, reason: str) -> StepResult:
        if not leases.complete(
            lease, status=InboxStatus.FAILED, outcome=Outcome.REJECTED, error=reason
        ):
            return StepResult.SKIPPED
        logger.error("fulfilment failed: %s", reason, extra=lease.log_extra())
        self._announce(lease, Outcome.REJECTED, reason)
        return StepResult.FAILED

    def _announce(self, lease: Lease, outcome: Outcome, reason: str) -> None:
        consumed(
            lease.consumer,
            lease.message_id,
            outcome,
            message_type="order.fulfilment",
            order_id=lease.order_id,
            reason=reason,
        )


def _order_id(lease: Lease) -> int:
    if lease.order_id is None:  # only a row claimed without an order, never by this step
        raise ValueError(f"inbox row {lease.pk} has no order")
    return lease.order_id


def _held(lease: Lease) -> bool:
    return ProcessedMessage.objects.filter(
        pk=lease.pk, status=InboxStatus.PROCESSING, attempts=lease.attempt
    ).exists()


#: The fulfilment step; the app registers it for its consumer in ``ready()``.
STEP = FulfilmentStep()


class QueueFulfilment:
    """The follow-up of a payment: queue the fulfilment step through the outbox.

    Written when an order enters a state the fulfilment transition starts from
    (``paid`` on the default model), in that transition's transaction: the
    outbox row commits with the payment or not at all; once committed the relay
    publishes it whatever the broker does at that moment, and its message id
    (the step's inbox id) makes a re-publish harmless.
    """

    def wanted(self, model: type[Model], target: str) -> bool:
        if not conf.FULFIL_AFTER_PAYMENT or model is not get_order_model():
            return False
        name = transition(model)
        return name is not None and target in edge(model, name).sources

    def write(self, instance: Model, name: str, result: TransitionResult) -> None:
        from idempotent_orders.outbox import publish_on_commit

        publish_on_commit(
            "idempotent_orders.fulfil_order",
            instance.pk,
            message_id=fulfilment_message_id(instance.pk),
            using=instance._state.db,
        )

    def write_many(self, written: list[tuple[Model, str, TransitionResult]]) -> None:
        """:meth:`write` for the transitions of one transaction (a batch chunk's): the same
        rows, written by one multi-row INSERT and handed to the publisher together."""
        from idempotent_orders.outbox.producer import publish_many_on_commit

        by_db: dict[str | None, list[tuple[str, Any]]] = {}
        for instance, _name, _result in written:
            by_db.setdefault(instance._state.db, []).append(
                (fulfilment_message_id(instance.pk), instance.pk)
            )
        for db, messages in by_db.items():
            publish_many_on_commit("idempotent_orders.fulfil_order", messages, using=db)

    def outbox_row(self, model: type[Model], pk: Any, name: str, target: Any) -> FollowUpRow:
        """The row :meth:`write` writes for order ``pk``, as data: the one-statement road
        writes it in its own statement, then hands its id back for the publish."""
        from idempotent_orders.outbox.producer import outbox_row, published_on_commit

        fields = outbox_row(
            "idempotent_orders.fulfil_order", pk, message_id=fulfilment_message_id(pk)
        )
        return FollowUpRow(fields, lambda db, row_id: published_on_commit(db, row_id))


QUEUE_FULFILMENT = QueueFulfilment()


def _record(order: AbstractOrder | None, order_id: int, outcome: Outcome, reason: str) -> Outcome:
    """Record a fulfilment request that needs no warehouse call (already done, impossible)."""
    message_id = fulfilment_message_id(order_id)
    try:
        with transaction.atomic():
            ProcessedMessage.objects.create(
                consumer=CONSUMER,
                message_id=message_id,
                message_type="order.fulfilment",
                status=InboxStatus.REJECTED if outcome is Outcome.REJECTED else InboxStatus.DONE,
                outcome=outcome,
                order_id=order.pk if order is not None else None,
                error=reason,
            )
    except IntegrityError:
        outcome, reason = Outcome.DUPLICATE, "already in the inbox"
    consumed(
        CONSUMER,
        message_id,
        outcome,
        message_type="order.fulfilment",
        order_id=order_id,
        reason=reason,
    )
    return outcome


def fulfil(order_id: int) -> Outcome | StepResult:
    """Run the fulfilment step of a paid order once: claim, call the warehouse, complete.

    Returns ``Outcome.APPLIED`` when this call moved the order to ``processing``;
    ``DUPLICATE``/``STALE``/``REJECTED`` when there was nothing to do (already
    fulfilled, moved on, or not paid); ``StepResult.RETRY`` when the warehouse
    call failed and the row waits for the reconciler; ``StepResult.FAILED``
    when the order moved somewhere fulfilment can no longer apply, for an
    operator. A row another worker holds is ``DUPLICATE``: that worker, or the
    reconciler once its lease expires, finishes it.
    """
    model = get_order_model()
    order = model._default_manager.filter(pk=order_id).first()
    if order is None:
        return _record(None, order_id, Outcome.REJECTED, f"unknown order {order_id}")
    name = transition(model)
    if name is None:
        reason = f"{model._meta.label} has no {conf.FULFILMENT_TRANSITION!r} transition"
        return _record(order, order_id, Outcome.REJECTED, reason)
    state = current_state(order)
    status = classify(model, name, state)
    if status is TransitionStatus.AT_TARGET:
        return _record(order, order_id, Outcome.DUPLICATE, f"order is already {state}")
    if status is TransitionStatus.PAST_TARGET:
        return _record(order, order_id, Outcome.STALE, f"order has moved on to {state}")
    if status is not TransitionStatus.APPLIED:
        return _record(
            order, order_id, Outcome.REJECTED, f"order is {state}, not ready: not fulfilled"
        )
    claimed = leases.claim(
        consumer=CONSUMER,
        message_id=fulfilment_message_id(order_id),
        token=order.version,
        order=order,
        message_type="order.fulfilment",
        # Only the reconciler takes expired leases over: it verifies first, and
        # a redelivered task arriving at the same time must not double-act.
        allow_takeover=False,
    )
    if claimed.state is ClaimState.FAILED:
        return StepResult.FAILED
    if claimed.state is not ClaimState.CLAIMED:
        return Outcome.DUPLICATE
    assert claimed.lease is not None
    result = leases.run_step(STEP, claimed.lease, via="worker")
    return Outcome.APPLIED if result is StepResult.COMPLETED else result
