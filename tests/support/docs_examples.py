"""The python blocks of the pages, and how each is shown to be code that runs.

Every python block of docs/*.md and README.md is one of:

- **run**: the line before its fence is ``<!-- example: NAME -->``, and a test executes it
  with ``run("NAME", namespace)`` (tests/project/test_docs_examples.py under the default order
  model, tests/swapped/test_docs_examples.py under ``shop.Order``), asserting its effect;
- **included**: it is a generated part ``<!-- gen:code path#region -->`` (docs/gen/hooks.py),
  the text of a region of a tested file, which ``make docs-gen`` writes into the page and
  tests/project/test_docs.py holds fresh;
- **fragment**: the line before its fence is ``<!-- fragment: why -->``: one line shown in
  its context, or code that needs what the project does not install. Kept few.

tests/project/test_docs.py fails on a block that is none of these, on a name no test runs, and on
a name two blocks carry.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
GENERATED = re.compile(
    r"^<!-- gen:code (?P<arg>\S+) -->\n(?P<body>.*?)^<!-- /gen:code -->$", re.MULTILINE | re.DOTALL
)
EXAMPLE = re.compile(r"<!-- example: (?P<name>[a-z0-9-]+) -->\n$")
_runs = itertools.count(1)
FRAGMENT = re.compile(r"<!-- fragment: (?P<why>[^>]+) -->\n$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    code: str
    kind: str  # "run", "included", "fragment" or "" (none: a failure)
    name: str  # the example's name, the included file region, or why it is a fragment

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def pages() -> list[Path]:
    """Every page of the site and the README."""
    site = sorted(p for p in DOCS.rglob("*.md") if "gen" not in p.relative_to(DOCS).parts)
    return [*site, ROOT / "README.md"]


def blocks(page: Path) -> list[Block]:
    return blocks_of(page.read_text(), page)


def blocks_of(text: str, page: Path) -> list[Block]:
    """The python blocks of a page's text, each with how it is shown to run."""
    generated = [(m.start("body"), m.end("body"), m["arg"]) for m in GENERATED.finditer(text)]
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        line = before.count("\n") + 1
        kind, name = "", ""
        inside = [arg for start, end, arg in generated if start <= match.start() < end]
        if inside:
            kind, name = "included", inside[0]
        elif example := EXAMPLE.search(before[-200:]):
            kind, name = "run", example["name"]
        elif fragment := FRAGMENT.search(before[-300:]):
            kind, name = "fragment", fragment["why"]
        found.append(Block(page, line, match["code"], kind, name))
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def example(name: str) -> Block:
    """The block marked ``<!-- example: name -->``."""
    [block] = [b for b in all_blocks() if b.kind == "run" and b.name == name]
    return block


def run(name: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute the example as written; ``namespace`` holds what the page's earlier code or
    the reader's project defines (a model, a user). Returns the namespace afterwards."""
    block = example(name)
    # A module name of its own each time: the tasks an example defines are named for it.
    scope: dict[str, Any] = {"__name__": f"docs_example_{name.replace('-', '_')}_{next(_runs)}"}
    scope.update(namespace or {})
    exec(compile(block.code, block.where, "exec"), scope)
    return scope


def evaluate(name: str, namespace: dict[str, Any] | None = None) -> Any:
    """The value of an example that is one expression (a dict shown on its own)."""
    block = example(name)
    return eval(compile(block.code, block.where, "eval"), dict(namespace or {}))
