"""Another "host" on this machine: a network namespace behind a veth pair, and a fault proxy.

The kernel here has no netem qdisc, so the faults are made in user space:

- :class:`FaultProxy` is a TCP proxy (asyncio, in a thread of the test process)
  listening on the host side of the veth pair, one port per service, forwarding
  to the service on loopback. It delays every chunk it forwards, refuses new
  connections and aborts live ones on demand (:meth:`FaultProxy.drop`);
- :class:`Namespace` is the namespace with its veth pair; a partition is the
  host end of the pair set down for a few seconds (:meth:`Namespace.partition`),
  so packets are lost in the kernel and TCP retransmits, as across a cut link;
- :func:`network_namespace` creates one and always removes it (and its veth
  pair), also removing namespaces left by a test process that was killed.

The injectors ``drop_connections`` and ``partition`` join
:data:`tests.support.chaos.INJECTORS`; they act on a :class:`NetworkChaosContext`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.support.chaos import INJECTORS, ChaosContext
from tests.support.services import unavailable

#: Namespaces this module creates are named ``io-chaos-<pid>-<hex>``.
PREFIX = "io-chaos-"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def require_namespaces() -> None:
    """Fail in CI, skip elsewhere, when namespaces and veth pairs cannot be made here."""
    required = "the network-namespace chaos run needs ip(8) and root"
    if shutil.which("ip") is None:
        unavailable("ip (iproute2) is not installed", required=required)
    if os.geteuid() != 0:
        unavailable("not root: cannot create network namespaces", required=required)


def remove_stale() -> list[str]:
    """Remove namespaces of this module whose test process is gone (killed mid-run)."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout.split()
    for name in listing:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            _ip("netns", "del", name, check=False)
            removed.append(name)
        except (ValueError, PermissionError):
            continue
    return removed


