"""One of several relay processes run at once; it records every id it publishes.

``python -m tests.outbox_parallel_relay OUT GO BATCH``: waits for the file GO
(so the relays start together), relays until no due row is left, appending
each published ``message_id`` to OUT. Publishing is recorded, not sent, and
takes a few milliseconds, so the relays' batches overlap.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import django


def main() -> None:
    out, go, batch = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from idempotent_orders import outbox

    with out.open("a") as log:

        def record(row: outbox.OutboxMessage) -> None:
            time.sleep(0.005)  # a broker round trip
            log.write(row.message_id + "\n")
            log.flush()

        outbox._send = record  # type: ignore[assignment]
        while not go.exists():
            time.sleep(0.01)
        outbox.relay_outbox(batch_size=batch)


if __name__ == "__main__":
    main()
