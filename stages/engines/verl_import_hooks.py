"""Patches applied to a module when it is imported, not before: most of verl's processes never
import the modules patched, and importing them up front would cost each process seconds."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def after_import(name: str, patch) -> None:
    """Run `patch(module)` once module `name` has executed: most processes never import it, and
    importing it here would cost each of them seconds."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    _on_import(name, after=patch)


def before_import(name: str, prepare) -> None:
    """Run `prepare(module)` on module `name`'s fresh namespace, before its code executes."""
    if name not in sys.modules:
        _on_import(name, before=prepare)


def _on_import(name: str, before=None, after=None) -> None:
    earlier_before, earlier_after = _PatchOnImport.patches.get(name, (None, None))
    _PatchOnImport.patches[name] = (before or earlier_before, after or earlier_after)
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    patches: dict = {}

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module):
            before, after = self.patches.pop(name)
            if before:
                before(module)
            run_module(module)
            if after:
                after(module)

        spec.loader.exec_module = exec_module
        return spec
