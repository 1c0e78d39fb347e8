"""Export to serving layouts: one suite every format passes, upstream's layer-id convention, the z-lab
and speculators layouts themselves, ``dflash export --check`` refusing corruptions, bad CLI input,
and the independent reader (vLLM's speculators, in its own venv) where it is installed.

A principle stated and proved here: an export is never silently wrong. What the trained drafter
computes is what the export computes (bit for bit through our reader, within float32 tolerance
through speculators'), and any change to the files that would change what a serving engine drafts
is refused by ``--check`` with one line that names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.cli.command import main
from dflash.core.config import DflashConfig, DrafterConfig, with_overrides
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.export import check_export, export_drafter
from dflash.model.export_formats import CONFIG_JSON, FORMATS, WEIGHTS
from dflash.model.export_independent import speculators_python
from dflash.model.export_reference import MANIFEST
from dflash.model.target import HiddenStateCapture, capture_layer_ids
from tests.tiny_models import tiny_llama

MASK_ID = 4
BLOCK = 8


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=False, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


TARGETS = {"llama": lambda: tiny_llama(seed=3, init_std=0.2), "qwen3": lambda: tiny_qwen3(seed=5)}


def trained_drafter(target, seed: int = 0) -> DFlashDrafter:
    """A drafter around ``target`` whose every weight (norms included) is off its init value."""
    ids = capture_layer_ids(target.config.num_hidden_layers, 3)
    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=ids, mask_token_id=MASK_ID,
                                          drafter=DrafterConfig(layers=2, block_size=BLOCK, anchors=8))
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target(target, spec, dtype=torch.float32)
    with torch.no_grad():
        for p in drafter.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter


@pytest.fixture(scope="module", params=sorted(TARGETS))
def run(request, tmp_path_factory):
    """A run directory (config.json naming a saved tiny target, drafter/) and its pieces."""
    root = tmp_path_factory.mktemp(f"run-{request.param}")
    target = TARGETS[request.param]()
    target.save_pretrained(root / "target")
    drafter = trained_drafter(target)
    drafter.save(root / "run" / "drafter")
    cfg = with_overrides(DflashConfig(), {"target.model": str(root / "target")})
    (root / "run" / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
    return {"root": root, "run": root / "run", "target": target, "drafter": drafter, "family": request.param}


def do_export(run, fmt: str, name: str | None = None, independent: bool = False) -> Path:
    out = run["root"] / (name or f"export-{fmt}")
    if not out.exists():
        export_drafter(run["run"] / "drafter", out, fmt, model=run["target"], tokenizer=None,
                       target_model=str(run["root"] / "target"), target_source=str(run["root"] / "target"),
                       run_dir=run["run"], independent=independent)
    return out


def random_block_batch(drafter: DFlashDrafter, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    spec = drafter.spec
    ctx = torch.randn(2, 30, spec.num_context_layers * spec.hidden_size, generator=g)
    ids = torch.randint(5, spec.vocab_size, (2, 30), generator=g)
    return ctx, ids, torch.tensor([[3, 9, 17], [5, 6, 21]])


# --------------------------------------------------------------------------- every format
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_trip_reproduces_the_trained_drafter_exactly(run, fmt):
    out = do_export(run, fmt)
    layout = FORMATS[fmt]
    spec = layout.parse(json.loads((out / CONFIG_JSON).read_text()))
    trained = run["drafter"]
    assert spec.target_layer_ids == trained.spec.target_layer_ids and spec.block_size == BLOCK
    back = DFlashDrafter.from_target(run["target"], spec, dtype=torch.float32)
    tensors = load_file(str(out / WEIGHTS))
    back.load_state_dict({k: v for k, v in tensors.items() if k not in layout.extra_shapes(spec)}, strict=True)
    ctx, ids, anchors = random_block_batch(trained)
    with torch.no_grad():
        assert torch.equal(back.block_logits(ctx, ids, anchors), trained.block_logits(ctx, ids, anchors))
    report = check_export(out, independent=False)
    assert [status for _, status, _ in report.rows] == ["ok"] * 4


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_draft_layers_are_qwen3_style_whatever_the_target(run, fmt):
    tensors = load_file(str(do_export(run, fmt) / WEIGHTS))
    for i in range(2):
        assert tensors[f"layers.{i}.self_attn.q_norm.weight"].shape == (16,)
        assert tensors[f"layers.{i}.self_attn.k_norm.weight"].shape == (16,)
        assert f"layers.{i}.self_attn.q_proj.bias" not in tensors
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert {"hidden_norm.weight", "norm.weight"} <= set(tensors)


def test_zlab_layout(run):
    out = do_export(run, "zlab")
    cfg = json.loads((out / CONFIG_JSON).read_text())
    target = run["target"].config
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == BLOCK and cfg["num_target_layers"] == target.num_hidden_layers == 6
    assert cfg["dflash_config"]["target_layer_ids"] == capture_layer_ids(6, 3) == [1, 2, 3]
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (64, 2, 4, 2, 16, 128, 256)
    assert cfg["attention_bias"] is False and cfg["torch_dtype"] == "float32"
    assert cfg["max_position_embeddings"] == target.max_position_embeddings
    names = set(load_file(str(out / WEIGHTS)))
    assert all(n.split(".")[0] in ("layers", "fc", "hidden_norm", "norm") for n in names)  # nothing of the target
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_JSON, WEIGHTS, MANIFEST,
                                                            "dflash_reference.safetensors"])
    # the upstream model's config class reads it
    q = Qwen3Config.from_pretrained(out)
    assert q.num_hidden_layers == 2 and q.head_dim == 16 and q.dflash_config["target_layer_ids"] == [1, 2, 3]


def test_speculators_layout_fills_the_target_tables(run):
    out = do_export(run, "speculators")
    cfg = json.loads((out / CONFIG_JSON).read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(run["root"] / "target")
    t = load_file(str(out / WEIGHTS))
    assert torch.equal(t["embed_tokens.weight"], run["target"].get_input_embeddings().weight)
    assert torch.equal(t["lm_head.weight"], run["target"].get_output_embeddings().weight)


def test_layer_ids_read_the_upstream_way_select_the_captured_states(run):
    """z-lab reads hidden_states[id + 1] for its target_layer_ids, speculators hidden_states[id]: both
    give exactly the states the trainer's capture fed the drafter."""
    target = run["target"]
    zlab = json.loads((do_export(run, "zlab") / CONFIG_JSON).read_text())["dflash_config"]["target_layer_ids"]
    aux = json.loads((do_export(run, "speculators") / CONFIG_JSON).read_text())["aux_hidden_state_layer_ids"]
    ids = torch.randint(5, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    captured = HiddenStateCapture(target, run["drafter"].spec.target_layer_ids)(ids)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(torch.cat([hs[i + 1] for i in zlab], -1), captured, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([hs[i] for i in aux], -1), captured, rtol=0, atol=0)


# --------------------------------------------------------------------------- --check refuses corruptions
def corrupt_copy(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / CONFIG_JSON).read_text())
        config(cfg)
        (dst / CONFIG_JSON).write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(dst / WEIGHTS))
        tensors(t)
        save_file(t, str(dst / WEIGHTS))
    return dst


