"""A TCP proxy in front of PostgreSQL that cuts a connection at a chosen statement, to make
a commit *in doubt*: the client loses its connection and cannot know whether the server
committed.

Armed with :meth:`CuttingProxy.cut`, it watches the statements clients send (simple
``Query`` and extended ``Parse`` messages) and, at the first one containing a pattern
(``b"COMMIT"``, say), cuts the connection either

- ``before`` the server sees the statement: the server rolls the transaction back; or
- ``after`` the server answered it: the statement ran (a COMMIT committed), but the answer
  never reaches the client.

Either way the client sees the same thing: the server closed the connection. Plain
connections only (``sslmode=disable``, ``gssencmode=disable``).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from dataclasses import dataclass, field

from tests.support.services import free_port


@dataclass
class Cut:
    pattern: bytes
    #: ``before``: the statement is not sent; ``after``: sent, and its answer dropped.
    when: str


@dataclass
class CuttingProxy:
    upstream: tuple[str, int]
    port: int = field(default_factory=free_port)
    #: Statements clients sent, in order (the text of Query and Parse messages).
    statements: list[bytes] = field(default_factory=list)
    #: What was cut: ``(when, statement)``.
    cuts: list[tuple[str, bytes]] = field(default_factory=list)
    _armed: Cut | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(32)
        self._listener.settimeout(0.2)
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def cut(self, pattern: bytes, when: str) -> None:
        """Cut the next connection that sends a statement containing ``pattern`` (once)."""
        assert when in {"before", "after"}
        with self._lock:
            self._armed = Cut(pattern, when)

    @property
    def armed(self) -> bool:
        with self._lock:
            return self._armed is not None

    def close(self) -> None:
        self._stopping.set()
        self._accepting.join(5)
        self._listener.close()

    # --- the relay --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.upstream, timeout=5)
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _take(self, statement: bytes) -> Cut | None:
        with self._lock:
            self.statements.append(statement)
            cut = self._armed
            if cut is not None and cut.pattern in statement:
                self._armed = None
                self.cuts.append((cut.when, statement))
                return cut
            return None

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        pending = b""  # client bytes not yet parsed into whole messages
        started = False  # the startup message (no type byte) went through
        swallowing = False  # the statement to cut was sent: drop answers up to ReadyForQuery
        answers = b""
        try:
            while not self._stopping.is_set():
                readable, _, _ = select.select([client, server], [], [], 0.2)
                if server in readable:
                    data = server.recv(65536)
                    if not data:
                        return
                    if not swallowing:
                        client.sendall(data)
                    else:
                        answers += data
                        if _ready_for_query(answers):
                            return  # the server answered; the client never hears it
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    pending += data
                    out = b""
                    while True:
                        if not started:
                            if len(pending) < 4:
                                break
                            (length,) = struct.unpack("!I", pending[:4])
                            if len(pending) < length:
                                break
                            out += pending[:length]
                            pending = pending[length:]
                            started = True
                            continue
                        if len(pending) < 5:
                            break
                        kind = pending[:1]
                        (length,) = struct.unpack("!I", pending[1:5])
                        if len(pending) < 1 + length:
                            break
                        message, pending = pending[: 1 + length], pending[1 + length :]
                        statement = _statement(kind, message[5:])
                        cut = self._take(statement) if statement is not None else None
                        if cut is not None and cut.when == "before":
                            if out:
                                server.sendall(out)
                            return  # the server never sees the statement
                        if cut is not None:
                            swallowing = True
                        out += message
                    if out:
                        server.sendall(out)
        except OSError:
            return
        finally:
            for sock in (client, server):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _statement(kind: bytes, body: bytes) -> bytes | None:
    if kind == b"Q":
        return body.rstrip(b"\x00")
    if kind == b"P":  # Parse: statement name, NUL, query, NUL, parameter types
        _name, _, rest = body.partition(b"\x00")
        query, _, _ = rest.partition(b"\x00")
        return query
    return None


def _ready_for_query(answers: bytes) -> bool:
    """Whether the server's answer bytes hold a whole ReadyForQuery message."""
    at = 0
    while len(answers) - at >= 5:
        kind = answers[at : at + 1]
        (length,) = struct.unpack("!I", answers[at + 1 : at + 5])
        if len(answers) - at < 1 + length:
            return False
        if kind == b"Z":
            return True
        at += 1 + length
    return False
