"""The savepoint a batch chunk runs each message's own code in (its decision and its
transition), taken at the first statement that code sends, and released with the next
message's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.db.backends.base.base import BaseDatabaseWrapper

from idempotent_orders.consuming.failures import TRANSIENT
from idempotent_orders.consuming.running import restore, snapshot_of
from idempotent_orders.models import AbstractOrder
from idempotent_orders.vendors import vendor

T = TypeVar("T")


class Savepoints:
    """The savepoints of one chunk's transaction, one a message whose code sends a
    statement. A message's savepoint is released with the next one's ``SAVEPOINT``, in one
    text where the database takes several statements a text (the chunk's ``COMMIT``
    releases the last): a round trip a message fewer than a ``RELEASE`` of its own."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        self.database = vendor(connection)
        self.several = self.database.several_statements(connection)
        #: Savepoints whose message's code ran to its end, not released yet.
        self.unreleased: list[str] = []
        self.taken = 0
        #: The chunk's held ``save()`` UPDATEs
        #: (:class:`~idempotent_orders.consuming.held.HeldSaves`), placed around a
        #: savepoint's ``SAVEPOINT`` when it is taken; None: each is sent at once.
        self.holder: Any = None

    def texts(self) -> tuple[str, list[str]]:
        """A new savepoint's name, and the statements that take it (the unreleased ones
        released first)."""
        ops = self.connection.ops
        self.taken += 1
        sid = f"io_message_{self.taken}"
        texts = [ops.savepoint_commit_sql(old) for old in self.unreleased]
        texts.append(ops.savepoint_create_sql(sid))
        self.unreleased.clear()
        return sid, texts

    def take(self) -> str:
        """A new savepoint, taken now; its name."""
        sid, texts = self.texts()
        with self.connection.cursor() as cursor:
            if self.several:
                cursor.execute("; ".join(texts))
            else:
                for text in texts:
                    cursor.execute(text)
        return sid

    def release(self, sid: str) -> None:
        """``sid``'s message's code ran to its end: release it with the next savepoint."""
        self.unreleased.append(sid)


class _Savepoint:
    """A savepoint taken with the first statement sent while it is installed
    (``connection.execute_wrapper``): code that sends none sends no SAVEPOINT either. Where
    the driver's cursor takes several statements a text, the ``SAVEPOINT`` (and the
    ``RELEASE`` of the message before) goes in that statement's text, and the cursor is
    left on that statement's result. The execute wrappers installed before this one see
    the statement as the code sent it, and so does query logging on PostgreSQL (MariaDB's
    logs the text the driver sent)."""

    def __init__(self, savepoints: Savepoints) -> None:
        self.savepoints = savepoints
        self.sid: str | None = None
        self.taking = False

    def __call__(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        if self.sid is not None or self.taking:
            return execute(sql, params, many, context)
        points = self.savepoints
        cursor = context["cursor"].cursor
        holder = points.holder
        if (
            points.several
            and not many
            and isinstance(sql, str)
            and points.database.takes_several(cursor)
        ):
            self.sid, texts = points.texts()
            if holder is None:
                done = execute("; ".join([*texts, sql]), params, many, context)
                with points.connection.wrap_database_errors:
                    points.database.skip_results(cursor, len(texts))
                return done
            # The held save() UPDATEs: the earlier messages' before the SAVEPOINT, this
            # message's after it (rolled back with it if its code raises).
            before, after = holder.around()
            escape = params is not None
            text = [*holder.prefix(before, escape), *texts, *holder.prefix(after, escape), sql]
            try:
                done = execute("; ".join(text), params, many, context)
            except Exception as exc:
                if before or after:
                    holder.failed(exc)
                raise
            holder.read(cursor, len(before))
            try:
                with points.connection.wrap_database_errors:
                    points.database.skip_results(cursor, len(texts))
            except Exception as exc:
                if after:  # raised at the step to this message's first UPDATE: its own
                    holder.failed(exc)
                raise
            holder.read(cursor, len(after))
            return done
        self.taking = True  # the SAVEPOINT statement itself passes through here
        try:
            self.sid = points.take()
        finally:
            self.taking = False
        if holder is not None:  # this message's own held UPDATEs, after its SAVEPOINT
            _, after = holder.around()
            holder.send_alone(after)
        return execute(sql, params, many, context)


def guarded(order: AbstractOrder, step: Callable[[], T], savepoints: Savepoints) -> T | Exception:
    """Run ``step`` (a message's decision and transition: the project's code) in a
    savepoint of the chunk's transaction; return what it raised instead of raising.

    What raised rolls back only this savepoint (and drops the ``on_commit`` callbacks
    registered since), and ``order`` is put back as it was in memory, so the chunk
    goes on and no other message's code runs twice. The savepoint is taken at the
    first statement ``step`` sends through Django's connection, so a body that writes
    only the order's own fields sends no SAVEPOINT. An error after which the
    delivery is simply run again (a lost connection, a deadlock) still propagates:
    the whole chunk rolls back.

    ``savepoints``: the chunk's.
    """
    connection = savepoints.connection
    before = snapshot_of(order)
    version: int = order.version
    savepoint = _Savepoint(savepoints)
    callbacks = len(connection.run_on_commit)
    holder = savepoints.holder
    if holder is not None:
        holder.begin(savepoint)
    # ``connection.execute_wrapper(savepoint)``, without a generator per message.
    wrappers = connection.execute_wrappers
    wrappers.append(savepoint)
    try:
        try:
            done = step()
        finally:
            wrappers.pop()
    except TRANSIENT:
        if holder is not None:
            holder.end(ran=False)
        restore(order, before, version)
        raise
    except Exception as exc:
        if holder is not None:
            holder.end(ran=False)  # what it held: unsent, or rolled back with its savepoint
        restore(order, before, version)
        # As atomic() does: the flag a failed query set is lowered first (the rollback is
        # itself a query), and the transaction goes on from the savepoint.
        connection.set_rollback(False)
        if savepoint.sid is not None:
            connection.savepoint_rollback(savepoint.sid)
        del connection.run_on_commit[callbacks:]
        return exc
    if holder is not None:
        holder.end(ran=True)
    if savepoint.sid is not None:
        savepoints.release(savepoint.sid)
    return done
