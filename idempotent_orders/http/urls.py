"""URLs of the app's HTTP API; a project includes them, e.g. under ``api/``."""

from django.urls import path

from idempotent_orders.http import views

app_name = "idempotent_orders"

urlpatterns = [
    path("idempotency-tokens/", views.token_endpoint, name="idempotency-tokens"),
    path("orders/", views.orders, name="orders"),
    path("orders/<int:pk>/", views.order_detail, name="order-detail"),
]
