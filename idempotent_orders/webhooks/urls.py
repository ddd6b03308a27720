"""URLs of the webhook ingress; a project includes them, e.g. under ``webhooks/``."""

from django.urls import path

from idempotent_orders.webhooks import views

app_name = "idempotent_orders_webhooks"

urlpatterns = [path("<str:provider>/", views.webhook, name="webhook")]
