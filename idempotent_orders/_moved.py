"""Old module paths and old names kept as deprecated aliases of what replaced them.

Each old module (``idempotent_orders.services``, ``engine``, ``transitions``,
``handlers``, ``statements``, ``presume``, ``batch``) answers attribute lookups
from its new home and warns once per name (``DeprecationWarning``); so do the
names a module gave up (``http.claims``' moved names, the renamed
``leases.Claim``, ``leases.Verdict`` and ``http.keys.Claim``). They are removed
in version 0.4.0.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

#: The release that removes the old paths.
REMOVED_IN = "0.4.0"


def moved(old: str, *new: str, renamed: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old`` that finds names in the ``new`` modules.

    ``renamed`` maps an old name of ``old`` to the dotted path of what replaced it
    (``"package.module.NewName"``).
    """
    warned: set[str] = set()

    def __getattr__(name: str) -> Any:
        if renamed and name in renamed:
            module_name, _, new_name = renamed[name].rpartition(".")
            if name not in warned:
                warned.add(name)
                warnings.warn(
                    f"{old}.{name} is now {module_name}.{new_name}; the old name is "
                    f"removed in {REMOVED_IN}",
                    DeprecationWarning,
                    stacklevel=2,
                )
            return getattr(importlib.import_module(module_name), new_name)
        for module_name in new:
            module = importlib.import_module(module_name)
            if hasattr(module, name):
                if name not in warned:
                    warned.add(name)
                    warnings.warn(
                        f"{old}.{name} moved to {module_name}.{name}; the old path is "
                        f"removed in {REMOVED_IN}",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
