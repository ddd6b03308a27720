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

Counters live in the process that counts them: scrape the workers too, or use
prometheus-client's multiprocess mode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from django.db.models import Min
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

__all__ = ["JsonFormatter", "connect", "metrics_view", "record_layer_hit"]

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
    key = (consumer, str(outcome))
    counter = _message_counters.get(key)
    if counter is None:
        labels = {"consumer": key[0], "outcome": key[1]}
        counter = _message_counters[key] = _metrics["idempotent_orders_messages"].labels(**labels)
    counter.inc()


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
    signals.lease_finished.connect(_on_lease, dispatch_uid="io_metrics_lease")
    signals.message_reconciled.connect(_on_reconciled, dispatch_uid="io_metrics_reconciled")
    signals.outbox_relayed.connect(_on_relayed, dispatch_uid="io_metrics_outbox_relayed")
    signals.message_dead.connect(_on_dead, dispatch_uid="io_metrics_inbox_dead")
    return True


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of the default registry (include it in your URLconf).

    It is not protected: serve it on an internal address or wrap it in your own check.
    """
    if prometheus_client is None:
        return HttpResponse(
            "prometheus-client is not installed (pip install idempotent-orders[prometheus])\n",
            status=501,
            content_type="text/plain",
        )
    return HttpResponse(
        prometheus_client.generate_latest(), content_type=prometheus_client.CONTENT_TYPE_LATEST
    )
