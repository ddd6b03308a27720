"""Say how each registered message type is committed on the order model, and why."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from idempotent_orders import get_order_model
from idempotent_orders.consuming.graph import has_transition
from idempotent_orders.consuming.registry import registered
from idempotent_orders.consuming.running import road

#: What each road means, for the reader of the output.
ROADS = {
    "save": "the model's transition, then the model's own save() with the version condition",
    "transition": "the model's transition, then the app's conditional UPDATE",
    "raw": "the app's own statement (nothing of the project's would run)",
}


def explain() -> list[tuple[str, str, str, str]]:
    """``(message type, transition, road, why)`` for every registered type, by type."""
    model = get_order_model()
    rows = []
    for handler in registered():
        if not has_transition(model, handler.transition):
            rows.append(
                (handler.message_type, handler.transition, "none", "the model lacks it (E040)")
            )
            continue
        name, why = road(model, handler.transition)
        rows.append((handler.message_type, handler.transition, name, why))
    return rows


class Command(BaseCommand):
    help = (
        "For each registered message type: the transition it drives and how the app "
        "commits it on the order model (save() road, transition road or raw road), and why."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        model = get_order_model()
        self.stdout.write(f"order model: {model._meta.label}")
        for message_type, transition, name, why in explain():
            self.stdout.write(f"{message_type} -> {transition}: {name} road — {why}")
        self.stdout.write("")
        for name, meaning in ROADS.items():
            self.stdout.write(f"{name} road: {meaning}")
