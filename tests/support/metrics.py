"""Reading Prometheus metrics in tests."""

from __future__ import annotations

import re


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the Prometheus text format (0 when absent)."""
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(label) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def messages_decided(consumer: str, outcome: object) -> float:
    """``idempotent_orders_messages_total`` for one consumer and outcome, from this
    process's registry (0 when absent)."""
    import prometheus_client

    labels = {"consumer": consumer, "outcome": str(outcome)}
    value = prometheus_client.REGISTRY.get_sample_value("idempotent_orders_messages_total", labels)
    return value or 0.0


def outcome_counts() -> dict[str, int]:
    """This process's ``outcome:`` counters (:mod:`idempotent_orders.stats`)."""
    from idempotent_orders import stats

    return {k: v for k, v in stats.local().items() if k.startswith("outcome:")}
