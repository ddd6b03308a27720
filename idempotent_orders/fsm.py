"""The ``django_fsm`` names the app builds on, imported in one place, and which package gave them.

Two distributions install the module ``django_fsm``: django-fsm-2 (what the app requires)
and the original ``django-fsm`` it was forked from (2.8.x, archived; 3.x is the same code
with a warning that it moved to ``viewflow.fsm``). The app runs on either: the original
lacks the names ``ANY_STATE`` and ``ANY_OTHER_STATE``, which are only the strings ``"*"``
and ``"+"`` it uses itself, so they are taken from here.

pip installs both side by side without a word (``pip check`` is content) and whichever
was installed last owns the files; uninstalling either one afterwards removes the files
both share, leaving an empty namespace package without ``FSMField``. :func:`installed`
reads what is there from the distributions' metadata and their records of the files, for
the system checks E004/W004 and for the error raised here when the module cannot give
the names the app needs.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

#: The distribution the app requires, and the original it descends from.
FSM2, ORIGINAL = "django-fsm-2", "django-fsm"
#: Removing both and installing one is the only clean way back: uninstalling one of
#: two installs removes the files they share.
REINSTALL_FSM2 = "pip uninstall -y django-fsm django-fsm-2 && pip install django-fsm-2"


@dataclass(frozen=True)
class Installed:
    """What provides the module ``django_fsm`` here."""

    #: Installed distributions that claim the module, by name, with their versions.
    versions: dict[str, str]
    #: The distribution whose record matches the module's ``__init__.py`` on disk, or
    #: ``None`` (no such file: an empty namespace package; or files nobody recorded).
    owner: str | None
    #: Where the module was found (``None``: nowhere).
    location: str | None
    #: Installed distributions whose record of ``django_fsm/__init__.py`` at that place
    #: is not the file there (another's content, or no file at all).
    disowned: tuple[str, ...] = ()

    @property
    def mixed(self) -> bool:
        """Both installed, or one installed whose files are not (all) there as it left them."""
        return len(self.versions) > 1 or bool(self.disowned)

    def describe(self) -> str:
        """One sentence: which distributions are installed and whose files are there."""
        named = ", ".join(f"{name} {version}" for name, version in sorted(self.versions.items()))
        installed = f"installed: {named}" if named else "no django-fsm distribution installed"
        if self.location is None:
            files = "no module django_fsm found"
        elif self.owner is None:
            files = f"the module django_fsm at {self.location} is none of theirs"
            if not Path(self.location, "__init__.py").exists():
                files += " (an empty namespace package: the files were uninstalled)"
        else:
            files = f"the files of django_fsm at {self.location} are {self.owner}'s"
        return f"{installed}; {files}"

    def repair(self) -> str:
        """The commands that leave one distribution with its own files."""
        keep_original = ""
        if ORIGINAL in self.versions:
            keep_original = (
                f" (or, to stay on the original: pip uninstall -y django-fsm django-fsm-2 && "
                f"pip install django-fsm=={self.versions[ORIGINAL]})"
            )
        return f"{REINSTALL_FSM2}{keep_original}"


def _digest(path: Path) -> str:
    """A file's sha256 as a wheel's RECORD spells it."""
    raw = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _record(dist: metadata.Distribution, init: Path) -> bool | None:
    """Whether ``dist``'s RECORD lists ``init`` with the content on disk (``None``: it does
    not list that file there, as an editable install or another location)."""
    for entry in dist.files or ():
        if entry.as_posix() != "django_fsm/__init__.py" or entry.hash is None:
            continue
        if Path(str(dist.locate_file(entry))).resolve() != init.resolve():
            continue
        return init.exists() and f"{entry.hash.mode}={entry.hash.value}" == _digest(init)
    return None


def installed() -> Installed:
    """Read which distributions provide ``django_fsm`` and whose files are there (no import)."""
    dists: dict[str, metadata.Distribution] = {}
    for name in (FSM2, ORIGINAL):
        try:
            dists[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    spec = importlib.util.find_spec("django_fsm")
    location: str | None = None
    owner: str | None = None
    disowned: list[str] = []
    if spec is not None and spec.submodule_search_locations:
        location = str(next(iter(spec.submodule_search_locations)))
        init = Path(location, "__init__.py")
        for name, dist in dists.items():
            recorded = _record(dist, init)
            if recorded:
                owner = name
            elif recorded is False:
                disowned.append(name)
    return Installed(
        versions={name: dist.version for name, dist in dists.items()},
        owner=owner,
        location=location,
        disowned=tuple(disowned),
    )


#: What a project meets when the module ``django_fsm`` cannot give the app its names.
BROKEN = (
    "idempotent_orders cannot import {names} from django_fsm ({detail}); {found}. Both "
    "django-fsm-2 and the original django-fsm install the module django_fsm: installed "
    "over each other, then one uninstalled, they leave it empty or mixed. Mend it with: "
    "{repair}"
)

try:
    import django_fsm
    from django_fsm import FSMField, FSMFieldMixin, State, transition
    from django_fsm import FSMModelMixin as _FSMModelMixin
except ImportError as exc:  # exercised in subprocesses and a throwaway venv by the tests
    found = installed()
    raise ImproperlyConfigured(
        BROKEN.format(
            names="FSMField, FSMFieldMixin, FSMModelMixin, State, transition",
            detail=exc,
            found=found.describe(),
            repair=found.repair(),
        )
    ) from exc

#: Whether this ``django_fsm`` is django-fsm-2's (the original lacks the names it added).
IS_FSM2 = hasattr(django_fsm, "ANY_OTHER_STATE")

#: ``source="*"``: every state. django-fsm-2 names it; the original spells it as the string.
ANY_STATE: str = getattr(django_fsm, "ANY_STATE", "*")
#: ``source="+"``: every state but the target. As ``ANY_STATE``.
ANY_OTHER_STATE: str = getattr(django_fsm, "ANY_OTHER_STATE", "+")


class FSMModelMixin(_FSMModelMixin):
    """``django_fsm.FSMModelMixin`` whose ``refresh_from_db()`` reloads protected state fields.

    django-fsm-2's does; the original django-fsm's skips them (an order refreshed after a
    consumer moved it would keep its old state). The same code on either package.
    """

    def refresh_from_db(self, *args: Any, **kwargs: Any) -> None:
        if IS_FSM2:
            super().refresh_from_db(*args, **kwargs)
            return
        protected = [
            field
            for field in self._meta.concrete_fields
            if isinstance(field, FSMFieldMixin) and field.protected
        ]
        for field in protected:
            field.protected = False
        try:
            super().refresh_from_db(*args, **kwargs)
        finally:
            for field in protected:
                field.protected = True


__all__ = [
    "ANY_OTHER_STATE",
    "ANY_STATE",
    "FSM2",
    "IS_FSM2",
    "ORIGINAL",
    "FSMField",
    "FSMFieldMixin",
    "FSMModelMixin",
    "Installed",
    "State",
    "installed",
    "transition",
]
