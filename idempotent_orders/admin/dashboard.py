"""What needs an operator now: the dashboard's lines (:func:`attention`), the liveness
lines (workers gone quiet, the reconciler's last pass), the "what is left" sentence said
after every action and the list filters the dashboard's counts link to (the same
queries, so a count is the size of the list its link opens).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin, messages
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.timesince import timesince

from idempotent_orders import liveness
from idempotent_orders.conf import conf
from idempotent_orders.consuming.decision import REFUND
from idempotent_orders.models import (
    InboxStatus,
    OutboxMessage,
    OutboxStatus,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.outbox import outbox_stats


def money_to_give_back(inbox: QuerySet[Any] | None = None) -> QuerySet[Any]:
    """The inbox rows of payments that cannot apply: kept as rejected, their reason ending
    in :data:`~idempotent_orders.consuming.decision.REFUND` (the one rule the dashboard's
    count and its list share)."""
    rows = ProcessedMessage.objects.all() if inbox is None else inbox
    return rows.filter(status=InboxStatus.REJECTED, error__endswith=REFUND)


def left_to_do(user: Any) -> str:
    """What still needs an operator, in one sentence (said after every action)."""
    due = [f"{line.count} {line.short}" for line in attention(user) if line.count and line.short]
    if not due:
        return "Nothing else needs attention now."
    return f"Still needing attention: {', '.join(due)}."


def tell_what_is_left(request: HttpRequest) -> None:
    messages.add_message(request, messages.INFO, left_to_do(request.user))


class AttentionFilter(admin.SimpleListFilter):
    """What an operator looks for: stuck leased work, rejections, failures."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("stuck", "stuck: a lease ran out with no word"),
            ("refused", "refused by the other system, to be tried again"),
            ("processing", "processing"),
            ("rejected", "rejected"),
            ("rejected_today", "rejected today"),
            ("failed", "failed"),
            ("dead", "dead (@idempotent work that keeps failing)"),
            ("refund", "money to give back (a payment that cannot apply)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "stuck":
            return stuck(queryset)
        if value == "refused":
            return refused(queryset)
        if value == "rejected_today":
            return queryset.filter(status=InboxStatus.REJECTED, created_at__gte=_start_of_today())
        if value == "refund":
            return money_to_give_back(queryset)
        if value in {"processing", "rejected", "failed", "dead"}:
            return queryset.filter(status=value)
        return queryset


def stuck(inbox: QuerySet[Any] | None = None) -> QuerySet[Any]:
    """Leased work whose lease ran out with no word from whoever held it (a stall: a worker
    died or hangs). The dashboard's count and its list share this rule."""
    rows = ProcessedMessage.objects.all() if inbox is None else inbox
    return rows.filter(status=InboxStatus.PROCESSING, lease_expires_at__lt=timezone.now(), error="")


def refused(inbox: QuerySet[Any] | None = None) -> QuerySet[Any]:
    """Leased work the other system refused or failed (the step released its lease with the
    answer): no worker stalled; the reconciler tries again, then gives it up to an operator."""
    rows = ProcessedMessage.objects.all() if inbox is None else inbox
    return rows.filter(status=InboxStatus.PROCESSING, lease_expires_at__lt=timezone.now()).exclude(
        error=""
    )


def _start_of_today() -> datetime:
    return timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)


def _overdue_cutoff() -> datetime:
    return timezone.now() - timedelta(seconds=conf.PARKED_TIMEOUT)


def _held_cutoff() -> datetime:
    return timezone.now() - timedelta(seconds=conf.PARKED_ATTENTION_AFTER)


def _minutes(seconds: int) -> str:
    if seconds % 60:
        return f"{seconds} seconds"
    minutes = seconds // 60
    return "1 minute" if minutes == 1 else f"{minutes} minutes"


