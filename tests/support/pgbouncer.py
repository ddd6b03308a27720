"""A private PgBouncer in front of the test PostgreSQL (fail in CI, skip elsewhere without it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.services import free_port, unavailable, wait_until


def _accepts(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


@contextmanager
def pgbouncer(host: str, port: int, user: str, pool_mode: str = "transaction") -> Iterator[int]:
    """Run ``pgbouncer`` on a port of its own, forwarding every database to ``host:port``
    as ``user`` (``auth_type = any``) in ``pool_mode``; yields its port, stops it after."""
    if shutil.which("pgbouncer") is None:
        unavailable(
            "pgbouncer is not installed",
            hint="apt-get install pgbouncer to run the transaction-pooling tests",
            required="pgbouncer is in .ci/system-packages.txt",
        )
    own = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="io-pgbouncer-"))
    config = workdir / "pgbouncer.ini"
    config.write_text(
        "[databases]\n"
        f"* = host={host} port={port} user={user}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {own}\n"
        f"unix_socket_dir = {workdir}\n"
        "auth_type = any\n"
        f"pool_mode = {pool_mode}\n"
        # Fewer server connections than client threads: clients share them.
        "default_pool_size = 4\nmax_client_conn = 200\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {workdir / 'pgbouncer.log'}\npidfile = {workdir / 'pgbouncer.pid'}\n"
    )
    command = ["pgbouncer", str(config)]
    if os.geteuid() == 0:
        # PgBouncer will not run as root: it drops to the database's system user.
        shutil.chown(workdir, "postgres")
        os.chmod(workdir, 0o755)
        command[1:1] = ["-u", "postgres"]
    output = (workdir / "output.log").open("wb")
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        if not wait_until(lambda: _accepts(own) or process.poll() is not None, timeout=30):
            unavailable("pgbouncer did not start listening", required="pgbouncer is required")
        if process.poll() is not None:
            said = (workdir / "output.log").read_text(errors="replace").strip()
            unavailable(f"pgbouncer exited at start: {said}", required="pgbouncer must start")
        yield own
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        output.close()
        shutil.rmtree(workdir, ignore_errors=True)
