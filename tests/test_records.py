"""The shared record schema: append-only JSONL that survives kills and resumes without duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.core.records import SCHEMA_VERSION, RecordWriter, export_parquet, read_records, truncate_after_step


def write_run(d: Path, steps: int = 4) -> None:
    with RecordWriter(d, "r1", "sim") as w:
        for s in range(steps):
            w.write("produce", t=s, item_id=f"i{s}", worker=0, bucket=0, n_seqs=1, real_tokens=10,
                    padded_len=10, t_start=s, t_end=s + 0.5, blocked_s=0.0, bytes=100)
            w.write("take", t=s + 0.6, drafter=0, step=s, item_ids=[f"i{s}"], bucket=0, wait_s=0.0,
                    depth_before=1, bucket_depths=[1])
            w.write("step", t=s + 0.9, step=s, loss=float("nan") if s == 0 else 1.0 / (s + 1), lr=1e-3,
                    anchors=16, tokens=10)


def test_every_record_carries_the_common_fields(tmp_path: Path) -> None:
    write_run(tmp_path)
    for kind in ("produce", "take", "step"):
        for r in read_records(tmp_path, kind):
            assert {r["run_id"], r["source"], r["schema_version"]} == {"r1", "sim", SCHEMA_VERSION}
            assert "t" in r
    assert next(read_records(tmp_path, "step"))["loss"] is None  # NaN written as null


def test_missing_fields_and_unknown_kinds_are_rejected(tmp_path: Path) -> None:
    with RecordWriter(tmp_path, "r", "real") as w:
        with pytest.raises(ValueError):
            w.write("take", t=0.0, drafter=0)
        with pytest.raises(ValueError):
            w.write("nope", t=0.0)
    with pytest.raises(ValueError):
        RecordWriter(tmp_path, "r", "imagined")


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    write_run(tmp_path)
    with open(tmp_path / "step.jsonl", "a") as f:
        f.write('{"kind": "step", "st')
    assert len(list(read_records(tmp_path, "step"))) == 4


def test_truncate_after_step_drops_later_records(tmp_path: Path) -> None:
    write_run(tmp_path, steps=5)
    lost = truncate_after_step(tmp_path, 2)
    assert [r["step"] for r in read_records(tmp_path, "step")] == [0, 1, 2]
    assert [r["item_id"] for r in read_records(tmp_path, "produce")] == ["i0", "i1", "i2"]
    assert lost["take"] == 2 and lost["step"] == 2
    for line in (tmp_path / "take.jsonl").read_text().splitlines():
        json.loads(line)


def test_parquet_export(tmp_path: Path) -> None:
    import pandas as pd

    write_run(tmp_path)
    paths = export_parquet(tmp_path)
    assert {p.name for p in paths} == {"produce.parquet", "take.parquet", "step.parquet"}
    assert len(pd.read_parquet(tmp_path / "take.parquet")) == 4


@pytest.mark.parametrize("tables", [
    [{}],  # a run resumed and stopped before its first step: no stage was timed
    [{}, {"drafter_forward_s": 0.2}],
    [{"per_rank": {}}],  # an empty table inside one
])
def test_parquet_export_stores_a_field_holding_an_empty_table_as_json(tmp_path: Path, tables) -> None:
    """Parquet has no struct without a field: such a column is written as JSON text, never a failed export
    (the failure ended a resumed fault-matrix run's rank with ArrowNotImplementedError)."""
    import pandas as pd

    with RecordWriter(tmp_path, "r", "real") as w:
        for i, table in enumerate(tables):
            w.write("summary", t=float(i), produced=0, trained=0, discarded_at_stop=0, stage_means_s=table)
    export_parquet(tmp_path)
    back = pd.read_parquet(tmp_path / "summary.parquet")["stage_means_s"]
    assert [json.loads(v) for v in back] == tables
