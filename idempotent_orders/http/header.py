"""The request's side of a key: the ``Idempotency-Key`` header, the body, the fingerprint.

The key is parsed (the quoted sf-string ``"abc"`` or the bare ``abc``); the
body is read within ``MAX_REQUEST_BYTES``; the request is fingerprinted over
method, path, query and body, so a key reused for another request is told
apart. Nothing here touches the database.
"""

from __future__ import annotations

import hashlib

from django.http import HttpRequest

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import BodyTooLarge, KeyInvalid

__all__ = [
    "HEADER",
    "TOKEN_PREFIX",
    "UNSAFE_METHODS",
    "check_length",
    "fingerprint",
    "header_key",
    "parse_key",
    "read_body",
]

HEADER = "Idempotency-Key"
#: Server-issued tokens start with this; client keys must not.
TOKEN_PREFIX = "iot_"
#: Methods an idempotency key applies to; safe methods pass straight through.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def parse_key(raw: str) -> str:
    """The key of an ``Idempotency-Key`` header value; raise :class:`KeyInvalid`.

    Accepts an RFC 8941 sf-string (``"abc"``, with ``\\"`` and ``\\\\`` escapes)
    and, as many clients send it, the bare key. Keys are printable ASCII,
    non-empty and at most ``KEY_MAX_LENGTH`` characters.
    """
    value = raw.strip(" \t")
    if len(value) >= 2 and value[0] == '"':
        if value[-1] != '"':
            raise KeyInvalid("unterminated quoted Idempotency-Key")
        chars: list[str] = []
        escaped = False
        for char in value[1:-1]:
            if escaped:
                if char not in '"\\':
                    raise KeyInvalid("invalid escape in quoted Idempotency-Key")
                chars.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                raise KeyInvalid("unescaped quote inside Idempotency-Key")
            else:
                chars.append(char)
        if escaped:
            raise KeyInvalid("dangling escape in quoted Idempotency-Key")
        key = "".join(chars)
    else:
        key = value
        if any(c in key for c in ' "\\'):
            raise KeyInvalid("a bare Idempotency-Key must not contain spaces, quotes or '\\'")
    if not key:
        raise KeyInvalid("Idempotency-Key is empty")
    if not (key.isascii() and key.isprintable()):  # " " to "~"
        raise KeyInvalid("Idempotency-Key must be printable ASCII")
    limit = min(conf.KEY_MAX_LENGTH, 255)
    if len(key) > limit:
        raise KeyInvalid(f"Idempotency-Key is {len(key)} characters, the limit is {limit}")
    return key


_HEADER_META = "HTTP_" + HEADER.upper().replace("-", "_")


def header_key(request: HttpRequest) -> str | None:
    """The key of the request's ``Idempotency-Key`` header, or None without one."""
    raw = request.META.get(_HEADER_META)  # request.headers would parse every header
    if raw is None:
        return None
    return parse_key(raw)


def check_length(request: HttpRequest) -> None:
    limit = conf.MAX_REQUEST_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        raise BodyTooLarge(f"request body is {declared} bytes, the limit is {limit}")


def read_body(request: HttpRequest) -> bytes:
    """The request body within ``MAX_REQUEST_BYTES``; raise :class:`BodyTooLarge`."""
    limit = conf.MAX_REQUEST_BYTES
    check_length(request)
    body = request.body
    if len(body) > limit:
        raise BodyTooLarge(f"request body is {len(body)} bytes, the limit is {limit}")
    return body


def fingerprint(request: HttpRequest, body: bytes) -> str:
    digest = hashlib.sha256()
    for part in (request.method or "", request.path, request.META.get("QUERY_STRING", "")):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\n")
    digest.update(body)
    return digest.hexdigest()
