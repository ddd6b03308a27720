"""A fake partner webhook for ``@idempotent(external=True)``: it can fail, hang, or lose its reply.

Like the fake warehouse, its state lives in database tables (``WebhookDelivery``,
``WebhookScript``) so worker processes, the reconciler and the tests all see it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.conf import settings

from demo_project.models import WebhookDelivery, WebhookScript
from demo_project.warehouse import next_scripted_mode

#: ``ok``; ``fail`` (refused, no effect); ``hang`` (no effect, blocks, then
#: times out); ``effect_then_hang`` (effect, then blocks before replying).
MODES = ("ok", "fail", "hang", "effect_then_hang")


class WebhookError(Exception):
    """The partner refused or did not answer; the effect is unknown to the caller."""


def script(ref: str, *modes: str) -> None:
    """Make the next requests for ``ref`` behave as ``modes``, in order; then ``ok``."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; expected some of {MODES}")
    WebhookScript.objects.update_or_create(ref=ref, defaults={"modes": list(modes)})


def effects(ref: str) -> int:
    """How many times the partner acted on ``ref``."""
    return WebhookDelivery.objects.filter(ref=ref, effect=True).count()


def _next_mode(ref: str) -> str:
    return next_scripted_mode(WebhookScript, ref=ref)


def post(ref: str, payload: dict[str, Any], *, idempotency_key: str) -> None:
    """Deliver ``payload`` about ``ref``; raise :class:`WebhookError` unless it was accepted."""
    mode = _next_mode(ref)
    WebhookDelivery.objects.create(
        idempotency_key=idempotency_key,
        ref=ref,
        mode=mode,
        effect=mode in {"ok", "effect_then_hang"},
        pid=os.getpid(),
    )
    if mode == "ok":
        return
    if mode == "fail":
        raise WebhookError("the partner refused the request")
    time.sleep(getattr(settings, "DEMO_WAREHOUSE_HANG_SECONDS", 300))
    raise WebhookError("the partner did not answer in time")


def delivered(idempotency_key: str) -> bool | None:
    """The verifier: did the partner act on a request with this key?"""
    return WebhookDelivery.objects.filter(idempotency_key=idempotency_key, effect=True).exists()
