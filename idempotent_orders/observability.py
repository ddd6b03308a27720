"""Structured logs and optional Prometheus metrics (install the ``prometheus`` extra).

Every log record of the app passes ``message_id`` and ``order_id`` in
``extra``; :class:`JsonFormatter` writes them as one JSON object a line.

Metrics, when ``prometheus-client`` is installed (connected in ``AppConfig.ready``):

- ``idempotent_orders_messages_total{consumer,outcome}``: decided messages;
- ``idempotent_orders_dedup_layer_hits_total{layer}``: duplicates answered by a
  fast layer (:func:`record_layer_hit`);
- ``idempotent_orders_leases_total{consumer,result}`` and
  ``idempotent_orders_reconciled_total{consumer,action}``: leased work;
- read from the database at scrape time, so every process reports the same:
  ``idempotent_orders_stuck_processing`` (expired leases),
  ``idempotent_orders_failed_messages``, ``idempotent_orders_parked_messages``
  and ``idempotent_orders_consumer_lag_seconds{consumer}`` (age of the oldest
  message a consumer has not finished: parked or processing);
  ``idempotent_orders_outbox_pending``, ``idempotent_orders_outbox_dead`` and
  ``idempotent_orders_outbox_oldest_pending_seconds`` (the outbox's backlog);
  ``idempotent_orders_inbox_dead`` (dead ``@idempotent`` rows);
- ``idempotent_orders_outbox_published_total`` and
  ``idempotent_orders_outbox_dead_lettered_total``: counted by the relays;
- ``idempotent_orders_inbox_dead_lettered_total{consumer}``: ``@idempotent``
  rows that went dead.

Counters live in the process that counts them. Under gunicorn or Celery's
prefork pool, set ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory, emptied at
each start) in every process's environment before it starts: each process then
writes its counters to its own file there, and :func:`metrics_view` adds up the
files of all of them (a ``MultiProcessCollector``), the dead ones included, as
counters must be. The database gauges are read once per scrape by the process
that serves it, so they are never added up. Call :func:`mark_process_dead` from
gunicorn's ``child_exit`` hook (:func:`gunicorn_child_exit` is one); the Celery
hook is connected here (``worker_process_shutdown``).

``/metrics`` is refused unless ``METRICS_TOKEN``, ``METRICS_ALLOW_IPS`` or
``METRICS_PUBLIC`` say who may read it; with none of them it is open only under
``DEBUG``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db.models import Min
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from idempotent_orders.conf import conf

__all__ = [
    "JsonFormatter",
    "connect",
    "gunicorn_child_exit",
    "mark_process_dead",
    "metrics_view",
    "multiprocess_dir",
    "record_layer_hit",
]

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # pragma: no cover - the extra is optional
    prometheus_client = None  # type: ignore[assignment]

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str, ensure_ascii=False)


_metrics: dict[str, Any] = {}


def _counter(name: str, doc: str, labels: list[str]) -> Any:
    if name not in _metrics:
        _metrics[name] = prometheus_client.Counter(name, doc, labels)
    return _metrics[name]


def record_layer_hit(layer: str) -> None:
    """Count a duplicate answered by a fast dedup layer (``bloom``, ``redis``)."""
    if prometheus_client is not None and _metrics:
        _metrics["idempotent_orders_dedup_layer_hits"].labels(layer=layer).inc()


class DatabaseCollector:
    """Gauges read from the inbox when Prometheus scrapes."""

    def describe(self) -> Iterator[Any]:
        # Registration asks for the names; answering here keeps it from querying the database.
        for name in (
            "idempotent_orders_stuck_processing",
            "idempotent_orders_failed_messages",
            "idempotent_orders_parked_messages",
            "idempotent_orders_inbox_dead",
            "idempotent_orders_outbox_pending",
            "idempotent_orders_outbox_dead",
            "idempotent_orders_outbox_oldest_pending_seconds",
        ):
            yield GaugeMetricFamily(name, "")
        yield GaugeMetricFamily("idempotent_orders_consumer_lag_seconds", "", labels=["consumer"])

    def collect(self) -> Iterator[Any]:
        from idempotent_orders.models import InboxStatus, ParkedMessage, ProcessedMessage

        now = timezone.now()
        stuck = ProcessedMessage.objects.filter(
            status=InboxStatus.PROCESSING, lease_expires_at__lt=now
        ).count()
        yield GaugeMetricFamily(
            "idempotent_orders_stuck_processing",
            "Leased work whose lease expired, waiting for the reconciler.",
            value=stuck,
        )
        yield GaugeMetricFamily(
            "idempotent_orders_failed_messages",
            "Inbox rows marked failed, waiting for an operator.",
            value=ProcessedMessage.objects.filter(status=InboxStatus.FAILED).count(),
        )
        yield GaugeMetricFamily(
            "idempotent_orders_inbox_dead",
            "@idempotent inbox rows dead-lettered, waiting for an operator to requeue them.",
            value=ProcessedMessage.objects.filter(status=InboxStatus.DEAD).count(),
        )
        yield GaugeMetricFamily(
            "idempotent_orders_parked_messages",
            "Messages parked until their predecessor arrives.",
            value=ParkedMessage.objects.count(),
        )
        lag = GaugeMetricFamily(
            "idempotent_orders_consumer_lag_seconds",
            "Age of the oldest message a consumer has not finished (parked or processing).",
            labels=["consumer"],
        )
        oldest: dict[str, Any] = {}
        for row in (
            ProcessedMessage.objects.filter(status=InboxStatus.PROCESSING)
            .values("consumer")
            .annotate(oldest=Min("created_at"))
        ):
            oldest[row["consumer"]] = row["oldest"]
        for row in ParkedMessage.objects.values("consumer").annotate(oldest=Min("parked_at")):
            seen = oldest.get(row["consumer"])
            oldest[row["consumer"]] = min(seen, row["oldest"]) if seen else row["oldest"]
        for consumer, since in sorted(oldest.items()):
            lag.add_metric([consumer], max(0.0, (now - since).total_seconds()))
        yield lag
        yield from self.collect_outbox()

    def collect_outbox(self) -> Iterator[Any]:
        from idempotent_orders.outbox import outbox_stats

        outbox = outbox_stats()
        yield GaugeMetricFamily(
            "idempotent_orders_outbox_pending",
            "Outbox rows not published yet (due or backing off).",
            value=outbox["pending"],
        )
        yield GaugeMetricFamily(
            "idempotent_orders_outbox_dead",
            "Outbox rows dead-lettered, waiting for an operator to requeue them.",
            value=outbox["dead"],
        )
        yield GaugeMetricFamily(
            "idempotent_orders_outbox_oldest_pending_seconds",
            "Age of the oldest pending outbox row (0 when none).",
            value=outbox["oldest_pending_age"] or 0.0,
        )


#: ``idempotent_orders_messages_total`` by ``(consumer, outcome)``: found once, counted often.
_message_counters: dict[tuple[str, str], Any] = {}


def _on_consumed(sender: Any, consumer: str, outcome: Any, **kwargs: Any) -> None:
    _count_consumed(consumer, outcome, 1)


def _count_consumed(consumer: str, outcome: Any, n: int) -> None:
    key = (consumer, str(outcome))
    counter = _message_counters.get(key)
    if counter is None:
        labels = {"consumer": key[0], "outcome": key[1]}
        counter = _message_counters[key] = _metrics["idempotent_orders_messages"].labels(**labels)
    counter.inc(n)


def _on_lease(sender: Any, consumer: str, result: str, **kwargs: Any) -> None:
    _metrics["idempotent_orders_leases"].labels(consumer=consumer, result=result).inc()


def _on_reconciled(sender: Any, consumer: str, action: str, **kwargs: Any) -> None:
    _metrics["idempotent_orders_reconciled"].labels(consumer=consumer, action=action).inc()


def _on_relayed(sender: Any, published: int, dead: int = 0, **kwargs: Any) -> None:
    _metrics["idempotent_orders_outbox_published"].inc(published)
    _metrics["idempotent_orders_outbox_dead_lettered"].inc(dead)


def _on_dead(sender: Any, consumer: str, **kwargs: Any) -> None:
    _metrics["idempotent_orders_inbox_dead_lettered"].labels(consumer=consumer).inc()


def connect() -> bool:
    """Create the metrics and connect them to the app's signals; False without the extra."""
    if prometheus_client is None:
        return False
    if _metrics:
        return True
    from idempotent_orders import signals
    from idempotent_orders.consuming.decision import COUNTERS

    _counter("idempotent_orders_messages", "Messages decided, by outcome.", ["consumer", "outcome"])
    _counter(
        "idempotent_orders_dedup_layer_hits", "Duplicates answered by a fast layer.", ["layer"]
    )
    _counter("idempotent_orders_leases", "Leased work attempts, by result.", ["consumer", "result"])
    _counter(
        "idempotent_orders_reconciled", "Reconciler actions, by action.", ["consumer", "action"]
    )
    _counter("idempotent_orders_outbox_published", "Outbox rows published by relays.", [])
    _counter("idempotent_orders_outbox_dead_lettered", "Outbox rows dead-lettered by relays.", [])
    _counter(
        "idempotent_orders_inbox_dead_lettered",
        "@idempotent inbox rows dead-lettered, by consumer.",
        ["consumer"],
    )
    prometheus_client.REGISTRY.register(DatabaseCollector())
    signals.message_consumed.connect(_on_consumed, dispatch_uid="io_metrics_consumed")
    COUNTERS["io_metrics_consumed"] = _count_consumed  # a batch counts at once
    signals.lease_finished.connect(_on_lease, dispatch_uid="io_metrics_lease")
    signals.message_reconciled.connect(_on_reconciled, dispatch_uid="io_metrics_reconciled")
    signals.outbox_relayed.connect(_on_relayed, dispatch_uid="io_metrics_outbox_relayed")
    signals.message_dead.connect(_on_dead, dispatch_uid="io_metrics_inbox_dead")
    _connect_celery_shutdown()
    return True


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when set (prometheus-client's multiprocess mode), else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def mark_process_dead(pid: int) -> None:
    """Tell prometheus-client that process ``pid`` exited (no-op outside multiprocess mode).

    Its counters stay in the sum (a counter never goes down); only the files of
    live gauges are removed. Call it from the parent (gunicorn's ``child_exit``)
    or from the exiting process itself (Celery's ``worker_process_shutdown``).
    """
    if prometheus_client is None or multiprocess_dir() is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, multiprocess_dir())


