"""torch's floor in pyproject.toml is the lowest version with every torch API the code calls.

Why a scan and not an install: an old CPU torch comes only from PyTorch's own index, which CI cannot
reach (the other dependencies' floors are run for real: scripts/lowest_versions.sh). So the source is
read with the AST for every ``torch.*`` attribute chain, ``from torch... import`` name, keyword and
method that :data:`SINCE` knows to be newer than torch 2.0, and the floor must equal the newest of them.
An API above the floor is allowed only where the code guards it (:data:`GUARDED`: used inside a ``try``
that catches ImportError/AttributeError, with a fallback), e.g. flex_attention's dense fallback.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dflash", "simulator", "tuning", "reports")

# The version that added each API (torch release notes / docs "added in"), for those after 2.0.
# ``name`` is a dotted chain from ``torch``; ``name(kw=)`` a keyword of that call; ``name(arg)`` a
# positional argument where older versions took none; ``.meth()`` a method on any object.
SINCE: dict[str, tuple[int, int]] = {
    "torch.get_autocast_dtype": (2, 4),
    "torch.is_autocast_enabled(arg)": (2, 4),  # the device_type argument
    "torch.serialization.add_safe_globals": (2, 4),
    "torch.library.custom_op": (2, 4),
    "torch.nn.attention.flex_attention": (2, 5),
    "torch.nn.attention.flex_attention.flex_attention": (2, 5),
    "torch.nn.attention.flex_attention.create_block_mask": (2, 5),
    "torch.nn.functional.scaled_dot_product_attention(enable_gqa=)": (2, 5),
    "torch.nn.attention.sdpa_kernel": (2, 3),
    "torch.get_default_device": (2, 3),
    "torch.amp.GradScaler": (2, 3),
    "torch.distributed.device_mesh": (2, 2),
    "torch.load(mmap=)": (2, 1),
    "torch.float8_e4m3fn": (2, 1),
    "torch.compile": (2, 0),
    ".untyped_storage()": (2, 0),
}
GUARDED = {"torch.nn.attention.flex_attention", "torch.nn.attention.flex_attention.flex_attention",
           "torch.nn.attention.flex_attention.create_block_mask"}
GUARD_EXCEPTIONS = {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception"}


def torch_floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert m, "pyproject.toml: no torch>= floor"
    return int(m.group(1)), int(m.group(2))


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside the body of a ``try`` whose handlers catch an import or attribute failure."""
    child, p = node, parents.get(node)
    while p is not None:
        if isinstance(p, ast.Try) and child in p.body:
            for h in p.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if h.type is None or any(isinstance(n, ast.Name) and n.id in GUARD_EXCEPTIONS for n in names):
                    return True
        child, p = p, parents.get(p)
    return False


def uses(source: str) -> Iterator[tuple[str, int, bool]]:
    """(API key of :data:`SINCE` form, line, guarded) for every torch use in ``source``."""
    tree = ast.parse(source)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    alias: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
                    yield a.name, n.lineno, _guarded(n, parents)
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
            yield n.module, n.lineno, _guarded(n, parents)
            for a in n.names:
                alias[a.asname or a.name] = f"{n.module}.{a.name}"
                yield f"{n.module}.{a.name}", n.lineno, _guarded(n, parents)

    def chain(x: ast.AST) -> str | None:
        parts = []
        while isinstance(x, ast.Attribute):
            parts.append(x.attr)
            x = x.value
        if isinstance(x, ast.Name) and x.id in alias:
            return ".".join([alias[x.id], *reversed(parts)])
        return None

    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and not isinstance(parents.get(n), ast.Attribute):
            name = chain(n)
            if name:
                yield name, n.lineno, _guarded(n, parents)
        if isinstance(n, ast.Call):
            name = chain(n.func) if isinstance(n.func, ast.Attribute) else (
                alias.get(n.func.id) if isinstance(n.func, ast.Name) else None)
            if name:
                for kw in n.keywords:
                    if kw.arg:
                        yield f"{name}({kw.arg}=)", n.lineno, _guarded(n, parents)
                if n.args:
                    yield f"{name}(arg)", n.lineno, _guarded(n, parents)
            if isinstance(n.func, ast.Attribute):
                yield f".{n.func.attr}()", n.lineno, _guarded(n, parents)


@functools.cache
def scan() -> list[tuple[str, str, int, bool]]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for api, line, guarded in uses(path.read_text()):
                if api in SINCE:
                    found.append((api, f"{path.relative_to(ROOT)}", line, guarded))
    return found


def test_the_torch_floor_is_the_newest_api_the_code_calls_unguarded():
    found = scan()
    unguarded = [(api, where, line) for api, where, line, guarded in found if not (guarded and api in GUARDED)]
    assert unguarded, "the scan found no version-marked torch API: it has gone blind"
    need = max(SINCE[api] for api, _, _ in unguarded)
    newest = [f"{where}:{line} {api}" for api, where, line in unguarded if SINCE[api] == need]
    floor = torch_floor()
    assert floor >= need, f"pyproject allows torch {floor}, but the code calls {newest[0]} (torch >= {need})"
    assert floor == need, f"torch>={floor[0]}.{floor[1]} is above what the code needs ({need}: {newest[0]})"


def test_apis_above_the_floor_are_used_only_behind_a_guard():
    floor = torch_floor()
    bad = [f"{where}:{line} {api} (torch >= {SINCE[api]})" for api, where, line, guarded in scan()
           if SINCE[api] > floor and not (guarded and api in GUARDED)]
    assert not bad, bad


def test_the_scanner_reads_calls_keywords_imports_and_guards():
    src = ("import torch\nimport torch.nn.functional as F\n"
           "x = torch.get_autocast_dtype('cuda')\ntorch.load(p, mmap=True)\n"
           "F.scaled_dot_product_attention(q, k, v, enable_gqa=True)\n"
           "try:\n    from torch.nn.attention.flex_attention import flex_attention\nexcept ImportError:\n"
           "    flex_attention = None\n")
    got = {(api, guarded) for api, _, guarded in uses(src) if api in SINCE}
    assert got == {("torch.get_autocast_dtype", False), ("torch.load(mmap=)", False),
                   ("torch.nn.functional.scaled_dot_product_attention(enable_gqa=)", False),
                   ("torch.nn.attention.flex_attention", True),
                   ("torch.nn.attention.flex_attention.flex_attention", True)}
