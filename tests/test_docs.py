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
            "Memory model", "Held-out quality", "Queue autopilot", "The rank context", "Control messages",
            "The simulator", "Tuning: the study and the selection", "Reports",
            "The run directory"} <= headings(ROOT / "docs" / "ARCHITECTURE.md")


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


# ---------------------------------------------------------------- the README and the user guide
# The pages people read to use the tool: every relative link resolves (a file, or a heading of the
# linked Markdown file for a ``#anchor``), and every ``dflash`` command they show parses through the
# command's own parser (a verb or flag renamed in the code fails here, not in a reader's terminal).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]*\bdflash [a-z][^`\n]*)`")
ENDS = ("|", "&&", ";", ">", "2>", "#", "||")


def guide_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "docs" / "development.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    bad = []
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
            bad.append(f"{name}: {target} (no such heading)")
    return bad


def dflash_commands(text: str) -> list[list[str]]:
    """The ``dflash`` arguments of every command shown: code blocks (continued lines joined) and inline
    code; ``torchrun ... -m dflash ...``, ``python -m dflash`` and shell lines give only what follows
    ``dflash``, up to a pipe, a redirection, ``&&``, ``;`` or a comment."""
    import shlex

    lines = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [line.strip() for line in joined.splitlines()]
    lines += INLINE.findall(text)
    lines += [line.strip() for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line.startswith("    ")
              and "dflash " in line]  # indented code blocks
    out = []
    for line in lines:
        line = line.removeprefix("$ ")
        try:
            words = shlex.split(line, comments=False)
        except ValueError:
            continue
        for i, w in enumerate(words):
            if w == "dflash" and i + 1 < len(words) and re.fullmatch(r"[a-z][a-z-]*", words[i + 1]):
                args = []
                for a in words[i + 1:]:
                    if a in ENDS or a.startswith(("#", ">", "2>")):
                        break
                    args.append(a)
                out.append(args)
                break
    return out


def test_the_link_and_command_scans_find_what_a_page_shows(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope) [web](https://x.org)\n"
                    "```bash\ndflash sweep --trials 4 \\\n    --out s   # comment\n```\n"
                    "`torchrun --nproc-per-node 2 -m dflash train --n-target 1` and `dflash eval --drafter R | x`\n")
    assert broken_links(page) == [f"{page}: missing.md (no such file)", f"{page}: there.md#nope (no such heading)"]
    assert dflash_commands(page.read_text()) == [["sweep", "--trials", "4", "--out", "s"],
                                                 ["train", "--n-target", "1"], ["eval", "--drafter", "R"]]


def test_every_link_of_the_readme_and_the_guide_resolves() -> None:
    assert [b for p in guide_pages() for b in broken_links(p)] == []


def test_every_guide_page_is_linked_from_the_guide_index_and_the_readme_stays_short() -> None:
    index = (ROOT / "docs" / "guide" / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs" / "guide").glob("*.md") if p.name != "README.md"
                and f"({p.name})" not in index]
    assert unlinked == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_dflash_command_of_the_readme_and_the_guide_parses_through_the_cli() -> None:
    from dflash.cli.command import UsageError, build_parser

    parser = build_parser()
    bad, seen = [], 0
    for page in guide_pages():
        for args in dflash_commands(page.read_text()):
            seen += 1
            try:
                parser.parse_args(args)
            except (UsageError, SystemExit) as exc:
                bad.append(f"{page.relative_to(ROOT)}: dflash {' '.join(args)}: {exc}")
    assert bad == []
    assert seen >= 30  # the scan found the pages' commands
