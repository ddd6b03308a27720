"""Reference tables generated from the source: settings (conf.py) and system checks (checks/).

A setting's type is its ``Settings`` property's return annotation, the type the
system check E003 holds a configured value to.

Both are read with ``ast``/``tokenize`` rather than imported, so the
descriptions are the comments and message texts as written in the code.
Used by the MkDocs hook (``docs/gen/hooks.py``) and by ``tests/project/test_docs.py``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "idempotent_orders" / "conf.py"
CHECKS = ROOT / "idempotent_orders" / "checks"
CHECK_PREFIX = "idempotent_orders."


@dataclass(frozen=True)
class SettingDoc:
    name: str
    default: str  # the value's source text, as written in conf.py
    value: object  # the evaluated default
    comment: str  # the comment block directly above the key ("" when none)
    described_by: str  # the key whose comment describes this one (itself when it has one)
    type: str = ""  # what conf reads it as: the return annotation of its Settings property


#: Marks a run-time value inside a message text (an f-string field): ``OPEN expr CLOSE``.
OPEN, CLOSE = "\x00", "\x01"


@dataclass(frozen=True)
class CheckDoc:
    id: str  # "E030"
    level: str  # "Error" or "Warning"
    message: str  # run-time values as OPEN expr CLOSE
    hint: str
    function: str  # the check function that emits it

    @property
    def plain_message(self) -> str:
        """The message with run-time values shown as ``{expr}``."""
        return self.message.replace(OPEN, "{").replace(CLOSE, "}")


def _comments(source: str) -> dict[int, str]:
    """Full-line comments by line number."""
    found: dict[int, str] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            if lines[row - 1].strip().startswith("#"):
                found[row] = tok.string.lstrip("#").strip()
    return found


def settings_docs(path: Path = CONF) -> list[SettingDoc]:
    """Every key of ``DEFAULTS`` with its default and the comment above it, in source order."""
    source = path.read_text()
    tree = ast.parse(source)
    comments = _comments(source)
    target: ast.Dict | None = None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            names = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            named = any(isinstance(n, ast.Name) and n.id == "DEFAULTS" for n in names)
            if named and isinstance(node.value, ast.Dict):
                target = node.value
    if target is None:
        raise LookupError(f"no DEFAULTS dict literal in {path}")
    types = {
        fn.name: ast.unparse(fn.returns)
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "Settings"
        for fn in node.body
        if isinstance(fn, ast.FunctionDef)
        and fn.returns is not None
        and any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
    }
    docs: list[SettingDoc] = []
    leader = ""
    for key, value in zip(target.keys, target.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            raise ValueError(f"{path}:{getattr(key, 'lineno', '?')}: DEFAULTS keys must be strings")
        block: list[str] = []
        row = key.lineno - 1
        while row in comments:
            block.insert(0, comments[row])
            row -= 1
        comment = " ".join(block)
        if comment:
            leader = key.value
        docs.append(
            SettingDoc(
                name=key.value,
                default=ast.get_source_segment(source, value) or "",
                value=ast.literal_eval(_folded(value)),
                comment=comment,
                described_by=leader,
                type=types.get(key.value, ""),
            )
        )
    return docs


def _folded(node: ast.expr) -> ast.expr:
    """``node`` with constant arithmetic (``7 * 24 * 3600``) folded, for ``literal_eval``."""
    if isinstance(node, ast.BinOp):
        left, right = _folded(node.left), _folded(node.right)
        if isinstance(left, ast.Constant) and isinstance(right, ast.Constant):
            expr = ast.Expression(ast.BinOp(left, node.op, right))
            value = eval(compile(ast.fix_missing_locations(expr), "<default>", "eval"), {})
            return ast.Constant(value)
    return node


def _text(node: ast.expr | None, source: str) -> str:
    """A message argument as readable text: literals as written, f-string fields as ``{expr}``."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append(OPEN + (ast.get_source_segment(source, value.value) or "…") + CLOSE)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, source) + _text(node.right, source)
    return OPEN + (ast.get_source_segment(source, node) or "…") + CLOSE


