"""A fake payment gateway: what the testing kit's tests plant in transitions and watch."""

from __future__ import annotations

#: What the gateway captured: ``(payment_id, amount)``, in order.
captured: list[tuple[str, str]] = []


def capture(payment_id: str, amount: str) -> None:
    """Capture ``amount`` of ``payment_id`` (recorded in :data:`captured`)."""
    captured.append((payment_id, amount))
