"""Gemma 3 (text) on the native backend: :class:`.native.NativeLlama` with Gemma's differences.

Gemma Team, "Gemma 3 Technical Report" (2025); the reference is transformers' ``Gemma3ForCausalLM``.
Where it differs from a Llama, and how this module follows it:

* the embedding is scaled by ``sqrt(hidden_size)`` (rounded to float32 first, as the reference does);
* RMSNorm weights are offsets: the norm multiplies by ``1 + w`` (added once here, in float32; a
  bfloat16 model keeps the sum in bfloat16 and multiplies in it, where transformers multiplies in
  float32: bfloat16 is outside the exact numerics' promise);
* "sandwich" norms: the attention's and the MLP's outputs are normalised before the residual add
  (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the MLP's input by
  ``pre_feedforward_layernorm``;
* queries and keys are RMS-normalised per head (``q_norm``, ``k_norm``) before the rotary embedding;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* layers listed as ``sliding_attention`` see only the last ``sliding_window`` positions (a key at
  position j is visible to a query at p when p - j < window, as the reference's mask) and use
  their own rotary base (``rope_parameters["sliding_attention"]``); the others attend to all;
* optional tanh soft-capping of the final logits (``final_logit_softcapping``; None in Gemma 3).

Every token's row is still computed on its own, so tree verification and rollback are as for a
Llama, and the one-call layer path (``kernels/forward.c``, with Gemma's fields) gives the layer
loop's bits. Choices: the cache keeps every position in every layer (a local layer reads only its
window, but its older entries are not freed); cache policies that evict or move entries are refused
(their slots would no longer be positions, which the window needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidParameter
from .kv_policy import KVPolicy
from .kernels import LAYER_NORMS, decoder_layers
from .llama_weights import (LlamaConfig, LlamaWeights, RopeTable, SplitProjection, config_object, read_rows, rms_norm,
                            rope_row_order)
from .native import NativeLlama


#: What transformers' Gemma3TextConfig reads for a key a config leaves out, where reading the config
#: as a Llama's would read something else (a hand-written config must mean the same model here).
GEMMA3_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "rms_norm_eps": 1e-6}


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    query_scale: float = 1.0
    sliding_window: int = 0
    local_layers: tuple[bool, ...] = ()
    local_rope_theta: float = 10000.0
    final_logit_softcap: float | None = None

    @classmethod
    def from_hf(cls, cfg: Mapping) -> "Gemma3Config":
        cfg = {**GEMMA3_DEFAULTS, **(config_object(cfg, "text_config") or cfg)}  # a multimodal config holds the text model's
        if cfg.get("rope_scaling"):  # the older spelling of a scaled rotary embedding
            raise NotImplementedError(f"rope scaling {cfg['rope_scaling']!r} is not supported by the native backend")
        rope = config_object(cfg, "rope_parameters")
        # the older spellings of the two bases: rope_theta (global layers), rope_local_base_freq
        full = config_object(rope, "full_attention") or {"rope_theta": cfg.get("rope_theta", 1e6)}
        local = config_object(rope, "sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        for part in (full, local):
            if part.get("rope_type", "default") != "default":
                raise NotImplementedError(f"rope scaling {part['rope_type']!r} is not supported by the native backend")
        if cfg.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attention logit soft-capping is not supported by the native backend")
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise NotImplementedError(f"activation {cfg['hidden_activation']!r} is not supported by the native backend")
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(layers)
        ]
        # the sizes as a Llama's; its windows and gating are Gemma's own, read here and below
        # (transformers' Gemma 3 ties the output head to the embedding table unless told otherwise)
        base = LlamaConfig.from_hf({**cfg, "model_type": "gemma3_text",  # (its attention_bias covers o too)
                                    "rope_parameters": {"rope_theta": full.get("rope_theta", 1e6)},
                                    "layer_types": None, "sliding_window": None, "hidden_act": "silu",
                                    "tie_word_embeddings": cfg.get("tie_word_embeddings", True)})
        return cls(
            **dataclasses.asdict(base),
            query_scale=cfg.get("query_pre_attn_scalar", base.head_dim) ** -0.5,
            sliding_window=cfg.get("sliding_window") or 0,
            local_layers=tuple(t == "sliding_attention" for t in types),
            local_rope_theta=local.get("rope_theta", 10000.0),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )


#: Tokens a pass of a long prompt reads in the exact numerics (see NativeGemma3._prefill_chunk).
LONG_PROMPT_CHUNK = 1024


class Gemma3Weights(LlamaWeights):
    """:class:`.llama_weights.LlamaWeights` plus Gemma's norms (as ``1 + w``)."""

    MLP_NORM = "pre_feedforward_layernorm.weight"

    def __init__(self, config: Gemma3Config, state, dtype, blocks=None, numerics="exact", matches=None):
        offset_state = _NormOffsets(state)
        super().__init__(config, offset_state, dtype, blocks, numerics, matches)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)

    def _layer(self, config: LlamaConfig, p: str, get: Callable[[str], torch.Tensor]) -> dict:
        layer = super()._layer(config, p, get)
        order = rope_row_order(config.head_dim, config.head_dim)  # q and k are stored rotary-interleaved
        layer["q_norm"] = get(p + "self_attn.q_norm.weight")[order].contiguous()
        layer["k_norm"] = get(p + "self_attn.k_norm.weight")[order].contiguous()
        layer["post_attn_norm"] = get(p + "post_attention_layernorm.weight")
        layer["post_mlp_norm"] = get(p + "post_feedforward_layernorm.weight")
        return layer


