"""Where the tests keep what they write: never the checkout.

``IO_TEST_SCRATCH``, else a folder of this checkout's own under the system's temporary
directory (two checkouts on one machine do not share it). It holds the test matrix's
logs and junit reports, the browser tests' pictures, Hypothesis's examples and the
bytecode of the test runs.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_OWN = hashlib.sha256(str(ROOT).encode()).hexdigest()[:10]
SCRATCH = Path(
    os.environ.get("IO_TEST_SCRATCH") or Path(tempfile.gettempdir()) / f"idempotent_orders-{_OWN}"
)
