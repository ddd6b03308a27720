"""Deprecated name of ``manage.py idempotent_orders_stats`` (removed in 0.3)."""

from __future__ import annotations

import warnings
from typing import Any

from idempotent_orders.management.commands import idempotent_orders_stats

MESSAGE = "`manage.py stats` is deprecated; use `manage.py idempotent_orders_stats` (same options)."


class Command(idempotent_orders_stats.Command):
    help = "Deprecated: use idempotent_orders_stats. " + idempotent_orders_stats.Command.help

    def handle(self, *args: Any, **options: Any) -> None:
        # The warning is for callers of call_command(); the line on stderr for people.
        warnings.warn(MESSAGE, DeprecationWarning, stacklevel=2)
        self.stderr.write(MESSAGE)
        super().handle(*args, **options)
