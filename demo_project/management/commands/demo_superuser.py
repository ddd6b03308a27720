"""``manage.py demo_superuser``: make sure the demo has an admin login, and say what it is.

Creates the superuser ``admin`` with a random password the first time (kept in
``admin-password`` in the demo's state folder, ``.demo/``) and prints where to log in;
if that file is gone, the password is set anew.
Later runs print the same login. Only for the demo: never run it in production.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

USERNAME = "admin"


class Command(BaseCommand):
    help = "Create the demo's superuser 'admin' if missing and print how to log into the admin."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000/admin/")

    def handle(self, *args: Any, **options: Any) -> None:
        folder = Path(getattr(settings, "STATE_DIR", None) or ".demo")
        folder.mkdir(parents=True, exist_ok=True)
        stored = folder / "admin-password"
        users = get_user_model()._default_manager
        user = users.filter(username=USERNAME).first()
        if user is None or not stored.exists():
            password = secrets.token_urlsafe(9)
            if user is None:
                users.create_superuser(USERNAME, "admin@example.com", password)
            else:
                user.set_password(password)
                user.save(update_fields=["password"])
            stored.write_text(password + "\n")
            stored.chmod(0o600)
        password = stored.read_text().strip()
        self.stdout.write(
            f"the admin: {options['url']}  (user {USERNAME}, password {password}; kept in {stored})"
        )
