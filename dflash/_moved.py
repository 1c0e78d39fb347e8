"""Old flat module paths (``dflash.drafter``) resolve to their homes in the subpackages.

Why a finder and not one re-export file per old module: one table is the single place that says
where everything went, and ``import dflash.drafter`` yields the *same* module object as
``import dflash.model.drafter`` (a star re-export would copy names, so monkeypatching one would
not affect the other, and private names would be lost).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    **{f"dflash.{m}": f"dflash.core.{m}" for m in (
        "config", "policies", "queue_core", "sampler", "mixmetrics", "runmetrics", "records", "errors", "atomic")},
    "dflash.lengths": "dflash.data.lengths",
    **{f"dflash.{m}": f"dflash.model.{m}" for m in ("target", "drafter", "acceptance")},
    **{f"dflash.{m}": f"dflash.pipeline.{m}" for m in ("trainer", "checkpoint", "telemetry", "hsqueue")},
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for the names in :data:`MOVED`; every other import goes its normal way."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module object is the already imported new one."""


def install() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
