"""A paginator for the admin's big lists that never counts a large filtered set.

Django's :class:`~django.core.paginator.Paginator` runs ``COUNT(*)`` over the whole
filtered queryset on every page: at 10M inbox rows that is a scan per page view.
:class:`EstimatedCountPaginator` counts exactly only up to :attr:`EXACT_UP_TO` rows
(``SELECT COUNT(*) FROM (SELECT 1 ... LIMIT n)``, which stops reading at ``n``). Past
that, on PostgreSQL, it shows the planner's estimate for the same query (``EXPLAIN``,
no rows read); on other databases, or when the estimate is not larger, the capped
count itself. A small set is therefore always counted exactly, on every database.
"""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.utils.functional import cached_property

from idempotent_orders.vendors import vendor

__all__ = ["EstimatedCountPaginator", "estimated_count"]


def _planner_estimate(queryset: QuerySet[Any]) -> int | None:
    """The planner's row estimate for ``queryset`` where the database gives one, or None."""
    connection = connections[queryset.db]
    sql, params = queryset.order_by().values("pk").query.sql_with_params()
    return vendor(connection).estimated_rows(connection, sql, params)


def estimated_count(queryset: QuerySet[Any], exact_up_to: int) -> tuple[int, bool]:
    """``(count, exact)``: the exact count when it is at most ``exact_up_to``, else an
    estimate (PostgreSQL's planner) or the lower bound ``exact_up_to + 1``."""
    capped = queryset.order_by()[: exact_up_to + 1].count()
    if capped <= exact_up_to:
        return capped, True
    estimate = _planner_estimate(queryset)
    if estimate is not None and estimate > capped:
        return estimate, False
    return capped, False


class EstimatedCountPaginator(Paginator):
    """Django's paginator with :func:`estimated_count` in place of ``COUNT(*)``.

    The last pages of a list bigger than :attr:`EXACT_UP_TO` are reached by a
    count that may be off: a page past the real end is empty. ``count_is_exact``
    says which kind the count is.
    """

    #: Rows counted exactly (the capped count reads at most this many and one more).
    EXACT_UP_TO = 10_000

    count_is_exact = True

    @cached_property
    def count(self) -> int:
        objects: Any = self.object_list
        if not isinstance(objects, QuerySet):
            return super().count
        count, self.count_is_exact = estimated_count(objects, self.EXACT_UP_TO)
        return count

    def validate_number(self, number: Any) -> int:
        """A page number past an estimated end is allowed (it shows what is there)."""
        if self.count and not self.count_is_exact:  # self.count sets count_is_exact
            try:
                number = int(number)
            except (TypeError, ValueError):
                return super().validate_number(number)
            if number >= 1:
                return number
        return super().validate_number(number)
