"""``dflash report INPUT ... --out DIR``: one self-contained HTML report and its Markdown twin.

Order of work, so that a failure never leaves half a report: recognise and load every input
(bad input is a :class:`~dflash.core.errors.ConfigError`, before anything is written), build every
section and figure in memory, and only then write ``figures/*.png``, ``report.md`` and
``report.html``, each to a temporary name first and renamed into place.

The recommendation comes first, so the report is readable in a minute; the rest follows in the
order a reader checks it: does the simulator agree with the real runs, what the front looks like,
what the queue and the loss did, what matters in the space, and what produced all of it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dflash.core.config import DflashConfig
from reports import meta, recommend, run_panels, run_sections, sweep_sections
from reports.document import Section, figures, render_html, render_markdown
from reports.inputs import Inputs, find_inputs

TITLE = "dflash-tune report: hidden-state queue"
DEFAULT_OUT = Path("report")


def build_sections(inputs: Inputs, cfg: DflashConfig) -> list[Section]:
    return [
        recommend.section(inputs),
        run_sections.comparison_section(inputs),
        sweep_sections.pareto_section(inputs),
        sweep_sections.split_section(inputs),
        run_sections.queue_section(inputs),
        run_panels.autopilot_section(inputs),
        run_panels.stages_section(inputs),
        run_sections.loss_section(inputs),
        sweep_sections.heatmap_section(inputs),
        sweep_sections.sensitivity_section(inputs),
        sweep_sections.importance_section(inputs),
        run_sections.calibration_section(inputs),
        meta.section(inputs, cfg),
    ]


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_report(sections: list[Section], out: Path) -> tuple[Path, Path]:
    """Figures first, then the Markdown, then the HTML (the file people open appears last)."""
    html = render_html(TITLE, sections).encode("utf-8")
    md = render_markdown(TITLE, sections).encode("utf-8")
    figs = figures(sections)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for fig in figs:
        _write(out / "figures" / f"{fig.name}.png", fig.png)
    _write(out / "report.md", md)
    _write(out / "report.html", html)
    return out / "report.html", out / "report.md"


def build_report(paths: list[str | Path], out: Path, cfg: DflashConfig) -> tuple[Path, Path]:
    inputs = find_inputs(paths)
    sections = build_sections(inputs, cfg)
    return write_report(sections, out)


def handle(args: argparse.Namespace, cfg: DflashConfig) -> int:
    out = Path(args.out) if getattr(args, "out", None) else DEFAULT_OUT
    html, md = build_report(list(args.input), out, cfg)
    print(f"report: {html}")
    print(f"markdown: {md} (figures in {out / 'figures'})")
    return 0
