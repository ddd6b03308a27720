"""Subprocess of the multiprocess-metrics test: count in this process, then exit.

``python -m tests.support.metrics_process N`` sends N ``message_consumed`` signals
(consumer "payments", outcome "applied") and counts N Redis layer hits, through the
app's own metrics (connected by ``AppConfig.ready``), with ``PROMETHEUS_MULTIPROC_DIR``
set by the test. It prints its pid.
"""

import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from idempotent_orders import signals  # noqa: E402
from idempotent_orders.observability import record_layer_hit  # noqa: E402


class Counting:
    """The signals' sender (they are cached per sender class)."""


def main() -> None:
    for _ in range(int(sys.argv[1])):
        signals.message_consumed.send(sender=Counting, consumer="payments", outcome="applied")
        record_layer_hit("redis")
    print(os.getpid())


if __name__ == "__main__":
    main()
