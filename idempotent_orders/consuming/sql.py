"""SQL the consumers write by hand: the order read, the inbox claim, the follow-up's row.

The claims keep the inbox's unique index the only authority on duplicates.
:func:`insert_inbox_values` is the batch path's multi-row ``INSERT ... ON
CONFLICT DO NOTHING RETURNING`` (``INSERT IGNORE ... RETURNING`` on MariaDB);
:class:`InboxTemplate` the one-row claim the roads without a read send.
:func:`read_order` is the single path's read of the order: the ORM's own SQL,
compiled once per model and database. :func:`preparation` and
:func:`inbox_preparation` give a column's value as the driver takes it.
Statements run as prepared statements of the session are in
:mod:`~idempotent_orders.prepared`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from django.db import connection, connections
from django.db.models import (
    AutoField,
    BigAutoField,
    BigIntegerField,
    CharField,
    DateTimeField,
    Field,
    IntegerField,
    Model,
    PositiveBigIntegerField,
    PositiveIntegerField,
    PositiveSmallIntegerField,
    SmallAutoField,
    SmallIntegerField,
    TextField,
)
from django.db.models.expressions import DatabaseDefault
from django.db.models.manager import BaseManager

from idempotent_orders.consuming.backends import backend
from idempotent_orders.models import OutboxMessage, ProcessedMessage

__all__ = [
    "CLAIMABLE",
    "FOLLOW_UP_FIELDS",
    "build",
    "compiled_read",
    "forget_inbox_shape",
    "handed_over",
    "inbox_names",
    "inbox_partitioned",
    "inbox_preparation",
    "insert_inbox_values",
    "on_conflict",
    "plain_type",
    "preparation",
    "queue_follow_up",
    "read_order",
]


#: On a partitioned inbox (:mod:`idempotent_orders.partitioning`), the SQL function
#: ``(consumer, message_id) -> boolean``: True when the inbox holds no such row, tested
#: after taking the pair's transaction-level advisory lock. A claim inserts only rows
#: it lets through; ``ON CONFLICT`` then has no unique index of the whole table to name.
CLAIMABLE = "io_inbox_claimable"


#: Whether the inbox is partitioned, by (database alias, database name): the table
#: itself says, once per process (``convert`` and ``revert`` forget it in theirs; other
#: processes are restarted after them), so no setting can make a claim take the wrong
#: statement, and a new connection costs no catalog query.
_shapes: dict[tuple[str, str], bool] = {}


def inbox_partitioned(conn: Any = None) -> bool:
    """Whether the inbox of ``conn`` (the default connection) is partitioned by time."""
    conn = conn or connection
    if not backend(conn).partitions:
        return False
    key = (conn.alias, conn.settings_dict["NAME"])
    partitioned = _shapes.get(key)
    if partitioned is None:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)",
                [ProcessedMessage._meta.db_table],
            )
            row = cursor.fetchone()
        partitioned = _shapes[key] = bool(row and row[0])
    return partitioned


def forget_inbox_shape() -> None:
    """Look the inbox's shape up again (after it was converted in this process)."""
    _shapes.clear()


@dataclass(frozen=True)
class _ReadPlan:
    """The compiled ``SELECT`` of one order by primary key, and how to build the instance."""

    sql: str
    attnames: tuple[str, ...]
    #: ``(position, converters, expression)`` of the columns that need converting.
    converters: tuple[tuple[int, tuple[Any, ...], Any], ...]


#: Read plans by (model, database alias, looked-up fields); None where the ORM must read.
_read_plans: dict[tuple[type[Model], str, tuple[str, ...]], _ReadPlan | None] = {}


