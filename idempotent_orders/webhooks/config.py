"""The providers named in ``IDEMPOTENT_ORDERS["WEBHOOKS"]``, read and checked."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.utils.module_loading import import_string

from idempotent_orders.conf import conf
from idempotent_orders.webhooks.signing import standard_key

#: Signature schemes a provider may use ("standard": Standard Webhooks 1.0).
SCHEMES = ("stripe", "hmac", "standard")
#: Seconds a provider keeps retrying an event, by scheme, when RETRY_HORIZON is not given
#: (Stripe retries for up to three days; a generic or Standard Webhooks sender's horizon
#: is unknown: 0).
RETRY_HORIZONS = {"stripe": 3 * 24 * 3600, "hmac": 0, "standard": 0}
#: Keys a provider's dict may have.
KEYS = frozenset(
    {
        "SCHEME",
        "SECRET",
        "SECRETS",
        "EVENT_TYPES",
        "TO_MESSAGE",
        "CONSUMER",
        "TOLERANCE",
        "RETRY_HORIZON",
        "INLINE",
        "SIGNATURE_HEADER",
        "TIMESTAMP_HEADER",
        "ID_FIELD",
        "TYPE_FIELD",
    }
)

#: Turns a provider's event (the parsed JSON body) into ``(order_id, payload)``.
ToMessage = Callable[[Mapping[str, Any]], tuple[Any, dict[str, Any]]]


@dataclass(frozen=True)
class Provider:
    name: str
    scheme: str
    secrets: list[str]
    #: Provider event type -> message type.
    event_types: dict[str, str]
    to_message_path: str
    consumer: str = "payments"
    tolerance: int = 300
    retry_horizon: int = 0
    inline: bool = False
    signature_header: str = "X-Signature"
    timestamp_header: str = ""
    id_field: str = "id"
    type_field: str = "type"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_message(self, event: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        function: ToMessage = import_string(self.to_message_path)
        return function(event)


def problems(name: Any, raw: Any) -> list[str]:
    """What is wrong with one provider's settings (empty when nothing)."""
    if not isinstance(name, str) or not name or "/" in name:
        return [f"provider name {name!r} must be a non-empty string without '/'"]
    if not isinstance(raw, dict):
        return [f"provider {name!r} must be a dict, got {type(raw).__name__}"]
    found = []
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        found.append(f"provider {name!r} has unknown keys {unknown}")
    if raw.get("SCHEME") not in SCHEMES:
        found.append(f"provider {name!r}: SCHEME must be one of {list(SCHEMES)}")
    secrets = _secrets(raw)
    if not secrets or not all(isinstance(s, str) and s for s in secrets):
        found.append(f"provider {name!r} needs SECRET (or SECRETS), non-empty strings")
    elif raw.get("SCHEME") == "standard":
        for secret in secrets:
            try:
                standard_key(secret)
            except ValueError as exc:
                found.append(f"provider {name!r}: {exc}")
                break
    types = raw.get("EVENT_TYPES")
    if not isinstance(types, dict) or not types:
        found.append(f"provider {name!r}: EVENT_TYPES must map provider types to message types")
    path = raw.get("TO_MESSAGE")
    try:
        import_string(str(path))
    except ImportError as exc:
        found.append(f"provider {name!r}: TO_MESSAGE {path!r} cannot be imported: {exc}")
    for key in ("TOLERANCE", "RETRY_HORIZON"):
        value = raw.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            found.append(f"provider {name!r}: {key} must be a number of seconds")
    return found


def _secrets(raw: Mapping[str, Any]) -> list[Any]:
    if "SECRETS" in raw:
        value = raw["SECRETS"]
        return list(value) if isinstance(value, list | tuple) else [value]
    return [raw.get("SECRET")] if raw.get("SECRET") else []


def provider(name: str) -> Provider | None:
    """The provider configured as ``name``; None when there is none (or it is misconfigured,
    which system check ``idempotent_orders.E050`` reports)."""
    raw = conf.WEBHOOKS.get(name)
    if raw is None or problems(name, raw):
        return None
    scheme = raw["SCHEME"]
    return Provider(
        name=name,
        scheme=scheme,
        secrets=[str(s) for s in _secrets(raw)],
        event_types={str(k): str(v) for k, v in raw["EVENT_TYPES"].items()},
        to_message_path=str(raw["TO_MESSAGE"]),
        consumer=str(raw.get("CONSUMER", "payments")),
        tolerance=int(raw.get("TOLERANCE", 300)),
        retry_horizon=int(raw.get("RETRY_HORIZON", RETRY_HORIZONS[scheme])),
        inline=bool(raw.get("INLINE", False)),
        signature_header=str(raw.get("SIGNATURE_HEADER", "X-Signature")),
        timestamp_header=str(raw.get("TIMESTAMP_HEADER", "")),
        id_field=str(raw.get("ID_FIELD", "id")),
        type_field=str(raw.get("TYPE_FIELD", "type")),
    )


def providers() -> list[Provider]:
    """Every well-configured provider."""
    found = (provider(name) for name in conf.WEBHOOKS)
    return [p for p in found if p is not None]
