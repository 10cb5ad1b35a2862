"""Tiny randomly initialised Llama and Gemma 3 models for tests and examples (no files, no downloads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .gguf_blocks import BlockMatrix
from .llama_weights import LlamaConfig
from .native import NativeLlama

if TYPE_CHECKING:
    from . import LoadedModel


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


def as_gguf_blocks(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, BlockMatrix]]:
    """The weights quantised as the embedded model's GGUF file holds them (projections Q4_1, the
    output head Q8_0, or the embedding table where the head is tied to it), and the state with
    each quantised weight replaced by its dequantised value."""
    state, blocks = dict(state), {}
    head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    for name, weight in state.items():
        if name.endswith("_proj.weight") or name == head:
            blocks[name] = BlockMatrix.quantize(weight, "q8_0" if name == head else "q4_1")
            state[name] = blocks[name].dequantize()
    return state, blocks


def tiny_llama(
    seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0, *, numerics: str = "exact",
    gguf_blocks: bool = False, **config_kwargs,
) -> NativeLlama:
    """A tiny native Llama backend with random weights; ``gguf_blocks`` (implied by the ``fast``
    numerics) quantises them first, as a GGUF file would hold them (:func:`as_gguf_blocks`)."""
    config = tiny_hf_config(**config_kwargs)
    state, blocks = tiny_state_dict(config, seed, scale), None
    if gguf_blocks or numerics != "exact":
        state, blocks = as_gguf_blocks(state)
    return NativeLlama(LlamaConfig.from_hf(config), state, dtype=dtype, name="tiny-llama", gguf_blocks=blocks,
                       numerics=numerics)


def tiny_model(seed: int = 0, scale: float = 1.0, **kwargs) -> "LoadedModel":
    """:func:`tiny_llama` with the character tokenizer, named ``tiny``: a whole model from a
    picklable call, e.g. ``functools.partial(tiny_model, seed=0)`` for the workers of a Ray run."""
    from . import LoadedModel
    from .tokenizer import CharTokenizer

    return LoadedModel(tiny_llama(seed, scale=scale, **kwargs), CharTokenizer(), "tiny")


def tiny_hf_model(seed: int = 0, scale: float = 1.0, **config_kwargs):
    """The same tiny model as :func:`tiny_llama` (same seed) as a transformers LlamaForCausalLM."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    config = tiny_hf_config(**config_kwargs)
    model = LlamaForCausalLM(HFLlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict(tiny_state_dict(config, seed, scale), strict=False)
    return model.eval()


def tiny_gemma3_hf_config(vocab_size: int = 96, num_layers: int = 4, hidden_size: int = 64, sliding_window: int = 8,
                          max_position: int = 512, attention_bias: bool = False) -> dict:
    """A Hugging Face style Gemma 3 text config: local (sliding-window) and global layers
    alternating, each kind with its own rotary base."""
    return {
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,  # not head_dim: a scale the test can tell apart
        "rms_norm_eps": 1e-6,
        "sliding_window": sliding_window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        "max_position_embeddings": max_position,
        "tie_word_embeddings": True,
        "attention_bias": attention_bias,  # q, k, v and o biases
    }


def tiny_gemma3_hf_model(seed: int = 0, **config_kwargs):
    """A tiny random Gemma 3 as transformers' Gemma3ForCausalLM (norm weights random too, so that
    Gemma's ``1 + w`` norms are exercised)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = tiny_gemma3_hf_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=g) * (0.3 if "norm" in name else 0.2))
    return model.eval()


def tiny_gemma3(seed: int = 0, dtype: torch.dtype = torch.float32, *, numerics: str = "exact",
                gguf_blocks: bool = False, **config_kwargs):
    """The native backend on :func:`tiny_gemma3_hf_model`'s weights (same seed); ``gguf_blocks``
    (implied by the ``fast`` numerics): quantised first, as :func:`as_gguf_blocks`."""
    from .gemma3 import Gemma3Config, NativeGemma3

    state, blocks = dict(tiny_gemma3_hf_model(seed, **config_kwargs).state_dict()), None
    state.pop("lm_head.weight", None)  # tied to the embedding table, as a saved model leaves it
    if gguf_blocks or numerics != "exact":
        state, blocks = as_gguf_blocks(state)
    config = Gemma3Config.from_hf(tiny_gemma3_hf_config(**config_kwargs))
    return NativeGemma3(config, state, dtype=dtype, name="tiny-gemma3", gguf_blocks=blocks, numerics=numerics)
