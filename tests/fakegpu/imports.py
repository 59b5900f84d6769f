"""Run a function on a module as soon as it is imported, before any importer sees it: how the
harness adjusts DeepSpeed, FSDP2 and the project's megatron shim without importing them itself
(a rank that never imports DeepSpeed does not pay for it)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from types import ModuleType


class _AfterImport(MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, name, path, target=None):
        callback = self.callbacks.get(name)
        if callback is None:
            return None
        spec = _spec_from_other_finders(self, name, path, target)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_call(module):
                exec_module(module)
                callback(module)

            spec.loader.exec_module = exec_then_call  # this loader object serves this module only
        return spec


def _spec_from_other_finders(me, name, path, target):
    for finder in sys.meta_path:
        if finder is not me and hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
    return None


_hook = _AfterImport()


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """`callback(module)` once module `name` has run, now if it has already."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _hook.callbacks[name] = callback
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
