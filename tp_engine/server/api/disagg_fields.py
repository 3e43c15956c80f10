"""The fields a prefill/decode router adds to a request (SGLang's): `bootstrap_host`,
`bootstrap_port` and `bootstrap_room` in the body, one value or one per prompt, or the
`x-override-bootstrap-host/-port/-room` headers of newer SGLang (which win over the body).

A request that carries none is a request of its own; a server outside prefill/decode mode
ignores them all, as SGLang does (rank 0 decides: it knows its role).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tp_engine.server.api.http_errors import APIError
from tp_engine.server.messages import Bootstrap

__all__ = ["bootstrap_of"]

_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_MAX_ROOM = 2**64 - 1


def bootstrap_of(
    req: Any, headers: Mapping[str, str] | None, num_prompts: int
) -> list[Bootstrap | None] | None:
    """Each prompt's `Bootstrap` (None where it has none); None when the request has none at
    all. APIError (400) naming the field for a value of the wrong kind or a list of the wrong
    length."""
    values: dict[str, Any] = {name: getattr(req, name, None) for name in _FIELDS}
    extra = getattr(req, "model_extra", None) or {}
    for name in _FIELDS:
        if values[name] is None and name in extra:
            values[name] = extra[name]
    for name in _FIELDS:
        header = (headers or {}).get("x-override-" + name.replace("_", "-"))
        if header is not None:
            values[name] = header if name == "bootstrap_host" else _int(header, name)
    if values["bootstrap_host"] is None and values["bootstrap_room"] is None:
        return None
    per_prompt = {name: _per_prompt(values[name], name, num_prompts) for name in _FIELDS}
    out: list[Bootstrap | None] = []
    for p in range(num_prompts):
        host, port, room = (per_prompt[name][p] for name in _FIELDS)
        if host is None or room is None:
            out.append(None)
            continue
        if not isinstance(host, str) or not host:
            raise APIError(400, "bootstrap_host must be a host name", param="bootstrap_host")
        for name, value in (("bootstrap_port", port), ("bootstrap_room", room)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_ROOM
            ):
                raise APIError(400, f"{name} must be a non-negative integer", param=name)
        out.append(Bootstrap(host, port, room))
    return out


def _per_prompt(value: Any, name: str, num_prompts: int) -> list[Any]:
    if not isinstance(value, list):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise APIError(400, f"{name} has {len(value)} values for {num_prompts} prompts", param=name)
    return value


def _int(text: str, name: str) -> int | None:
    if text.lower() in ("", "none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        raise APIError(400, f"x-override-{name.replace('_', '-')} must be an integer") from None
