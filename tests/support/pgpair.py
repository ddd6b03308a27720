"""A PostgreSQL primary and its streaming replica of the test's own (fail in CI, skip elsewhere
without the server binaries): synchronous replication, a primary that can be killed, a replica
that can be promoted. Never the shared server: the pair lives in a temporary directory on
ports of its own and is stopped and removed after."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.services import free_port, unavailable, wait_until

#: The binaries the pair needs.
PROGRAMS = ("initdb", "pg_ctl", "pg_basebackup", "postgres")


def postgres_bindir() -> Path | None:
    """Where ``initdb`` and friends are: ``IO_TEST_PG_BINDIR``, the directory ``pg_ctl`` on
    PATH resolves to, or the newest ``/usr/lib/postgresql/<major>/bin`` (Debian keeps them
    off PATH)."""
    if os.environ.get("IO_TEST_PG_BINDIR"):
        return Path(os.environ["IO_TEST_PG_BINDIR"])
    candidates = [Path(p).resolve().parent for p in [shutil.which("pg_ctl")] if p is not None] + [
        Path(p)
        for p in sorted(
            glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: -int(p.split("/")[-2])
        )
    ]
    for bindir in candidates:
        if all((bindir / program).exists() for program in PROGRAMS):
            return bindir
    return candidates[0] if candidates else None


@dataclass
class Server:
    name: str
    port: int
    datadir: Path
    log: Path


@dataclass
class PostgresPair:
    """A primary replicating synchronously to one standby (``application_name`` ``replica``)."""

    bindir: Path
    workdir: Path
    primary: Server
    replica: Server
    #: How a subprocess is run: as the ``postgres`` user when we are root.
    as_user: list[str] = field(default_factory=list)
    #: WAL sender processes stopped by :meth:`hold_replication`.
    held: list[int] = field(default_factory=list)

    # --- connection settings ------------------------------------------------------------

    @property
    def hosts(self) -> str:
        return "127.0.0.1,127.0.0.1"

    @property
    def ports(self) -> str:
        return f"{self.primary.port},{self.replica.port}"

    def database_settings(self, name: str) -> dict[str, Any]:
        """Django ``DATABASES`` entry listing both servers; libpq connects to the one that
        accepts writes (``target_session_attrs=read-write``)."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": "postgres",
            "PASSWORD": "",
            "HOST": self.hosts,
            "PORT": self.ports,
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
            "ATOMIC_REQUESTS": False,
            "AUTOCOMMIT": True,
            "TIME_ZONE": None,
            "TEST": {},
            "OPTIONS": {
                "target_session_attrs": "read-write",
                "connect_timeout": 2,
                "sslmode": "disable",
                "gssencmode": "disable",
            },
        }

    # --- processes ----------------------------------------------------------------------

    def run(self, program: str, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            [*self.as_user, str(self.bindir / program), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.workdir,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} exited {done.returncode}: "
                f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return done.stdout

    def start(self, server: Server) -> None:
        self.run(
            "pg_ctl", "-D", str(server.datadir), "-l", str(server.log), "-w", "-t", "60", "start"
        )

    def hold_replication(self) -> None:
        """Stop the primary's WAL sender (SIGSTOP): the standby receives nothing more, as
        when it lags or the network between them stalls. Under synchronous replication
        every commit from now on waits; under asynchronous replication commits go on."""
        rows = self.sql(self.primary.port, "SELECT pid FROM pg_stat_replication")
        self.held = [int(pid) for (pid,) in rows]
        for pid in self.held:
            os.kill(pid, signal.SIGSTOP)

    def kill_primary(self) -> None:
        """Stop the primary at once (``-m immediate``: every backend is killed, no checkpoint,
        no goodbye to the clients or the standby), as a crash would. A held WAL sender is
        killed first, so it sends nothing more."""
        for pid in self.held:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.held = []
        self.run("pg_ctl", "-D", str(self.primary.datadir), "-m", "immediate", "stop")

    def promote_replica(self) -> None:
        self.run("pg_ctl", "-D", str(self.replica.datadir), "-w", "-t", "60", "promote")

    def stop(self) -> None:
        for pid in self.held:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for server in (self.replica, self.primary):
            pid = server.datadir / "postmaster.pid"
            if pid.exists():
                with suppress(RuntimeError, subprocess.TimeoutExpired):
                    self.run("pg_ctl", "-D", str(server.datadir), "-m", "immediate", "stop")

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {s.name}\n{s.log.read_text(errors='replace')[-chars:]}"
            for s in (self.primary, self.replica)
            if s.log.exists()
        )

    def sql(self, port: int, query: str, database: str = "postgres") -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=port, user="postgres", dbname=database, autocommit=True
        ) as conn:
            cursor = conn.execute(query)
            return list(cursor.fetchall()) if cursor.description is not None else []


