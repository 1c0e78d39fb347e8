"""One home per figure, end to end (issue #29): a real validation, then its report; every figure the
CLI summary and report.md both show is the same text.

Before, the CLI said "about 4650 more takes per configuration would resolve the remaining
differences" and the report, on the same validation, "about 822,125 more takes": two computations
over two sets of comparisons. Now tuning.validation.evidence computes the figure once, validation.json carries
it in the recommendation's words, and both print those words.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_cli_summary_and_the_report_of_one_validation_agree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps({"configs": [
        {"name": "baseline", "queue": {"min_ready": 4, "max_depth": 12, "policy": "random_item"}},
        {"name": "tuned-1", "queue": {"min_ready": 2, "max_depth": 8, "policy": "fullest"}}]}))
    val = tmp_path / "val"
    profile = tmp_path / "cpu-one-tau-prompt.toml"  # tau on one prompt: no figure compared here depends on it
    profile.write_text((ROOT / "examples" / "cpu-smollm2.toml").read_text().replace(
        "log_every = 10", "log_every = 10\neval_prompts = 1"))
    assert main(["validate", "--config", str(profile), "--selection", str(sel),
                 "--takes", "8", "--block-takes", "4", "--out", str(val)]) == 0
    cli = capsys.readouterr().out
    payload = json.loads((val / "validation.json").read_text())
    words = payload["recommendation"]["words"]
    assert f"recommended: {words}" in cli
    # without [train] quality_every the held-out objective is off: said once, with how to turn it on
    assert cli.count("held-out quality objective: off") == 1 and "quality_every = N" in cli
    assert payload["heldout"]["on"] is False and "heldout_tau" not in payload["objectives"]
    assert "Decided by" in words

    assert main(["report", str(val), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"The evidence: {words}" in md
    more = [re.findall(r"about ([\d,]+) more takes", text) for text in (cli, md)]
    assert more[0] == more[1]  # the same figure, or none in both
    for c in payload["comparisons"]:
        lo, hi = c["ci95"]
        if lo is None or hi is None:
            continue
        assert f"{c['difference']:+.4g} (95% interval {lo:+.4g} .. {hi:+.4g})" in cli
        assert f"{c['difference']:+.4g}, 95% interval {lo:+.4g} .. {hi:+.4g}" in md
