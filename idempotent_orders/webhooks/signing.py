"""Signature schemes over the raw request body: generic HMAC-SHA256, Stripe's ``t=…,v1=…``
and Standard Webhooks 1.0 (``webhook-id``, ``webhook-timestamp``, ``webhook-signature``)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable


class SignatureError(Exception):
    """The request is not signed by the provider (or not recently): answered 4xx, recorded."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def hmac_sha256(secret: str, payload: bytes) -> str:
    """Hex HMAC-SHA256 of ``payload`` under ``secret``."""
    return hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest()


def _matches(expected: Iterable[str], given: Iterable[str]) -> bool:
    # Every pair is compared, in constant time each: no early exit tells which one matched.
    found = False
    for want in expected:
        for got in given:
            found |= hmac.compare_digest(want, got)
    return found


def _timestamp(raw: str, tolerance: int, now: float | None) -> int:
    try:
        stamp = int(raw)
    except ValueError:
        raise SignatureError(
            "webhook-signature-malformed", "the timestamp is not an integer"
        ) from None
    age = (time.time() if now is None else now) - stamp
    if abs(age) > tolerance:
        raise SignatureError(
            "webhook-timestamp-outside-tolerance",
            f"the signature's timestamp is {int(age)}s away from now; at most {tolerance}s "
            "is accepted (a replayed or delayed request)",
        )
    return stamp


def sign_hmac(secret: str, body: bytes, *, timestamp: int | None = None) -> str:
    """The generic scheme's signature header value: ``sha256=<hex>`` of the body, or of
    ``"<timestamp>.<body>"`` when the provider sends a timestamp header."""
    payload = body if timestamp is None else f"{timestamp}.".encode() + body
    return f"sha256={hmac_sha256(secret, payload)}"


def verify_hmac(
    body: bytes,
    signature: str | None,
    secrets: list[str],
    *,
    timestamp: str | None = None,
    tolerance: int = 300,
    now: float | None = None,
) -> None:
    """Raise :class:`SignatureError` unless ``signature`` (hex, optionally ``sha256=``-prefixed)
    is the HMAC-SHA256 of the body (of ``"<timestamp>.<body>"`` when ``timestamp`` is given,
    within ``tolerance`` seconds of now) under one of ``secrets``."""
    if not signature:
        raise SignatureError("webhook-signature-missing", "the request carries no signature")
    given = signature.strip()
    given = given.removeprefix("sha256=")
    payload = body
    if timestamp is not None:
        stamp = _timestamp(timestamp, tolerance, now)
        payload = f"{stamp}.".encode() + body
    if not _matches([hmac_sha256(s, payload) for s in secrets], [given.lower()]):
        raise SignatureError(
            "webhook-signature-invalid", "the signature does not match the body under any secret"
        )


def stripe_signature(secret: str, body: bytes, *, timestamp: int | None = None) -> str:
    """A ``Stripe-Signature`` header value for ``body`` (tests and the demo's fake provider)."""
    stamp = int(time.time()) if timestamp is None else timestamp
    return f"t={stamp},v1={hmac_sha256(secret, f'{stamp}.'.encode() + body)}"


def verify_stripe(
    body: bytes,
    header: str | None,
    secrets: list[str],
    *,
    tolerance: int = 300,
    now: float | None = None,
) -> None:
    """Raise :class:`SignatureError` unless ``header`` (``t=<unix>,v1=<hex>[,v1=…]``) holds
    a ``v1`` HMAC-SHA256 of ``"<t>.<body>"`` under one of ``secrets`` and ``t`` is within
    ``tolerance`` seconds of now. ``v0`` and unknown schemes are ignored, as Stripe says."""
    if not header:
        raise SignatureError("webhook-signature-missing", "no Stripe-Signature header")
    stamps: list[str] = []
    signatures: list[str] = []
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            stamps.append(value)
        elif key == "v1":
            signatures.append(value.lower())
    if len(stamps) != 1 or not signatures:
        raise SignatureError(
            "webhook-signature-malformed",
            "the Stripe-Signature header needs one t= and at least one v1=",
        )
    stamp = _timestamp(stamps[0], tolerance, now)
    payload = f"{stamp}.".encode() + body
    if not _matches([hmac_sha256(s, payload) for s in secrets], signatures):
        raise SignatureError(
            "webhook-signature-invalid", "no v1 signature matches the body under any secret"
        )


#: The prefix of a Standard Webhooks secret (the rest is the key, base64).
STANDARD_SECRET_PREFIX = "whsec_"
#: The headers of the Standard Webhooks scheme.
STANDARD_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


def standard_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: ``whsec_<base64>`` (the prefix is
    optional); ``ValueError`` when the rest is not base64 or is empty."""
    raw = secret.removeprefix(STANDARD_SECRET_PREFIX)
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a Standard Webhooks secret is whsec_ and a base64 key") from None
    if not key:
        raise ValueError("a Standard Webhooks secret's key is empty")
    return key


def standard_signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for ``body``: ``v1,<base64 HMAC-SHA256>`` of
    ``"<msg_id>.<timestamp>.<body>"`` under the secret's key."""
    payload = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(standard_key(secret), payload, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(digest).decode('ascii')}"


def verify_standard(
    body: bytes,
    msg_id: str | None,
    timestamp: str | None,
    signature: str | None,
    secrets: list[str],
    *,
    tolerance: int = 300,
    now: float | None = None,
) -> None:
    """Raise :class:`SignatureError` unless ``signature`` (space-separated
    ``<version>,<base64>`` entries) holds a ``v1`` signature of ``msg_id``,
    ``timestamp`` and ``body`` under one of ``secrets`` and ``timestamp`` is within
    ``tolerance`` seconds of now. Other versions (``v1a``, ``v2``) are ignored."""
    if not (msg_id and timestamp and signature):
        given_headers = zip(STANDARD_HEADERS, (msg_id, timestamp, signature), strict=True)
        missing = [header for header, value in given_headers if not value]
        raise SignatureError("webhook-signature-missing", f"no {', '.join(missing)} header")
    given = []
    for entry in signature.split(" "):
        version, sep, value = entry.partition(",")
        if sep and version == "v1" and value:
            given.append(value)
    if not given:
        raise SignatureError(
            "webhook-signature-malformed", "the webhook-signature header holds no v1,<base64>"
        )
    stamp = _timestamp(timestamp, tolerance, now)
    expected = [standard_signature(s, msg_id, stamp, body).partition(",")[2] for s in secrets]
    if not _matches(expected, given):
        raise SignatureError(
            "webhook-signature-invalid", "no v1 signature matches the body under any secret"
        )
