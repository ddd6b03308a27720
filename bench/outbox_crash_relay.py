"""A relay the outbox section kills mid-batch: ours, django-celery-outbox's or
django-reliable-outbox's worker (``reliable``, run from ``bench.outbox_reliable`` in its venv).

``python -m bench.outbox_crash_relay ours|peer|reliable BROKER_URL KILL_AFTER LOG MARKER``
relays the benchmark database's outbox for real (to the broker), appending the
id of every publish to LOG; after KILL_AFTER publishes it writes MARKER and
stops there, inside its batch (published, not yet recorded as sent), for the
benchmark to SIGKILL it. The database is the benchmark's (``bench.settings``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import django


def main() -> None:
    kind, url, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    log, marker = Path(sys.argv[4]), Path(sys.argv[5])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    django.setup()
    from celery import current_app

    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    published = 0

    def tick(message_id: str) -> None:
        nonlocal published
        os.write(fd, f"{message_id}\n".encode())
        published += 1
        if published == kill_after:
            marker.write_text(str(published))
            time.sleep(3600)  # the benchmark kills the relay here

    if kind == "ours":
        from idempotent_orders.outbox import relay, sender

        current_app.conf.broker_url = url
        fast_send, send = sender._TemplateSender.send, sender._send

        def counted_fast(self: Any, row: Any) -> bool:
            done = fast_send(self, row)
            if done:
                tick(row.message_id)
            return done

        def counted(row: Any) -> None:
            send(row)
            tick(row.message_id)

        sender._TemplateSender.send = counted_fast  # type: ignore[method-assign]
        sender._send = counted  # type: ignore[assignment]
        relay.relay_outbox(batch_size=100)
        return
    if kind == "reliable":  # django-reliable-outbox, in its own venv (bench.outbox_reliable)
        from reliable_outbox.worker import Worker

        from bench.common import CRASH_LEASE_S
        from bench.outbox_reliable import CeleryTaskDestination

        current_app.conf.broker_url = url
        deliver = CeleryTaskDestination.deliver

        def counted_deliver(self: Any, envelope: Any) -> None:
            deliver(self, envelope)
            tick(str(envelope.message_id))

        CeleryTaskDestination.deliver = counted_deliver  # type: ignore[method-assign]
        Worker(batch_size=100, lease_seconds=CRASH_LEASE_S, notify=False).run(burst=True)
        return
    from django_celery_outbox.models import CeleryOutbox
    from django_celery_outbox.relay import Relay, RelayConfig
    from django_celery_outbox.relay._publisher import RelayPublisher

    from bench.outbox_peer import peer_app

    peer_app.conf.broker_url = url
    publish = RelayPublisher.publish

    def counted_publish(self: Any, msg: Any) -> None:
        publish(self, msg)
        tick(msg.task_id)

    RelayPublisher.publish = counted_publish  # type: ignore[method-assign]
    relay = Relay(peer_app, RelayConfig.init(batch_size=100, idle_time=0.0))
    while CeleryOutbox.objects.exists():
        relay._processing()


if __name__ == "__main__":
    main()
