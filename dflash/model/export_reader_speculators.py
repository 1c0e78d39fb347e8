"""The independent reader: vLLM's ``speculators`` package loads a dflash export and runs it.

A standalone script (nothing of dflash is imported: it runs under the Python of the speculators
virtual environment, ``scripts/speculators_venv.sh``, where dflash is not installed), started by
:mod:`dflash.model.export_independent`:

    python export_reader_speculators.py --format zlab|speculators --export DIR --verifier DIR --out DIR

* ``zlab``: speculators' own ``DFlashConverter`` converts the export (validating by loading, as
  it does for the published z-lab checkpoints), filling embedding and LM head from ``--verifier``;
  the result is loaded with ``DFlashDraftModel.from_pretrained``.
* ``speculators``: the export is loaded with ``DFlashDraftModel.from_pretrained`` directly.

Then the reference block of the export (``dflash_reference.safetensors``) runs through the loaded
model's own modules the way upstream's inference does (``fc`` -> ``hidden_norm`` on the context, the
block embedded with speculators' ``embed_tokens``, every decoder layer with no mask, ``norm``,
``lm_head``), and the hidden states, the logits on the reference rows and the config values the
model reads (layer ids, block size, MASK id) are written to ``--out``, with the speculators
``config.json`` it loaded (for a z-lab export: the one its converter wrote).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch


def load(fmt: str, export: Path, verifier: str) -> tuple[Any, Path]:
    from speculators.models.dflash import DFlashDraftModel

    path = export
    if fmt == "zlab":
        from speculators.convert.dflash import DFlashConverter

        path = Path(tempfile.mkdtemp(prefix="dflash-speculators-")) / "converted"
        DFlashConverter().convert(str(export), str(path), base_model=verifier, validate=True)
    model = DFlashDraftModel.from_pretrained(str(path))
    return model.float().eval(), path


def forward(model: Any, ref: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    model.config.transformer_layer_config._attn_implementation = "eager"  # no mask: the block sees all context
    with torch.no_grad():
        ctx = model.hidden_norm(model.fc(ref["context"]))
        x = model.embed_tokens(ref["block_ids"])
        pos = torch.arange(ctx.shape[1] + x.shape[1])[None]
        emb = model.rotary_emb(x, pos)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                      position_embeddings=emb)
        hidden = model.norm(x)
        logits = model.lm_head(hidden)[..., ref["vocab_rows"]]
    return hidden, logits


def main() -> None:
    from safetensors.torch import load_file, save_file

    ap = argparse.ArgumentParser()
    ap.add_argument("--format", required=True, choices=("zlab", "speculators"))
    ap.add_argument("--export", required=True, type=Path)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    model, path = load(a.format, a.export, a.verifier)
    ref = load_file(str(a.export / "dflash_reference.safetensors"))
    hidden, logits = forward(model, ref)
    a.out.mkdir(parents=True, exist_ok=True)
    save_file({"hidden": hidden.contiguous(), "logits": logits.contiguous()}, str(a.out / "outputs.safetensors"))
    from importlib.metadata import version

    (a.out / "read.json").write_text(json.dumps({
        "aux_hidden_state_layer_ids": list(model.target_layer_ids), "block_size": int(model.block_size),
        "mask_token_id": model.config.mask_token_id, "speculators_version": version("speculators"),
        "state_dict_keys": sorted(model.state_dict()),
    }))
    (a.out / "speculators_config.json").write_text((path / "config.json").read_text())  # as it was loaded


if __name__ == "__main__":
    main()
