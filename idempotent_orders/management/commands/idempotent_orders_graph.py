"""Print an order model's state graph, read from its django-fsm-2 declarations."""

from __future__ import annotations

import re
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Model

from idempotent_orders import get_order_model
from idempotent_orders.consuming.graph import edges, state_field
from idempotent_orders.exceptions import UnknownTransition

FORMATS = ("mermaid", "dot")
_PLAIN_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def states(model: type[Model]) -> list[str]:
    """The model's states: its choices in order, then any state only a transition names."""
    seen = [str(value) for value, _ in state_field(model).flatchoices]
    for e in edges(model):
        for state in [*sorted(map(str, e.sources)), *sorted(map(str, e.targets))]:
            if state not in seen:
                seen.append(state)
    return seen


def initial_state(model: type[Model]) -> str | None:
    """The state field's default, when it has a plain one."""
    field = state_field(model)
    if not field.has_default():
        return None
    default = field.get_default()
    return None if default in (None, "") else str(default)


def _ordered_edges(model: type[Model]) -> list[tuple[str, str, str]]:
    """``(source, target, transition)`` for every declared source of every transition,
    in the order of the states (so the graph reads along the flow).
    """
    order = {state: i for i, state in enumerate(states(model))}
    found = [
        (str(source), str(source if e.targetless else target), e.name)
        for e in edges(model)
        for source in e.sources
        for target in ([source] if e.targetless else e.targets)
    ]
    return sorted(found, key=lambda t: (order[t[0]], order[t[1]], t[2]))


def _terminal(model: type[Model]) -> list[str]:
    sources = {source for source, _, _ in _ordered_edges(model)}
    return [state for state in states(model) if state not in sources]


def mermaid(model: type[Model]) -> str:
    """The graph as a Mermaid ``stateDiagram-v2``."""
    ids: dict[str, str] = {}
    lines = ["stateDiagram-v2"]
    for i, state in enumerate(states(model)):
        if _PLAIN_ID.match(state):
            ids[state] = state
        else:
            ids[state] = f"s{i}"
            label = state.replace('"', "'")
            lines.append(f'    state "{label}" as s{i}')
    start = initial_state(model)
    if start is not None and start in ids:
        lines.append(f"    [*] --> {ids[start]}")
    for source, target, name in _ordered_edges(model):
        lines.append(f"    {ids[source]} --> {ids[target]}: {name}")
    for state in _terminal(model):
        lines.append(f"    {ids[state]} --> [*]")
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def dot(model: type[Model]) -> str:
    """The graph as Graphviz DOT."""
    lines = [
        f"digraph {_quoted(model._meta.label)} {{",
        "    rankdir=LR;",
        '    node [shape=box, style=rounded, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=10];',
    ]
    terminal = set(_terminal(model))
    for state in states(model):
        extra = ", peripheries=2" if state in terminal else ""
        lines.append(f"    {_quoted(state)} [label={_quoted(state)}{extra}];")
    start = initial_state(model)
    if start is not None:
        lines.append("    __start__ [shape=point, width=0.15];")
        lines.append(f"    __start__ -> {_quoted(start)};")
    for source, target, name in _ordered_edges(model):
        lines.append(f"    {_quoted(source)} -> {_quoted(target)} [label={_quoted(name)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(model: type[Model], fmt: str = "mermaid") -> str:
    """``model``'s state graph in ``fmt`` (``"mermaid"`` or ``"dot"``)."""
    if fmt == "mermaid":
        return mermaid(model)
    if fmt == "dot":
        return dot(model)
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")


def resolve_model(label: str | None) -> type[Model]:
    """The model named ``app_label.Model``, or the configured order model."""
    if not label:
        return get_order_model()
    try:
        return apps.get_model(label)
    except (LookupError, ValueError) as exc:
        raise CommandError(f"--model {label!r}: {exc}") from None


class Command(BaseCommand):
    help = (
        "Print the order model's state graph (its django-fsm-2 transitions) as a Mermaid "
        "stateDiagram-v2 or Graphviz DOT."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=FORMATS, default="mermaid")
        parser.add_argument(
            "--model",
            metavar="APP_LABEL.MODEL",
            help="another model with an FSMField (default: the configured order model)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        model = resolve_model(options["model"])
        try:
            self.stdout.write(render(model, options["format"]), ending="")
        except UnknownTransition as exc:
            raise CommandError(f"{model._meta.label}: {exc}") from None
