"""Hypothesis strategies for the messages of every process hop (`shm_ipc.wire`): values of the
types a message's fields declare, so that a round-trip test covers every field."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any

import msgspec
from hypothesis import strategies as st

from tp_engine.lora_request import LoRARequest

# msgpack's own values, as `dict[str, Any]` fields carry them.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
PLAIN = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
LORA = st.builds(
    LoRARequest,
    st.text(min_size=1, max_size=8),
    st.integers(1, 2**31),
    st.text(max_size=8),
    st.none() | st.text(max_size=8),
)


def strategy(tp: Any) -> st.SearchStrategy:
    """Values of the type a message field declares."""
    if tp is Any:
        return PLAIN
    if tp is LoRARequest:
        return LORA
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy(a) for a in args))
    if origin is list:
        return st.lists(strategy(args[0]), max_size=3)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(strategy(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), strategy(args[1]), max_size=3)
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return record(tp)
    if dataclasses.is_dataclass(tp):
        return record(tp)
    return {
        int: st.integers(-(2**63), 2**63 - 1),
        float: st.floats(allow_nan=False),
        str: st.text(max_size=8),
        bool: st.booleans(),
        bytes: st.binary(max_size=8),
    }[tp]


def record(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    names = (
        [f.name for f in dataclasses.fields(cls)]
        if dataclasses.is_dataclass(cls)
        else list(cls.__struct_fields__)
    )
    return st.builds(cls, **{name: strategy(hints[name]) for name in names})
