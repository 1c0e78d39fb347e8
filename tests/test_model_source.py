"""Finding a model has one home (dflash/data/model_source.py): every reading of ``target.model`` goes
through :func:`find_model`, and a string that names nothing is one line before any work starts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash.core.errors import ConfigError
from dflash.data.model_source import (
    PACKAGED_GGUF,
    find_model,
    gguf_cache_entry,
    load_tokenizer,
    model_identity,
    packaged_target_gguf,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_four_kinds_of_target_model(tmp_path: Path) -> None:
    packaged = find_model("smollm2")
    assert packaged.gguf == packaged_target_gguf() and packaged.gguf.name == PACKAGED_GGUF

    gguf = tmp_path / "m.GGUF"
    gguf.write_bytes(b"GGUF")
    assert find_model(str(gguf)).gguf == gguf.resolve()

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert find_model(str(ckpt)).directory == ckpt and find_model(str(ckpt)).gguf is None

    for hub in ("gpt2", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"):
        assert find_model(hub).hub_id == hub


@pytest.mark.parametrize("model", ["/nonexistent/model.gguf", "missing.gguf", "./here", "~/nowhere/at/all",
                                   "a/b/c", "../up"])
def test_a_path_that_names_nothing_is_one_line_naming_target_model(model: str) -> None:
    with pytest.raises(ConfigError) as err:
        find_model(model)
    assert err.value.key == "target.model" and "no such file or directory" in err.value.allowed


def test_a_file_that_is_no_gguf_and_a_directory_without_a_model_are_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"must be 'smollm2', a directory, a hub id or a \.gguf path"):
        find_model(str(tmp_path / "weights.bin"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="give that file's path"):
        find_model(str(tmp_path / "d"))


def test_identity_and_cache_entry_follow_the_file_not_its_name(tmp_path: Path) -> None:
    g = tmp_path / "a.gguf"
    g.write_bytes(b"GGUF one")
    first_id, first_entry = model_identity(str(g)), gguf_cache_entry(g, tmp_path)
    g.write_bytes(b"GGUF two, longer")
    assert model_identity(str(g)) != first_id
    assert gguf_cache_entry(g, tmp_path) != first_entry
    assert first_entry.parent == tmp_path / "models" and first_entry.name.startswith("a-")
    assert model_identity("Qwen/Qwen3-8B") == {"model": "Qwen/Qwen3-8B", "kind": "hub"}


def test_the_packaged_tokenizer_loads_through_the_one_home(tmp_path: Path) -> None:
    tok = load_tokenizer("smollm2", tmp_path)
    assert len(tok) > 49_000 and tok.chat_template
    assert any((tmp_path / "tokenizers").iterdir())  # converted once, kept


def test_no_other_module_reads_a_gguf_or_the_packaged_model_itself() -> None:
    """transformers' ``gguf_file=`` and the packaged file name appear in model_source only: a second
    reader of ``target.model`` would be a second rule for what the string means."""
    home = ROOT / "dflash" / "data" / "model_source.py"
    readers = []
    for p in sorted((ROOT / "dflash").rglob("*.py")):
        if p == home:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "gguf_file":
                readers.append(f"{p.relative_to(ROOT)}:{node.value.lineno}")
            if isinstance(node, ast.Constant) and node.value == PACKAGED_GGUF:
                readers.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert readers == []
