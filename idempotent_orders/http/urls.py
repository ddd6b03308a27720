"""URLs of the app's HTTP API; a project includes them, e.g. under ``api/``."""

from django.urls import path

from idempotent_orders.http import views

app_name = "idempotent_orders"

urlpatterns = [
    path("idempotency-tokens/", views.token_endpoint, name="idempotency-tokens"),
    path("orders/", views.orders, name="orders"),
    # Any segment: a malformed id is the API's own problem+json 404, not Django's page.
    path("orders/<str:pk>/", views.order_detail, name="order-detail"),
    path("schema/", views.schema, name="schema"),
]
