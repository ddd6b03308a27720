"""Checks of the inbox partitioned by time: PostgreSQL only (E060), the table in the shape
the settings ask (W061, W062), a partition ready for the next period (W063)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from idempotent_orders.checks.configuration import well_typed

__all__ = ["check_partitioned_inbox", "check_partitions"]


@register(Tags.compatibility)
def check_partitioned_inbox(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``INBOX_PARTITION_DAYS`` is 0, or a positive number with the inbox on a database
    that partitions (PostgreSQL)."""
    from idempotent_orders.conf import conf

    if not well_typed("INBOX_PARTITION_DAYS") or conf.INBOX_PARTITION_DAYS == 0:
        return []
    from idempotent_orders.models import ProcessedMessage
    from idempotent_orders.vendors import vendor

    inbox = vendor(connections[router.db_for_write(ProcessedMessage)])
    if conf.INBOX_PARTITION_DAYS < 0 or not inbox.partitions:
        return [
            Error(
                f"INBOX_PARTITION_DAYS is {conf.INBOX_PARTITION_DAYS}: a partitioned inbox "
                "needs a positive number of days and PostgreSQL's declarative partitioning.",
                hint="Set IDEMPOTENT_ORDERS['INBOX_PARTITION_DAYS'] to 0 (one plain inbox "
                "table, retention by DELETE) on other databases.",
                id="idempotent_orders.E060",
            )
        ]
    return []


@register(Tags.database)
def check_partitions(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """With ``--database`` (and in ``migrate``): the inbox's shape and its next partition."""
    from idempotent_orders.conf import conf
    from idempotent_orders.partitioning import is_partitioned, partitioned_inbox, partitions

    if not databases or "default" not in databases or not well_typed("INBOX_PARTITION_DAYS"):
        return []
    wanted, actual = partitioned_inbox(), is_partitioned()
    if wanted and not actual:
        return [
            Warning(
                "INBOX_PARTITION_DAYS is set but the inbox is one plain table: retention "
                "deletes rows one batch at a time.",
                hint="Run manage.py idempotent_orders_partitions convert (it locks the inbox "
                "while it copies).",
                id="idempotent_orders.W061",
            )
        ]
    if actual and not wanted:
        return [
            Warning(
                "The inbox is partitioned but INBOX_PARTITION_DAYS is 0: no partition is "
                "created ahead nor dropped; new rows go to the default partition.",
                hint="Set INBOX_PARTITION_DAYS back, or run manage.py "
                "idempotent_orders_partitions revert.",
                id="idempotent_orders.W062",
            )
        ]
    if not actual:
        return []
    now = datetime.now(UTC)
    after = now + timedelta(days=conf.INBOX_PARTITION_DAYS)
    if not any(p.start is not None and p.end is not None and p.end > after for p in partitions()):
        return [
            Warning(
                "No inbox partition covers the next period: its rows will go to the "
                "default partition, which grows and slows the claims.",
                hint="Run manage.py idempotent_orders_partitions maintain (the purge task runs it) "
                "at least once a period.",
                id="idempotent_orders.W063",
            )
        ]
    return []
