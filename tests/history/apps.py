from django.apps import AppConfig


class HistoryConfig(AppConfig):
    name = "tests.history"
    label = "history"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        import reversion
        from auditlog.registry import auditlog

        from tests.history import models

        reversion.register(models.Order)
        # The app's machinery columns left out, as a shop's audit configuration would.
        auditlog.register(models.Order, exclude_fields=["version", "last_seq", "has_parked"])
        models.connect_receiver()
