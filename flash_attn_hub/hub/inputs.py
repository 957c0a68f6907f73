"""What the embedded Hub reads from a request, within limits that keep one client from
holding the server or its memory.

* A body is read only when a route asks for it, after the route's own checks (the write
  token first): a refused request never costs its body.
* Every body has a size limit (``413`` when a declared ``Content-Length`` or the bytes read
  pass it) and an idle limit between two chunks (``408``).
* JSON is checked field by field: valid JSON of the wrong shape is a ``400`` naming the
  field and what it must be, never a server error.

The HTTP framing itself (a bad ``Content-Length`` or chunk size, a header too large) is
uvicorn's and h11's to refuse, before a request reaches the routes.
"""

from __future__ import annotations

import json
from typing import BinaryIO

import anyio
from starlette.requests import ClientDisconnect, Request

from .store import HubError

__all__ = ["ClientDisconnect", "has_body", "iter_body", "read_body", "spool_body", "drain", "json_value",
           "json_object", "field"]

_TYPE_NAMES = {str: "a string", dict: "a JSON object", list: "a JSON array", bool: "true or false",
               int: "an integer"}


def has_body(request: Request) -> bool:
    """Whether the request carries a body (h11 has already checked the framing headers)."""
    if "transfer-encoding" in request.headers:
        return True
    return request.headers.get("content-length", "0").strip() not in ("", "0")


def _done(request: Request) -> None:
    request.state.body_read = True


async def iter_body(request: Request, *, limit: int, idle_timeout: float, what: str = "Request body"):
    """The body's chunks; HubError 413 past ``limit`` bytes, 408 after ``idle_timeout`` seconds
    without data; ``ClientDisconnect`` when the client goes away."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and "transfer-encoding" not in request.headers and int(declared) > limit:
        raise HubError(413, f"{what} of {int(declared)} bytes is over this Hub's limit of {limit} bytes")
    total = 0
    more = has_body(request)
    while more:
        with anyio.move_on_after(idle_timeout) as waited:
            message = await request.receive()
        if waited.cancelled_caught:
            raise HubError(408, f"{what}: no data for {idle_timeout:g} s")
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        total += len(chunk)
        if total > limit:
            raise HubError(413, f"{what} is over this Hub's limit of {limit} bytes")
        if chunk:
            yield chunk
    _done(request)


async def read_body(request: Request, *, limit: int, idle_timeout: float, what: str = "Request body") -> bytes:
    """The whole body in memory (for the small JSON and form bodies; ``limit`` bounds it)."""
    return b"".join([chunk async for chunk in iter_body(request, limit=limit, idle_timeout=idle_timeout,
                                                          what=what)])


async def spool_body(request: Request, handle: BinaryIO, *, limit: int, idle_timeout: float,
                     what: str = "Request body") -> int:
    """Write the body to ``handle`` as it arrives; returns its size."""
    total = 0
    async for chunk in iter_body(request, limit=limit, idle_timeout=idle_timeout, what=what):
        handle.write(chunk)
        total += len(chunk)
    return total


async def drain(request: Request, *, limit: int, idle_timeout: float) -> bool:
    """Read and discard what is left of a body the route did not read (a refused request), so
    the connection can serve the next one; False when more than ``limit`` bytes remain, the
    client stalls or leaves: the caller must then close the connection."""
    if not has_body(request) or getattr(request.state, "body_read", False):
        return True
    try:
        async for _ in iter_body(request, limit=limit, idle_timeout=idle_timeout):
            pass
    except (HubError, ClientDisconnect):
        return False
    return True


def json_value(raw: bytes, what: str):
    """``raw`` parsed as JSON; HubError 400 for bytes that are not UTF-8 JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise HubError(400, f"{what} is not valid JSON: {type(err).__name__}: {str(err)[:200]}") from None


def json_object(raw: bytes, what: str, *, empty_ok: bool = True) -> dict:
    """``raw`` parsed as a JSON object (an empty body is ``{}`` when ``empty_ok``)."""
    if empty_ok and not raw.strip():
        return {}
    value = json_value(raw, what)
    if not isinstance(value, dict):
        raise HubError(400, f"{what} must be a JSON object, got {_kind(value)}")
    return value


def _kind(value) -> str:
    return "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)


def field(obj: dict, key: str, kind: type, what: str, *, required: bool = False, default=None):
    """``obj[key]`` checked to be of ``kind`` (a string must also be valid UTF-8, which a JSON
    escape of a lone surrogate is not); a missing key or null gives ``default``, or HubError 400
    when ``required``."""
    value = obj.get(key)
    if value is None:
        if required:
            raise HubError(400, f"{what}: {key!r} is required")
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HubError(400, f"{what}: {key!r} must be {_TYPE_NAMES.get(kind, kind.__name__)}, got {_kind(value)}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise HubError(400, f"{what}: {key!r} is not valid UTF-8 (a lone surrogate)") from None
    return value
