"""Section 7: the transactional outbox — what the producer pays, and the relay's msg/s.

Producer: one transaction that creates an order (the business write), alone
(the baseline), then with ``publish_on_commit`` in its three modes: relay only
(``OUTBOX_PUBLISH_ON_COMMIT=False``: the row insert), publish after commit in
the caller's thread (``OUTBOX_PUBLISHER_THREAD=False``) and publish after
commit handed to the background publisher thread (the default). The time is
the caller's: from ``atomic()`` entered to the return after commit.

Relay: ``relay_outbox()`` over a backlog of rows, beside publishing the same
messages straight with ``apply_async`` (no outbox), on the same broker queue.
Nothing consumes the queue; it is deleted afterwards.

Peers, when the ``bench`` extra installed it: django-celery-outbox (its
``OutboxCelery.send_task`` writes the row in the caller's transaction, its
``Relay`` publishes; batch 100 as ours, idle time 0, StatsD metrics off). And
when ``make bench`` built its venv (Python >= 3.12): django-reliable-outbox,
in its own process (``bench.outbox_reliable``): its ``publish()`` in the same
order transaction beside that process's own baseline (and our default there
too), its ``Worker`` publishing each event as the Celery task to the same queue
(``RELIABLE_ROWS``: it commits once per message), and its worker SIGKILLed.

Crash: a relay process (``bench.outbox_crash_relay``), ours and the peers',
SIGKILLed after ``CRASH_AFTER`` real publishes of ``CRASH_ROWS`` rows, then a new
relay: ids lost, messages re-sent, effects applied twice by the consumers (ours
through the inbox, the peer's without dedup) and how long the rows the dead
relay held stayed held.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from decimal import Decimal
from typing import Any

from bench.common import CRASH_LEASE_S, RUNS, Row, fmt, kill_at_marker, median, na, setup

PRODUCER_TXNS = int(os.environ.get("BENCH_OUTBOX_TXNS", "300"))
RELAY_ROWS = int(os.environ.get("BENCH_OUTBOX_ROWS", "3000"))
#: django-reliable-outbox commits once per message (a few hundred a second): fewer rows.
RELIABLE_ROWS = int(os.environ.get("BENCH_OUTBOX_RELIABLE_ROWS", "1000"))
SECTION = "7 outbox"


def _broker() -> tuple[str, str] | None:
    from tests.support.services import BROKERS, service_reachable

    for name in ("rabbitmq", "redis"):
        url = BROKERS[name]()
        if service_reachable(url):
            return name, url
    return None


def _peer() -> Any:
    try:
        from bench.outbox_peer import peer_app
    except ImportError:
        return None
    return peer_app


class _Reliable:
    """django-reliable-outbox, driven in its own venv (Python >= 3.12) through
    ``bench.outbox_reliable``: one JSON command a line, one JSON answer a line.
    """

    def __init__(self, python: str, url: str, queue: str) -> None:
        import subprocess

        from bench.common import ROOT

        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench.outbox_reliable_settings",
            "BENCH_PEER_BROKER_URL": url,
            "BENCH_PEER_QUEUE": queue,
        }
        self.process = subprocess.Popen(
            [python, "-m", "bench.outbox_reliable"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = self._answer()

    def ask(self, **command: Any) -> dict[str, Any]:
        import json

        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        import json

        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"django-reliable-outbox's process ended ({self.process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"django-reliable-outbox: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except Exception:
            self.process.kill()


def _reliable(url: str, queue: str) -> _Reliable | None:
    """django-reliable-outbox's process, when its venv is there (``make bench`` builds it)."""
    from bench.common import ROOT

    python = os.environ.get("BENCH_PEER_PYTHON") or str(ROOT / ".venv-bench-peer/bin/python")
    python = os.path.abspath(python)
    if not os.path.exists(python):
        return None
    return _Reliable(python, url, queue)


