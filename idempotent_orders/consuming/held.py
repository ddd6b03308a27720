"""A guarded ``save()``'s UPDATE held back for the next text on the connection.

On the save() road the model's own ``save()`` writes the transition: its UPDATE,
guarded by the state and ``version`` as read
(:func:`~idempotent_orders.consuming.running.commit`). Sent at once, that UPDATE is a
round trip of its own between the road's first text and its last. Where the backend's
texts can carry it (:attr:`~idempotent_orders.consuming.backends.Texts.holds_save_update`)
and nothing watches the connection's statements, :class:`HeldUpdate` holds it back:
``save()`` is told the row was written, and the UPDATE goes at the head of the next text
sent on the connection, in the order it was sent:

- the road's last text (the follow-up's outbox row and ``COMMIT``), where an UPDATE that
  matched no row stops the text before ``COMMIT``;
- or the first statement the project's code sends after it (a ``post_save`` receiver, a
  history package's row, a savepoint of its own), through an execute wrapper: the
  UPDATE returns the rows it matched, and the project's statement runs after it, as it
  would have, its cursor left on its own result;
- or, where nothing else goes after it, a round trip of its own.

An UPDATE that matched no row (another writer moved the order since the read) rolls the
message back like any lost race, and the road reads and decides again. The project's
code after ``save()`` (an override's tail, ``post_save`` receivers) then ran in a
transaction that was rolled back, as it does when any later statement of a transaction
fails; the exception never reaches it.

A batch chunk on the save() road holds each message's ``save()`` UPDATE the same way
(:class:`HeldSaves`), several at a time: they go together with the chunk's next
statement, placed around the ``SAVEPOINT`` of the message whose code sends it, or in one
text before the chunk commits.
"""

from __future__ import annotations

from typing import Any

from idempotent_orders.consuming.backends import backend
from idempotent_orders.models import send_update
from idempotent_orders.prepared import watched
from idempotent_orders.vendors import vendor

#: A held UPDATE: its statement and arguments.
Held = tuple[str, list[Any]]

__all__ = ["HeldSaves", "HeldUpdate", "MovedUnderChunk"]


class _Holder:
    """What both holders share: the held UPDATEs put at the head of the project's next
    statement (:meth:`carry`), their rows read back, and what a failed text tells."""

    #: Whether the held UPDATEs stop their text with an error when they match no row
    #: (``Texts.held_prefix(stop=...)``).
    stops = False

    def __init__(self, conn: Any, texts: Any) -> None:
        self.conn = conn
        self.texts = texts
        self.database = vendor(conn)
        #: A held UPDATE matched no row (the order moved since the read), or its answer
        #: was lost with the text's error: what was written with it rolls back.
        self.moved = False
        #: The error the database answered a held UPDATE with, where the project's code
        #: that sent its text may have swallowed it: raised again before the commit.
        self.refused: BaseException | None = None

    def carry(
        self, execute: Any, sql: Any, params: Any, many: bool, context: Any, held: list[Held]
    ) -> Any:
        """Run the project's statement ``sql`` with ``held`` at the head of its text (sent
        alone first where its cursor takes one statement a text); its cursor is left on
        the project's statement's result."""
        if not held:
            return execute(sql, params, many, context)
        cursor = context["cursor"].cursor
        if many or not isinstance(sql, str) or not self.database.takes_several(cursor):
            self.send_alone(held)
            return execute(sql, params, many, context)
        text = "; ".join([*self.prefix(held, params is not None), sql])
        try:
            done = execute(text, params, many, context)
        except Exception as exc:
            self.failed(exc)
            raise
        self.read(cursor, len(held))
        return done

    def prefix(self, held: list[Held], escape: bool) -> list[str]:
        """The statements of ``held`` as texts that return the rows each matched
        (``escape``: the driver reads the text for its own arguments)."""
        stop = self.stops
        texts = [self.texts.held_prefix(self.conn, sql, p, stop=stop) for sql, p in held]
        return [t.replace("%", "%%") for t in texts] if escape else texts

    def read(self, cursor: Any, count: int) -> None:
        """Read the rows matched by ``count`` held UPDATEs from the cursor's result on. An
        error of a later statement in the text is raised after the count before it was
        read (MariaDB raises each at the step to its result); an UPDATE whose count was
        not read counts as lost."""
        for n in range(count):
            try:
                self.texts.held_rows(self.conn, cursor, self._matched)
            except Exception:
                if n + 1 < count:
                    self.lost()
                raise

    def send_alone(self, held: list[Held]) -> None:
        """Send ``held`` one statement a round trip (a cursor that takes one statement)."""
        for sql, params in held:
            if send_update(self.conn, sql, params) != 1:
                self.moved = True

    def failed(self, exc: BaseException) -> None:
        """The text that carried held UPDATEs raised ``exc`` before their rows were read."""
        if self.texts.held_unanswered(exc):
            self.moved = True
            self.refused = exc

    def lost(self) -> None:
        """A held UPDATE's rows were not read."""
        self.moved = True

    def _matched(self, rows: int) -> None:
        if rows != 1:
            self.moved = True


