"""SGLang's own trainer-side helper, `init_custom_process_group`, loaded from the sglang wheel
without importing the sglang package.

Why a shim: `import sglang` pulls in its whole runtime (CUDA kernels, msgspec, pybase64, its
platform detection), which does not install on a CPU machine, while the helper itself needs only
torch. So this loads the one file, `sglang/srt/utils/common.py`, by path, and answers every
import it makes that is missing here (other `sglang.*` modules, and third-party packages absent
from this venv) with a stand-in module whose attributes are `MagicMock`s. The function under
test is SGLang's code, byte for byte; only its module's unrelated imports are stood in for.
The wheel is installed with `pip install --no-deps sglang==0.5.23` (`.ci/run`, the README). Also here: payloads made with
SGLang's own serializer and `FlattenedTensorBucket`, as slime sends them.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

_COMMON = "sglang/srt/utils/common.py"


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


# Third-party modules common.py imports that its CPU-free helper never uses and this venv lacks.
_ABSENT = ("pybase64", "msgspec")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every `sglang.*` module and the `_ABSENT` ones (only: a library that tries an
    optional import must still see it fail)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top = fullname.split(".")[0]
        if top != "sglang" and (
            top not in _ABSENT or importlib.machinery.PathFinder.find_spec(top)
        ):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def sglang_common() -> types.ModuleType:
    """The module `sglang.srt.utils.common` of the installed wheel (see the module docstring)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the sglang wheel is not installed (pip install --no-deps sglang)")
    path = Path(spec.submodule_search_locations[0]).parent / _COMMON
    finder = _StandInFinder()
    saved = {k: v for k, v in sys.modules.items() if k.startswith("sglang")}
    sys.meta_path.insert(0, finder)
    try:
        module_spec = importlib.util.spec_from_file_location("_sglang_common", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses look their module up there
        module_spec.loader.exec_module(module)
        return module
    finally:
        sys.meta_path.remove(finder)
        for name in [k for k in sys.modules if k.startswith("sglang")]:
            if name not in saved:
                del sys.modules[name]


def sglang_serialize(obj, serializer=None) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`: its pickle, base64
    (encoded here with the standard library: the wheel's base64 package is not installed)."""
    serializer = serializer or sglang_common().MultiprocessingSerializer
    return base64.b64encode(serializer.serialize(obj)).decode()


def flattened_payload(named: list) -> str:
    """What slime sends for `load_format="flattened_bucket"`: SGLang's FlattenedTensorBucket of
    `named`, serialized by SGLang's serializer. The tensors must stay alive until read."""
    serializer = sglang_common().MultiprocessingSerializer
    with sglang_bucket_module() as buckets:
        bucket = buckets.FlattenedTensorBucket(named_tensors=named)
        data = {
            "flattened_tensor": bucket.get_flattened_tensor(),
            "metadata": bucket.get_metadata(),
        }
        flattened_payload.keep = data  # shared memory lives as long as the sender's tensor
        return sglang_serialize(data, serializer)


@contextlib.contextmanager
def sglang_bucket_module() -> Iterator[types.ModuleType]:
    """`sglang.srt.weight_sync.tensor_bucket` of the wheel (it imports only torch), registered
    under its own name (with empty parent packages) while in use, so that its classes pickle as
    SGLang's do."""
    name = "sglang.srt.weight_sync.tensor_bucket"
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    added = [p for p in ("sglang", "sglang.srt", "sglang.srt.weight_sync") if p not in sys.modules]
    for parent in added:
        sys.modules[parent] = types.ModuleType(parent)
    spec = importlib.util.spec_from_file_location(name, root / "srt/weight_sync/tensor_bucket.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for key in [*added, name]:
            sys.modules.pop(key, None)
