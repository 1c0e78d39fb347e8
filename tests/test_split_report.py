"""The report's split section: each split's choice, the best split and its gain over an even split."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from reports.document import Figure, Missing, Table
from reports.inputs import find_inputs
from reports.sweep_sections import split_section
from tuning.select import split_table

# (n_target, n_drafter, tokens/s, mix_efficiency, feasible): 6 GPUs, one GPU per target.
TRIALS = [(1, 5, 20_000, 0.99, True), (2, 4, 40_000, 0.97, True), (2, 4, 39_000, 0.99, True),
          (3, 3, 32_000, 0.99, True), (3, 3, 50_000, 0.99, False),  # infeasible: never chosen
          (4, 2, 21_000, 0.99, True), (6, 0, 0.0, 0.0, False)]


def write_sweep(tmp_path: Path) -> Path:
    rows = [{"number": k, "state": "COMPLETE", "values_0": t, "values_1": m, "feasible": ok, "n_target": nt,
             "n_drafter": nd, "user_attrs_n_target": nt, "user_attrs_n_drafter": nd,
             "user_attrs_throughput_tokens_per_s": t, "user_attrs_mix_efficiency": m,
             "user_attrs_queue_min_ready": 10, "user_attrs_queue_max_depth": 30, "user_attrs_queue_policy": "fifo"}
            for k, (nt, nd, t, m, ok) in enumerate(TRIALS)]
    out = tmp_path / "sweep"
    out.mkdir()
    pd.DataFrame(rows).to_parquet(out / "trials.parquet", index=False)
    (out / "selection.json").write_text(json.dumps({"study": "s", "objectives": ["a", "b"], "configs": []}))
    return out


def test_split_table_rechooses_knobs_per_split_and_measures_the_gain_over_even() -> None:
    rows = [{"number": k, "n_target": nt, "n_drafter": nd, "throughput_tokens_per_s": t, "mix_efficiency": m,
             "feasible": ok} for k, (nt, nd, t, m, ok) in enumerate(TRIALS)]
    table = split_table(rows, gpus=6)
    by = {s["n_target"]: s for s in table["splits"]}
    # 2/4's front {40k@0.97, 39k@0.99}: shortfalls (0, 0.020) beat (0.025, 0), so the knee is 40k
    assert by[2]["trial"] == 1
    assert by[3]["trial"] == 3 and by[6]["trial"] is None  # the infeasible 50k never counts
    assert table["best"]["n_target"] == 2 and table["even"]["n_target"] == 3
    assert table["gain_over_even"] == 40_000 / 32_000 - 1


def test_the_report_shows_the_split_figure_and_names_best_and_even(tmp_path: Path) -> None:
    sec = split_section(find_inputs([write_sweep(tmp_path)]))
    fig, table = sec.blocks
    assert isinstance(fig, Figure) and fig.png[:4] == b"\x89PNG"
    assert "Best split of 6 GPUs: 2 target worker(s)" in fig.caption
    assert "+25.0% throughput over the even split (3/3)" in fig.caption
    assert isinstance(table, Table)
    assert list(table.df["split (targets/drafters)"]) == ["1/5", "2/4", "3/3", "4/2", "6/0"]


def test_a_sweep_without_a_split_says_so(tmp_path: Path) -> None:
    out = write_sweep(tmp_path)
    df = pd.read_parquet(out / "trials.parquet").drop(columns=["n_target", "n_drafter", "user_attrs_n_target",
                                                               "user_attrs_n_drafter"])
    df.to_parquet(out / "trials.parquet", index=False)
    (block,) = split_section(find_inputs([out])).blocks
    assert isinstance(block, Missing) and "n_target" in block.text