class HeldUpdate(_Holder):
    """The guarded UPDATE of one ``save()`` on the road's connection, held for the next text.

    Handed to the model's ``_do_update`` (through the instance, as its guard is:
    :data:`~idempotent_orders.models.SAVE_HOLD`): :meth:`hold` keeps the statement and
    installs this object as the connection's execute wrapper until the statement goes
    out. Its UPDATE counts the rows it matched without stopping its text, so the
    project's statement never raises for it.
    """

    def __init__(self, conn: Any, texts: Any) -> None:
        super().__init__(conn, texts)
        #: The held UPDATE and its arguments (None: nothing held).
        self.sql: str | None = None
        self.params: list[Any] = []

    @classmethod
    def arm(cls, conn: Any, texts: Any) -> HeldUpdate | None:
        """One for the road's block on ``conn``, or None where the UPDATE goes at once:
        the backend's texts cannot carry it, or something must see every statement as
        it is sent (:func:`~idempotent_orders.prepared.watched`)."""
        if not getattr(texts, "holds_save_update", False) or watched(conn):
            return None
        return cls(conn, texts)

    def hold(self, conn: Any, sql: str, params: list[Any]) -> bool:
        """Keep ``sql`` (a guarded UPDATE of one row) for the next text; False (the caller
        sends it) where it is not this block's connection or one is held already."""
        if conn is not self.conn or self.sql is not None or conn.needs_rollback:
            return False
        self.sql, self.params = sql, list(params)
        conn.execute_wrappers.append(self)
        return True

    def take(self) -> Held | None:
        """The UPDATE still held, for the last text to carry (no longer held)."""
        return self._release()

    def settle(self) -> bool:
        """Send the UPDATE still held on its own (nothing went after it); False when the
        order moved, by then or now."""
        held = self._release()
        if held is not None:
            self.send_alone([held])
        return not self.moved

    def close(self) -> None:
        """Drop what is held (the block is rolling back) and the execute wrapper."""
        self._release()

    def _release(self) -> Held | None:
        if self.sql is None:
            return None
        held = (self.sql, self.params)
        self.sql, self.params = None, []
        wrappers = self.conn.execute_wrappers
        if self in wrappers:
            wrappers.remove(self)
        return held

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        """The execute wrapper: the held UPDATE goes in the text of the project's statement
        (on its own first where the cursor takes one statement a text)."""
        held = self._release()
        return self.carry(execute, sql, params, many, context, [] if held is None else [held])


class MovedUnderChunk(Exception):
    """A batch chunk's held UPDATE matched no row, or its answer was lost with an error of
    the statement it travelled with: the chunk rolls back whole and its messages go one
    by one (:func:`~idempotent_orders.consuming.batch.consume_batch`)."""