def _setting_lines(port: int, socket_dir: Path) -> str:
    return "\n".join(
        [
            "listen_addresses = '127.0.0.1'",
            f"port = {port}",
            f"unix_socket_directories = '{socket_dir}'",
            "max_connections = 50",
            "shared_buffers = 32MB",
            "wal_level = replica",
            "max_wal_senders = 4",
            "hot_standby = on",
            "synchronous_commit = on",
            # The servers are killed, not the machine: skipping fsync loses nothing the
            # kernel holds, and keeps the test's set-up short on a loaded box.
            "fsync = off",
            "full_page_writes = off",
            "wal_sender_timeout = 5s",
            "wal_receiver_status_interval = 1s",
            "logging_collector = off",
            "",
        ]
    )


@contextmanager
def postgres_pair(
    database: str = "io_failover", *, synchronous: bool = True
) -> Iterator[PostgresPair]:
    """initdb a primary, create ``database``, clone a streaming standby with pg_basebackup,
    start both with synchronous replication (asynchronous with ``synchronous=False``); stop
    both and remove their files after."""
    bindir = postgres_bindir()
    missing = [p for p in PROGRAMS if bindir is None or not (bindir / p).exists()]
    if missing:
        unavailable(
            f"PostgreSQL server binaries not found ({', '.join(missing)})",
            hint="install postgresql (or set IO_TEST_PG_BINDIR) to run the failover test",
            required="the failover test needs initdb, pg_ctl and pg_basebackup",
        )
    assert bindir is not None
    workdir = Path(tempfile.mkdtemp(prefix="io-pgpair-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root: run it as the postgres user, in a directory
        # that user owns.
        shutil.chown(workdir, "postgres")
        os.chmod(workdir, 0o755)
        as_user = ["runuser", "-u", "postgres", "--"]
    pair = PostgresPair(
        bindir=bindir,
        workdir=workdir,
        primary=Server("primary", free_port(), workdir / "primary", workdir / "primary.log"),
        replica=Server("replica", free_port(), workdir / "replica", workdir / "replica.log"),
        as_user=as_user,
    )
    try:
        pair.run(
            "initdb", "-D", str(pair.primary.datadir), "-U", "postgres", "--auth=trust",
            "--no-sync", "--no-instructions", "-E", "UTF8", "--locale=C",
        )  # fmt: skip
        _append(
            pair,
            pair.primary.datadir / "postgresql.conf",
            _setting_lines(pair.primary.port, workdir),
        )
        pair.start(pair.primary)
        pair.sql(pair.primary.port, f"CREATE DATABASE {database}")
        pair.run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(pair.primary.port), "-U", "postgres",
            "-D", str(pair.replica.datadir), "-X", "stream", "-c", "fast", "--no-sync",
        )  # fmt: skip
        conf = pair.replica.datadir / "postgresql.conf"
        _append(pair, conf, _setting_lines(pair.replica.port, workdir))
        _append(
            pair,
            conf,
            f"primary_conninfo = 'host=127.0.0.1 port={pair.primary.port} user=postgres "
            "application_name=replica'\n",
        )
        _write(pair, pair.replica.datadir / "standby.signal", "")
        pair.start(pair.replica)

        def state() -> list[tuple[Any, ...]]:
            return pair.sql(
                pair.primary.port,
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'replica'",
            )

        # From now on every commit waits until the standby has flushed its WAL (set only now:
        # with no standby yet, the commits above would wait for ever).
        names = "replica" if synchronous else ""
        pair.sql(pair.primary.port, f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        pair.sql(pair.primary.port, "SELECT pg_reload_conf()")
        expected = [("sync" if synchronous else "async",)]
        if not wait_until(lambda: state() == expected, timeout=30, interval=0.1):
            raise RuntimeError(f"the standby is not streaming as asked\n{pair.log_tail()}")
        yield pair
    finally:
        pair.stop()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            shutil.rmtree(workdir, ignore_errors=True)
            if not workdir.exists():
                break
            time.sleep(0.2)


def _append(pair: PostgresPair, path: Path, text: str) -> None:
    with path.open("a") as handle:
        handle.write(text)
    _own(pair, path)


def _write(pair: PostgresPair, path: Path, text: str) -> None:
    path.write_text(text)
    _own(pair, path)


def _own(pair: PostgresPair, path: Path) -> None:
    if pair.as_user:
        shutil.chown(path, "postgres")
        os.chmod(path, 0o600)
