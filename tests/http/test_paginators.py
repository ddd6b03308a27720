"""The admin's paginator for big lists: exact when small, never a full count when large."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.paginator import EmptyPage
from django.db import connection
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext

from idempotent_orders.admin import ProcessedMessageAdmin
from idempotent_orders.models import AuditEntry, ProcessedMessage
from idempotent_orders.paginators import EstimatedCountPaginator, estimated_count

pytestmark = pytest.mark.django_db


def _entries(n: int) -> Any:
    AuditEntry.objects.bulk_create(
        AuditEntry(username="u", action="a", target="t", object_id=str(i), result="ok")
        for i in range(n)
    )
    return AuditEntry.objects.order_by("-id")


class _Small(EstimatedCountPaginator):
    EXACT_UP_TO = 3


def test_a_set_within_the_cap_is_counted_exactly_with_a_capped_count() -> None:
    rows = _entries(3)
    paginator = _Small(rows, 2)
    with CaptureQueriesContext(connection) as queries:
        assert paginator.count == 3
    assert paginator.count_is_exact
    assert paginator.num_pages == 2
    assert len(queries) == 1
    assert "LIMIT" in queries[0]["sql"].upper()  # never a COUNT(*) over the whole table
    assert "EXPLAIN" not in queries[0]["sql"].upper()
    with pytest.raises(EmptyPage):
        paginator.page(3)  # an exact count keeps Django's bounds


def test_a_set_past_the_cap_is_not_counted_in_full() -> None:
    rows = _entries(6)
    paginator = _Small(rows, 2)
    with CaptureQueriesContext(connection) as queries:
        count = paginator.count
    assert not paginator.count_is_exact
    assert count >= 4  # at least the cap and one more
    sqls = [q["sql"].upper() for q in queries]
    assert "LIMIT" in sqls[0]
    if connection.vendor == "postgresql":
        assert any(sql.startswith("EXPLAIN") for sql in sqls)  # the planner's estimate
    else:
        assert count == 4  # no estimate here: the capped count, a lower bound
        assert len(sqls) == 1
    # A page past an estimated end shows what is there instead of failing.
    assert list(paginator.page(50).object_list) == []
    assert [e.object_id for e in paginator.page(1).object_list] == ["5", "4"]


def test_estimated_count_uses_the_queryset_filter() -> None:
    _entries(5)
    count, exact = estimated_count(AuditEntry.objects.filter(object_id__in=["1", "2"]), 10)
    assert (count, exact) == (2, True)


def test_the_inbox_changelist_counts_with_it() -> None:
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="payments", message_id=f"m-{i}") for i in range(4)
    )

    class Admin(ProcessedMessageAdmin):
        paginator = EstimatedCountPaginator

    user = get_user_model().objects.create_superuser("root", "root@example.com", "x")
    request = RequestFactory().get("/admin/idempotent_orders/processedmessage/")
    request.user = user
    changelist = Admin(ProcessedMessage, admin.site).get_changelist_instance(request)
    assert isinstance(changelist.paginator, EstimatedCountPaginator)
    assert changelist.result_count == 4
    assert len(changelist.result_list) == 4
