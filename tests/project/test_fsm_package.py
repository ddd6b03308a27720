"""Which package provides ``django_fsm``: django-fsm-2, the original django-fsm, or both mixed.

The checks E004/W004 read the distributions' metadata and their records of the files; the
last test reproduces a shop's install in a throwaway venv: django-fsm-2, then the original
installed over it, then the original uninstalled (an empty namespace package), then the
repair the message gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from idempotent_orders.checks import check_fsm_package, fsm_package_messages
from idempotent_orders.fsm import FSM2, ORIGINAL, REINSTALL_FSM2, Installed, installed
from tests.support.services import ROOT

SITE = "/venv/lib/python3.11/site-packages/django_fsm"


def ids(found: Installed) -> list[str | None]:
    return [m.id for m in fsm_package_messages(found)]


def test_django_fsm_2_with_its_own_files_is_silent() -> None:
    assert ids(Installed({FSM2: "4.2.4"}, owner=FSM2, location=SITE)) == []


def test_the_original_alone_runs_with_a_warning_naming_it() -> None:
    [message] = fsm_package_messages(Installed({ORIGINAL: "2.8.2"}, owner=ORIGINAL, location=SITE))
    assert message.id == "idempotent_orders.W004"
    assert "django-fsm 2.8.2" in message.msg
    assert "pip uninstall -y django-fsm && pip install django-fsm-2" in message.hint


def test_both_installed_is_an_error_whichever_owns_the_files() -> None:
    for owner in (FSM2, ORIGINAL):
        found = Installed({FSM2: "4.2.4", ORIGINAL: "2.8.2"}, owner=owner, location=SITE)
        [message] = fsm_package_messages(found)
        assert message.id == "idempotent_orders.E004"
        assert f"are {owner}'s" in message.msg
        assert "installed: django-fsm 2.8.2, django-fsm-2 4.2.4;" in message.msg
        assert REINSTALL_FSM2 in message.hint
        assert "pip install django-fsm==2.8.2" in message.hint


def test_one_installed_without_its_files_is_an_error() -> None:
    found = Installed({FSM2: "4.2.4"}, owner=None, location=SITE, disowned=(FSM2,))
    [message] = fsm_package_messages(found)
    assert message.id == "idempotent_orders.E004"
    assert "none of theirs" in message.msg
    assert message.hint.startswith(f"Keep one, with its own files: {REINSTALL_FSM2};")


def test_the_check_names_the_package_this_leg_runs_on() -> None:
    """django-fsm-2 on every leg but the original django-fsm's (IO_TEST_DJANGO_FSM)."""
    expected, _, version = settings.DJANGO_FSM.partition("==")
    found = installed()
    assert found.owner == expected
    assert list(found.versions) == [expected]
    assert found.versions[expected].startswith(version)
    assert [m.id for m in check_fsm_package()] == (
        [] if expected == FSM2 else ["idempotent_orders.W004"]
    )


@pytest.mark.django_db
def test_refresh_from_db_reloads_the_protected_state_on_either_package(make_order: Any) -> None:
    """The original django-fsm's FSMModelMixin skips protected fields; the app's order not."""
    order = make_order()
    type(order).objects.filter(pk=order.pk).update(status="paid")
    order.refresh_from_db()
    assert order.status == "paid"


#: Run inside the throwaway venv: the real check function, loaded by its path (the checks
#: package would import the whole app), on what that venv has installed.
PROBE = """
import importlib.util, json, sys
from django.conf import settings
settings.configure()
try:
    import idempotent_orders.fsm
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "text": str(exc)}))
    sys.exit(0)
spec = importlib.util.spec_from_file_location("probe_fsm_package", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
found = [{"id": m.id, "msg": m.msg, "hint": m.hint} for m in module.check_fsm_package()]
print(json.dumps({"messages": found}))
"""


@pytest.mark.backends("sqlite")  # once per Django, not once per database
def test_a_half_overwritten_install_in_a_throwaway_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"

    def pip(command: str) -> None:
        """One ``pip ...`` command line, as the messages spell them, run for the venv."""
        args = command.split()
        assert args[0] == "pip"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), *args[1:], "-q"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr

    def probe() -> dict[str, object]:
        done = subprocess.run(
            [python, "-c", PROBE, ROOT / "idempotent_orders" / "checks" / "fsm_package.py"],
            env={**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": ""},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    import django

    pip(f"pip install Django=={django.__version__} django-fsm-2")
    assert probe() == {"messages": []}

    # The shop's pin installed after the app's requirement: pip says nothing.
    pip("pip install django-fsm==2.8.2")
    [error] = probe()["messages"]  # type: ignore[misc]
    assert error["id"] == "idempotent_orders.E004"
    assert "installed: django-fsm 2.8.2, django-fsm-2 " in error["msg"]
    assert "are django-fsm's" in error["msg"]

    # Uninstalling the pin removes the files both share: the module is an empty
    # namespace package, and importing the app says what happened and how to mend it.
    pip("pip uninstall -y django-fsm")
    broken = probe()
    assert broken["raised"] == "ImproperlyConfigured"
    text = str(broken["text"])
    assert "cannot import FSMField" in text
    assert "installed: django-fsm-2 " in text
    assert "an empty namespace package" in text
    repair = text.rpartition("Mend it with: ")[2]
    assert repair == REINSTALL_FSM2

    for command in repair.split(" && "):
        pip(command)
    assert probe() == {"messages": []}
