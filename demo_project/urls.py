"""URLs of the demo project: admin, the app's API under /api/ and the shop under /shop/."""

from django.contrib import admin
from django.urls import include, path

from demo_project import payments, shop
from idempotent_orders.observability import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("api/", include("idempotent_orders.http.urls")),
    path("shop/", shop.shop, name="shop"),
    path("shop/checkout/", shop.checkout, name="shop-checkout"),
    path("shop/orders/", shop.my_orders, name="shop-orders"),
    path("shop/orders/<int:pk>/", shop.order_page, name="shop-order"),
    path("shop/orders/<int:pk>/status.json", shop.order_status_json, name="shop-order-status"),
    path("shop/orders/<int:pk>/pay/", payments.pay_page, name="shop-pay"),
    path("webhooks/", include("idempotent_orders.webhooks.urls")),
]