def check_sources(path: Path = CHECKS) -> list[Path]:
    """The modules of the checks package ``path`` (or the one module ``path``), in name order."""
    return sorted(path.glob("*.py")) if path.is_dir() else [path]


def checks_docs(path: Path = CHECKS) -> list[CheckDoc]:
    """Every ``Error``/``Warning`` with a literal ``id="idempotent_orders.…"``, sorted by ID.

    ``path`` is the checks package (each of its modules read) or one module.
    """
    docs: dict[str, CheckDoc] = {}
    for module in check_sources(path):
        _module_checks(module.read_text(), docs)
    return sorted(docs.values(), key=lambda d: (d.id[1:], d.id[0]))


def _module_checks(source: str, docs: dict[str, CheckDoc]) -> None:
    """Add the checks of one module's ``source`` to ``docs`` (an ID already there is kept)."""
    tree = ast.parse(source)
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("Error", "Warning"):
                continue
            kwargs = {k.arg: k.value for k in node.keywords if k.arg}
            ident = kwargs.get("id")
            if not (isinstance(ident, ast.Constant) and isinstance(ident.value, str)):
                continue
            if not ident.value.startswith(CHECK_PREFIX):
                continue
            short = ident.value.removeprefix(CHECK_PREFIX)
            if short in docs:
                continue  # the same ID raised at two places: the first one describes it
            docs[short] = CheckDoc(
                id=short,
                level=node.func.id,
                message=_text(node.args[0] if node.args else kwargs.get("msg"), source),
                hint=_text(kwargs.get("hint"), source),
                function=func.name,
            )


def _cell(text: str) -> str:
    """``text`` on one line, its pipes escaped except inside code spans (where the table
    extension does not split and an escape would show)."""
    parts = re.split(r"(`+)", text.replace("\n", " "))
    out, fence = [], ""
    for part in parts:
        if part.startswith("`"):
            fence = "" if part == fence else (fence or part)
        elif not fence:
            part = part.replace("|", "\\|")
        out.append(part)
    return "".join(out)


def _prose(text: str) -> str:
    """A message or hint as a table cell: literal text escaped, run-time values as code."""
    out = []
    for i, part in enumerate(text.split(OPEN)):
        value, _, rest = part.partition(CLOSE) if i else ("", "", part)
        if i:
            out.append(_code("{" + value + "}"))
        literal = rest.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        for char in "\\`*_[]":
            literal = literal.replace(char, "\\" + char)
        out.append(_cell(literal))
    return "".join(out)


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return _cell(f"{fence}{pad}{text}{pad}{fence}")


def settings_table(docs: list[SettingDoc] | None = None) -> str:
    """The settings reference as a Markdown table."""
    docs = settings_docs() if docs is None else docs
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for d in docs:
        default = _code(d.default)
        if isinstance(d.value, int | float) and d.default != repr(d.value):
            default = f"{_code(repr(d.value))} ({default})"
        if d.comment:
            text = _cell(d.comment)
        elif d.described_by:
            text = f"*No comment of its own in `conf.py`; listed under `{d.described_by}`.*"
        else:
            text = ""
        rows.append(
            f"| <code class='io-key' id='{d.name.lower()}'>{d.name}</code> | {_code(d.type)} "
            f"| {default} | {text} |"
        )
    return "\n".join(rows) + "\n"


def checks_table(docs: list[CheckDoc] | None = None) -> str:
    """The system checks reference as a Markdown table."""
    docs = checks_docs() if docs is None else docs
    rows = ["| ID | level | message | hint |", "|---|---|---|---|"]
    for d in docs:
        rows.append(
            f"| <code class='io-key' id='{d.id.lower()}'>{d.id}</code> | {d.level} "
            f"| {_prose(d.message)} | {_prose(d.hint)} |"
        )
    return "\n".join(rows) + "\n"
