"""The layout is a contract (docs/ARCHITECTURE.md, "Layering"): every module imports on a base
install, the arrows between the parts point one way, and no two modules import each other.

Two kinds of check. The import scan reads every ``import`` statement in the source with the AST,
the ones inside functions included (most of the tree imports lazily, per verb, so what loads at
import time shows only a fraction of the arrows); a new arrow that runs upward fails naming its
file and line. The import probes run in a fresh interpreter, so what one test imported cannot hide
what another needs; optional dependencies (extras) are blocked there.
"""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dflash", "simulator", "tuning", "reports")
OPTIONAL = ("openai", "speculators", "optuna_dashboard")  # extras: imported only inside functions

# The floors, lowest first (docs/ARCHITECTURE.md draws the same picture). A module may import
# from its own part and from any lower floor; parts that share a floor do not import each other.
# ``dflash`` itself (the package root) only carries ``__version__``: it stands on the floor of core.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("dflash", "dflash.core"),
    ("dflash.data",),
    ("dflash.model",),
    ("dflash.pipeline", "dflash.regenerate", "simulator"),
    ("tuning", "dflash.gpucheck"),  # gpucheck drives the verbs in subprocesses; it reads only lower floors
    ("tuning.validation",),  # the one part of tuning that runs the trainer and loads the model
    ("reports",),
    ("dflash.cli",),
    ("dflash.__main__",),  # ``python -m dflash``: the command's one caller
)

# Arrows known to run the wrong way, each with its reason; the lead empties this list as they go.
# (file, imported module) pairs. Empty today: a new entry needs a reason a reviewer accepts.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Arrow:
    """One import: ``importer`` (a module) reads ``imported`` at ``path:line``."""

    path: str
    line: int
    importer: str
    imported: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


def part_of(module: str) -> str | None:
    """The longest part name (``dflash.model``, ``tuning``) the module belongs to; None outside the tree."""
    best = None
    for floor in FLOORS:
        for part in floor:
            if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best)):
                best = part
    return best


