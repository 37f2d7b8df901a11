"""Import paths that moved, kept working with a ``DeprecationWarning``.

Each old dotted path is an alias of the module that now holds its code: the
same module object (``sys.modules[old] is sys.modules[new]``), so attributes,
monkeypatching and ``isinstance`` behave exactly as before. A meta-path finder
resolves an old name (and any submodule under an old package name) to the new
module; it is installed by ``import tunekit`` and imports nothing itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> the module that holds its code now (the layout of ARCHITECTURE.md).
MOVED: dict[str, str] = {
    "tunekit.shapes": "tunekit.problems.shapes",
    "tunekit.opspec": "tunekit.problems.opspec",
    "tunekit.models": "tunekit.problems.models",
    "tunekit.bench": "tunekit.measure.bench",
    "tunekit.verify": "tunekit.measure.verify",
    "tunekit.device": "tunekit.measure.device",
    "tunekit.chain": "tunekit.evidence.chain",
    "tunekit.report": "tunekit.evidence.compare",
    "tunekit.serving": "tunekit.dispatch",
    "tunekit.serve": "tunekit.evidence.serve_bench",
    "tunekit.evidence.serving": "tunekit.evidence.check_serving.model_check",
    "tunekit.evidence.ops_check": "tunekit.evidence.check_serving.ops_check",
    "tunekit.evidence.hf_decode": "tunekit.evidence.check_serving.hf_decode",
    "tunekit.evidence.checks": "tunekit.evidence.check_serving.checks",
    "tunekit.integrations.vllm_plugin": "tunekit.integrations.vllm.plugin",
    "tunekit.integrations.vllm_fold": "tunekit.integrations.vllm.fold",
    "tunekit.integrations.vllm_merge": "tunekit.integrations.vllm.merge",
    "tunekit.integrations.graph_routes": "tunekit.integrations.vllm.graph_routes",
}


def new_path(name: str) -> str | None:
    """The current path of ``name`` if it (or a package above it) moved, else None."""
    for old in sorted(MOVED, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return MOVED[old] + name[len(old):]
    return None


def _importer_level() -> int:
    """The stacklevel of the first frame outside the import machinery: the line that imported the old path."""
    frame, level = sys._getframe(2), 3
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__):
        frame, level = frame.f_back, level + 1
    return level


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the module is the new one, already executed; the import system has recorded it under the old
        # name too, and set its __spec__ to the alias's: give it back its own (the new name stays its name)
        module.__spec__ = self._own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_path(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=_importer_level())
        module = importlib.import_module(new)
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(new), is_package=hasattr(module, "__path__"))
        return spec


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
