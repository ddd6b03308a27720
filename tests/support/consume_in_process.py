"""Subprocess used by the concurrency tests: consume deliveries from a JSON file, print outcomes."""

import json
import os
import sys
from collections import Counter

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from idempotent_orders.consuming.single import consume_message  # noqa: E402


def main() -> None:
    with open(sys.argv[1]) as fh:
        deliveries = json.load(fh)
    outcomes: Counter[str] = Counter()
    for consumer, message in deliveries:
        outcomes[consume_message(message, consumer=consumer).value] += 1
    json.dump(outcomes, sys.stdout)


if __name__ == "__main__":
    main()
