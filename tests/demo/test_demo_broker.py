"""The demo's embedded broker never loses a message: producers and a polling consumer
race on one folder, in separate processes, and every message arrives whole.

kombu's own filesystem transport creates a message file before writing it; a
reader that takes the file in between reads it empty and dies, and the message
is gone. ``demo_project.broker`` writes aside and renames into place.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

# No database in it: one matrix leg per Django version is enough.
pytestmark = pytest.mark.backends("sqlite")

PRODUCERS = 3
EACH = 200


def _options(folder: Path) -> dict[str, Any]:
    # kombu keeps its exchange table in ``control_folder`` (``./control`` by default):
    # beside the queue's folder in the test's tmp_path, never in the checkout.
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder.parent / "control"),
        "store_processed": False,
        "polling_interval": 0.001,
    }


def _slow(dumps: Any) -> Any:
    """A busy machine: serialising a message takes a few milliseconds."""

    def slow(value: Any) -> Any:
        time.sleep(0.003)
        return dumps(value)

    return slow


def _produce(folder: str, transport: str, n: int, start: int) -> None:
    import kombu.transport.filesystem

    import demo_project.broker

    kombu.transport.filesystem.dumps = _slow(kombu.transport.filesystem.dumps)
    demo_project.broker.dumps = _slow(demo_project.broker.dumps)
    with Connection(
        "filesystem://", transport=transport, transport_options=_options(Path(folder))
    ) as conn:
        queue = conn.SimpleQueue("stress")
        for i in range(start, start + n):
            queue.put({"n": i, "pad": "x" * 2000})
        queue.close()


def _consume(folder: str, transport: str, total: int, out: str) -> None:
    got: list[int] = []
    errors: list[str] = []
    deadline = time.monotonic() + 10
    with Connection(
        "filesystem://", transport=transport, transport_options=_options(Path(folder))
    ) as conn:
        queue = conn.SimpleQueue("stress")
        while len(got) < total and time.monotonic() < deadline:
            try:
                message = queue.get(block=True, timeout=0.05)
            except queue.Empty:
                continue
            except Exception as exc:  # what kombu's own transport dies of
                errors.append(repr(exc)[:200])
                continue
            got.append(message.payload["n"])
            message.ack()
        queue.close()
    Path(out).write_text(json.dumps({"got": got, "errors": errors}))


@pytest.mark.parametrize(
    ("transport", "whole"),
    [("demo_project.broker:Transport", True), ("filesystem", False)],
    ids=["demo-broker", "kombu-filesystem"],
)
def test_the_embedded_broker_delivers_every_message_whole_under_load(
    tmp_path: Path, transport: str, whole: bool
) -> None:
    """The demo's broker delivers all of them; kombu's own (the control) does not."""
    folder = tmp_path / "queue"
    folder.mkdir()
    result = tmp_path / "result.json"
    total = PRODUCERS * EACH
    ctx = multiprocessing.get_context("spawn")
    consumer = ctx.Process(target=_consume, args=(str(folder), transport, total, str(result)))
    consumer.start()
    producers = [
        ctx.Process(target=_produce, args=(str(folder), transport, EACH, p * EACH))
        for p in range(PRODUCERS)
    ]
    for p in producers:
        p.start()
    for p in producers:
        p.join(60)
    consumer.join(90)
    outcome = json.loads(result.read_text())
    delivered = sorted(outcome["got"]) == list(range(total)) and not outcome["errors"]
    assert delivered is whole, outcome["errors"][:3]
    if whole:
        assert list(folder.iterdir()) == []  # nothing left behind, no half-written file