class HeldSaves(_Holder):
    """The guarded UPDATEs of a batch chunk's ``save()``\\s, held for the next text.

    On the batch's save() road each transition is committed by the model's own
    ``save()`` in the message's savepoint (:func:`~idempotent_orders.consuming.savepoints.guarded`),
    taken at the first statement the message's code sends. Sent at once, each UPDATE is
    a round trip, and the savepoint's with it. Held, the UPDATEs of one message after
    another go at the head of the next statement on the connection, in the order they
    were sent, so a chunk whose receivers send nothing sends its saves with its first
    write:

    - outside a message's code (the chunk's writes), every UPDATE held;
    - where a message's code takes its savepoint, the UPDATEs of the messages before it
      ahead of the ``SAVEPOINT``, its own after it (:meth:`around`), so a message that
      raises rolls back its own and no other's;
    - within a message's code past its savepoint, its own.

    The chunk holds its orders' locks, so only the project's own code can have moved an
    order behind a held UPDATE. An UPDATE that matched no row, or whose answer was lost
    with an error of the statement it went with, marks the chunk; :meth:`settle` then
    raises :class:`MovedUnderChunk` before the chunk commits.
    """

    stops = True  # psycopg raises a text's first error at execute(), before any row is read

    def __init__(self, conn: Any, texts: Any) -> None:
        super().__init__(conn, texts)
        #: Held UPDATEs of the messages whose code ran to its end.
        self.done: list[Held] = []
        #: Held UPDATEs of the message whose code runs now.
        self.current: list[Held] = []
        #: The running message's savepoint (``savepoints._Savepoint``), or None.
        self.step: Any = None

    @classmethod
    def arm(cls, conn: Any) -> HeldSaves | None:
        """One for a chunk on ``conn``, or None where each UPDATE goes at once: the
        backend's texts cannot carry it, the connection takes one statement a text, or
        something must see every statement as it is sent."""
        texts = backend(conn).texts()
        if (
            not getattr(texts, "holds_save_update", False)
            or watched(conn)
            or not vendor(conn).several_statements(conn)
        ):
            return None
        return cls(conn, texts)

    def hold(self, conn: Any, sql: str, params: list[Any]) -> bool:
        """Keep ``sql`` (a guarded UPDATE of one row) for the next text; False (the caller
        sends it) where it is not the chunk's connection."""
        if conn is not self.conn or conn.needs_rollback:
            return False
        self.current.append((sql, list(params)))
        return True

    def begin(self, step: Any) -> None:
        """A message's code starts (``step``: its savepoint, taken at its first statement)."""
        self.step = step

    def end(self, ran: bool) -> None:
        """The message's code ended: ``ran`` to its end (what it holds goes with the next
        text), or it raised (what it held was never sent, or went after its savepoint,
        which is rolled back)."""
        if ran:
            self.done += self.current
        self.current = []
        self.step = None

    def around(self) -> tuple[list[Held], list[Held]]:
        """For the text that takes the running message's savepoint: what goes before the
        ``SAVEPOINT`` (the earlier messages') and after it (this message's)."""
        before, after = self.done, self.current
        self.done, self.current = [], []
        return before, after

    def settle(self) -> None:
        """Before the chunk commits: send what is still held, in one text; raise
        :class:`MovedUnderChunk` when an UPDATE matched no row."""
        held, self.done = self.done + self.current, []
        self.current = []
        if len(held) > 1:
            with self.conn.cursor() as cursor:
                try:
                    cursor.execute("; ".join(self.prefix(held, escape=False)))
                except Exception as exc:
                    self.failed(exc)
                    if not self.moved:
                        raise
                else:
                    self.read(cursor.cursor, len(held))
        else:
            self.send_alone(held)
        if self.moved:
            raise MovedUnderChunk("an order changed under the batch's lock before its save()")

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        """The execute wrapper, installed for the chunk before any message's savepoint."""
        if not self.done and not self.current:
            return execute(sql, params, many, context)
        step = self.step
        if step is not None and step.sid is None and not step.taking:
            return execute(sql, params, many, context)  # the savepoint's text places them
        if step is not None and step.taking:  # the SAVEPOINT itself: the earlier ones first
            held, self.done = self.done, []
        else:
            held, self.done = self.done + self.current, []
            self.current = []
        return self.carry(execute, sql, params, many, context, held)