def _producer_ms(mode: str, queue: str) -> float:
    """Median milliseconds the caller spends in one order-creating transaction."""
    from django.db import transaction
    from django.test import override_settings

    from demo_project.tasks import award_points
    from idempotent_orders.models import Order
    from idempotent_orders.outbox import flush_publisher, publish_on_commit

    base = {
        "outbox": {},
        "relay only": {"OUTBOX_PUBLISH_ON_COMMIT": False},
        "inline": {"OUTBOX_PUBLISHER_THREAD": False},
    }.get(mode, {})
    tag = uuid.uuid4().hex[:8]
    times = []
    with override_settings(IDEMPOTENT_ORDERS=base):
        for i in range(PRODUCER_TXNS):
            start = time.perf_counter()
            with transaction.atomic():
                order = Order.objects.create(
                    business_key=f"bench-out-{tag}-{i}", amount=Decimal("12.50"), currency="CNY"
                )
                if mode == "reliable":  # bench.outbox_reliable, in its own venv
                    from reliable_outbox import publish

                    publish(
                        award_points.name,
                        {"message_id": f"pts-{tag}-{i}", "customer": "b", "points": order.pk},
                    )
                elif mode == "peer":
                    _peer().send_task(
                        award_points.name,
                        args=({"message_id": f"pts-{tag}-{i}", "customer": "b", "points": 1},),
                        queue=queue,
                    )
                elif mode != "baseline":
                    publish_on_commit(
                        award_points,
                        {"message_id": f"pts-{tag}-{i}", "customer": "b", "points": order.pk},
                        queue=queue,
                    )
            times.append(time.perf_counter() - start)
        flush_publisher(60)  # the thread's work is not the caller's, but do not overlap runs
    return statistics.median(times) * 1000


