"""The single path's order read: the ORM's SQL compiled once, the same instance as the ORM's."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.models import QuerySet
from django.db.models.manager import BaseManager
from django.test.utils import CaptureQueriesContext

from idempotent_orders import get_order_model
from idempotent_orders.consuming import sql
from idempotent_orders.consuming.sql import read_order

pytestmark = pytest.mark.django_db


def _fields(instance: Any) -> dict[str, Any]:
    return {f.attname: getattr(instance, f.attname) for f in type(instance)._meta.concrete_fields}


def test_read_order_builds_the_instance_the_orm_builds(make_order) -> None:
    model = get_order_model()
    order = make_order()
    orm = model._default_manager.filter(pk=order.pk).first()
    with CaptureQueriesContext(connection) as queries:
        read = read_order(model, order.pk)
        again = read_order(model, order.pk)
    assert len(queries) == 2
    assert type(read) is model
    assert _fields(read) == _fields(orm) == _fields(again)
    assert read is not None
    assert read._state.adding is False
    assert read._state.db == orm._state.db
    assert read_order(model, order.pk + 10_000) is None


def test_a_default_manager_with_its_own_queryset_is_read_through_the_orm(
    make_order, monkeypatch
) -> None:
    model = get_order_model()
    order = make_order()
    hidden: list[int] = []

    def get_queryset(self: Any) -> QuerySet[Any]:
        return BaseManager.get_queryset(self).exclude(pk__in=hidden)

    monkeypatch.setattr(type(model._default_manager), "get_queryset", get_queryset)
    monkeypatch.setattr(sql, "_read_plans", {})
    assert read_order(model, order.pk) is not None
    hidden.append(order.pk)  # the manager's filter changed since the first read
    assert read_order(model, order.pk) is None


def test_the_order_model_is_looked_up_again_when_its_setting_changes() -> None:
    from django.contrib.auth.models import User
    from django.test import override_settings

    from idempotent_orders.models import Order

    assert get_order_model() is Order
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="auth.User"):
        assert get_order_model() is User
    assert get_order_model() is Order
