"""The pytest plugin: the ``exactly_once`` fixture.

Registered as the ``idempotent_orders`` entry point (``pytest11``), so installing the
app makes it available; it only defines fixtures (nothing autouse, no hooks, no
options), and imports nothing of Django until a test asks for a fixture. Load it by
hand with ``pytest -p idempotent_orders.testing.plugin``; turn it off with
``-p no:idempotent_orders``.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from idempotent_orders.testing.kit import ExactlyOnce


@pytest.fixture
def exactly_once(request: pytest.FixtureRequest) -> ExactlyOnce:
    """The testing kit, with a random generator seeded from the test's id.

    ``exactly_once.shuffled_copies(messages)``, ``.deliver(...)``,
    ``.deliver_in_batches(...)``, ``.deliver_from_threads(...)``,
    ``.deliver_from_event_loop(...)``, ``.crash_at(point)``, ``.watch_effects(...)`` and
    ``.assert_exactly_once(orders, messages)``: see :mod:`idempotent_orders.testing.kit`.
    Asks for the database itself unless the test already has it: ``transactional_db``,
    so that deliveries commit as in production (no test transaction around them, and
    ``on_commit`` callbacks run).
    """
    if not {"db", "transactional_db"} & set(request.fixturenames) and not any(
        m.name == "django_db" for m in request.node.iter_markers()
    ):
        request.getfixturevalue("transactional_db")
    from idempotent_orders.testing.kit import ExactlyOnce

    seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("exactly_once_seed", seed))
    return ExactlyOnce(seed)
