"""What the API process checks before a request's handler runs, and the limits it works under.

One pure-ASGI middleware (`RequestGuard`, so that streamed responses pass through untouched)
answers, in this order and before the body is read:

    check                                            refused with
    Host header not one this server answers to       421  (DNS rebinding: a page on evil.example
                                                           resolving to 127.0.0.1)
    any route but the open list, without the key     401  (every route that reads or costs, and
                                                           every one added later; /metrics and
                                                           the docs pages too with
                                                           --protect-metrics-and-docs)
    a body that is not application/json              415  (a web page's form or text/plain POST
                                                           needs no CORS preflight; JSON does; a
                                                           POST with no body, as RL clients send
                                                           /sleep?level=1, has none to check)
    a body over the limit                            413  (by Content-Length at once, else while
                                                           it streams in, never buffering more)

Open without a key (`_OPEN_PATHS`): `/health`, `/version`, `/metrics` and the docs pages, as in
vLLM, and the worker facts that sglang-router reads (`/get_model_info`, `/get_server_info`,
`/get_load` and their SGLang aliases). The key covers everything else, so a route added later
(the weight-update and sleep routes, pooling) is never open by omission.

`RequestLimits` travels to the API process in Hello; `check_nesting` is the iterative depth
check that JSON documents from a request (schemas, tool parameters) pass before any recursive
code (jsonschema, xgrammar, the json module) sees them.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tp_engine.server.api.http_errors import APIError, bad_request

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = ("0.0.0.0", "::", "")
_DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/metrics")
_ROUTER_PATHS = ("/get_model_info", "/model_info", "/get_server_info", "/server_info", "/get_load")
_OPEN_PATHS = frozenset(("/health", "/version", *_DOCS_PATHS, *_ROUTER_PATHS))
_BODY_METHODS = ("POST", "PUT", "PATCH")


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may make the server do (`launch/serve.py` flags)."""

    # --max-request-body-bytes: larger bodies get a 413 before they are read.
    max_body_bytes: int = 8 << 20
    # The Host header names the server must answer to; empty: any (a wildcard bind without
    # --allowed-hosts, or --allowed-hosts '*').
    allowed_hosts: tuple[str, ...] = field(default=LOOPBACK_HOSTS)
    # --protect-metrics-and-docs: /metrics and the docs pages need the API key too.
    protect_metrics_and_docs: bool = False
    # Output constraints (JSON schemas, regexes, grammars, tool parameters): bytes of their
    # text and nesting of a JSON document, checked before anything parses them...
    max_constraint_bytes: int = 256 << 10
    max_constraint_depth: int = 64
    # ...and the seconds their check (API process) and compilation (rank 0) may take.
    constraint_timeout_s: float = 30.0
    # Threads for tokenizing, rendering chat templates and checking constraints.
    request_workers: int = 4

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, values: dict[str, Any]) -> RequestLimits:
        return cls(**{**values, "allowed_hosts": tuple(values["allowed_hosts"])})


def allowed_hosts(bind_host: str, extra: Iterable[str] | None) -> tuple[str, ...]:
    """The Host names to answer to: the loopback names, the bound name, and `extra`
    (--allowed-hosts). A wildcard bind (0.0.0.0, ::) without `extra` answers to any name, as
    does an `extra` of '*': () stands for "any"."""
    extra = [h.strip().lower() for h in (extra or []) if h.strip()]
    if "*" in extra or (bind_host in _WILDCARD_BINDS and not extra):
        return ()
    names = [*LOOPBACK_HOSTS, *extra]
    if bind_host not in _WILDCARD_BINDS:
        names.append(bind_host.lower().strip("[]"))
    return tuple(dict.fromkeys(names))


def exposure_warning(bind_host: str, api_key: str | None) -> str | None:
    """The warning to log when the server listens beyond loopback without an API key."""
    if api_key is not None or _is_loopback(bind_host):
        return None
    return (
        f"the server listens on {bind_host!r}, beyond this machine's loopback, WITHOUT an API "
        "key: anyone who can reach the port can run the model, tokenize, and read the metrics. "
        "Pass --api-key (or set TP_ENGINE_API_KEY), or bind 127.0.0.1."
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def host_name(header: bytes) -> str:
    """The name of a Host header, without its port: "[::1]:8000" -> "::1"."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class RequestGuard:
    """The checks of the module docstring, before the app sees a request."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, api_key: str | None) -> None:
        self.app = app
        self.limits = limits
        self._hosts = frozenset(limits.allowed_hosts)
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        if scope["method"] in _BODY_METHODS:
            receive = self._bounded(receive)
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        host = headers.get(b"host")
        if self._hosts and host is not None and host_name(host) not in self._hosts:
            return APIError(
                421,
                f"this server does not answer to Host {host.decode('latin-1')!r}; add the name "
                "with --allowed-hosts",
                code="misdirected_request",
            )
        path = scope["path"]
        if self._expected is not None and self._needs_key(path):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                return APIError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
        if scope["method"] in _BODY_METHODS and _has_body(headers):
            media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
            if media_type != b"application/json":
                return APIError(
                    415,
                    "the request body must be JSON, sent with 'Content-Type: application/json'",
                    code="unsupported_media_type",
                )
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
                return self._too_large()
        return None

    def _needs_key(self, path: str) -> bool:
        if path not in _OPEN_PATHS:
            return True
        return self.limits.protect_metrics_and_docs and path in _DOCS_PATHS

    def _too_large(self) -> APIError:
        return BodyTooLarge(
            413,
            f"the request body is larger than this server's limit of "
            f"{self.limits.max_body_bytes} bytes (--max-request-body-bytes)",
            code="request_too_large",
        )

    def _bounded(self, receive: Receive) -> Receive:
        """`receive`, counting the body's bytes: past the limit it raises BodyTooLarge, which
        the handler reading the body passes on to the app's APIError handler (a chunked body
        has no Content-Length to check up front)."""
        seen = 0
        limit = self.limits.max_body_bytes

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise self._too_large()
            return message

        return bounded


def _has_body(headers: dict[bytes, bytes]) -> bool:
    """Whether the request announces a body: a non-zero Content-Length, or a chunked one (whose
    length nobody knows up front). A bodiless POST carries neither, or `Content-Length: 0`."""
    if b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length")
    return length is not None and length.strip() not in (b"", b"0")


class BodyTooLarge(APIError):
    """A 413, raised from inside the handler's read of the body."""


# -- nesting -----------------------------------------------------------------------------------


def check_nesting(value: Any, param: str, max_depth: int) -> None:
    """A 400 naming `param` if the JSON value `value` (dicts, lists, scalars) nests deeper than
    `max_depth`; iterative, so any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > max_depth:
            raise bad_request(
                f"{param} nests deeper than this server's limit of {max_depth} levels",
                param,
            )
        stack.extend((child, depth + 1) for child in children)