def _drop(t):
    del t["layers.1.self_attn.k_norm.weight"]


def _reshape(t):
    t["layers.0.mlp.up_proj.weight"] = t["layers.0.mlp.up_proj.weight"][:-1]


def _nudge(t):
    t["norm.weight"] = t["norm.weight"] * 1.01


def _ids(c):
    c["dflash_config"]["target_layer_ids"] = [0, 1, 2]


def _block(c):
    c["block_size"] = 16


def _embed(t):
    t["embed_tokens.weight"] = torch.zeros(256, 64)


CORRUPTIONS = {
    "missing tensor": (dict(tensors=_drop), "missing tensor layers.1.self_attn.k_norm.weight"),
    "wrong shape": (dict(tensors=_reshape), "layers.0.mlp.up_proj.weight: shape [127, 64]"),
    "changed weight": (dict(tensors=_nudge), "reference hidden states"),
    "target_layer_ids": (dict(config=_ids), "target_layer_ids: config.json reads target layers [0, 1, 2]"),
    "block_size": (dict(config=_block), "block_size: config.json says 16, the drafter was trained with 8"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_check_refuses_a_corrupted_zlab_export(run, tmp_path, capsys, case):
    kw, expect = CORRUPTIONS[case]
    bad = corrupt_copy(do_export(run, "zlab"), tmp_path / "bad", **kw)
    assert main(["export", "--check", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err


def test_check_refuses_a_speculators_export_with_foreign_tables_or_shifted_ids(run, tmp_path, capsys):
    good = do_export(run, "speculators")
    bad = corrupt_copy(good, tmp_path / "tables", tensors=_embed)
    assert main(["export", "--check", str(bad)]) == 1
    assert "embed_tokens.weight (reference rows)" in capsys.readouterr().err

    def zlab_ids(c):  # the classic mistake: z-lab's ids written where speculators' belong
        c["aux_hidden_state_layer_ids"] = [1, 2, 3]

    bad = corrupt_copy(good, tmp_path / "ids", config=zlab_ids)
    assert main(["export", "--check", str(bad)]) == 1
    assert "aux_hidden_state_layer_ids: config.json reads target layers [0, 1, 2]" in capsys.readouterr().err


def test_check_of_an_intact_export_and_of_a_tampered_reference(run, tmp_path, capsys):
    good = do_export(run, "zlab")
    assert main(["export", "--check", str(good)]) == 0
    out = capsys.readouterr().out
    assert "every check passed" in out and "independent reader (speculators)" in out
    bad = corrupt_copy(good, tmp_path / "cfg")
    (bad / CONFIG_JSON).write_text((bad / CONFIG_JSON).read_text() + " ")  # parses the same, bytes differ
    assert main(["export", "--check", str(bad)]) == 1
    assert "config.json: sha256 differs" in capsys.readouterr().err
    (bad / MANIFEST).unlink()
    assert main(["export", "--check", str(bad)]) == 1
    assert "dflash_export.json: missing" in capsys.readouterr().err


# --------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A run whose target directory carries a tokenizer (SmolLM2's), as dflash train's targets do."""
    from dflash.data.model_source import load_tokenizer

    root = tmp_path_factory.mktemp("cli")
    target = tiny_llama(seed=3, init_std=0.2)
    target.save_pretrained(root / "target")
    load_tokenizer("smollm2").save_pretrained(root / "target")
    trained_drafter(target).save(root / "run" / "drafter")
    cfg = with_overrides(DflashConfig(), {"target.model": str(root / "target")})
    (root / "run" / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
    return root


def test_cli_export_writes_checks_and_prints_serving_commands(cli_run, capsys, monkeypatch):
    monkeypatch.setenv("DFLASH_SPECULATORS_VENV", str(cli_run / "no-venv"))  # the skip path, fast
    out = cli_run / "exported"
    assert main(["export", "--drafter", str(cli_run / "run"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bit-identical in float32" in text and "skipped (no speculators environment" in text
    assert "--speculative-algorithm DFLASH" in text and '"method": "dflash"' in text
    cfg = json.loads((out / CONFIG_JSON).read_text())
    # the MASK token's text, so the serving side finds (or adds) the very row the drafter was trained with
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID and cfg["dflash_config"]["mask_token"] == "<reponame>"
    assert not [p for p in cli_run.iterdir() if p.name.startswith(".exported")]  # no temporary left


@pytest.mark.parametrize("argv, expect", [
    (["--drafter", "RUN", "--out", "OUT", "--format", "gguf"], "--format: must be one of zlab, speculators"),
    (["--drafter", "RUN"], "--out: required with --drafter"),
    (["--check", "OUT_NONEMPTY", "--format", "zlab"], "--format: only with --drafter"),
    (["--drafter", "RUN", "--check", "OUT_NONEMPTY"], "give exactly one"),
    (["--drafter", "RUN", "--out", "OUT_NONEMPTY"], "--out: must be a new or empty directory"),
    (["--drafter", "TARGET", "--out", "OUT"], "--drafter: must be a dflash train run directory"),
    (["--check", "MISSING"], "--check: must be an existing directory"),
])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(cli_run, tmp_path, capsys, argv, expect):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "x").write_text("keep")
    subst = {"RUN": str(cli_run / "run"), "OUT": str(tmp_path / "new"), "OUT_NONEMPTY": str(tmp_path / "nonempty"),
             "TARGET": str(cli_run / "target"), "MISSING": str(tmp_path / "missing")}
    assert main(["export", *[subst.get(a, a) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err, err
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nonempty"]


# --------------------------------------------------------------------------- the independent reader
needs_speculators = pytest.mark.skipif(speculators_python()[0] is None, reason=speculators_python()[1])


@needs_speculators
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_independent_reader_loads_the_export_and_agrees(run, tmp_path, fmt):
    """speculators' DFlashConverter (z-lab layout) / DFlashDraftModel (its own layout) load the export
    and their forward reproduces the reference; their layer ids are ours + 1."""
    report = export_drafter(run["run"] / "drafter", tmp_path / "out", fmt, model=run["target"], tokenizer=None,
                            target_model="t", target_source=str(run["root"] / "target"), independent=True)
    name, status, detail = report.rows[-1]
    assert name == "independent reader (speculators)" and status == "ok", detail
    assert "layer ids [2, 3, 4]" in detail
    print(detail)


@needs_speculators
def test_our_speculators_layout_is_what_its_converter_writes(run, tmp_path):
    """speculators' DFlashConverter turns our z-lab export into a config equal to our speculators
    export's on every key it writes (the verifier path aside), and into the same draft tensors."""
    import subprocess

    from dflash.model.export_independent import READER

    zlab, ours = do_export(run, "zlab"), do_export(run, "speculators")
    res = subprocess.run([str(speculators_python()[0]), str(READER), "--format", "zlab", "--export", str(zlab),
                          "--verifier", str(run["root"] / "target"), "--out", str(tmp_path / "read")],
                         capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    conv = json.loads((tmp_path / "read" / "speculators_config.json").read_text())
    mine = json.loads((ours / CONFIG_JSON).read_text())
    for key in ("speculators_model_type", "architectures", "aux_hidden_state_layer_ids", "block_size", "mask_token_id",
                "draft_vocab_size", "sample_from_anchor", "sliding_window_non_causal"):
        assert mine[key] == conv[key], key
    for key, value in conv["transformer_layer_config"].items():
        if key not in ("transformers_version", "max_window_layers", "use_cache") and value is not None:
            assert mine["transformer_layer_config"].get(key) == value, key
    sc, mc = conv["speculators_config"], mine["speculators_config"]
    assert (mc["algorithm"], mc["proposal_methods"], mc["default_proposal_method"]) == \
        (sc["algorithm"], sc["proposal_methods"], sc["default_proposal_method"])


# --------------------------------------------------------------------------- serving commands in the report
def test_report_launch_section_serves_the_export_next_to_its_target(tmp_path):
    from reports.document import Code
    from reports.inputs import Inputs
    from reports.recommend import serving_blocks
    from reports.runs import RunData

    run = RunData(dir=tmp_path / "run", name="run", source="real",
                  config={"target": {"model": "smollm2"}, "drafter": {"block_size": 10}})
    code = next(b for b in serving_blocks(Inputs(runs=[run]), "tuned-1") if isinstance(b, Code)).text
    export_dir = f"{tmp_path / 'run'}/export"
    assert f"dflash export --drafter {tmp_path / 'run'} --out {export_dir}" in code
    assert ("python -m sglang.launch_server --model-path HuggingFaceTB/SmolLM2-135M-Instruct "
            f"--speculative-algorithm DFLASH --speculative-draft-model-path {export_dir} "
            "--speculative-num-draft-tokens 10") in code
    spec = json.dumps({"method": "dflash", "model": export_dir, "num_speculative_tokens": 9})
    assert f"vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config '{spec}'" in code
    none = next(b for b in serving_blocks(Inputs(), "x") if isinstance(b, Code)).text  # no run: the defaults
    assert "--drafter RUN_DIR" in none and "--speculative-num-draft-tokens 16" in none


def test_cli_refuses_a_drafter_saved_with_family_layers(cli_run, tmp_path, capsys):
    import shutil

    old = tmp_path / "old-run"
    shutil.copytree(cli_run / "run", old)
    meta = json.loads((old / "drafter" / "drafter_config.json").read_text())
    meta["spec"].update(format=1, qk_norm=False, attention_bias=False)  # a Llama-style drafter of format 1
    (old / "drafter" / "drafter_config.json").write_text(json.dumps(meta))
    assert main(["export", "--drafter", str(old), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "retrain it with dflash train" in err, err
    assert not (tmp_path / "out").exists()


def test_a_bfloat16_drafter_exports_in_bfloat16_and_checks_in_float32(tmp_path):
    """GPU runs train in bfloat16: the export keeps the saved tensors bit for bit and says so in its
    config; the checks run in float32, where bfloat16 weights are exact."""
    target = tiny_llama(seed=3, init_std=0.2)
    drafter = trained_drafter(target).to(torch.bfloat16)
    drafter.save(tmp_path / "drafter")
    report = export_drafter(tmp_path / "drafter", tmp_path / "out", "zlab", model=target, tokenizer=None,
                            target_model="t", target_source="t", independent=False)
    assert [s for _, s, _ in report.rows] == ["ok"] * 5
    assert json.loads((tmp_path / "out" / CONFIG_JSON).read_text())["torch_dtype"] == "bfloat16"
    saved = load_file(str(tmp_path / "drafter" / "drafter.safetensors"))
    exported = load_file(str(tmp_path / "out" / WEIGHTS))
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)
    assert all(v.dtype == torch.bfloat16 for v in exported.values())