def floor_of(part: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if part in floor)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, module: str, path: str, is_package: bool = False) -> Iterator[Arrow]:
    """Every import in ``source``, at any depth (functions, classes, ``if`` blocks), as absolute names.

    ``from pkg import name`` yields ``pkg.name`` when that is a module of the tree, else ``pkg``."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Arrow(path, node.lineno, module, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*here[:len(here) - node.level + 1], node.module or ""]).strip(".") if node.level \
                else node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield Arrow(path, node.lineno, module, sub if _is_module(sub) else base)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__init__.py").is_file()


def upward(arrow: Arrow) -> bool:
    """True for an arrow to a higher floor, or sideways between two parts of one floor."""
    src, dst = part_of(arrow.importer), part_of(arrow.imported)
    if src is None or dst is None or src == dst:
        return False
    return floor_of(dst) >= floor_of(src)


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def all_arrows() -> list[Arrow]:
    return [a for p in source_files()
            for a in imports_in(p.read_text(), module_name(p), str(p.relative_to(ROOT)), p.name == "__init__.py")]


# --------------------------------------------------------------------------- the scan, tested first
def test_the_scan_reports_an_upward_import_inside_a_function_with_file_and_line() -> None:
    source = "import json\n\n\ndef f():\n    if True:\n        from tuning.validation.job import run\n    return run\n"
    found = [a for a in imports_in(source, "dflash.model.target", "dflash/model/target.py") if upward(a)]
    assert [str(a) for a in found] == [
        "dflash/model/target.py:6: dflash.model.target imports tuning.validation.job"]


def test_the_scan_resolves_relative_imports_and_sees_sideways_arrows() -> None:
    source = "from ..pipeline import launch\nfrom . import drafter\nfrom .drafter import DrafterSpec\n"
    arrows = list(imports_in(source, "dflash.model.target", "dflash/model/target.py"))
    assert [a.imported for a in arrows] == ["dflash.pipeline.launch", "dflash.model.drafter", "dflash.model.drafter"]
    assert [a.line for a in arrows if upward(a)] == [1]
    sideways = Arrow("simulator/engine.py", 1, "simulator.engine", "dflash.pipeline.launch")
    assert upward(sideways)  # parts on one floor do not lean on each other
    assert not upward(Arrow("tuning/x.py", 1, "tuning.x", "dflash.pipeline.launch"))  # downward is fine
    assert part_of("tuning.validation.job") == "tuning.validation" and part_of("tuning.sweep") == "tuning"
    assert upward(Arrow("tuning/sweep.py", 1, "tuning.sweep", "tuning.validation.evidence"))  # its own floor


# --------------------------------------------------------------------------- the tree
def test_every_arrow_in_the_tree_points_down() -> None:
    arrows = all_arrows()
    assert len(arrows) > 500  # the scan sees in-function imports (there are hundreds)
    bad = [a for a in arrows if upward(a) and (a.path, a.imported) not in ALLOWED_UPWARD]
    assert bad == [], "imports that run up the layering (docs/ARCHITECTURE.md, Layering):\n" + \
        "\n".join(map(str, bad))


def test_only_validation_reaches_into_the_pipeline_and_the_model() -> None:
    """``tuning.validation`` runs the real trainer and loads the model; the rest of ``tuning`` (the
    search, the selection) works on the simulator alone and must not start leaning on them."""
    bad = [a for a in all_arrows() if part_of(a.importer) == "tuning"
           and part_of(a.imported) in ("dflash.pipeline", "dflash.model")]
    assert bad == [], "\n".join(map(str, bad))


def test_the_allow_list_holds_only_arrows_that_still_exist() -> None:
    present = {(a.path, a.imported) for a in all_arrows() if upward(a)}
    assert set(ALLOWED_UPWARD) <= present, "fixed: remove from ALLOWED_UPWARD " + \
        str(sorted(set(ALLOWED_UPWARD) - present))


def test_no_two_modules_import_each_other_even_through_others() -> None:
    """A circle between modules is one module in two files: move the shared name to its owner.

    Arrows to a package (``from dflash.cli import verbs`` loads ``dflash/cli/__init__.py``) are not
    counted: a package's ``__init__`` re-exporting its children is not a circle of meaning."""
    graph: dict[str, set[str]] = {}
    for a in all_arrows():
        if a.imported != a.importer and not (ROOT / Path(*a.imported.split(".")) / "__init__.py").is_file():
            graph.setdefault(a.importer, set()).add(a.imported)
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert circles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of a small graph (recursive: the tree is a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle_through_a_third_module() -> None:
    found = strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert sorted(c for c in found if len(c) > 1) == [["a", "b", "c"]]


# --------------------------------------------------------------------------- import probes
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
    """Once lengths are cached, the simulator and the sweep import no torch (docs/ARCHITECTURE.md, Layering)."""
    result = probe(["simulator.run", "simulator.engine", "tuning.sweep", "tuning.study", "dflash.cli"],
                   blocked=("torch", "transformers"))
    assert result["failed"] == {}


OLD_NAMES = [f"dflash.{m}" for m in (
    "config", "policies", "queue_core", "sampler", "mixmetrics", "runmetrics", "records", "errors", "atomic",
    "lengths", "target", "drafter", "acceptance", "trainer", "checkpoint", "telemetry", "hsqueue")] + [
    f"tuning.{m}" for m in ("validate", "claims", "drift", "quality", "evidence")] + [  # now in tuning.validation
    "dflash.pipeline.quality"]  # now dflash.pipeline.heldout


def test_the_old_flat_module_names_stay_gone() -> None:
    """The flat paths of early versions (``dflash.drafter``) were served by a hidden import hook that
    also hid arrows from any scan; it is gone, and nothing may bring the names back."""
    result = probe(OLD_NAMES)
    assert sorted(result["failed"]) == sorted(OLD_NAMES)
    assert all(why.startswith("ModuleNotFoundError") for why in result["failed"].values())
    assert not (ROOT / "dflash" / "_moved.py").exists()
