"""PostgreSQL failover under a consuming stream: a primary of the test's own, replicating
synchronously to a streaming standby, is killed mid-stream; the standby is promoted; the
consumers reconnect through a connection string listing both servers and redeliver whatever
they had not acknowledged. Read from the promoted server: nothing lost, nothing applied
twice, nothing stuck (docs/operations.md, "PostgreSQL failover")."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, connections
from django.test import override_settings

from idempotent_orders.admin.dashboard import attention
from idempotent_orders.consuming.single import surface_overdue_parked
from idempotent_orders.models import Outcome, ParkedMessage
from tests.support.chaos import build_stream, check_invariants, make_orders, unaccounted
from tests.support.pgpair import postgres_pair
from tests.support.redelivery import LateAckQueue, consume_until_done, database

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.services,
    pytest.mark.backends("postgresql"),
]

ORDERS = 200
THREADS = 4
#: The standby stops receiving when this share of the deliveries was acknowledged...
HOLD_AFTER = 0.4
#: ... for this long (the consumers go on), then the primary is killed.
HELD_FOR = 0.5


@pytest.mark.parametrize("synchronous", [True, False], ids=["synchronous", "asynchronous"])
def test_a_killed_primary_loses_nothing_and_applies_nothing_twice(
    django_db_blocker: Any, synchronous: bool
) -> None:
    """Synchronous replication: nothing lost, nothing twice, nothing stuck. Asynchronous
    replication (the control): messages acknowledged while the standby lagged are gone
    from the promoted server, which the same checks see."""
    with (
        postgres_pair("io_failover", synchronous=synchronous) as pair,
        django_db_blocker.unblock(),
        database(pair.database_settings("io_failover")),
    ):
        call_command("migrate", verbosity=0)
        orders = make_orders(ORDERS, prefix="failover")
        stream = build_stream(orders, rng=random.Random(28), max_copies=4, seq_share=0.5)
        queue = LateAckQueue(stream.planned, stream.deliveries)
        started = time.monotonic()
        threads = consume_until_done(queue, threads=THREADS, deadline=started + 60)

        # Mid-stream: the standby stops receiving for a moment, then the primary dies
        # at once and the standby is promoted.
        cut = int(len(stream.deliveries) * HOLD_AFTER)
        while queue.acked() < cut and any(t.is_alive() for t in threads):
            time.sleep(0.005)
        pair.hold_replication()
        time.sleep(HELD_FOR)
        acked_before_kill = queue.acked()
        pair.kill_primary()
        killed_at = time.monotonic()  # the primary is gone (pg_ctl waited for it)
        pair.promote_replica()
        promoted_at = time.monotonic()

        for thread in threads:
            thread.join(max(1.0, started + 70 - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a consumer hung"
        finished = time.monotonic()

        # Read back from the server that now accepts writes: the promoted standby (this
        # thread's connection went down with the primary).
        connections[DEFAULT_DB_ALIAS].close()
        served_by = pair.sql(pair.replica.port, "SELECT pg_is_in_recovery()")
        report = check_invariants(stream.planned, dict(stream.final_status))
        lost = unaccounted(
            [stream.planned[a.index] for a in queue.acks if a.outcome is not Outcome.DUPLICATE]
        )
        if not synchronous:
            surfaced = surface_what_is_stuck()

    # Recovery: from the kill until a delivery begun after it was applied (on the new primary).
    applied_after = [
        a.at for a in queue.acks if a.began > killed_at and a.outcome is Outcome.APPLIED
    ]
    recovery = (min(applied_after) - killed_at) if applied_after else float("nan")
    reported = Counter(
        stream.planned[a.index].key for a in queue.acks if a.outcome is Outcome.APPLIED
    )
    acked = {stream.planned[a.index].key for a in queue.acks}
    retried = Counter(a.outcome.value for a in queue.acks if a.index in queue.put_back_indexes)
    twice = [key for key, n in reported.items() if n > 1]
    stuck = [v for v in report.violations if "parked" in v or "processing" in v]
    print(
        f"\nfailover ({'a' if not synchronous else ''}synchronous): {ORDERS} orders, "
        f"{len(stream.planned)} messages, {len(stream.deliveries)} deliveries by {THREADS} "
        f"consumers; standby held after {cut} acks, primary killed after "
        f"{acked_before_kill}; standby promoted {promoted_at - killed_at:.2f}s after the kill, "
        f"first delivery begun after the kill applied {recovery:.2f}s after it; put back: "
        f"{dict(queue.redelivered)}, answered on redelivery: {dict(retried)}; lost "
        f"(acknowledged, no inbox row): {len(lost)}, answered applied twice: {len(twice)}, "
        f"stuck: {len(stuck)}; outcomes {dict(report.outcomes)}; "
        f"{finished - started:.1f}s in all"
    )
    assert served_by == [(False,)]
    assert queue.errors == []
    assert not queue.pending
    assert queue.in_flight == 0
    # The fault happened mid-stream: deliveries before and after it.
    assert cut <= acked_before_kill < len(stream.deliveries)
    assert applied_after, "nothing was applied on the promoted standby"
    # Every delivery was acknowledged once, and no message was answered "applied" twice.
    assert len(queue.acks) == len(stream.deliveries)
    assert acked == {p.key for p in stream.planned}
    assert twice == []
    if not synchronous:
        # What PostgreSQL says asynchronous replication may do: acknowledged commits vanish.
        assert lost != []
        assert report.violations != []
        # The orders this leaves waiting show on the dashboard's "held" line and are marked
        # overdue by beat's pass (both after minutes by default; at once here).
        parked, held, marked, unmarked = surfaced
        print(
            f"surfaced: {parked} parked, {held} on the held line; the pass released "
            f"{parked - marked - unmarked} that could go ahead and marked {marked} overdue"
        )
        assert parked >= 1
        assert held == parked
        assert marked >= 1
        assert unmarked == 0
        return
    # Under synchronous replication the commits the standby had not confirmed were never
    # acknowledged: they were redelivered.
    assert sum(queue.redelivered.values()) >= 1
    # 0 lost, 0 applied twice, 0 stuck, read from the promoted database.
    assert lost == []
    assert report.violations == []
    assert report.outcomes == Counter({Outcome.APPLIED: len(stream.planned)})


def surface_what_is_stuck() -> tuple[int, int, int, int]:
    """Parked messages now; the dashboard's "held" count; the rows beat's pass marks overdue;
    the rows still parked and not marked after it (with PARKED_ATTENTION_AFTER and the
    timeout at 0: no waiting in a test)."""
    values = {**settings.IDEMPOTENT_ORDERS, "PARKED_ATTENTION_AFTER": 0}
    with override_settings(IDEMPOTENT_ORDERS=values):
        operator = get_user_model().objects.create_superuser("operator", "op@example.com", "pw")
        parked = ParkedMessage.objects.count()
        held = {line.key: line.count for line in attention(operator)}["held"]
        marked = surface_overdue_parked(timeout=0)
    unmarked = ParkedMessage.objects.filter(overdue_at__isnull=True).count()
    return parked, held, len(marked), unmarked
