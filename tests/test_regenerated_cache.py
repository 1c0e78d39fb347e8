"""Regenerated data by default where it exists: ``[workload] dataset = "auto"``.

``dflash regenerate`` without ``--out`` writes the target's cache (a work file, moved into place only
when the run finishes), and ``"auto"`` trains on that file when it is complete, else on the packaged
ShareGPT. A run pins what it found (path + content fingerprint) so every later step reads the same
file. A tiny random Llama with SmolLM2's real tokenizer stands in for the target; the cache lives in a
temporary directory (``DFLASH_CACHE_DIR``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.core.config import DflashConfig, WorkloadConfig, load_config
from dflash.core.errors import ConfigError
from dflash.data.conversations import load_conversations, packaged_sharegpt_path, resolve_dataset
from dflash.data.dataset_choice import choose_dataset, fingerprint, pin_dataset
from dflash.data.regenerated_cache import (
    cache_path,
    cache_state,
    sidecar_path,
    target_identity,
    work_path,
)
from tests.tiny_models import tiny_llama

MAX_LEN = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from dflash.data.lengths import load_tokenizer

    tok = load_tokenizer("smollm2")
    d = tmp_path_factory.mktemp("tiny") / "tiny-target"
    tiny_llama(seed=0, vocab_size=len(tok), init_std=0.3).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(root))
    return root


def prompts_file(path: Path, n: int = 6) -> Path:
    recs = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"Question {i}: why?"},
                                              {"from": "gpt", "value": "original reply"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def config_file(path: Path, dataset: str, model: Path | str) -> Path:
    path.write_text(f'[workload]\ndataset = "{dataset}"\nsample = "first_exchange"\nmax_len = {MAX_LEN}\n'
                    f'bucket_bounds = [64, {MAX_LEN}]\nseqs_per_item = 1\n[target]\nmodel = "{model}"\n'
                    '[drafter]\nblock_size = 4\n',
                    encoding="utf-8")
    return path


def place_regenerated(model: str, status: str = "finished", ids=("r0", "r1")) -> Path:
    """A regenerated data set in the cache, as dflash regenerate leaves it (sidecar's last run: ``status``)."""
    path = cache_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "conversations": [{"from": "human", "value": "hi"},
                                                                    {"from": "gpt", "value": "the target's own"}]})
                            + "\n" for i in ids), encoding="utf-8")
    sidecar_path(path).write_text(json.dumps({"format": "dflash-regenerate/1", "settings": {},
                                              "counts": {"records": len(ids)}, "runs": [{"status": status}]}))
    return path


def test_target_identity_is_stable_and_filename_safe(tmp_path):
    assert target_identity("smollm2") == "smollm2"
    a, b = tmp_path / "My Model:v1", tmp_path / "other" / "My Model:v1"
    a.mkdir()
    b.mkdir(parents=True)
    ia, ib = target_identity(str(a)), target_identity(str(b))
    assert ia == target_identity(str(a) + "/") and ia != ib  # same directory, same name; another, another
    assert ia.startswith("My-Model-v1-") and "/" not in ia and ":" not in ia
    assert target_identity("org/name@rev1") != target_identity("org/name@rev2")


def test_auto_picks_a_complete_cache_else_the_packaged_sharegpt(cache):
    packaged = packaged_sharegpt_path()
    assert resolve_dataset("auto", "smollm2") == packaged
    absent = choose_dataset("auto", "smollm2")
    assert absent.kind == "packaged" and "no regenerated cache for smollm2" in absent.line()
    assert "0.42 prompts/s" in absent.line()

    path = place_regenerated("smollm2")
    assert path == cache / "regenerated" / "smollm2.jsonl"
    assert resolve_dataset("auto", "smollm2") == path
    assert resolve_dataset("sharegpt", "smollm2") == packaged  # "sharegpt" still means the packaged file
    chosen = choose_dataset("auto", "smollm2")
    assert chosen.kind == "regenerated" and chosen.fingerprint == fingerprint(path)
    assert chosen.line().startswith("data: regenerated replies of smollm2, 2 conversations (")
    assert resolve_dataset("auto", "another-model") == packaged  # the cache is per target


@pytest.mark.parametrize("leftover", ["running", "interrupted", "work file only"])
def test_an_incomplete_regeneration_is_never_picked(cache, leftover):
    if leftover == "work file only":
        work = work_path(cache_path("smollm2"))
        work.parent.mkdir(parents=True)
        work.write_text('{"id": "x", "conversations": []}\n')
    else:
        place_regenerated("smollm2", status=leftover)
    assert resolve_dataset("auto", "smollm2") == packaged_sharegpt_path()
    assert cache_state("smollm2").state == "incomplete"
    assert "incomplete" in choose_dataset("auto", "smollm2").line()


def test_a_run_pins_the_file_and_refuses_it_changed(cache, capsys):
    path = place_regenerated("smollm2")
    cfg = DflashConfig(workload=WorkloadConfig(dataset="auto"))
    pinned = pin_dataset(cfg)
    assert pinned.workload.dataset == str(path) and pinned.workload.dataset_fingerprint == fingerprint(path)
    assert capsys.readouterr().out.count("data: regenerated replies of smollm2") == 1
    path.unlink()  # the cache is gone: the pinned run still names its own file, never falls back
    with pytest.raises(ConfigError, match=r"workload\.dataset"):
        pin_dataset(pinned)
    place_regenerated("smollm2", ids=("r0", "r1", "r2"))  # another file at the same place
    with pytest.raises(ConfigError, match="has changed since this run was pinned"):
        pin_dataset(pinned)
    packaged = pin_dataset(DflashConfig(workload=WorkloadConfig(dataset="sharegpt")))
    assert packaged.workload.dataset == "sharegpt" and len(packaged.workload.dataset_fingerprint) == 16


