"""``manage.py relay_outbox``: publish pending outbox rows once, or keep relaying."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders.outbox import OutboxListener, relay_outbox


class _Stop(BaseException):
    """SIGTERM or SIGINT arrived while the relay was waiting."""


class Command(BaseCommand):
    help = "Publish pending outbox rows (task_id = message_id) and mark them sent."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument("--loop", action="store_true", help="Keep relaying until stopped.")
        parser.add_argument(
            "--interval",
            type=float,
            default=1.0,
            help="With --loop, the longest wait between runs in seconds (on PostgreSQL a "
            "new row wakes the relay at once through LISTEN/NOTIFY).",
        )
        parser.add_argument(
            "--heartbeat-file",
            type=Path,
            default=None,
            metavar="PATH",
            help="With --loop, write the time to PATH after every run (a liveness probe "
            "checks its age).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["loop"]:
            self._run_once(options)
            return
        state = {"stopping": False, "waiting": False}

        def stop(signum: int, frame: FrameType | None) -> None:
            state["stopping"] = True
            if state["waiting"]:
                raise _Stop
            # Mid-batch: the batch finishes (published rows are marked), then the loop ends.

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        listener = OutboxListener()
        try:
            while not state["stopping"]:
                self._run_once(options)
                if options["heartbeat_file"] is not None:
                    _beat(options["heartbeat_file"])
                if state["stopping"]:
                    break
                state["waiting"] = True
                try:
                    listener.wait(options["interval"])
                finally:
                    state["waiting"] = False
        except _Stop:
            pass
        finally:
            listener.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write("stopped")

    def _run_once(self, options: dict[str, Any]) -> None:
        result = relay_outbox(batch_size=options["batch_size"])
        self.stdout.write(
            f"published={result.published} retried={result.retried} "
            f"pending={result.pending} dead={result.dead}"
        )
        self.stdout.flush()


def _beat(path: Path) -> None:
    """Write the time into ``path`` whole: a probe never reads a half-written file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(f"{time.time():.3f}\n")
    os.replace(partial, path)