class ParkedAttentionFilter(admin.SimpleListFilter):
    """Parked messages waiting longer than ``PARKED_TIMEOUT``, marked overdue or not yet."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("held", f"held longer than {_minutes(conf.PARKED_ATTENTION_AFTER)}"),
            ("overdue", "overdue (waiting longer than PARKED_TIMEOUT)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "held":
            return queryset.filter(parked_at__lte=_held_cutoff())
        if self.value() == "overdue":
            return queryset.filter(
                Q(overdue_at__isnull=False) | Q(parked_at__lte=_overdue_cutoff())
            )
        return queryset


@dataclass(frozen=True)
class Attention:
    """One line of the attention dashboard: a count and where to see the rows."""

    key: str
    label: str
    count: int
    url: str
    note: str = ""
    #: The line in a few words ("2 stuck"), for "what is left" after an action; "" to omit.
    short: str = ""


def _some(names: list[str], shown: int = 3) -> str:
    """A few names, each cut short, and how many more (the dashboard's note stays short)."""
    cut = [n if len(n) <= 32 else f"{n[:31]}…" for n in names[:shown]]
    more = len(names) - shown
    return ", ".join(cut) + (f" and {more} more" if more > 0 else "")


def _seconds(seconds: float) -> str:
    """A threshold in words: "60 seconds" is "1 minute"."""
    return _minutes(int(seconds))


def _ago(seconds: float) -> str:
    """A short age in words: "12 seconds", "3 minutes"."""
    if seconds < 120:
        return f"{int(seconds)} seconds"
    return timesince(timezone.now() - timedelta(seconds=seconds))


def _liveness_lines(stuck_url: str) -> list[Attention]:
    """Workers gone quiet and the reconciler's last pass, from their heartbeats (rows in
    the database: what every process wrote, whatever the caches are)."""
    workers = liveness.ages("worker:")
    gone = sorted(
        name.removeprefix("worker:") for name, age in workers.items() if age > liveness.SILENT_AFTER
    )
    alive = len(workers) - len(gone)
    reconciler = liveness.ages("reconciler").get("reconciler")
    silent = liveness.reconciler_silent_after()
    late = reconciler is None or reconciler > silent
    if workers:
        heard = (f"gone: {_some(gone)}; " if gone else "") + (
            f"{alive} heard from in the last minute"
        )
    else:
        heard = "no worker heard from in the last hour (is a Celery worker running?)"
    return [
        Attention(
            "workers_gone",
            f"Workers not heard from for {_seconds(liveness.SILENT_AFTER)}",
            len(gone),
            stuck_url,
            heard,
            short="",
        ),
        Attention(
            "reconciler",
            f"Reconciler not run for {_seconds(silent)}",
            int(late),
            stuck_url,
            "never heard from (is Celery beat running?)"
            if reconciler is None
            else f"last pass {_ago(reconciler)} ago",
            short="",
        ),
    ]


def attention(user: Any) -> list[Attention]:
    """What needs an operator now, for the models ``user`` may view.

    Each count is the size of the changelist its link opens (the same filter).
    Shown on the admin index and on the app's index.
    """
    now = timezone.now()
    inbox = ProcessedMessage.objects.all()

    def changelist(model: type[Model], query: str) -> str:
        return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist") + query

    def may_view(model: type[Model]) -> bool:
        opts = model._meta
        return any(
            user.has_perm(f"{opts.app_label}.{perm}_{opts.model_name}")
            for perm in ("view", "change")
        )

    lines: list[Attention] = []
    if may_view(ProcessedMessage):
        lines += [
            Attention(
                "stuck",
                "Stuck: a lease ran out with no word",
                stuck(inbox).count(),
                changelist(ProcessedMessage, "?attention=stuck"),
                short="stuck",
            ),
            Attention(
                "refused",
                "Refused by the other system (tried again)",
                refused(inbox).count(),
                changelist(ProcessedMessage, "?attention=refused"),
                "the reconciler tries again; Retry… to try now",
                short="refused",
            ),
            Attention(
                "failed",
                "Failed, waiting for an operator",
                inbox.filter(status=InboxStatus.FAILED).count(),
                changelist(ProcessedMessage, "?attention=failed"),
                short="failed",
            ),
            Attention(
                "inbox_dead",
                "Dead (requeue once the cause is fixed)",
                inbox.filter(status=InboxStatus.DEAD).count(),
                changelist(ProcessedMessage, "?attention=dead"),
                short="dead",
            ),
            Attention(
                "refund",
                "Money to give back (a payment that cannot apply)",
                money_to_give_back(inbox).count(),
                changelist(ProcessedMessage, "?attention=refund"),
                short="money to give back",
            ),
            Attention(
                "rejected_today",
                "Rejected today",
                inbox.filter(
                    status=InboxStatus.REJECTED, created_at__gte=_start_of_today()
                ).count(),
                changelist(ProcessedMessage, "?attention=rejected_today"),
            ),
        ]
        lines += _liveness_lines(changelist(ProcessedMessage, "?attention=stuck"))
    if may_view(ParkedMessage):
        held = ParkedMessage.objects.filter(parked_at__lte=_held_cutoff())
        oldest = held.order_by("parked_at").values_list("parked_at", flat=True).first()
        lines += [
            Attention(
                "held",
                f"Held longer than {_minutes(conf.PARKED_ATTENTION_AFTER)} (parked)",
                held.count(),
                changelist(ParkedMessage, "?attention=held"),
                f"oldest held {timesince(oldest, now)}" if oldest else "",
                short="held too long",
            ),
            Attention(
                "overdue",
                "Parked longer than PARKED_TIMEOUT",
                ParkedMessage.objects.filter(
                    Q(overdue_at__isnull=False) | Q(parked_at__lte=_overdue_cutoff())
                ).count(),
                changelist(ParkedMessage, "?attention=overdue"),
            ),
        ]
    if may_view(OutboxMessage):
        stats = outbox_stats(sent=False)
        age = stats["oldest_pending_age"]
        lines.append(
            Attention(
                "outbox_pending",
                "Outbox pending",
                stats["pending"],
                changelist(OutboxMessage, f"?status__exact={OutboxStatus.PENDING}"),
                f"oldest waiting {timesince(now - timedelta(seconds=age), now)}" if age else "",
            )
        )
        lines.append(
            Attention(
                "outbox_dead",
                "Outbox dead letters (requeue once the cause is fixed)",
                stats["dead"],
                changelist(OutboxMessage, f"?status__exact={OutboxStatus.DEAD}"),
                short="outbox dead",
            )
        )
    return lines


# The admin's own index shows the attention dashboard too, unless the project set
# an index template of its own (it can add {% attention_dashboard %} to it).
if admin.site.index_template is None:
    admin.site.index_template = "admin/idempotent_orders/index.html"
