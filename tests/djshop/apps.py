from django.apps import AppConfig


class DjShopConfig(AppConfig):
    name = "tests.djshop"
    label = "djshop"
    default_auto_field = "django.db.models.BigAutoField"