def _read_plan(model: type[Model], alias: str, lookups: tuple[str, ...]) -> _ReadPlan | None:
    manager = model._default_manager
    if type(manager).get_queryset is not BaseManager.get_queryset:
        return None  # a manager that filters may do so differently on each call
    try:
        queryset = manager.using(alias).all()
        for name in lookups:  # one filter() each: the parameters keep the lookups' order
            queryset = queryset.filter(**{name: _sample(model, name)})
        compiler = queryset.query.get_compiler(alias)
        sql, params = compiler.as_sql()
    except Exception:  # a field that the sample value cannot stand for: let the ORM read
        return None
    select, klass_info = compiler.select, compiler.klass_info
    if len(params) != len(lookups) or not klass_info or compiler.annotation_col_map:
        return None
    start, end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
    if (start, end) != (0, len(select)):
        return None
    converters = compiler.get_converters([col for col, _, _ in select])
    return _ReadPlan(
        sql=sql,
        attnames=tuple(col.target.attname for col, _, _ in select),
        converters=tuple((pos, tuple(c), expr) for pos, (c, expr) in converters.items()),
    )


def _sample(model: type[Model], name: str) -> Any:
    field = model._meta.pk if name == "pk" else model._meta.get_field(name)
    integer = field.get_internal_type() in {kind.__name__ for kind in _INTEGER_FIELDS}
    return 1 if integer else "x"


def compiled_read(model: type[Model], *lookups: str) -> tuple[str, _ReadPlan | None]:
    """The database alias of ``model``'s default manager and its compiled read by ``lookups``.

    The plan is the SQL of ``model._default_manager.filter(<lookup>=...)``, compiled
    once; None when the manager has its own ``get_queryset`` (read through the ORM).
    """
    alias = model._default_manager.db
    key = (model, alias, lookups)
    try:
        plan = _read_plans[key]
    except KeyError:
        plan = _read_plans[key] = _read_plan(model, alias, lookups)
    return alias, plan


def build(model: type[Model], alias: str, plan: _ReadPlan, row: Sequence[Any]) -> Model:
    """The instance ``plan``'s SELECT returned as ``row``, as the ORM would build it."""
    conn = connections[alias]
    if plan.converters:
        values = list(row)
        for pos, functions, expression in plan.converters:
            value = values[pos]
            for function in functions:
                value = function(value, expression, conn)
            values[pos] = value
        row = values
    return model.from_db(alias, plan.attnames, row)


def read_order(model: type[Model], pk: Any, *, lock: bool = False) -> Model | None:
    """The order ``pk`` as ``model._default_manager.filter(pk=pk).first()`` reads it
    (``lock``: ``select_for_update()``, the row locked until the transaction ends).

    The same SQL, compiled once per model and database instead of per message
    (the compile costs more than the query). A default manager with its own
    ``get_queryset`` is read through the ORM every time.
    """
    alias, plan = compiled_read(model, "pk")
    if plan is None:
        orders = model._default_manager.filter(pk=pk)
        return (orders.select_for_update() if lock else orders).first()
    conn = connections[alias]
    pk_field = model._meta.pk
    assert pk_field is not None
    with conn.cursor() as cursor:
        sql = f"{plan.sql} FOR UPDATE" if lock else plan.sql
        cursor.execute(sql, (pk_field.get_db_prep_value(pk, conn),))
        row = cursor.fetchone()
    return None if row is None else build(model, alias, plan, row)