class _NormOffsets(Mapping):
    """A state dict whose norm weights read as ``1 + w`` (Gemma's RMSNorm multiplies by that)."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self._state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self._state[name]
        return 1.0 + weight.float() if name.endswith("norm.weight") else weight

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self[name] if name.endswith("norm.weight") else read_rows(self._state, name, start, stop)

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class NativeGemma3(NativeLlama):
    """The native backend for Gemma 3 text models (see the module's docstring)."""

    config: Gemma3Config
    weights_class = Gemma3Weights
    takes_streaming_cache = False  # (see _use_policy)

    def __init__(self, config: Gemma3Config, state, *, kv_cache: KVPolicy | str | None = None, **kwargs):
        # the local layers' rotary table first: building the layers' kernel path reads it
        local = RopeTable(config.local_rope_theta, config.head_dim, config.max_position)
        self._local_freqs, self._local_pairs = local.angles, local.pairs
        super().__init__(config, state, kv_cache=kv_cache, **kwargs)
        self._ropes.append(local)
        self.info = dataclasses.replace(self.info, architecture=self.info.architecture.replace("native-llama", "native-gemma3"))

    @classmethod
    def check_policy(cls, policy: KVPolicy) -> None:
        if policy.evicts() or policy.reassigns_positions or policy.kivi:
            raise InvalidParameter(f"kv cache {policy.spec} is not supported for Gemma 3 (its sliding-window layers "
                                   "need every slot at its position, in float32 or int8); use full or int8")

    def _use_policy(self, policy: KVPolicy) -> None:
        self.check_policy(policy)
        super()._use_policy(policy)

    def _decoder_layers(self, int8_cache=None):
        """The one-call layer path (``kernels/forward.c``) with Gemma's fields; None under the int8
        cache (its rows are not ``head_dim`` floats, which the window's slot offset assumes), where
        a piece is missing and where a projection has a bias."""
        c, w = self.config, self.weights
        if int8_cache is not None or self._ops is None or self._attend is None:
            return None
        layers = []
        for local, layer in zip(c.local_layers, w.layers):
            qkv = layer["qkv"]
            parts = qkv.parts if isinstance(qkv, SplitProjection) else [qkv]
            kernels = dict(zip(("qkv", "k", "v"), (p.kernel for p in parts)))
            kernels.update({n: layer[n].kernel for n in ("o", "gate_up", "down")})
            if len(parts) not in (1, 3) or any(k is None for k in kernels.values()):
                return None
            if any(p.bias is not None for p in (*parts, *(layer[n] for n in ("o", "gate_up", "down")))):
                return None  # (forward.c adds no biases: attention_bias runs layer by layer)
            layers.append({**kernels, **{n: layer[n] for n in ("attn_norm", "mlp_norm", *LAYER_NORMS)},
                           "freqs": self._local_pairs if local else None, "local": local})
        return decoder_layers(
            self.dtype, self._ops, self._attend, hidden=c.hidden_size, inter=c.intermediate_size, n_heads=c.num_heads,
            n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps, layers=layers, scale=c.query_scale,
            gelu=True, window=c.sliding_window,
        )

    def _prefill_chunk(self, tokens: torch.Tensor, hidden_layers, skip_layers, observe: bool = False) -> int | None:
        """A long prompt that the kernels do not read (hidden states asked for; no kernels) is read
        :data:`LONG_PROMPT_CHUNK` tokens a pass: a sliding-window layer's mask over a whole prompt
        grows with its square, over a chunk with its length (the logits differ only by float32
        rounding)."""
        chunk = super()._prefill_chunk(tokens, hidden_layers, skip_layers, observe)
        return LONG_PROMPT_CHUNK if chunk is None and self.config.sliding_window else chunk

    @property
    def _attention_scale(self) -> float:
        return self.config.query_scale

    def _rope_pairs(self, i: int) -> torch.Tensor:
        return self._local_pairs if self.config.local_layers[i] else self._freqs_pairs

    def _rope_angles(self, i: int) -> torch.Tensor:
        return self._local_freqs if self.config.local_layers[i] else self._freqs

    def _window(self, i: int, positions: torch.Tensor, mask: torch.Tensor | None, start: int):
        window = self.config.sliding_window
        if not (self.config.local_layers[i] and window):
            return None
        k = positions.numel()
        lo = max(0, min(int(positions.min()) - window + 1, start))  # the first slot any row can see
        if int(positions.max()) - window < lo:  # every row sees every slot from lo on: its mask as it is
            return None if lo == 0 else (lo, None if mask is None else mask[:, lo:])
        # the cache holds position j at slot j (no policy moves entries here); new slots hold `positions`
        key_positions = torch.cat([torch.arange(lo, start), positions])
        visible = key_positions[None, :] > positions[:, None] - window
        if mask is not None:
            visible &= mask[:, lo:]
        elif k > 1:
            raise ValueError("a pass of several tokens needs its mask")
        return lo, visible

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weights.embedding(tokens) * self.weights.embed_scale

    def _layer(self, i, layer, x, pending, positions, mask, start, ops, causal):
        c = self.config
        h = self._add_norm(x, pending, layer["attn_norm"], ops)
        qkv = layer["qkv"](h)
        q_size, k_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for heads, weight in ((qkv[..., :q_size], layer["q_norm"]), (qkv[..., q_size : q_size + k_size], layer["k_norm"])):
            heads.copy_(self._norm(heads.reshape(-1, c.head_dim), weight, ops).view(heads.shape))
        attn = self._attention(i, qkv, positions, mask, start, ops, causal)
        h = self._add_norm(x, self._norm(layer["o"](attn), layer["post_attn_norm"], ops), layer["mlp_norm"], ops)
        gate_up = layer["gate_up"](h)
        if ops is not None:
            act = ops.gelu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        return self._norm(layer["down"](act), layer["post_mlp_norm"], ops)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, ops) -> torch.Tensor:
        """RMSNorm of the last axis (rows alone, by the layer kernels where the pass takes them)."""
        if ops is not None:
            return ops.add_rms_norm(x.contiguous(), None, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super()._head(h)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
