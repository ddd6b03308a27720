"""Management command names: the app's own, not ones another app could also take."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command, find_commands

import idempotent_orders
from idempotent_orders import stats

COMMANDS = Path(idempotent_orders.__file__).parent / "management"
#: Words that tie a command name to this app when it does not start with its label.
OWN_WORDS = ("idempotent", "idempotency", "orders", "outbox", "parked")


def test_every_command_name_says_whose_it_is() -> None:
    names = set(find_commands(str(COMMANDS)))
    assert "idempotent_orders_stats" in names
    generic = {
        name
        for name in names
        if not name.startswith("idempotent_orders_")
        and not any(word in name.split("_") for word in OWN_WORDS)
    }
    assert generic == set()


@pytest.mark.django_db  # the command reads the outbox rows too
def test_the_stats_command_reports_the_counts_as_json(settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"DEDUP_CACHE_ALIAS": ""}  # counts stay in this process
    stats.reset()
    stats.incr("outcome:applied")
    out = StringIO()
    call_command("idempotent_orders_stats", "--json", stdout=out)
    assert json.loads(out.getvalue())["outcome:applied"] == 1
