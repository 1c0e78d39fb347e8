"""One module per verb: its :class:`~dflash.cli.options.Verb` (options and checks) as ``VERB`` and
its ``handle(args, cfg) -> int``. A module imports only torch-free code at its top; what a verb
needs to run (torch, the simulator, Optuna) it imports inside ``handle``, so ``dflash --help`` and
validation stay fast.

Adding a verb: a module here and its name in :data:`NAMES` (the order of ``dflash --help``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

NAMES = ("simulate", "sweep", "train", "tune-live", "eval", "export", "calibrate", "validate", "report",
         "regenerate", "lengths", "demo", "gpu-check")


def load() -> dict[str, ModuleType]:
    return {name: importlib.import_module(f"dflash.cli.verbs.{name.replace('-', '_')}") for name in NAMES}
