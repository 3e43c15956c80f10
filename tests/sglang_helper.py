"""SGLang's own trainer-side helper, `init_custom_process_group`, loaded from the sglang wheel
without importing the sglang package.

Why a shim: `import sglang` pulls in its whole runtime (CUDA kernels, msgspec, pybase64, its
platform detection), which does not install on a CPU machine, while the helper itself needs only
torch. So this loads the one file, `sglang/srt/utils/common.py`, by path, and answers every
import it makes that is missing here (other `sglang.*` modules, and third-party packages absent
from this venv) with a stand-in module whose attributes are `MagicMock`s. The function under
test is SGLang's code, byte for byte; only its module's unrelated imports are stood in for.
The wheel (`pip install --no-deps sglang`) is in the `dev` extra.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
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
