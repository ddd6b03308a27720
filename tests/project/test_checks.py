"""System checks: each ID fires on the misconfiguration it names and is silent on the demo."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from celery import current_app
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from idempotent_orders import checks as io_checks
from idempotent_orders.conf import DEFAULTS, POSITIVE, Settings, conf
from tests.support.services import ROOT

pytestmark = pytest.mark.django_db


def ids(**io: Any) -> set[str]:
    with override_settings(IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, **io}):
        found = {m.id for m in checks.run_checks() if (m.id or "").startswith("idempotent")}
    return found - set(settings.SILENCED_SYSTEM_CHECKS)  # as `manage.py check` reports


def test_silent_on_the_test_settings() -> None:
    assert ids() == set()


def test_silent_on_the_demo_settings(tmp_path) -> None:
    for env in ({}, {"REDIS_URL": "redis://127.0.0.1:6379/15"}):
        result = subprocess.run(
            [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "CRITICAL"],
            cwd=ROOT,
            env={
                "PATH": "/usr/bin:/bin",
                "DJANGO_SETTINGS_MODULE": "demo_project.settings",
                "DEMO_STATE_DIR": str(tmp_path),
                **env,
            },
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        said = result.stdout + result.stderr
        if settings.DJANGO_FSM != "django-fsm-2":  # the original django-fsm leg
            assert "idempotent_orders.W004" in said
            said = said.replace("idempotent_orders.W004", "")
        assert "idempotent_orders." not in said


@pytest.mark.parametrize(
    ("io", "expected"),
    [
        ({"LEASE_SECONDS": "30"}, "idempotent_orders.E003"),
        ({"DEDUP_CACHE_ALIAS": 1}, "idempotent_orders.E003"),
        ({"FULFILMENT_CLIENT": "no.such.Client"}, "idempotent_orders.E035"),
        ({"FULFILMENT_VERIFIER": "idempotent_orders.fulfilment.Nope"}, "idempotent_orders.E035"),
        ({"LEASE_SECONDS": 0}, "idempotent_orders.E036"),
        ({"PURGE_BATCH_SIZE": -1}, "idempotent_orders.E036"),
        ({"MAX_MESSAGE_ID_LENGTH": 256}, "idempotent_orders.E037"),
        ({"LEASE_SECONDS": 10, "HEARTBEAT_SECONDS": 8}, "idempotent_orders.W030"),
        ({"DEDUP_RETENTION": 120}, "idempotent_orders.E030"),  # the retry budget is 303s
        ({"BROKER_REDELIVERY_HORIZON": 8 * 24 * 3600}, "idempotent_orders.E030"),
    ],
)
def test_setting_checks_fire(io, expected) -> None:
    assert expected in ids(**io)


def test_every_setting_has_one_typed_accessor_its_default_fits() -> None:
    accessors = {name for name, value in vars(Settings).items() if isinstance(value, property)}
    assert accessors == set(DEFAULTS)
    for name, default in DEFAULTS.items():
        assert io_checks.accepts(name, default), name


def test_a_setting_is_checked_against_the_type_conf_reads() -> None:
    # conf reads the lease as a float: a fractional lease is fine (it was E003 when the
    # check took the default's type, int).
    assert ids(LEASE_SECONDS=0.5, HEARTBEAT_SECONDS=0.2) == set()
    with override_settings(IDEMPOTENT_ORDERS={"LEASE_SECONDS": 0.5}):
        assert conf.LEASE_SECONDS == 0.5
    assert ids(KEY_TTL=1.5) == {"idempotent_orders.E003"}
    assert ids(LEASE_SECONDS=True) >= {"idempotent_orders.E003"}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_one_rule_holds_every_positive_setting(name: str) -> None:
    assert isinstance(DEFAULTS[name], int | float)
    assert DEFAULTS[name] > 0
    with override_settings(IDEMPOTENT_ORDERS={name: 0}):
        found = [m for m in checks.run_checks() if m.id == "idempotent_orders.E036"]
    assert [m.msg for m in found] == [
        f"settings.IDEMPOTENT_ORDERS[{name!r}] must be positive, got 0."
    ]


#: The app's registered checks, by module of the checks package, with their tags.
REGISTERED = {
    ("configuration", "check_settings", ("compatibility",)),
    ("configuration", "check_setting_values", ("compatibility",)),
    ("delivery", "check_celery_tasks", ("compatibility",)),
    ("delivery", "check_database_vendor", ("compatibility",)),
    ("delivery", "check_dedup", ("caches", "compatibility")),
    ("delivery", "check_isolation", ("database",)),
    ("delivery", "check_outbox_and_locks", ("caches", "compatibility")),
    ("delivery", "check_redis_layer", ("caches",)),
    ("delivery", "check_retention", ("compatibility",)),
    ("delivery", "check_webhooks", ("compatibility",)),
    ("fsm_package", "check_fsm_package", ("compatibility",)),
    ("http", "check_http_settings", ("compatibility",)),
    ("metrics", "check_metrics_access", ("security",)),
    ("order_model", "check_operator_transitions", ("admin",)),
    ("order_model", "check_order_model", ("models",)),
    ("order_model", "check_order_model_history", ("database",)),
    ("order_model", "check_payment_timeout", ("models",)),
    ("partitioning", "check_partitioned_inbox", ("compatibility",)),
    ("partitioning", "check_partitions", ("database",)),
    ("redis_cluster", "check_redis_cluster", ("caches",)),
}


def test_every_check_is_registered_once_from_its_module() -> None:
    from django.core.checks.registry import registry

    found = [
        (f.__module__.rpartition(".")[2], f.__name__, tuple(sorted(f.tags)))
        for f in registry.get_checks(include_deployment_checks=True)
        if f.__module__.startswith("idempotent_orders.")
    ]
    assert sorted(found) == sorted(REGISTERED)
    # Importing the package again (as a project's own code may) registers nothing more.
    import importlib

    importlib.import_module("idempotent_orders.checks")
    assert len(
        [f for f in registry.get_checks(True) if f.__module__.startswith("idempotent_orders.")]
    ) == len(REGISTERED)


def test_no_other_check_says_must_be_positive() -> None:
    # One rule, one ID: the "must be positive" message lives in one place in checks/.
    source = "\n".join(p.read_text() for p in (ROOT / "idempotent_orders" / "checks").glob("*.py"))
    assert source.count("must be positive") == 1


def test_retention_shorter_than_the_visibility_timeout() -> None:
    with override_settings(
        CELERY_BROKER_URL="redis://127.0.0.1:6379/1",
        CELERY_BROKER_TRANSPORT_OPTIONS={"visibility_timeout": 30 * 24 * 3600},
    ):
        assert "idempotent_orders.E030" in ids()
    with override_settings(CELERY_BROKER_URL="redis://127.0.0.1:6379/1"):
        assert io_checks.redelivery_horizon() == io_checks.DEFAULT_VISIBILITY_TIMEOUT
        assert "idempotent_orders.E030" not in ids()
        assert "idempotent_orders.E030" in ids(DEDUP_RETENTION=3000)


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [("acks_late", "idempotent_orders.E031"), ("reject_on_worker_lost", "idempotent_orders.E032")],
)
def test_task_options(monkeypatch, attribute, expected) -> None:
    task = current_app.tasks["idempotent_orders.fulfil_order"]
    monkeypatch.setattr(task, attribute, False)
    assert expected in ids()


def test_prefetch_multiplier() -> None:
    with override_settings(CELERY_WORKER_PREFETCH_MULTIPLIER=4):
        assert "idempotent_orders.W031" in ids()


def test_redis_layer_without_django_redis() -> None:
    locmem = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    with override_settings(CACHES=locmem):
        assert "idempotent_orders.E033" in ids()
        assert "idempotent_orders.E033" not in ids(DEDUP_CACHE_ALIAS="")
    assert "idempotent_orders.E010" in ids(DEDUP_CACHE_ALIAS="missing")


def test_isolation() -> None:
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "x", "OPTIONS": {}}
    fine = {**mysql, "OPTIONS": {"isolation_level": "read committed"}}
    for settings_dict, fires in (
        (mysql, True),
        ({**mysql, "OPTIONS": {"isolation_level": "repeatable read"}}, True),
        (fine, False),
    ):
        conns = {"other": SimpleNamespace(vendor="mysql", settings_dict=settings_dict)}
        found = {m.id for m in io_checks.isolation_errors(conns)}
        assert ("idempotent_orders.E034" in found) is fires
    # PostgreSQL and SQLite read what others committed whatever their options say.
    others = {
        name: SimpleNamespace(vendor=name, settings_dict=mysql) for name in ("postgresql", "sqlite")
    }
    assert io_checks.isolation_errors(others) == []

    class _Connections(dict):  # an alias whose backend's driver is not installed
        def __getitem__(self, alias: str) -> Any:
            if alias == "legacy":
                raise ImproperlyConfigured("Error loading MySQLdb module.")
            return super().__getitem__(alias)

    loading = _Connections(other=SimpleNamespace(vendor="mysql", settings_dict=mysql), legacy=None)
    found = io_checks.isolation_errors(loading)
    assert [m.id for m in found] == ["idempotent_orders.E034", "idempotent_orders.W034"]
    assert "'legacy'" in found[1].msg
    assert "MySQLdb" in found[1].msg
    # The test database itself (READ COMMITTED on the MariaDB leg) passes.
    assert io_checks.check_isolation() == []


def test_the_archived_django_fsm_over_django_fsm_2_is_said_plainly(tmp_path: Any) -> None:
    """A django_fsm without the names the app needs shadowing django-fsm-2's: setup says what
    and how to mend (the throwaway venv of tests/project/test_fsm_package.py does it with pip)."""
    fake = tmp_path / "django_fsm"
    fake.mkdir()
    # FSMField and transition, but neither FSMModelMixin nor State.
    (fake / "__init__.py").write_text(
        "class FSMField: pass\ndef transition(*a, **k):\n    return lambda f: f\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr
    assert "pip uninstall -y django-fsm django-fsm-2 && pip install django-fsm-2" in done.stderr


class _Router:
    """Writes the app's inbox to database ``elsewhere`` (whatever its vendor)."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "elsewhere" if model._meta.model_name == "processedmessage" else None


def test_the_apps_tables_on_a_database_it_does_not_know(monkeypatch) -> None:
    import django.db

    from idempotent_orders.checks import delivery

    # The leg's own database is one the app knows.
    assert delivery.check_database_vendor() == []
    # The inbox routed to a database of a vendor the app has no class for.
    stand_in = SimpleNamespace(
        vendor="oracle", settings_dict={"ENGINE": "django.db.backends.oracle"}
    )
    monkeypatch.setattr(
        django.db, "connections", _Connections(django.db.connections, {"elsewhere": stand_in})
    )
    with override_settings(DATABASE_ROUTERS=[f"{__name__}._Router"]):
        found = delivery.check_database_vendor()
    assert [m.id for m in found] == ["idempotent_orders.W032"]
    assert "'elsewhere' (django.db.backends.oracle)" in found[0].msg


class _Connections:
    """Django's connections, with some aliases answered by stand-ins."""

    def __init__(self, handler: Any, stand_ins: dict[str, Any]) -> None:
        self.handler = handler
        self.stand_ins = stand_ins

    def __getitem__(self, alias: str) -> Any:
        return self.stand_ins.get(alias) or self.handler[alias]
