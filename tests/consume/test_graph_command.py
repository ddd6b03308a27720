"""``manage.py idempotent_orders_graph``: the state graph from the fsm-2 declarations."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from idempotent_orders.consuming.graph import edges
from idempotent_orders.models import Order


def graph(*args: str) -> str:
    out = StringIO()
    call_command("idempotent_orders_graph", *args, stdout=out)
    return out.getvalue()


ORDER_EDGES = {
    "pending_payment --> paid: pay",
    "paid --> processing: start_processing",
    "paid --> shipped: ship",
    "processing --> shipped: ship",
    "shipped --> completed: complete",
    "pending_payment --> cancelled: cancel",
    "pending_payment --> expired: expire",
    "paid --> refunded: refund",
}


def test_mermaid_of_the_configured_order_model() -> None:
    lines = [line.strip() for line in graph().splitlines()]
    assert lines[0] == "stateDiagram-v2"
    assert "[*] --> pending_payment" in lines
    transitions = {line for line in lines if "[*]" not in line and "-->" in line}
    assert transitions == ORDER_EDGES
    # One line per (source, transition) of the declarations, no more.
    assert len(transitions) == sum(len(e.sources) for e in edges(Order))
    terminal = {line for line in lines if line.endswith("--> [*]")}
    assert terminal == {f"{s} --> [*]" for s in ("completed", "cancelled", "expired", "refunded")}


def test_dot_of_the_configured_order_model() -> None:
    out = graph("--format", "dot")
    assert out.startswith('digraph "idempotent_orders.Order" {')
    assert '"pending_payment" -> "paid" [label="pay"];' in out
    assert '"processing" -> "shipped" [label="ship"];' in out
    assert '__start__ -> "pending_payment";' in out
    assert '"completed" [label="completed", peripheries=2];' in out
    assert out.rstrip().endswith("}")


def test_another_model_by_label() -> None:
    lines = {line.strip() for line in graph("--model", "demo_project.ShopOrder").splitlines()}
    assert "[*] --> awaiting_payment" in lines
    assert {
        "awaiting_payment --> paid: mark_paid",
        "paid --> picking: start_picking",
        "picking --> packed: pack",
        "paid --> in_transit: dispatch",
        "picking --> in_transit: dispatch",
        "packed --> in_transit: dispatch",
        "in_transit --> delivered: deliver",
    } <= lines
    assert "pending_payment --> paid: pay" not in lines


def test_a_model_without_a_state_graph_is_a_command_error() -> None:
    with pytest.raises(CommandError, match="FSMField"):
        graph("--model", "demo_project.LoyaltyAccount")
    with pytest.raises(CommandError, match="--model"):
        graph("--model", "demo_project.NoSuchModel")
