"""App config of the demo project (it holds the demo's management command)."""

from django.apps import AppConfig


class DemoProjectConfig(AppConfig):
    name = "demo_project"
    verbose_name = "Demo shop"
