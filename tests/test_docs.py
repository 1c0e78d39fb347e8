"""Every document the tree cites is in the repository (docs/ARCHITECTURE.md, docs/REFERENCE.md), and
a cited section exists there.

The contracts used to live in a DESIGN.md and a REFERENCE.md outside the repository: code cited them
and nobody could read them. A citation is any ``DESIGN.md``, ``REFERENCE.md`` or
``ARCHITECTURE.md`` in a tracked (or new, not ignored) text file; it resolves when that path exists
relative to the repository root or to the citing file. A section named right after it
(``docs/ARCHITECTURE.md, "Records"`` or ``docs/ARCHITECTURE.md ("Records")``) must be a heading of
that document.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*(?:DESIGN|REFERENCE|ARCHITECTURE)\.md)"
                      r"(?:(?:,\s*|\s*\(\s*|\s+)\"([^\"\n]+)\")?")

# Files that may still cite an absent document (none: the citations were rewritten in one pass).
PENDING: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Citation:
    path: str  # the citing file, relative to the root
    line: int
    cited: str
    section: str | None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.cited}" + (f' "{self.section}"' if self.section else "")


def text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    # A symbolic link (examples/cpu-smollm2.toml -> dflash/profiles/...) is checked as its target.
    return sorted(p for p in out if (ROOT / p).is_file() and not (ROOT / p).is_symlink()
                  and p.endswith((".py", ".md", ".toml", ".sh", ".txt")))


def citations_in(path: str, text: str) -> list[Citation]:
    return [Citation(path, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in CITATION.finditer(text)]


def resolves(c: Citation) -> Path | None:
    for base in (ROOT, (ROOT / c.path).parent):
        if (base / c.cited).is_file():
            return base / c.cited
    return None


def headings(doc: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")}


def all_citations() -> list[Citation]:
    """Every citation in the tree, except in this file (which talks about the names)."""
    return [c for p in text_files() if p != "tests/test_docs.py"
            for c in citations_in(p, (ROOT / p).read_text(errors="replace"))]


def test_the_scan_finds_citations_and_their_sections() -> None:
    text = 'a (DESIGN.md "Records") b\nsee docs/ARCHITECTURE.md, "Metrics".\n[x](REFERENCE.md) and not_DESIGN.md\n'
    found = [(c.line, c.cited, c.section) for c in citations_in("docs/x.md", text)]
    assert found == [(1, "DESIGN.md", "Records"), (2, "docs/ARCHITECTURE.md", "Metrics"), (3, "REFERENCE.md", None)]
    assert resolves(Citation("docs/x.md", 3, "REFERENCE.md", None)) == ROOT / "docs" / "REFERENCE.md"
    assert resolves(Citation("dflash/x.py", 1, "DESIGN.md", None)) is None


def test_the_two_documents_are_in_the_repository() -> None:
    for name in ("ARCHITECTURE.md", "REFERENCE.md"):
        assert (ROOT / "docs" / name).is_file(), name
    assert {"Layering", "Queue semantics", "Records", "Metrics", "The `dflash` command", "The distributed pipeline",
            "Memory model", "Held-out quality", "Queue autopilot"} <= headings(ROOT / "docs" / "ARCHITECTURE.md")


def test_every_citation_resolves_to_a_file_in_the_repository() -> None:
    bad = [c for c in all_citations() if resolves(c) is None]
    unlisted = [str(c) for c in bad if c.path not in PENDING]
    assert unlisted == [], "cite docs/ARCHITECTURE.md or docs/REFERENCE.md:\n" + "\n".join(unlisted)
    clean = sorted(PENDING - {c.path for c in bad})
    assert clean == [], f"these files cite only documents that exist now: remove them from PENDING: {clean}"


def test_every_cited_section_is_a_heading_of_the_cited_document() -> None:
    missing = []
    for c in all_citations():
        doc = resolves(c)
        if doc is not None and c.section is not None and c.section not in headings(doc):
            missing.append(str(c))
    assert missing == []