@dataclass
class Namespace:
    name: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str
    partitions: int = 0

    def prefix(self) -> list[str]:
        """Run a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def link(self, up: bool) -> None:
        _ip("link", "set", self.host_if, "up" if up else "down")

    def partition(self, seconds: float) -> None:
        """Cut the link for ``seconds``: every packet either way is lost meanwhile."""
        self.link(False)
        try:
            time.sleep(seconds)
        finally:
            self.link(True)
        self.partitions += 1


def _free_subnet() -> tuple[str, str]:
    used = _ip("-o", "-4", "addr", check=False).stdout
    for _ in range(200):
        b, c = random.randrange(256), random.randrange(64) * 4
        if f"10.213.{b}.{c + 1}/" not in used and f"10.213.{b}.{c + 2}/" not in used:
            return f"10.213.{b}.{c + 1}", f"10.213.{b}.{c + 2}"
    raise RuntimeError("no free 10.213.x.y/30 subnet")


@contextlib.contextmanager
def network_namespace() -> Iterator[Namespace]:
    """A namespace joined to this one by a veth pair; removed on exit, whatever happened."""
    require_namespaces()
    remove_stale()
    tag = uuid.uuid4().hex[:4]
    name = f"{PREFIX}{os.getpid()}-{tag}"
    host_if, ns_if = f"ioc{tag}{os.getpid() % 10000}h", f"ioc{tag}{os.getpid() % 10000}n"
    host_ip, ns_ip = _free_subnet()
    made = _ip("netns", "add", name, check=False)
    if made.returncode:
        unavailable(
            f"cannot create a network namespace: {made.stderr.strip()}",
            required="the network-namespace chaos run needs ip netns",
        )
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield Namespace(name, host_if, ns_if, host_ip, ns_ip)
    finally:
        _ip("netns", "del", name, check=False)  # takes the namespace's end of the pair
        _ip("link", "del", host_if, check=False)  # and its peer, if the move failed


def namespace_exists(name: str) -> bool:
    return name in _ip("netns", "list", check=False).stdout.split()


def link_exists(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


# --- the fault proxy ------------------------------------------------------------------------


class FaultProxy:
    """A TCP proxy that delays, refuses and aborts, in a thread with its own event loop."""

    def __init__(self, listen_host: str, *, delay: tuple[float, float] = (0.0, 0.0)) -> None:
        self.listen_host = listen_host
        #: Each forwarded chunk waits uniform(lo, hi) seconds (order kept per direction).
        self.delay = delay
        #: New connections to refuse (accepted, then reset at once).
        self.refuse = 0
        self.counts: Counter[str] = Counter()
        self._rng = random.Random()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list[asyncio.base_events.Server] = []
        self._live: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    def start(self) -> None:
        self._thread.start()

    def forward(self, target_host: str, target_port: int) -> int:
        """Listen on a new port of ``listen_host`` for ``target``; the port."""

        async def serve() -> int:
            server = await asyncio.start_server(
                lambda r, w: self._handle(r, w, (target_host, target_port)),
                self.listen_host,
                0,
            )
            self._servers.append(server)
            return int(server.sockets[0].getsockname()[1])

        return asyncio.run_coroutine_threadsafe(serve(), self._loop).result(10)

    async def _handle(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        target: tuple[str, int],
    ) -> None:
        if self.refuse > 0:
            self.refuse -= 1
            self.counts["refused"] += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*target), 5)
        except (OSError, TimeoutError):
            self.counts["upstream failed"] += 1
            writer.transport.abort()
            return
        self.counts["connections"] += 1
        pair = (writer, up_writer)
        self._live.add(pair)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
            )
        finally:
            self._live.discard(pair)
            writer.transport.abort()
            up_writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                lo, hi = self.delay
                if hi > 0:
                    await asyncio.sleep(self._rng.uniform(lo, hi))
                    self.counts["delayed chunks"] += 1
                writer.write(data)
                await writer.drain()
        finally:
            # One side is done or gone: so is the other (no half-closed links here).
            writer.transport.abort()

    def drop(self, share: float, refuse_next: int = 0) -> int:
        """Abort ``share`` of the live connections (at least one if any) and refuse the next few."""

        async def cut() -> int:
            live = list(self._live)
            chosen = self._rng.sample(live, max(1, round(len(live) * share))) if live else []
            for client, upstream in chosen:
                client.transport.abort()
                upstream.transport.abort()
            return len(chosen)

        self.refuse += refuse_next
        dropped = asyncio.run_coroutine_threadsafe(cut(), self._loop).result(10)
        self.counts["dropped"] += dropped
        return dropped

    def live(self) -> int:
        return len(self._live)

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers:
                server.close()
            for client, upstream in list(self._live):
                client.transport.abort()
                upstream.transport.abort()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()


# --- the injectors --------------------------------------------------------------------------


@dataclass
class NetworkChaosContext(ChaosContext):
    """A chaos context whose workers sit in ``namespace`` behind ``proxy``."""

    namespace: Namespace | None = None
    proxy: FaultProxy | None = None
    partition_seconds: float = 3.0
    dropped: int = field(default=0)


def _drop_connections(ctx: ChaosContext) -> None:
    assert isinstance(ctx, NetworkChaosContext)
    assert ctx.proxy is not None
    # Wait for the workers to hold connections through the proxy, so the fault hits something.
    deadline = time.monotonic() + 10
    while not ctx.proxy.live() and time.monotonic() < deadline:
        time.sleep(0.05)
    dropped = ctx.proxy.drop(0.5, refuse_next=3)
    ctx.dropped += dropped
    ctx.log.append(f"proxy aborted {dropped} live connections, refuses the next 3")


def _partition(ctx: ChaosContext) -> None:
    assert isinstance(ctx, NetworkChaosContext)
    assert ctx.namespace is not None
    ctx.namespace.partition(ctx.partition_seconds)
    ctx.log.append(f"partition: link down {ctx.partition_seconds:.0f}s")


INJECTORS.update({"drop_connections": _drop_connections, "partition": _partition})