@dataclass(frozen=True)
class InboxTemplate:
    """The INSERT of one inbox row whose per-message columns are filled in by position.

    Built once per database from a sample row, so the fields' defaults and
    database preparation stay the model's own; only :data:`PER_MESSAGE`
    columns (and ``updated_at``'s ``auto_now``) change between messages.
    """

    fields: list[Field[Any, Any]]
    #: ``INSERT INTO <inbox> (<columns>) VALUES (%s, ...) ON CONFLICT ... DO NOTHING``
    sql: str
    base: list[Any]
    #: Position of each per-message column in ``base``.
    positions: dict[str, int]
    #: ``sql`` around its value list: ``INSERT INTO <inbox> (<columns>) VALUES (`` and the rest.
    head: str
    tail: str
    #: ``::<type>`` of each value on a partitioned inbox (its rows pass a ``SELECT``), else "".
    casts: tuple[str, ...] = ()

    def insert(self, values: Sequence[str]) -> str:
        """``sql`` with ``values`` (SQL expressions, one per field) as its value list."""
        if self.casts:
            values = [f"{v}{c}" for v, c in zip(values, self.casts, strict=True)]
        return f"{self.head}{', '.join(values)}{self.tail}"

    def params(self, values: Mapping[str, Any], now: Any) -> list[Any]:
        """``base`` with ``values`` and ``updated_at`` = ``now``, prepared by their fields.

        A plain ``str`` or ``int`` is what every inbox column's preparation
        returns for it, so only other values go through ``get_db_prep_save``.
        """
        params = list(self.base)
        positions = self.positions
        fields = self.fields
        for name, value in values.items():
            pos = positions[name]
            if value is not None and type(value) not in _PLAIN:
                value = fields[pos].get_db_prep_save(value, connection)
            params[pos] = value
        if "updated_at" in positions:
            pos = positions["updated_at"]
            params[pos] = fields[pos].get_db_prep_save(now, connection)
        return params


_PLAIN = frozenset({str, int})

#: Columns :meth:`InboxTemplate.params` may set per message.
PER_MESSAGE = (
    "consumer",
    "message_id",
    "message_type",
    "status",
    "outcome",
    "order_id",
    "seq",
    "error",
    "body",
    "fingerprint",
)

_templates: dict[tuple[str, bool], InboxTemplate] = {}


def inbox_template() -> InboxTemplate:
    """The :class:`InboxTemplate` of the current database (an applied message's row)."""
    key = (connection.alias, inbox_partitioned())
    template = _templates.get(key)
    if template is None:
        from idempotent_orders.models import InboxStatus, Outcome

        sample = ProcessedMessage(
            consumer="",
            message_id="",
            message_type="",
            status=InboxStatus.DONE,
            outcome=Outcome.APPLIED,
            order_id=None,
            seq=None,
        )
        # Every field but the key and those the database fills in itself.
        fields = [
            f
            for f in ProcessedMessage._meta.concrete_fields
            if not f.primary_key and not isinstance(getattr(sample, f.attname), DatabaseDefault)
        ]
        base = [f.get_db_prep_save(f.pre_save(sample, True), connection) for f in fields]
        attnames = [f.attname for f in fields]
        positions = {name: attnames.index(name) for name in (*PER_MESSAGE, "updated_at")}
        head, tail, casts = _insert_around(fields)
        sql = head + ", ".join(f"%s{cast}" for cast in casts or [""] * len(fields)) + tail
        template = _templates[key] = InboxTemplate(fields, sql, base, positions, head, tail, casts)
    return template


def _insert_around(fields: Sequence[Field[Any, Any]]) -> tuple[str, str, tuple[str, ...]]:
    """Head and tail of a one-row inbox INSERT of ``fields``, and the casts of its values.

    ``INSERT ... VALUES (...) ON CONFLICT (consumer, message_id) DO NOTHING``; on a
    partitioned inbox ``INSERT ... SELECT * FROM (VALUES (...)) AS v WHERE
    CLAIMABLE(v.consumer, v.message_id) ON CONFLICT DO NOTHING``.
    """
    qn = connection.ops.quote_name
    table, _, _ = inbox_names()
    columns = ", ".join(qn(str(f.column)) for f in fields)
    if not inbox_partitioned():
        return f"INSERT INTO {table} ({columns}) VALUES (", f") {on_conflict()}", ()
    casts = tuple(f"::{f.db_type(connection)}" for f in fields)
    return (
        f"INSERT INTO {table} ({columns}) SELECT * FROM (VALUES (",
        f")) AS v ({columns}) WHERE {_claimable('v')} {on_conflict()}",
        casts,
    )


def _claimable(alias: str) -> str:
    """``CLAIMABLE(<alias>.consumer, <alias>.message_id)`` for rows named by their columns."""
    return f"{CLAIMABLE}({', '.join(f'{alias}.{c}' for c in _unique_columns())})"


