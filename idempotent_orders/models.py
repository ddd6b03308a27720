"""Orders (abstract base, swappable default), the inbox, parked messages, outbox and keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, models
from django.db.models.functions import Now

from idempotent_orders.conf import ORDER_MODEL_SETTING, order_model_label
from idempotent_orders.exceptions import OrderChanged
from idempotent_orders.fsm import FSMField, FSMModelMixin, transition
from idempotent_orders.prepared import driver_cursor

#: Where a guarded ``save()`` keeps its optimistic condition until ``_do_update`` takes it.
SAVE_GUARD = "_idempotent_orders_guard"
#: Where it keeps what may hold its UPDATE back for the next text (the consumer's
#: ``HeldUpdate``: ``hold(connection, sql, params)``, False when it sends nothing held).
SAVE_HOLD = "_idempotent_orders_hold"


@dataclass(frozen=True)
class _SaveUpdate:
    """The UPDATE a guarded ``save()`` sends for one shape of row: its SQL, the fields it
    sets and the fields its guard compares (with the length of an ``__in`` list)."""

    sql: str
    sets: tuple[models.Field[Any, Any], ...]
    where: tuple[tuple[models.Field[Any, Any], int | None], ...]


_save_updates: dict[tuple[Any, ...], _SaveUpdate | None] = {}

#: Types whose values are never an expression, a model or SQL: the checks of every
#: value skip asking them (a missing attribute costs an exception raised and caught).
PLAIN_TYPES = frozenset(
    {str, int, bool, float, Decimal, datetime, date, time, timedelta, UUID, bytes, type(None)}
)


def _guarded_update(
    base_qs: Any,
    guard: Mapping[str, Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    hold: Any = None,
) -> Any:
    """What Django's ``Model._do_update(base_qs.filter(**guard), *args)`` returns, sending
    the same UPDATE (every column ``save()`` passed, ``WHERE <guard> AND pk``) from SQL
    kept per shape of row instead of a query built and compiled on every ``save()``.
    None, with nothing sent, where Django's query must build it: a value that is an
    expression or a model, a field with its own placeholder, ``select_on_save``, values
    returned by the UPDATE, a base manager with its own queryset or filters, a guard
    Django would not spell as ``=``/``IN``. ``hold``: it may keep the UPDATE for the next
    text on the connection (then the row counts as written: the text that carries it
    stops the transaction when it matched none)."""
    if kwargs or len(args) not in (5, 6):
        return None
    using, pk_val, values, _update_fields, forced_update = args[:5]
    returning = args[5] if len(args) == 6 else None
    model = base_qs.model
    meta = model._meta
    if not values or returning or (meta.select_on_save and not forced_update):
        return None
    if type(base_qs) is not models.QuerySet or base_qs.query.where or base_qs.query.is_sliced:
        return None
    fields: list[models.Field[Any, Any]] = []
    ids: list[int] = []
    for field, _, value in values:
        if type(value) not in PLAIN_TYPES and (
            hasattr(value, "resolve_expression") or hasattr(value, "prepare_database_save")
        ):
            return None
        fields.append(field)
        ids.append(id(field))  # the fields are the model's own, kept by it: ids stay theirs
    shape: list[tuple[str, int | None]] = []
    for k, v in guard.items():
        if v is None:
            return None  # IS NULL: Django's lookups spell it
        if k.endswith("__in"):
            if None in v:
                return None  # an IN list with NULL: Django's lookups spell it
            shape.append((k, len(v)))
        else:
            shape.append((k, None))
    key = (model, using, tuple(ids), tuple(shape))
    try:
        update = _save_updates[key]
    except KeyError:
        update = _save_updates[key] = _save_update(model, using, fields, shape)
    if update is None:
        return None
    conn = connections[using]
    params = [f.get_db_prep_save(v, connection=conn) for f, _, v in values]
    for param in params:
        if type(param) not in PLAIN_TYPES and hasattr(param, "as_sql"):
            return None
    for (field, length), value in zip(update.where, guard.values(), strict=True):
        if length is None:
            params.append(field.get_db_prep_value(value, conn))
        else:
            params += [field.get_db_prep_value(v, conn) for v in value]
    assert meta.pk is not None
    params.append(meta.pk.get_db_prep_value(pk_val, conn))
    held = hold is not None and hold.hold(conn, update.sql, params)
    rows = 1 if held else send_update(conn, update.sql, params)
    if len(args) == 6:  # Django 6: the rows updated, each with its returned values (none)
        return [()] * rows
    return rows > 0


def send_update(conn: Any, sql: str, params: Sequence[Any]) -> int:
    """Send a guarded UPDATE; the rows it matched. On the driver's own cursor where nothing
    watches the statement (:func:`~idempotent_orders.prepared.driver_cursor`: no execute
    wrapper, no query logging; and a transaction not marked for rollback, which Django's
    cursor refuses), with Django's error mapping; else through Django's cursor."""
    cursor = None if conn.needs_rollback else driver_cursor(conn, in_transaction=True)
    if cursor is None:
        with conn.cursor() as wrapped:
            wrapped.execute(sql, params)
            return int(wrapped.rowcount)
    with conn.wrap_database_errors, cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def _save_update(
    model: type[models.Model],
    using: str,
    fields: Sequence[models.Field[Any, Any]],
    shape: Sequence[Any],
) -> _SaveUpdate | None:
    meta = model._meta
    by_name: dict[str, models.Field[Any, Any]] = {}
    for f in meta.concrete_fields:
        by_name[f.name] = by_name[f.attname] = f
    if any(hasattr(f, "get_placeholder") or f.model is not model for f in fields):
        return None
    qn = connections[using].ops.quote_name
    where: list[tuple[models.Field[Any, Any], int | None]] = []
    tests: list[str] = []
    for key, length in shape:
        name = key.removesuffix("__in") if length is not None else key
        field = by_name.get(name)
        if field is None or "__" in name or field.model is not model:
            return None
        column = qn(str(field.column))
        if length is None:
            tests.append(f"{column} = %s")
        elif length:
            tests.append(f"{column} IN ({', '.join(['%s'] * length)})")
        else:
            return None  # an empty IN list matches nothing: Django says so without a query
        where.append((field, length))
    assert meta.pk is not None
    tests.append(f"{qn(str(meta.pk.column))} = %s")
    sets = ", ".join(f"{qn(str(f.column))} = %s" for f in fields)
    sql = f"UPDATE {qn(meta.db_table)} SET {sets} WHERE {' AND '.join(tests)}"
    return _SaveUpdate(sql, tuple(fields), tuple(where))


class OrderStatus(models.TextChoices):
    PENDING_PAYMENT = "pending_payment", "pending payment"
    PAID = "paid", "paid"
    PROCESSING = "processing", "processing"
    SHIPPED = "shipped", "shipped"
    COMPLETED = "completed", "completed"
    CANCELLED = "cancelled", "cancelled"
    EXPIRED = "expired", "expired"
    REFUNDED = "refunded", "refunded"


S = OrderStatus


class AbstractOrder(FSMModelMixin, models.Model):
    """What the machinery needs on an order model, and nothing else.

    Subclass it with your own state ``FSMField`` (any name; name it in
    ``state_field_name`` when the model has more than one) and your own
    ``@transition`` methods, then point ``settings.IDEMPOTENT_ORDERS_ORDER_MODEL``
    at the model before the first ``migrate``. The state is never assigned
    directly: every change is committed by
    :func:`idempotent_orders.consuming.running.apply_transition`, one conditional
    ``UPDATE`` that also bumps ``version``.
    """

    #: Name of the state field when the model has more than one ``FSMField``.
    state_field_name: str | None = None

    #: +1 on every committed transition; the optimistic lock and the fencing token.
    version = models.PositiveIntegerField(default=0)
    #: Highest per-order message sequence applied (0 when none).
    last_seq = models.PositiveIntegerField(default=0)
    #: Set (and never cleared) in the transaction that parks a message for this
    #: order. A consumer that read it false makes its UPDATE conditional on it
    #: and then skips the after-commit look for parked successors.
    has_parked = models.BooleanField(default=False, editable=False)

    class Meta:
        abstract = True

    def _do_update(self, base_qs: Any, *args: Any, **kwargs: Any) -> Any:
        """Add the consumer's optimistic condition (the state and ``version`` as read) to
        the ``UPDATE`` that ``save()`` sends, as django-fsm-2's
        ``ConcurrentTransitionMixin`` adds the state; no matching row raises
        :class:`~idempotent_orders.exceptions.OrderChanged` instead of an INSERT.

        The condition is set by the consumer for one ``save()`` of a transition and
        taken by its first UPDATE; any other save is Django's own. With it the consumer
        may hand over what holds the UPDATE back for its next text
        (:mod:`~idempotent_orders.consuming.held`).
        """
        guard = self.__dict__.pop(SAVE_GUARD, None)
        hold = self.__dict__.pop(SAVE_HOLD, None)
        if guard is None:
            return super()._do_update(base_qs, *args, **kwargs)
        updated = _guarded_update(base_qs, guard, args, kwargs, hold)
        if updated is None:  # not a plain UPDATE of plain values: Django's query builds it
            updated = super()._do_update(base_qs.filter(**guard), *args, **kwargs)
        if not updated:
            raise OrderChanged(f"order {self.pk} changed since it was read")
        return updated


class Order(AbstractOrder):
    """The default order model: a payment and a parcel, moved only along the transitions below.

    A project with its own order model swaps this one out with
    ``settings.IDEMPOTENT_ORDERS_ORDER_MODEL`` (as ``AUTH_USER_MODEL`` swaps the user).
    """

    business_key = models.CharField(max_length=128, unique=True)
    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="idempotent_orders",
    )
    amount = models.DecimalField(max_digits=12, decimal_places=2)
    currency = models.CharField(max_length=3)
    status = FSMField(
        choices=OrderStatus.choices, default=OrderStatus.PENDING_PAYMENT, protected=True
    )
    payment_id = models.CharField(max_length=128, blank=True, default="")
    tracking_number = models.CharField(max_length=128, blank=True, default="")
    carrier = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta(AbstractOrder.Meta):
        swappable = ORDER_MODEL_SETTING
        ordering = ["-id"]
        indexes = [models.Index(fields=["status", "updated_at"])]

    def __str__(self) -> str:
        return f"Order {self.pk} ({self.status}, v{self.version})"

    # The transition graph. Bodies are empty on purpose: the state change is
    # committed by apply_transition(), which reads sources and targets from here.
    @transition(field=status, source=S.PENDING_PAYMENT, target=S.PAID)
    def pay(self) -> None:
        """Payment captured."""

    @transition(field=status, source=S.PAID, target=S.PROCESSING)
    def start_processing(self) -> None:
        """Fulfilment started (warehouse notified)."""

    @transition(field=status, source=[S.PAID, S.PROCESSING], target=S.SHIPPED)
    def ship(self) -> None:
        """Parcel dispatched; the warehouse may ship before ``processing`` is recorded."""

    @transition(field=status, source=S.SHIPPED, target=S.COMPLETED)
    def complete(self) -> None:
        """Parcel delivered."""

    @transition(field=status, source=S.PENDING_PAYMENT, target=S.CANCELLED)
    def cancel(self) -> None:
        """Cancelled before payment."""

    @transition(field=status, source=S.PENDING_PAYMENT, target=S.EXPIRED)
    def expire(self) -> None:
        """Not paid in time."""

    @transition(field=status, source=S.PAID, target=S.REFUNDED)
    def refund(self) -> None:
        """Payment returned before fulfilment started."""


class InboxStatus(models.TextChoices):
    PROCESSING = "processing", "processing"
    DONE = "done", "done"
    FAILED = "failed", "failed"
    REJECTED = "rejected", "rejected"
    #: ``@idempotent`` work that failed ``IDEMPOTENT_MAX_ATTEMPTS`` times or
    #: permanently; nothing of it was committed. Not run again until an operator
    #: requeues it (back to ``processing``).
    DEAD = "dead", "dead"


class Outcome(models.TextChoices):
    """What consuming a message did. The values are part of the public contract."""

    APPLIED = "applied", "applied"
    DUPLICATE = "duplicate", "duplicate"
    STALE = "stale", "stale"
    PARKED = "parked", "parked"
    REJECTED = "rejected", "rejected"
    #: Handling it raised (a bug in a body, condition, receiver or validator): kept
    #: as a ``failed`` inbox row with why, retried, and dead-lettered at last.
    FAILED = "failed", "failed"


#: Outcomes whose inbox row this delivery wrote ``done`` for good: nothing reopens it (an
#: operator retries or requeues only failed, dead or processing rows), so a process that
#: saw one commit may answer its copies itself (``dedup.memory``). Not a duplicate the
#: database found (that row may be parked, and a parked row may fail on release).
SETTLED_OUTCOMES = frozenset({Outcome.APPLIED, Outcome.STALE, Outcome.REJECTED})


class ProcessedMessage(models.Model):
    """The inbox: one row per (consumer, message id), written in the order's transaction.

    The unique constraint is the only authority on "seen before"; caches in
    front of it are advisory.
    """

    consumer = models.CharField(max_length=64)
    message_id = models.CharField(max_length=255)
    message_type = models.CharField(max_length=64, blank=True, default="")
    status = models.CharField(max_length=16, choices=InboxStatus.choices, default=InboxStatus.DONE)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, blank=True, default="")
    order = models.ForeignKey(
        order_model_label(),
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="inbox_messages",
    )
    seq = models.PositiveIntegerField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=1)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    #: Fencing token for leased work: the order version the lease was taken at.
    fencing_token = models.PositiveIntegerField(null=True, blank=True)
    #: Human-readable reason for a rejection or failure.
    error = models.TextField(blank=True, default="")
    #: The raw envelope of rejected messages (escaped, truncated), for operators.
    body = models.TextField(blank=True, default="")
    #: SHA-256 of the message's type, order, seq and payload: a later message with
    #: this id and another fingerprint is a reused id, kept and flagged, never a duplicate.
    fingerprint = models.CharField(max_length=64, blank=True, default="", db_default="")
    #: When ``@idempotent`` work was dead-lettered (cleared by a requeue).
    dead_at = models.DateTimeField(null=True, blank=True)
    #: JSON form of what an ``@idempotent`` function returned the first time; duplicates get it.
    result: models.JSONField[Any] = models.JSONField(
        null=True, blank=True, encoder=DjangoJSONEncoder
    )
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            # Message id first: the same uniqueness, and the index also answers a search
            # by message id alone (the admin's) without a second index over every row.
            models.UniqueConstraint(
                fields=["message_id", "consumer"], name="io_inbox_message_consumer"
            )
        ]
        # created_at: the purge's cut-off, the Bloom warm-up's buckets, the admin's
        # sort by time. A BRIN index costs ~0 bytes a row, but the sort then reads
        # the whole table (7 s at 10M rows, docs/operations.md "Admin at size").
        indexes = [models.Index(fields=["created_at"])]
        # The rest differ by database, so the migration creates them, not Meta
        # (declared here, MariaDB would get a partial index as a full one): on
        # PostgreSQL and SQLite, partial indexes for the rows operators and the
        # reconciler look for (stuck, failed, dead, rejected) and for the outcomes
        # other than "applied"; on MariaDB full (status, lease_expires_at) and
        # outcome indexes instead.

    def __str__(self) -> str:
        return f"{self.consumer}:{self.message_id} ({self.outcome or self.status})"


class ParkedMessage(models.Model):
    """A message that arrived before it could apply: a sequence gap or a state not yet reached."""

    consumer = models.CharField(max_length=64)
    message_id = models.CharField(max_length=255)
    order = models.ForeignKey(
        order_model_label(), on_delete=models.CASCADE, related_name="parked_messages"
    )
    seq = models.PositiveIntegerField(null=True, blank=True)
    envelope: models.JSONField[Any] = models.JSONField()
    reason = models.CharField(max_length=255)
    parked_at = models.DateTimeField(db_default=Now())
    #: Set once the message waited longer than PARKED_TIMEOUT (operators look here).
    overdue_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["order_id", "seq", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["order", "seq"], name="idempotent_orders_parked_order_seq"
            ),
            models.UniqueConstraint(
                fields=["consumer", "message_id"], name="idempotent_orders_parked_message"
            ),
        ]
        indexes = [models.Index(fields=["message_id"], name="io_parked_message_id")]

    def __str__(self) -> str:
        return f"parked {self.consumer}:{self.message_id} for order {self.order_id}"


class OutboxStatus(models.TextChoices):
    PENDING = "pending", "pending"
    SENT = "sent", "sent"
    #: Never published: ``OUTBOX_MAX_ATTEMPTS`` failed publishes or a permanent
    #: error. Kept with its ``last_error`` until an operator requeues it.
    DEAD = "dead", "dead"


class OutboxMessage(models.Model):
    """A task message written in the producer's transaction and published by the relay.

    ``message_id`` is fixed when the row is written and becomes the Celery
    ``task_id``, so a re-publish after a relay crash carries the same id and
    the consumer's inbox recognises it.
    """

    message_id = models.CharField(max_length=255, unique=True)
    task_name = models.CharField(max_length=255)
    payload: models.JSONField[Any] = models.JSONField(encoder=DjangoJSONEncoder)
    #: Extra ``apply_async`` options (queue, routing_key, priority, ...).
    options: models.JSONField[Any] = models.JSONField(default=dict, blank=True)
    status = models.CharField(
        max_length=16, choices=OutboxStatus.choices, default=OutboxStatus.PENDING
    )
    #: Failed publish attempts so far (0 when the first one succeeded).
    attempts = models.PositiveIntegerField(default=0)
    #: Not published before this time (backoff after a failed publish).
    available_at = models.DateTimeField(db_default=Now())
    #: Claim lease on databases without ``SELECT ... FOR UPDATE SKIP LOCKED``.
    claimed_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    sent_at = models.DateTimeField(null=True, blank=True)
    #: When the row was dead-lettered (cleared by a requeue).
    dead_at = models.DateTimeField(null=True, blank=True)
    #: Rows with the same key are published in id order: one is not published
    #: while an earlier one of its key is pending or dead. None: no order.
    # NULL, not "": a row without a key matches no other row (order_key = NULL is never true).
    order_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    #: The producer's W3C trace context and correlation id, sent as task headers.
    traceparent = models.CharField(max_length=55, blank=True, default="")
    correlation_id = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["status", "available_at"]),
            models.Index(fields=["status", "sent_at"]),
            models.Index(fields=["order_key", "status", "id"]),
        ]

    def __str__(self) -> str:
        return f"outbox {self.message_id} -> {self.task_name} ({self.status})"


class AuditEntry(models.Model):
    """One operator action taken in the admin: who, when, what, on which row, with what result."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="idempotent_orders_audit",
    )
    #: Kept as text too, so the record survives the user's deletion.
    username = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    result = models.CharField(max_length=32)
    detail = models.TextField(blank=True, default="")
    #: The order the action concerned (its primary key as text), "" when none: an
    #: action on an inbox row names the row's order too, so an order's timeline finds it.
    order_pk = models.CharField(max_length=64, blank=True, default="")
    #: The message the action concerned (an inbox, parked or outbox message id), "" when none.
    message_id = models.CharField(max_length=255, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "audit entries"
        indexes = [
            models.Index(fields=["target", "object_id"]),
            models.Index(fields=["order_pk"], name="io_audit_order_pk"),
            models.Index(fields=["message_id"], name="io_audit_message_id"),
        ]

    def __str__(self) -> str:
        return f"{self.username} {self.action} {self.target} {self.object_id}: {self.result}"


class LeaseAttempt(models.Model):
    """One attempt of a leased step (the warehouse call) and its answer, kept after the fix.

    The inbox row keeps only the last attempt's reason; these rows keep each one
    (refused, unverified, stalled, completed), so an order's timeline still shows
    the warehouse's four refusals once a retry went through. Written by
    :func:`idempotent_orders.leases.run_step`; purged after ``DEDUP_RETENTION``, as
    the inbox rows.
    """

    consumer = models.CharField(max_length=64)
    message_id = models.CharField(max_length=255)
    #: The order (no database constraint: the record outlives neither its row nor the order).
    order_id = models.BigIntegerField(null=True, blank=True)
    #: The row's ``attempts`` when it ran (the lease's claim generation).
    attempt = models.PositiveIntegerField()
    #: Who ran it: ``worker``, ``reconciler``, ``admin``.
    via = models.CharField(max_length=16, blank=True, default="")
    #: ``completed``, ``refused``, ``unverified``, ``stalled``, ``failed``, ``skipped``.
    result = models.CharField(max_length=16)
    #: The answer in words (the exception the other system raised, why it stopped).
    answer = models.TextField(blank=True, default="")
    at = models.DateTimeField(db_default=Now())

    class Meta:
        indexes = [models.Index(fields=["consumer", "message_id"], name="io_attempt_message")]

    def __str__(self) -> str:
        return f"{self.consumer}:{self.message_id} attempt {self.attempt}: {self.result}"


class Heartbeat(models.Model):
    """When a Celery worker process or the reconciler was last heard from (one row each).

    In the database, so every process reads what every other wrote, whatever the
    caches are (:mod:`idempotent_orders.liveness` writes and reads it).
    """

    #: ``worker:<hostname>`` or ``reconciler``.
    name = models.CharField(max_length=191, primary_key=True)
    beat_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name} heard from at {self.beat_at}"


