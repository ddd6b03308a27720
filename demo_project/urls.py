"""URLs of the demo project."""

from django.contrib import admin
from django.urls import path

from idempotent_orders.observability import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
]