def inbox_names() -> tuple[str, str, str]:
    """Quoted table, primary key and message id column of the inbox."""
    meta = ProcessedMessage._meta
    qn = connection.ops.quote_name
    pk = qn(str(meta.pk.column if meta.pk else "id"))
    message_id = qn(str(meta.get_field("message_id").column))
    return qn(meta.db_table), pk, message_id


def on_conflict() -> str:
    if inbox_partitioned():
        # No unique index spans the partitions; CLAIMABLE has filtered the rows, and
        # each partition's own unique index is the arbiter.
        return "ON CONFLICT DO NOTHING"
    return f"ON CONFLICT ({', '.join(_unique_columns())}) DO NOTHING"


def _unique_columns() -> list[str]:
    """The inbox's unique columns (consumer, message id), quoted."""
    qn = connection.ops.quote_name
    return [
        qn(str(ProcessedMessage._meta.get_field(name).column))  # type: ignore[union-attr]
        for name in ("consumer", "message_id")
    ]


def insert_inbox_values(
    fields: Sequence[Field[Any, Any]], rows: Sequence[Sequence[Any]]
) -> dict[str, int]:
    """Insert inbox rows given as prepared values of ``fields`` (as
    :meth:`InboxTemplate.params` builds them), skipping ids already there;
    ``{message_id: pk}`` of the new ones. PostgreSQL's batch claims with its arrays
    (``chunk.claim_postgres``)."""
    qn = connection.ops.quote_name
    table, pk, message_id = inbox_names()
    head, tail = backend().insert_ignoring(
        table, ", ".join(qn(str(f.column)) for f in fields), ", ".join(_unique_columns())
    )
    one = "(" + ", ".join(["%s"] * len(fields)) + ")"
    with connection.cursor() as cursor:
        cursor.execute(
            f"{head} VALUES {', '.join([one] * len(rows))} {tail} RETURNING {pk}, {message_id}",
            [value for row in rows for value in row],
        )
        return {mid: pk_ for pk_, mid in cursor.fetchall()}


#: The outbox fields a follow-up hands over (``FollowUpRow.fields``).
FOLLOW_UP_FIELDS = (
    "message_id",
    "task_name",
    "payload",
    "options",
    "order_key",
    "traceparent",
    "correlation_id",
)


def queue_follow_up(
    conn: Any,
    queued: Sequence[str],
    ref: Callable[[str, Field[Any, Any]], str],
    *,
    after_moved: bool = True,
) -> str:
    """``queued AS (INSERT INTO <outbox> ... SELECT ... WHERE EXISTS (moved) ON CONFLICT
    (message_id) DO NOTHING RETURNING id)``: a follow-up's row as ``publish_on_commit``
    writes it (the ``queued`` fields as arguments, ``ref(source, field)`` placing one,
    the model's defaults as literals, the database's own defaults left to it).
    ``after_moved=False``: no ``WHERE EXISTS (moved)`` (the order was written already)."""
    meta = OutboxMessage._meta
    sample = OutboxMessage()
    qn = conn.ops.quote_name
    columns, selected = [], []
    for f in meta.concrete_fields:
        if f.primary_key or f.has_db_default():
            continue
        columns.append(qn(str(f.column)))
        if f.name in queued:
            placed = ref(f"outbox:{f.name}", f)
            # A JSON argument is typed: the driver's literal of it is.
            json = f.get_internal_type() == "JSONField"
            selected.append(f"{placed}::{f.db_type(conn)}" if json else placed)
        else:
            value = f.get_db_prep_save(f.pre_save(sample, True), conn)
            selected.append(str(conn.ops.compose_sql("%s", [value])).replace("%", "%%"))
    pk = meta.pk
    assert pk is not None
    unique = qn(str(meta.get_field("message_id").column))
    moved = " WHERE EXISTS (SELECT 1 FROM moved)" if after_moved else ""
    return (
        f"queued AS (INSERT INTO {qn(meta.db_table)} ({', '.join(columns)})"
        f" SELECT {', '.join(selected)}{moved}"
        f" ON CONFLICT ({unique}) DO NOTHING RETURNING {qn(str(pk.column))} AS id)"
    )