class KeyState(models.TextChoices):
    """Life of an :class:`IdempotencyKey`; the values are part of the public contract."""

    ISSUED = "issued", "issued"  # a server-issued token, not used yet
    IN_FLIGHT = "in_flight", "in flight"  # claimed by a request that is still running
    COMPLETED = "completed", "completed"  # the response is stored and replayed


class IdempotencyKey(models.Model):
    """One ``Idempotency-Key`` (or one-time token) and the response it produced.

    The unique ``(scope, key)`` constraint is the authority: ``scope`` is a hash
    of principal, method and route, so one principal's key can never match
    another's. Server-issued tokens start ``issued`` with an empty method and
    route and are bound to their route when consumed.
    """

    scope = models.CharField(max_length=64)
    key = models.CharField(max_length=255)
    #: Who the key belongs to: ``user:<pk>``, ``client:<id>`` or ``session:<key>``.
    principal = models.CharField(max_length=191)
    method = models.CharField(max_length=16, blank=True, default="")
    route = models.CharField(max_length=255, blank=True, default="")
    #: SHA-256 over method, route, query and body of the first request.
    fingerprint = models.CharField(max_length=64, blank=True, default="")
    state = models.CharField(max_length=16, choices=KeyState.choices)
    #: True for server-issued tokens (endpoint or form field).
    is_token = models.BooleanField(default=False)
    #: Random id of the request holding the lease; a stale holder cannot store.
    lease_owner = models.CharField(max_length=32, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    #: Allow-listed response headers as ``[[name, value], ...]``.
    response_headers: models.JSONField[Any] = models.JSONField(default=list, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    #: The body was not stored (streaming or over the size limit).
    body_omitted = models.BooleanField(default=False)
    created_at = models.DateTimeField(db_default=Now())
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotent_orders_key_scope")
        ]
        # No column the stored response sets is indexed: on PostgreSQL storing it
        # is then a heap-only update, which writes no index entry.
        indexes = [
            models.Index(fields=["principal", "expires_at"]),
            models.Index(fields=["expires_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.method or 'token'} {self.route} {self.key[:16]} ({self.state})"


class KeyQuota(models.Model):
    """Per principal, a bound its live keys and tokens never exceed (PostgreSQL's quota check).

    Every key a claim inserts adds one, in the claim's own transaction, so the
    bound never falls below the principal's count of live keys; keys that
    expire or are released leave it higher. A claim reads this row instead of
    counting the principal's keys; only once the bound reaches ``KEY_QUOTA``
    are the keys counted, and the bound set to the count. Rows untouched for
    ``KEY_TTL`` are purged with the keys.
    """

    principal = models.CharField(max_length=191, primary_key=True)
    bound = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"{self.principal}: at most {self.bound} live keys"


class SpentPayment(models.Model):
    """A payment id that paid an order: a payment pays one order, once.

    Written in the transaction that applies a message carrying money (a type
    registered with ``money=True``, such as ``payment.succeeded``); the unique
    index refuses a second use, which is then rejected as money to give back.
    """

    payment_id = models.CharField(max_length=128, unique=True)
    #: The order it paid (no database constraint: the record outlives the order).
    order = models.ForeignKey(
        order_model_label(),
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    consumer = models.CharField(max_length=64)
    message_id = models.CharField(max_length=255)
    created_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"payment {self.payment_id} paid order {self.order_id}"


class WebhookStatus(models.TextChoices):
    """Life of a :class:`WebhookEvent`; the values are part of the public contract."""

    #: Verified and stored; its consumption is queued (or running).
    RECEIVED = "received", "received"
    #: Consumed: ``outcome`` says what the inbox decided.
    PROCESSED = "processed", "processed"
    #: Turning it into a message, or consuming it, raised; kept with why, replayable.
    FAILED = "failed", "failed"
    #: Refused at the door (signature, timestamp, body, type): answered 4xx, never consumed.
    REJECTED = "rejected", "rejected"


class WebhookEvent(models.Model):
    """One provider event as it arrived (the raw body), or one refused request.

    Accepted events are unique on ``(provider, event_id)``: a provider's retry
    of an event counts a delivery on the same row. Consuming it goes through
    the inbox with the event id as the message id, which is the authority on
    "seen before". Refused requests keep ``event_id`` empty (NULL) and the id
    they claimed in ``claimed_id``: an unsigned request cannot occupy the slot
    of a real event.
    """

    provider = models.CharField(max_length=64)
    # NULL for refused requests: NULLs never collide in the unique index.
    event_id = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    #: The id a refused request claimed (unverified), for operators.
    claimed_id = models.CharField(max_length=255, blank=True, default="")
    event_type = models.CharField(max_length=255, blank=True, default="")
    #: The message type the event type maps to ("" when it maps to none).
    message_type = models.CharField(max_length=64, blank=True, default="")
    status = models.CharField(max_length=16, choices=WebhookStatus.choices)
    #: What consuming it decided (an :class:`Outcome` value), "" until then.
    outcome = models.CharField(max_length=16, choices=Outcome.choices, blank=True, default="")
    order = models.ForeignKey(
        order_model_label(),
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="webhook_events",
    )
    #: The raw body as received (refused requests: an excerpt).
    body = models.TextField(blank=True, default="")
    #: Why it was refused, or why consuming it failed.
    error = models.TextField(blank=True, default="")
    #: Deliveries of this event (the provider's retries add to it).
    deliveries = models.PositiveIntegerField(default=1)
    #: Consumptions started (the first one, retries, operator replays).
    attempts = models.PositiveIntegerField(default=0)
    received_at = models.DateTimeField(db_default=Now())
    last_delivery_at = models.DateTimeField(db_default=Now())
    processed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["provider", "event_id"], name="idempotent_orders_webhook_event"
            )
        ]
        indexes = [models.Index(fields=["status", "received_at"])]

    def __str__(self) -> str:
        return f"{self.provider}:{self.event_id or self.claimed_id or '?'} ({self.status})"


class TimerStatus(models.TextChoices):
    PENDING = "pending", "pending"
    #: Its message was consumed: ``outcome`` says what the inbox decided.
    FIRED = "fired", "fired"
    #: Firing raised; kept with why, fired again on the next pass.
    FAILED = "failed", "failed"


class Timer(models.Model):
    """A transition an order is due to take at ``due_at`` unless something else moved it first.

    Written in the transaction that put the order in the state the timer waits
    on, so the timer exists if and only if that state was committed. Firing
    consumes ``message_id`` (fixed when the row is written) through the inbox,
    so firing it twice, from two beats or two workers, is harmless.
    """

    order = models.ForeignKey(order_model_label(), on_delete=models.CASCADE, related_name="timers")
    #: The order model's ``@transition`` the timer takes.
    transition = models.CharField(max_length=64)
    #: The message type consumed (bound to ``transition`` for the ``timers`` consumer).
    message_type = models.CharField(max_length=64)
    message_id = models.CharField(max_length=255, unique=True)
    payload: models.JSONField[Any] = models.JSONField(
        default=dict, blank=True, encoder=DjangoJSONEncoder
    )
    due_at = models.DateTimeField()
    status = models.CharField(
        max_length=16, choices=TimerStatus.choices, default=TimerStatus.PENDING
    )
    outcome = models.CharField(max_length=16, choices=Outcome.choices, blank=True, default="")
    #: A firing process holds it until then (others skip it; the inbox is the authority).
    claimed_until = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    fired_at = models.DateTimeField(null=True, blank=True)
    #: The W3C trace context the timer was scheduled in: its firing is that trace's.
    traceparent = models.CharField(max_length=55, blank=True, default="")

    class Meta:
        ordering = ["due_at", "id"]
        indexes = [models.Index(fields=["status", "due_at"])]

    def __str__(self) -> str:
        due = f"{self.due_at:%Y-%m-%d %H:%M}"
        return f"{self.transition} order {self.order_id} at {due} ({self.status})"
