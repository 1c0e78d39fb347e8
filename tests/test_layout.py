"""The layout is a contract (DESIGN.md): every module imports on a base install, and the arrows
between the parts point one way.

Each check runs in a fresh interpreter, so what one test imported cannot hide what another needs.
Optional dependencies (extras) are blocked there: a module that imports one at its top fails.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dflash", "simulator", "tuning", "reports")
OPTIONAL = ("openai", "speculators", "optuna_dashboard")  # extras: imported only inside functions

# Runs in the child: block some top-level modules, import the given ones, report what got loaded.
_PROBE = r"""
import importlib, importlib.abc, json, sys
blocked, modules = json.loads(sys.argv[1])

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"blocked for this test: {name}")
        return None

sys.meta_path.insert(0, Block())
failed = {}
for m in modules:
    try:
        importlib.import_module(m)
    except Exception as exc:
        failed[m] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"failed": failed, "loaded": sorted(sys.modules)}))
"""


def probe(modules: list[str], blocked: tuple[str, ...] = ()) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([list(blocked), modules])],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def modules_of(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    found = [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")]
    return [package] + [m for m in found if not m.endswith(".__main__")]  # __main__ runs the command


def test_every_module_imports_without_the_optional_extras() -> None:
    modules = [m for p in PACKAGES for m in modules_of(p)]
    assert len(modules) > 60
    result = probe(modules, blocked=OPTIONAL)
    assert result["failed"] == {}


@pytest.mark.parametrize("module", modules_of("dflash.core"))
def test_core_imports_neither_torch_nor_its_siblings(module: str) -> None:
    loaded = probe([module])["loaded"]
    assert "torch" not in loaded
    siblings = [m for m in loaded if m.split(".")[:2] in (["dflash", s] for s in ("data", "model", "pipeline",
                                                                                    "regenerate", "cli"))]
    assert siblings == []


@pytest.mark.parametrize("module", modules_of("dflash.data"))
def test_data_does_not_import_the_model(module: str) -> None:
    loaded = probe([module])["loaded"]
    assert [m for m in loaded if m.startswith(("dflash.model", "dflash.pipeline"))] == []


def test_simulate_and_sweep_run_without_torch() -> None:
    """Once lengths are cached, the simulator and the sweep import no torch (DESIGN.md)."""
    result = probe(["simulator.run", "simulator.engine", "tuning.sweep", "tuning.study", "dflash.cli"],
                   blocked=("torch", "transformers"))
    assert result["failed"] == {}


@pytest.mark.parametrize("old, new", [
    ("dflash.drafter", "dflash.model.drafter"),
    ("dflash.queue_core", "dflash.core.queue_core"),
    ("dflash.trainer", "dflash.pipeline.trainer"),
    ("dflash.lengths", "dflash.data.lengths"),
])
def test_old_module_paths_are_the_new_modules(old: str, new: str) -> None:
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)