def handed_over(fields: Mapping[str, Any]) -> bool:
    """Whether a statement can write a follow-up's row of ``fields``: the fields it writes,
    each fitting its column (a value too long goes to ``write``, which raises as ever)."""
    if fields.keys() != _FOLLOW_UP_NAMES:
        return False
    for name, limit in _text_limits():
        value = fields[name]
        if value is not None and (not isinstance(value, str) or (limit and len(value) > limit)):
            return False
    return True


_FOLLOW_UP_NAMES = frozenset(FOLLOW_UP_FIELDS)


@cache
def _text_limits() -> tuple[tuple[str, int | None], ...]:
    """The outbox's text columns a follow-up's row fills, each with its ``max_length``
    (read once: the model's fields do not change)."""
    meta = OutboxMessage._meta
    names = ("message_id", "task_name", "order_key", "traceparent", "correlation_id")
    return tuple((name, getattr(meta.get_field(name), "max_length", None)) for name in names)


# -- Arguments: a value as the driver takes it ---------------------------------------------

#: Django's own fields whose preparation returns a ``str`` (text) or an ``int`` (integers)
#: as it is.
_TEXT_FIELDS = frozenset({CharField, TextField})
_INTEGER_FIELDS = frozenset(
    {
        AutoField,
        BigAutoField,
        SmallAutoField,
        IntegerField,
        BigIntegerField,
        SmallIntegerField,
        PositiveIntegerField,
        PositiveBigIntegerField,
        PositiveSmallIntegerField,
    }
)


#: The methods a field prepares a value with: a subclass that overrides none of them
#: prepares as the Django field it derives from.
_PREPARING = ("get_db_prep_save", "get_db_prep_value", "get_prep_value", "to_python")


def plain_type(field: Field[Any, Any]) -> type | None:
    """The value type ``field`` prepares for the database as it is: ``str`` for Django's own
    text fields, ``int`` for its integer fields, and for a subclass of one that changes none
    of their preparation (fsm-2's state field); None for any other field."""
    kind = type(field)
    for plain, own in ((str, _TEXT_FIELDS), (int, _INTEGER_FIELDS)):
        if kind in own:
            return plain
        base = next((c for c in kind.__mro__ if c in own), None)
        if base is not None and all(getattr(kind, m) is getattr(base, m) for m in _PREPARING):
            return plain
    return None


def preparation(field: Field[Any, Any]) -> Callable[[Any, Any], Any]:
    """A column's preparation (``get_db_prep_save``), skipped where it returns the value
    unchanged: a value of its :func:`plain_type`, an aware ``datetime`` for Django's
    ``DateTimeField`` (PostgreSQL's, the only one served here).
    """
    prepare = field.get_db_prep_save
    kind = type(field)
    if kind is DateTimeField:

        def aware(value: Any, conn: Any) -> Any:
            if type(value) is datetime and value.tzinfo is not None:
                return value
            return prepare(value, conn)

        return aware
    plain = plain_type(field)
    if plain is None:
        return prepare

    def unchanged(value: Any, conn: Any) -> Any:
        return value if type(value) is plain else prepare(value, conn)

    return unchanged


def inbox_preparation(field: Field[Any, Any]) -> Callable[[Any, Any], Any]:
    """An inbox column's preparation: a plain ``str``/``int`` (or None) goes as it is,
    as :meth:`~idempotent_orders.consuming.sql.InboxTemplate.params` sends it."""

    def prepare(value: Any, conn: Any) -> Any:
        if value is None or type(value) in _PLAIN:
            return value
        return field.get_db_prep_save(value, conn)

    return prepare
