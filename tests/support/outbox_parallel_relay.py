"""One of several relay processes run at once; it records every id it publishes.

``python -m tests.support.outbox_parallel_relay OUT GO BATCH READY [STALL_AFTER MARKER]``:
once set up, writes a file named for its pid into the folder READY, waits for the file GO
(which the test writes when every relay is ready: they start together), relays until no due row
is left, appending each published ``message_id`` to OUT (one ``write`` of one
line to a file opened for appending, so relays may share it and its line
order is the order of the publishes). Publishing is recorded, not sent, and
takes a few milliseconds, so the relays' batches overlap. With STALL_AFTER,
the relay writes MARKER after that many publishes and stalls before marking
its batch sent, for the test to kill it there.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import django


def main() -> None:
    out, go, batch = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    ready = Path(sys.argv[4])
    stall_after = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    marker = Path(sys.argv[6]) if len(sys.argv) > 6 else None
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from idempotent_orders.models import OutboxMessage
    from idempotent_orders.outbox import relay, sender

    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    published = 0

    def record(row: OutboxMessage) -> None:
        nonlocal published
        time.sleep(0.005)  # a broker round trip
        os.write(fd, f"{os.getpid()} {row.message_id}\n".encode())
        published += 1
        if published == stall_after and marker is not None:
            marker.write_text(str(published))
            time.sleep(3600)  # published, not marked: the window a crash can hit

    def record_fast(self: sender._TemplateSender, row: OutboxMessage) -> bool:
        record(row)  # recorded, not sent, as the general path
        return True

    sender._send = record  # type: ignore[assignment]
    sender._TemplateSender.send = record_fast  # type: ignore[method-assign]
    (ready / str(os.getpid())).touch()
    while not go.exists():
        time.sleep(0.01)
    relay.relay_outbox(batch_size=batch)


if __name__ == "__main__":
    main()
