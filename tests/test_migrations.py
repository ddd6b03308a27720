"""Models and migrations agree, and migrations do not depend on settings."""

from io import StringIO

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    out = StringIO()
    try:
        call_command("makemigrations", "idempotent_orders", "--check", "--dry-run", stdout=out)
    except SystemExit as exc:  # --check exits non-zero when a migration is missing
        pytest.fail(f"missing migration:\n{out.getvalue()} ({exc})")
