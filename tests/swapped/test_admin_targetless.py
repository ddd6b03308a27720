"""``OrderAdminMixin`` on a model with a ``target=None`` transition (``shop.ParcelReturn``).

tests/shop/admin.py registers it at admin autodiscovery: that this module runs at all
means ``django.setup()`` did not crash. Its pages answer; ``note`` gets no "Mark as"
action (it has no target state), ``receive`` keeps its own.
This module runs under ``tests.settings_swapped``.
"""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.test import Client
from django.urls import reverse

from idempotent_orders.admin import OrderAdminMixin
from tests.shop.models import ParcelReturn

pytestmark = pytest.mark.django_db


def test_registered_and_its_pages_answer_without_transition_actions(staff: Client) -> None:
    assert isinstance(admin.site.get_model_admin(ParcelReturn), OrderAdminMixin)
    parcel = ParcelReturn.objects.create(parcel="SF00000001")

    listing = staff.get(reverse("admin:shop_parcelreturn_changelist"))
    assert listing.status_code == 200
    actions = [name for name, _ in listing.context["action_form"].fields["action"].choices]
    assert [name for name in actions if name.startswith("transition_")] == ["transition_receive"]

    change = staff.get(reverse("admin:shop_parcelreturn_change", args=[parcel.pk]))
    assert change.status_code == 200
    assert "status" not in change.context["adminform"].form.fields  # the state stays read-only
