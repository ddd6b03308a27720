"""A relay process that stalls after publishing N rows, before marking them; the test kills it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import django


def main() -> None:
    stop_after, marker = int(sys.argv[1]), Path(sys.argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from idempotent_orders.models import OutboxMessage
    from idempotent_orders.outbox import relay, sender

    real_send, real_fast_send = sender._send, sender._TemplateSender.send
    sent = 0

    def counted() -> None:
        nonlocal sent
        sent += 1
        if sent == stop_after:
            marker.write_text(str(sent))
            time.sleep(3600)  # published, not marked: the window a crash can hit

    def send_then_stall(row: OutboxMessage) -> None:
        real_send(row)
        counted()

    def fast_send_then_stall(self: sender._TemplateSender, row: OutboxMessage) -> bool:
        # The batch's fast publish path; False means the row takes _send instead.
        if not real_fast_send(self, row):
            return False
        counted()
        return True

    sender._send = send_then_stall  # type: ignore[assignment]
    sender._TemplateSender.send = fast_send_then_stall  # type: ignore[method-assign]
    relay.relay_outbox()


if __name__ == "__main__":
    main()