def _depth(queue: str) -> int:
    """Messages waiting in ``queue`` on the broker (it proves where the publishes went)."""
    from celery import current_app

    with current_app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def _depth_reaches(queue: str, expected: int, timeout: float = 15.0) -> int:
    """The queue's depth once it reaches ``expected`` (or after ``timeout``).

    The broker counts a publish once it has routed it, which can trail the
    publisher's return by a moment; the rate is timed on the relay alone.
    """
    deadline = time.monotonic() + timeout
    while (depth := _depth(queue)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return depth


def _peer_relay_rate(queue: str) -> float:
    from django.db import transaction
    from django_celery_outbox.models import CeleryOutbox
    from django_celery_outbox.relay import Relay, RelayConfig

    from demo_project.tasks import award_points

    peer = _peer()
    CeleryOutbox.objects.all().delete()
    tag = uuid.uuid4().hex[:8]
    with transaction.atomic():
        for i in range(RELAY_ROWS):
            peer.send_task(
                award_points.name,
                args=({"message_id": f"peer-{tag}-{i}", "customer": "b", "points": 1},),
                queue=queue,
            )
    relay = Relay(peer, RelayConfig.init(batch_size=100, idle_time=0.0))
    before = _depth(queue)
    start = time.perf_counter()
    while CeleryOutbox.objects.exists():
        relay._processing()
    elapsed = time.perf_counter() - start
    published = _depth_reaches(queue, before + RELAY_ROWS) - before
    assert published == RELAY_ROWS, f"the peer's relay put {published} messages on the queue"
    return RELAY_ROWS / elapsed


def _fill_outbox(messages: list[dict[str, Any]], queue: str) -> None:
    """The outbox holds exactly one pending ``award_points`` row per message, for ``queue``."""
    from demo_project.tasks import award_points
    from idempotent_orders.models import OutboxMessage

    OutboxMessage.objects.all().delete()
    OutboxMessage.objects.bulk_create(
        OutboxMessage(
            message_id=m["message_id"],
            task_name=award_points.name,
            payload=m,
            options={"queue": queue},
        )
        for m in messages
    )


def _relay_rate(queue: str, direct: bool) -> float:
    from django.test import override_settings

    from demo_project.tasks import award_points
    from idempotent_orders.outbox import relay_outbox

    tag = uuid.uuid4().hex[:8]
    messages = [
        {"message_id": f"relay-{tag}-{i}", "customer": "b", "points": 1} for i in range(RELAY_ROWS)
    ]
    if direct:
        start = time.perf_counter()
        for m in messages:
            award_points.apply_async(args=(m,), task_id=m["message_id"], queue=queue)
        return RELAY_ROWS / (time.perf_counter() - start)
    _fill_outbox(messages, queue)  # the producer runs' relay-only rows go first
    before = _depth(queue)
    with override_settings(IDEMPOTENT_ORDERS={}):
        start = time.perf_counter()
        result = relay_outbox()
        elapsed = time.perf_counter() - start
    assert result.published == RELAY_ROWS == _depth_reaches(queue, before + RELAY_ROWS) - before, (
        result
    )
    return RELAY_ROWS / elapsed


CRASH_ROWS = int(os.environ.get("BENCH_OUTBOX_CRASH_ROWS", "1000"))
CRASH_AFTER = int(os.environ.get("BENCH_OUTBOX_CRASH_AFTER", "255"))
#: django-celery-outbox's stale timeout for the crash run (its default, 300 s, is noted).
PEER_STALE_S = 5


def _drain(queue: str) -> list[tuple[str, Any]]:
    """(task id, first argument) of every message in ``queue``, removing them."""
    from celery import current_app

    got = []
    with current_app.connection_for_write() as conn:
        channel = conn.default_channel
        while (raw := channel.basic_get(queue, no_ack=True)) is not None:
            message = channel.message_to_python(raw)
            body = message.decode()
            got.append((message.headers["id"], body[0][0]))
    return got


def _crash(kind: str, url: str, queue: str) -> dict[str, float]:
    """A relay SIGKILLed mid-batch after ``CRASH_AFTER`` publishes of ``CRASH_ROWS`` rows,
    then a new relay: messages lost, sent twice, effects applied twice, seconds the rows
    the dead relay had published (not marked) stayed held.

    Effects: ours through the inbox (``award_points``, ``@idempotent``: each delivery
    runs as a worker runs it); the peer's consumers have no dedup, so each delivery
    adds its points (the same UPDATE, no inbox).
    """
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from django.db.models import F
    from django.test import override_settings

    from bench.common import ROOT
    from demo_project.models import LoyaltyAccount
    from demo_project.tasks import award_points
    from idempotent_orders.models import OutboxMessage, OutboxStatus
    from idempotent_orders.outbox import relay_outbox

    tag = uuid.uuid4().hex[:8]
    customer = f"crash-{kind}-{tag}"
    messages = [
        {"message_id": f"crash-{tag}-{i}", "customer": customer, "points": 1}
        for i in range(CRASH_ROWS)
    ]
    if kind == "ours":
        _fill_outbox(messages, queue)
    else:
        from django.db import transaction
        from django_celery_outbox.models import CeleryOutbox

        CeleryOutbox.objects.all().delete()
        with transaction.atomic():
            for m in messages:
                _peer().send_task(
                    award_points.name, args=(m,), task_id=m["message_id"], queue=queue
                )
    with tempfile.TemporaryDirectory() as tmp:
        log, marker = Path(tmp) / "published", Path(tmp) / "stalled"
        relay = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.outbox_crash_relay",
                kind,
                url,
                str(CRASH_AFTER),
                str(log),
                str(marker),
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        killed = kill_at_marker(relay, marker, f"the {kind} relay")
        published = set(log.read_text().split())
    # The rows the dead relay published but had not marked: held until a new relay may take them.
    if kind == "ours":
        with override_settings(IDEMPOTENT_ORDERS={}):
            held_ids = list(
                OutboxMessage.objects.filter(
                    status=OutboxStatus.PENDING, message_id__in=published
                ).values_list("pk", flat=True)
            )
            while relay_outbox(ids=held_ids).published < len(held_ids):
                time.sleep(0.01)
            held = time.monotonic() - killed
            relay_outbox()
    else:
        from django_celery_outbox.models import CeleryOutbox
        from django_celery_outbox.relay import Relay, RelayConfig

        config = RelayConfig.init(batch_size=100, idle_time=0.0, stale_timeout_seconds=PEER_STALE_S)
        relay_again = Relay(_peer(), config)
        waiting = CeleryOutbox.objects.filter(task_id__in=published)
        held = 0.0
        while CeleryOutbox.objects.exists():
            relay_again._processing()
            if not held and not waiting.exists():
                held = time.monotonic() - killed
            time.sleep(0.01)
    delivered = _drain_all(queue, CRASH_ROWS)
    ids = [mid for mid, _ in delivered]
    distinct = set(ids)
    if kind == "ours":
        for mid, payload in delivered:
            award_points.apply(args=(payload,), task_id=mid)
    else:
        account, _ = LoyaltyAccount.objects.get_or_create(customer=customer)
        for _mid, payload in delivered:
            LoyaltyAccount.objects.filter(pk=account.pk).update(
                points=F("points") + payload["points"]
            )
    applied = LoyaltyAccount.objects.get(customer=customer).points
    return {
        "lost": CRASH_ROWS - len(distinct & {m["message_id"] for m in messages}),
        "resent": len(ids) - len(distinct),
        "twice": applied - len(distinct),
        "held": held,
        "dead_published": len(published),
    }


def _drain_all(queue: str, expected: int, timeout: float = 30.0) -> list[tuple[str, Any]]:
    """Drain ``queue`` until at least ``expected`` messages came and it stays empty a moment."""
    got: list[tuple[str, Any]] = []
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline and (len(got) < expected or quiet < 3):
        more = _drain(queue)
        got += more
        quiet = 0 if more else quiet + 1
        time.sleep(0.2)
    return got


def _crash_rows(url: str, queue: str, peer: bool, reliable: _Reliable | None) -> list[Row]:
    rows = []
    kinds = ["ours", *(["peer"] if peer else []), *(["reliable"] if reliable else [])]
    labels = {
        "ours": "relay_outbox + @idempotent consumer",
        "peer": "django-celery-outbox",
        "reliable": "django-reliable-outbox + its inbox",
    }
    for kind in kinds:
        if kind == "reliable":
            assert reliable is not None
            try:
                r = reliable.ask(
                    cmd="crash", rows=CRASH_ROWS, after=CRASH_AFTER, queue=f"{queue}-crash-{kind}"
                )
            except Exception as exc:
                rows.append(na(SECTION, "django-reliable-outbox crash", repr(exc)[:100]))
                continue
        else:
            r = _crash(kind, url, f"{queue}-crash-{kind}")
        held = f"{r['held']:.2f} s held"
        if kind == "peer":
            held += f" (stale timeout set to {PEER_STALE_S} s; its default is 300 s)"
        if kind == "reliable":
            held += f" (lease set to {CRASH_LEASE_S:g} s; its default is 60 s)"
        rows.append(
            Row(
                SECTION,
                f"relay SIGKILLed after {CRASH_AFTER} of {CRASH_ROWS:,} publishes: {labels[kind]}",
                f"{r['lost']} lost",
                f"{r['resent']} re-sent, {r['twice']} effects applied twice; {held}",
            )
        )
    return rows


#: The other outbox libraries, by the name of their producer mode.
PEERS = {"peer": "django-celery-outbox", "reliable": "django-reliable-outbox"}


def run() -> list[Row]:
    setup()
    from celery import current_app

    found = _broker()
    if found is None:
        return [na(SECTION, "outbox", "no RabbitMQ or Redis reachable")]
    broker, url = found
    queue = f"bench-outbox-{uuid.uuid4().hex[:8]}"
    from tests.support.services import reset_broker_pools

    for app in (current_app, _peer()):
        if app is not None:  # the peer's app too: it read the settings' in-memory broker
            app.conf.broker_url = url
            reset_broker_pools(app)
    rows: list[Row] = []
    reliable: _Reliable | None = None
    try:
        try:
            reliable = _reliable(url, queue)
        except Exception as exc:  # its process did not start: say why, measure the rest
            rows.append(na(SECTION, "django-reliable-outbox", repr(exc)[:100]))
        else:
            if reliable is None:
                why = "needs Python >= 3.12: no .venv-bench-peer (make bench builds it)"
                rows.append(na(SECTION, "django-reliable-outbox", why))
        peer = _peer() is not None
        modes = ["baseline", "relay only", "inline", "outbox", *(["peer"] if peer else [])]
        _producer_ms("outbox", queue)  # warm-up: connections, the publisher thread
        there = ["baseline", "reliable", "outbox"]  # in django-reliable-outbox's process
        ms: dict[str, list[float]] = {m: [] for m in modes}
        ms_there: dict[str, list[float]] = {m: [] for m in there}
        for run in range(-1, RUNS):  # -1: django-reliable-outbox's process warms up
            for mode in modes if run >= 0 else ():  # interleaved: drift hits every mode alike
                ms[mode].append(_producer_ms(mode, queue))
            if reliable is not None:
                try:
                    answer = reliable.ask(cmd="producer", modes=there, queue=queue)["ms"]
                except Exception as exc:  # say why; the other figures go on
                    rows.append(na(SECTION, "django-reliable-outbox producer", repr(exc)[:100]))
                    reliable.close()
                    reliable = None
                    continue
                for mode in there if run >= 0 else ():
                    ms_there[mode].append(answer[mode])
        base = median(ms["baseline"])
        rows.append(
            Row(
                SECTION,
                f"producer: order txn, no outbox ({broker})",
                f"{base:.2f} ms",
                "baseline: the business write alone",
            )
        )
        labels = {
            "relay only": "+ publish_on_commit, relay only (row insert)",
            "inline": "+ publish_on_commit, publish in caller's thread",
            "outbox": "+ publish_on_commit, default (publisher thread)",
            "peer": "+ django-celery-outbox send_task (row insert)",
        }
        added = {mode: median(ms[mode]) - base for mode in modes}
        if reliable is not None:
            # Its added cost over the same baseline measured in its own process (Python 3.12).
            added["reliable"] = median(ms_there["reliable"]) - median(ms_there["baseline"])
        for mode in modes[1:]:
            note = f"+{added[mode]:.2f} ms over the baseline"
            if mode in ("relay only", "outbox"):
                ratios = [
                    f"{added[mode] / added[p]:.2f}x {PEERS[p]}'s"
                    for p in PEERS
                    if added.get(p, 0) > 0
                ]
                if ratios:
                    note += "; " + ", ".join(ratios) + " added cost"
            rows.append(
                Row(SECTION, f"producer: {labels[mode]}", f"{median(ms[mode]):.2f} ms", note)
            )
        if reliable is not None:
            base_there = median(ms_there["baseline"])
            ours_there = median(ms_there["outbox"]) - base_there
            note = (
                f"+{added['reliable']:.2f} ms over its baseline ({base_there:.2f} ms, the same "
                f"order txn in its process, Python {reliable.hello['python']})"
            )
            if added["reliable"] > 0:
                note += (
                    f"; there ours (default) adds +{ours_there:.2f} ms, "
                    f"{ours_there / added['reliable']:.2f}x"
                )
            rows.append(
                Row(
                    SECTION,
                    "producer: + django-reliable-outbox publish (row insert)",
                    f"{median(ms_there['reliable']):.2f} ms",
                    note,
                )
            )
        _relay_rate(queue, direct=True)  # warm-up
        direct = median([_relay_rate(queue, direct=True) for _ in range(RUNS)])
        relay = median([_relay_rate(queue, direct=False) for _ in range(RUNS)])
        rows.append(
            Row(
                SECTION,
                f"no outbox: apply_async in a loop, {RELAY_ROWS:,} msgs",
                fmt(direct),
                f"the broker's own rate ({broker}, no confirms)",
            )
        )
        note = f"{relay / direct:.0%} of apply_async alone"
        if peer:
            peer_rate = median([_peer_relay_rate(queue) for _ in range(RUNS)])
            note += f"; {relay / peer_rate:.2f}x django-celery-outbox"
        reliable_rate = 0.0
        if reliable is not None:
            try:
                reliable_rate = median([_reliable_relay_rate(reliable, queue) for _ in range(RUNS)])
            except Exception as exc:
                rows.append(na(SECTION, "django-reliable-outbox relay", repr(exc)[:100]))
            else:
                note += f"; {relay / reliable_rate:.2f}x django-reliable-outbox"
        rows.append(Row(SECTION, f"relay_outbox, {RELAY_ROWS:,} rows, 1 process", fmt(relay), note))
        if peer:
            rows.append(
                Row(
                    SECTION,
                    f"django-celery-outbox Relay, {RELAY_ROWS:,} rows, 1 process",
                    fmt(peer_rate),
                    f"{peer_rate / direct:.0%} of apply_async alone; batch 100",
                )
            )
        if reliable_rate:
            rows.append(
                Row(
                    SECTION,
                    f"django-reliable-outbox Worker, {RELIABLE_ROWS:,} rows, 1 process",
                    fmt(reliable_rate),
                    f"{reliable_rate / direct:.0%} of apply_async alone; batch 100, one commit "
                    "per message; each event published as the Celery task, same queue",
                )
            )
        rows += _crash_rows(url, queue, peer, reliable)
    finally:
        if reliable is not None:
            reliable.close()
        try:
            with current_app.connection_for_write() as conn:
                for name in (queue, *(f"{queue}-crash-{kind}" for kind in ("ours", *PEERS))):
                    conn.default_channel.queue_delete(name)
        except Exception:
            pass
    return rows


def _reliable_relay_rate(reliable: _Reliable, queue: str) -> float:
    """django-reliable-outbox's worker over ``RELIABLE_ROWS`` events (in its process); the
    queue's depth proves the publishes.
    """
    before = _depth(queue)
    answer = reliable.ask(cmd="relay", rows=RELIABLE_ROWS, queue=queue)
    published = _depth_reaches(queue, before + RELIABLE_ROWS) - before
    assert published == answer["delivered"] == RELIABLE_ROWS, (published, answer)
    return float(answer["rate"])


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