def gunicorn_child_exit(server: Any, worker: Any) -> None:
    """gunicorn's ``child_exit`` hook: ``child_exit = gunicorn_child_exit`` in its config file."""
    mark_process_dead(worker.pid)


def _on_worker_process_shutdown(
    sender: Any = None, pid: int | None = None, exitcode: Any = None, **kwargs: Any
) -> None:
    mark_process_dead(pid if pid is not None else os.getpid())


def _connect_celery_shutdown() -> None:
    try:
        from celery.signals import worker_process_shutdown
    except ImportError:  # pragma: no cover - Celery is optional here
        return
    worker_process_shutdown.connect(
        _on_worker_process_shutdown, weak=False, dispatch_uid="io_metrics_process_shutdown"
    )


def _client_address_allowed(address: str, allowed: list[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    for entry in allowed:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:  # reported by the system check
            continue
    return False


def _refusal(request: HttpRequest) -> HttpResponse | None:
    """None if ``request`` may read the metrics, else the answer that refuses it."""
    if conf.METRICS_PUBLIC:
        return None
    token = conf.METRICS_TOKEN
    allowed = conf.METRICS_ALLOW_IPS
    if not token and not allowed:
        if settings.DEBUG:
            return None
        return HttpResponse(
            "metrics are closed: set METRICS_TOKEN or METRICS_ALLOW_IPS in IDEMPOTENT_ORDERS\n",
            status=403,
            content_type="text/plain",
        )
    if allowed and _client_address_allowed(request.META.get("REMOTE_ADDR", ""), allowed):
        return None
    if token:
        scheme, _, given = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return None
        refused = HttpResponse(
            "a valid bearer token is required\n", status=401, content_type="text/plain"
        )
        refused["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return refused
    return HttpResponse(
        "this address may not read the metrics\n", status=403, content_type="text/plain"
    )


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition (include it in your URLconf).

    The default registry, or in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``)
    the sum of every process's counters plus the database gauges read once.
    Only for requests the ``METRICS_*`` settings let in (see :func:`_refusal`).
    """
    refused = _refusal(request)
    if refused is not None:
        return refused
    if prometheus_client is None:
        return HttpResponse(
            "prometheus-client is not installed (pip install idempotent-orders[prometheus])\n",
            status=501,
            content_type="text/plain",
        )
    directory = multiprocess_dir()
    if directory is None:
        registry = prometheus_client.REGISTRY
    else:
        from prometheus_client import multiprocess

        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
        registry.register(DatabaseCollector())
    response = HttpResponse(
        prometheus_client.generate_latest(registry),
        content_type=prometheus_client.CONTENT_TYPE_LATEST,
    )
    response["Cache-Control"] = "no-store"
    return response
