"""Load a z-lab export with upstream's own ``DFlashDraftModel`` (z-lab ``dflash/model.py``) and run it.

Upstream's model code is not on PyPI, so this is a manual check, not a test: point it at a copy of
z-lab's ``dflash/model.py`` (``git clone https://github.com/z-lab/dflash``), an export written by
``dflash export``, and the target's transformers checkpoint directory. It builds upstream's model
with ``from_pretrained(EXPORT)`` (the way the published z-lab checkpoints load), runs the export's
reference block exactly as upstream's ``dflash_generate`` runs a block (target embedding of
``[anchor, MASK...]``, ``target_hidden`` = the context, no mask, positions 0..C+B-1, the target's
``lm_head``) and prints how far its output is from the export's reference.

    python scripts/check_with_zlab_model.py PATH/TO/dflash/model.py EXPORT_DIR TARGET_DIR
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(model_py: str, export: str, target_dir: str) -> int:
    spec = importlib.util.spec_from_file_location("zlab_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    draft = module.DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    draft.config._attn_implementation = "eager"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ref = load_file(str(Path(export) / "dflash_reference.safetensors"))
    manifest = json.loads((Path(export) / "dflash_export.json").read_text())
    with torch.no_grad():
        noise = target.get_input_embeddings()(ref["block_ids"])
        n = ref["context"].shape[1] + noise.shape[1]
        hidden = draft(position_ids=torch.arange(n)[None], noise_embedding=noise, target_hidden=ref["context"],
                       attention_mask=None, use_cache=False, is_causal=False)
        logits = target.get_output_embeddings()(hidden)[..., ref["vocab_rows"]]
    dh = float((hidden - ref["hidden"]).abs().max())
    dl = float((logits - ref["logits"]).abs().max())
    same = (list(draft.target_layer_ids) == manifest["capture_layers"] and draft.block_size == manifest["block_size"]
            and draft.mask_token_id == manifest["mask_token_id"])
    print(f"z-lab DFlashDraftModel: target_layer_ids {draft.target_layer_ids}, block_size {draft.block_size}, "
          f"mask_token_id {draft.mask_token_id} ({'as trained' if same else 'NOT as trained'}); "
          f"max |diff| hidden {dh:.2g}, logits {dl:.2g}")
    return 0 if same and dl <= 1e-4 * max(1.0, float(ref["logits"].abs().max())) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
