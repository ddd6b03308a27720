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
"""

from __future__ import annotations

from typing import Any

from idempotent_orders.models import send_update
from idempotent_orders.prepared import watched
from idempotent_orders.vendors import vendor

__all__ = ["HeldUpdate"]


class HeldUpdate:
    """The guarded UPDATE of one ``save()`` on the road's connection, held for the next text.

    Handed to the model's ``_do_update`` (through the instance, as its guard is:
    :data:`~idempotent_orders.models.SAVE_HOLD`): :meth:`hold` keeps the statement and
    installs this object as the connection's execute wrapper until the statement goes
    out.
    """

    def __init__(self, conn: Any, texts: Any) -> None:
        self.conn = conn
        self.texts = texts
        self.database = vendor(conn)
        #: The held UPDATE and its arguments (None: nothing held).
        self.sql: str | None = None
        self.params: list[Any] = []
        #: A statement sent before the last text found the order moved (the UPDATE matched
        #: no row): the message rolls back.
        self.moved = False

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

    def take(self) -> tuple[str, list[Any]] | None:
        """The UPDATE still held, for the last text to carry (no longer held)."""
        return self._release()

    def settle(self) -> bool:
        """Send the UPDATE still held on its own (nothing went after it); False when the
        order moved, by then or now."""
        held = self._release()
        if held is not None and not send_update(self.conn, *held):
            self.moved = True
        return not self.moved

    def close(self) -> None:
        """Drop what is held (the block is rolling back) and the execute wrapper."""
        self._release()

    def _release(self) -> tuple[str, list[Any]] | None:
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
        if held is None:
            return execute(sql, params, many, context)
        cursor = context["cursor"].cursor
        if many or not isinstance(sql, str) or not self.database.takes_several(cursor):
            if not send_update(self.conn, *held):
                self.moved = True
            return execute(sql, params, many, context)
        text = self.texts.held_prefix(self.conn, *held)
        if params is not None:  # the driver reads the text for its own arguments
            text = text.replace("%", "%%")
        done = execute(f"{text}; {sql}", params, many, context)
        self.texts.held_rows(self.conn, cursor, self._matched)
        return done

    def _matched(self, rows: int) -> None:
        if rows != 1:
            self.moved = True
