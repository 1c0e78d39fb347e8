"""A tiny randomly initialised Llama for model tests: real transformers code, no downloads."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(vocab_size: int = 256, layers: int = 6, hidden: int = 64, heads: int = 4,
                      kv_heads: int = 2, intermediate: int = 128, tie: bool = True,
                      init_std: float = 0.02) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=1024, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       tie_word_embeddings=tie, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       initializer_range=init_std)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> LlamaForCausalLM:
    """A frozen, eval-mode tiny Llama with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw)).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def tiny_qwen3(seed: int = 0, dtype: torch.dtype = torch.float32, vocab_size: int = 256, layers: int = 4,
               hidden: int = 64, heads: int = 4, kv_heads: int = 1, head_dim: int = 24, tie: bool = False):
    """A frozen, eval-mode tiny Qwen3: its own ``head_dim`` (24, not hidden / heads = 16) and 4 query heads per
    kv head, the shape a Llama-sized test does not cover."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=1024, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=tie, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
