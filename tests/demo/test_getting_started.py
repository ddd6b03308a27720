"""docs/getting-started.md, run as written in a fresh ``startproject``: the page cannot drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from tests.support.services import ROOT, require_service

pytestmark = pytest.mark.backends("postgresql")  # the page's reference setup; one leg

PAGE = ROOT / "docs" / "getting-started.md"


def blocks() -> list[tuple[str, str]]:
    """The page's fenced code blocks, in order: ``(language, code)``."""
    return re.findall(r"```(\w+)\n(.*?)```", PAGE.read_text(), flags=re.S)


def run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_getting_started_page_runs_as_written(tmp_path: Path) -> None:
    require_service("redis", settings.REDIS_URL)
    import psycopg

    code = blocks()
    langs = [lang for lang, _ in code]
    assert langs[:5] == ["sh", "python", "python", "python", "python"], langs
    settings_block, celery_block, init_block, urls_block = (c for _, c in code[1:5])
    first_message = next(c for lang, c in code if "consume_message(message" in c)
    keyed_request = next(c for lang, c in code if "HTTP_IDEMPOTENCY_KEY" in c)

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("IO_", "DJANGO_")) and k not in {"PYTHONPATH"}
    }
    run([sys.executable, "-m", "django", "startproject", "shop", "."], tmp_path, env)
    database = f"gs_{uuid.uuid4().hex[:10]}"
    # The page creates the database `shop`; this run uses a name of its own.
    settings_py = tmp_path / "shop" / "settings.py"
    settings_py.write_text(
        settings_py.read_text()
        + "\n"
        + settings_block.replace('"NAME": "shop"', f'"NAME": "{database}"')
    )
    (tmp_path / "shop" / "celery.py").write_text(celery_block)
    (tmp_path / "shop" / "__init__.py").write_text(init_block)
    (tmp_path / "shop" / "urls.py").write_text(urls_block)

    admin = psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True)
    admin.execute(f'CREATE DATABASE "{database}"')
    try:
        env["DJANGO_SETTINGS_MODULE"] = "shop.settings"
        run([sys.executable, "manage.py", "migrate", "-v0"], tmp_path, env)
        checked = subprocess.run(
            [sys.executable, "manage.py", "check"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "no issues" in checked.stdout
        out = run(
            [
                sys.executable,
                "manage.py",
                "shell",
                "-c",
                first_message
                + "\nprint('MESSAGE', consume_message(message, consumer='payments').value)"
                + "\nprint('ORDER', order.status, order.version, order.payment_id)\n"
                + keyed_request
                + "\nfrom idempotent_orders.models import Order, IdempotencyKey"
                + "\nprint('KEYED', r.status_code, r.json()['code'], Order.objects.count(),"
                + " IdempotencyKey.objects.get(key='first-order').response_status)",
            ],
            tmp_path,
            env,
        )
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.close()
    assert "MESSAGE duplicate" in out
    assert "ORDER paid 1 PAY-1" in out
    # The mismatching retry is refused; the first keyed request made the one new order.
    assert "KEYED 422 key-mismatch 2 201" in out
