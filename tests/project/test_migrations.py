"""Models and migrations agree, and migrations do not depend on settings."""

from io import StringIO

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    out = StringIO()
    try:
        call_command("makemigrations", "idempotent_orders", "--check", "--dry-run", stdout=out)
    except SystemExit as exc:  # --check exits non-zero when a migration is missing
        pytest.fail(f"missing migration:\n{out.getvalue()} ({exc})")


# -- the indexes for the admin and the reconciler at size --------------------------------

PARTIAL = {
    "idempotent_orders_processedmessage": {"io_inbox_stuck", "io_inbox_attention"},
    "idempotent_orders_outboxmessage": {"io_outbox_open", "io_outbox_retried"},
}


def _index_names(table: str) -> set[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, table))


@pytest.mark.django_db
def test_message_id_indexes_exist_everywhere_and_partial_ones_where_supported() -> None:
    from django.db import connection

    inbox = _index_names("idempotent_orders_processedmessage")
    assert "io_inbox_message_consumer" in inbox  # message id first: serves a search by it
    assert "io_parked_message_id" in _index_names("idempotent_orders_parkedmessage")
    for table, names in PARTIAL.items():
        found = _index_names(table) & names
        if connection.features.supports_partial_indexes:
            assert found == names
        else:  # MariaDB: no full-table copy of an index meant for a few rows
            assert found == set()


@pytest.mark.django_db
def test_no_index_warning_on_this_database() -> None:
    from django.core import checks

    found = checks.run_checks(databases=["default"], include_deployment_checks=False)
    ours = [m for m in found if getattr(m.obj, "__module__", "").startswith("idempotent_orders")]
    assert [m.id for m in ours if m.id in {"models.W037", "models.W036", "models.W043"}] == []


@pytest.mark.django_db
def test_the_admin_queries_use_the_partial_and_message_id_indexes() -> None:
    from django.db import connection
    from django.utils import timezone

    from idempotent_orders.models import InboxStatus, OutboxMessage, OutboxStatus, ProcessedMessage

    inbox = ProcessedMessage.objects
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # a few test rows: no table scan, please
            cursor.execute("SET LOCAL enable_seqscan = off")
        plans = {
            "io_inbox_stuck": inbox.filter(
                status=InboxStatus.PROCESSING, lease_expires_at__lt=timezone.now()
            ).explain(),
            "io_inbox_attention": inbox.filter(status=InboxStatus.FAILED)
            .order_by("-id")[:100]
            .explain(),
            "io_inbox_message_consumer": inbox.filter(message_id="m-1").explain(),
            "io_outbox_open": OutboxMessage.objects.filter(status=OutboxStatus.PENDING)
            .order_by("id")[:100]
            .explain(),
            "io_outbox_retried": OutboxMessage.objects.filter(attempts__gt=0).explain(),
        }
    if connection.vendor != "postgresql":  # SQLite's planner may take the full status index
        plans = {"io_inbox_message_consumer": plans["io_inbox_message_consumer"]}
    if connection.vendor == "sqlite":  # the unique constraint's index has SQLite's own name
        plan = plans.pop("io_inbox_message_consumer")
        assert "SEARCH" in plan, plan
        assert "USING INDEX" in plan, plan
        assert "(message_id=?)" in plan, plan
    for name, plan in plans.items():
        assert name in plan, plan


# -- the leaner inbox ---------------------------------------------------------------------

#: The full indexes MariaDB gets instead of the partial ones, the partial one on the
#: rare outcomes, and created_at's (everywhere).
FULL_STATUS, FULL_OUTCOME = "io_inbox_status_lease", "io_inbox_outcome"
RARE_OUTCOME, CREATED = "io_inbox_outcome_rare", "idempotent__created_aece4c_idx"


def _expected_inbox_indexes(partial: bool) -> tuple[set[str], set[str]]:
    """(present, absent) among the status and outcome indexes (and created_at's)."""
    if partial:
        return {RARE_OUTCOME, CREATED}, {FULL_STATUS, FULL_OUTCOME}
    return {FULL_STATUS, FULL_OUTCOME, CREATED}, {RARE_OUTCOME}


@pytest.mark.django_db
def test_the_inbox_keeps_only_the_indexes_its_queries_need() -> None:
    from django.db import connection

    inbox = _index_names("idempotent_orders_processedmessage")
    present, absent = _expected_inbox_indexes(connection.features.supports_partial_indexes)
    assert present <= inbox, present - inbox
    assert not absent & inbox, absent & inbox


@pytest.mark.backends("postgresql")  # the planner the figures in docs/operations.md are from
@pytest.mark.django_db
def test_the_queries_the_dropped_indexes_served_use_the_leaner_ones() -> None:
    from django.db import connection
    from django.utils import timezone

    from idempotent_orders import leases
    from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage

    inbox = ProcessedMessage.objects
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a few test rows
        plans = [
            # The admin's outcome filter on a rare outcome: its page, newest first,
            # and the paginator's capped count.
            (RARE_OUTCOME, inbox.filter(outcome=Outcome.PARKED).order_by("-id")[:100].explain()),
            (RARE_OUTCOME, inbox.filter(outcome=Outcome.STALE).values("id")[:10001].explain()),
            # The reconciler: expired leases, oldest first (a partial index).
            ("io_inbox_stuck", leases.expired()[:100].explain()),
            # The metrics' and the dashboard's counts by status.
            (
                "io_inbox_stuck",
                inbox.filter(status=InboxStatus.PROCESSING, lease_expires_at__lt=timezone.now())
                .values("id")
                .explain(),
            ),
            ("io_inbox_attention", inbox.filter(status=InboxStatus.DEAD).values("id").explain()),
        ]
    for name, plan in plans:
        assert name in plan, plan