@pytest.mark.parametrize(("value", "why"), [("autoo", "must be 'auto', 'sharegpt' or a path"),
                                            ("missing.jsonl", "existing .json/.jsonl file")])
def test_a_bad_dataset_value_is_one_line_exit_2(tmp_path, capsys, value, why):
    cfg = config_file(tmp_path / "c.toml", value, "smollm2")
    before = sorted(tmp_path.rglob("*"))
    assert main(["lengths", "--config", str(cfg)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dflash lengths: error: workload.dataset") and why in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_profiles_train_on_the_cache_when_there_is_one():
    root = Path(__file__).resolve().parents[1]
    for p in [*root.glob("dflash/profiles/cpu-*.toml"), *root.glob("examples/cpu-*.toml")]:
        assert load_config(p).workload.dataset == "auto", p


def test_regenerate_writes_the_cache_and_auto_trains_on_it(cache, model_dir, tmp_path, capsys, monkeypatch):
    """No --out: the run writes the work file; a killed (here: interrupted) run publishes nothing and
    "auto" keeps the packaged data; the rerun finishes, publishes, and the next load reads it."""
    import dflash.regenerate.local as local

    cfg = config_file(tmp_path / "c.toml", str(prompts_file(tmp_path / "prompts.jsonl")), model_dir)
    argv = ["regenerate", "--config", str(cfg), "--limit", "2", "--max-new-tokens", "8", "--batch-size", "1"]
    real = local.local_generator

    def killed_after_one_batch(opts, backend):
        gen = real(opts, backend)

        def generate(jobs, emit, progress):
            def emit_then_stop(records, failures):
                emit(records, failures)
                raise KeyboardInterrupt

            gen(jobs, emit_then_stop, progress)

        return generate

    monkeypatch.setattr(local, "local_generator", killed_after_one_batch)
    assert main(argv) == 130
    published, work = cache_path(str(model_dir)), work_path(cache_path(str(model_dir)))
    assert not published.exists() and len(work.read_text().splitlines()) == 1
    assert cache_state(str(model_dir)).state == "incomplete"
    assert resolve_dataset("auto", str(model_dir)) == packaged_sharegpt_path()

    monkeypatch.setattr(local, "local_generator", real)
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "published" in out and f"{published} holds 2 records" in out
    assert not work.exists() and cache_state(str(model_dir)).complete
    assert json.loads(sidecar_path(published).read_text())["runs"][-1]["status"] == "finished"
    assert resolve_dataset("auto", str(model_dir)) == published
    convs, _ = load_conversations(published, "first_exchange")
    assert [c.id for c in convs] == ["p0", "p1"] and all(c.messages[1][1] != "original reply" for c in convs)

    before = published.read_bytes()
    assert main(argv) == 0  # complete for this selection: nothing to do, nothing rewritten
    assert "nothing to do" in capsys.readouterr().err and published.read_bytes() == before
    assert not work.exists()

    auto_cfg = config_file(tmp_path / "auto.toml", "auto", model_dir)
    assert main(["lengths", "--config", str(auto_cfg)]) == 0
    captured = capsys.readouterr()
    assert f"data: regenerated replies of {model_dir}, 2 conversations" in captured.out
    assert "length table: 2 sequences" in captured.out and str(published) in captured.out


def test_extending_the_cache_keeps_the_published_file_whole(cache, model_dir, tmp_path, capsys):
    cfg = config_file(tmp_path / "c.toml", str(prompts_file(tmp_path / "prompts.jsonl")), model_dir)
    base = ["regenerate", "--config", str(cfg), "--max-new-tokens", "8", "--batch-size", "2"]
    assert main([*base, "--limit", "1"]) == 0
    published = cache_path(str(model_dir))
    first = published.read_bytes()
    assert main([*base, "--limit", "3"]) == 0
    grown = published.read_bytes()
    assert grown.startswith(first) and len(grown.splitlines()) == 3
    assert len(json.loads(sidecar_path(published).read_text())["runs"]) == 2
    assert main([*base, "--limit", "3", "--max-new-tokens", "5"]) == 2  # other settings: refused, one line
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "max_new_tokens: 8 there, 5 now" in err
    assert published.read_bytes() == grown



def test_a_simulation_reads_the_data_choice_once_and_says_it(cache, tmp_path, capsys):
    """``dataset = "auto"`` is resolved before the handler (Verb.pins_data), so the verb's every stage
    reads one file; the line saying which file appears exactly once."""
    place_regenerated("smollm2", ids=tuple(f"r{i}" for i in range(40)))
    cfg = config_file(tmp_path / "auto.toml", "auto", "smollm2")
    assert main(["simulate", "--sim-seconds", "20", "--config", str(cfg)]) == 0
    said = capsys.readouterr().out
    assert said.count("data: regenerated replies of smollm2, 40 conversations") == 1, said
