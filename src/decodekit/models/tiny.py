"""Tiny randomly initialised Llama models for tests and examples (no files, no downloads)."""

from __future__ import annotations

import torch

from .native import LlamaConfig, NativeLlama


def tiny_hf_config(vocab_size: int = 96, num_layers: int = 2, hidden_size: int = 32, max_position: int = 512) -> dict:
    """A Hugging Face style Llama config dict; small enough for a test to run hundreds of steps."""
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": max_position,
        "tie_word_embeddings": False,
    }


def tiny_state_dict(config: dict, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random weights. A larger ``scale`` makes sharper (lower entropy) next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    c = LlamaConfig.from_hf(config)

    def rand(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std * scale

    kv = c.num_kv_heads * c.head_dim
    state = {
        "model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size, std=1.0),
        "model.norm.weight": torch.ones(c.hidden_size),
        "lm_head.weight": rand(c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": torch.ones(c.hidden_size),
                p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
                p + "self_attn.q_proj.weight": rand(c.num_heads * c.head_dim, c.hidden_size),
                p + "self_attn.k_proj.weight": rand(kv, c.hidden_size),
                p + "self_attn.v_proj.weight": rand(kv, c.hidden_size),
                p + "self_attn.o_proj.weight": rand(c.hidden_size, c.num_heads * c.head_dim),
                p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
            }
        )
    return state


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0, **config_kwargs) -> NativeLlama:
    """A tiny native Llama backend with random weights."""
    config = tiny_hf_config(**config_kwargs)
    return NativeLlama(LlamaConfig.from_hf(config), tiny_state_dict(config, seed, scale), dtype=dtype, name="tiny-llama")


def tiny_hf_model(seed: int = 0, scale: float = 1.0, **config_kwargs):
    """The same tiny model as :func:`tiny_llama` (same seed) as a transformers LlamaForCausalLM."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    config = tiny_hf_config(**config_kwargs)
    model = LlamaForCausalLM(HFLlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict(tiny_state_dict(config, seed, scale), strict=False)
    return model.eval()
