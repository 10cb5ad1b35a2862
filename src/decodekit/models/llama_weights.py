"""The weights of a Llama-family model as the native backend computes with them: the config, the
rotary tables, and each linear layer as a :class:`Projection` on the GGUF file's own blocks (or on
float32 weights), in the numerics the model was loaded with (:data:`..arguments.NUMERICS`).

:class:`LlamaWeights` holds them all; :class:`.native.NativeLlama` (the backend, with its cache)
runs the passes over them.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidModel, InvalidParameter, NumericsUnavailable
from .gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, BlockMatrix, matching_blocks, matrix_rows, matrix_shape
from .kernels import (
    INTEGER_GROUP, MAX_ROWS, KernelProjection, block_matmul, empty_packed, few_rows_matmul, integer_block_matmul,
    integer_block_rows, pack_integer_blocks,
)
from .memory import return_freed_memory

# The numerics (:data:`..arguments.NUMERICS`). ``exact``: float32 on the weights (or their GGUF
# blocks), bit-identical to the dequantised model. ``fast``: inputs quantised to 8 bits per block of 32 and integer dot products against the GGUF
# blocks (``kernels/gemm_q8.c``), for every pass, prefill included. Both compute every token's row
# on its own, so speculative decoding and batching are lossless relative to plain decoding in
# the same numerics; ``fast`` differs from ``exact`` by the inputs' quantisation.


#: The longest context this backend takes (a model's rotary table is allocated for all of it).
MAX_POSITIONS = 1 << 24

@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q, k and v have biases (Qwen2; Llama with attention_bias)
    output_bias: bool = False  # o too (Llama and Gemma 3 with attention_bias)

    def __post_init__(self) -> None:
        """A config.json whose sizes cannot describe a model is refused here, in one line, rather
        than met as a reshape or type error deep in a layer."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.max_position > MAX_POSITIONS:  # (its rotary table would be allocated whole)
            raise ValueError(f"max_position {self.max_position} is more than the {MAX_POSITIONS} positions "
                             "this backend holds")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads cannot share {self.num_kv_heads} key/value heads evenly")

    def norm_shape(self, name: str) -> tuple[int]:
        """The shape of a norm's weight: one value per channel of what it normalises (a head's for
        the per-head q and k norms, the hidden state's for the others)."""
        return (self.head_dim,) if name.endswith(("q_norm.weight", "k_norm.weight")) else (self.hidden_size,)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """The shape of each layer's projection weights (by name after the layer's prefix)."""
        h, q, kv, ff = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h),
                "mlp.down_proj.weight": (h, ff)}

    @classmethod
    def from_hf(cls, cfg: Mapping) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        rope = config_object(cfg, "rope_parameters")
        # (rope_scaling: the older configs' name for it, with "type" for "rope_type" in the oldest)
        for scaling in (rope, config_object(cfg, "rope_scaling")):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", None):
                raise NotImplementedError(f"rope scaling {kind!r} is not supported by the native backend")
        unsupported = native_unsupported(cfg)
        if unsupported:
            raise NotImplementedError(f"{unsupported} is not supported by the native backend")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            # (no heads: refused below by name, not a division by zero here)
            head_dim=cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else 0),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            # o's too where attention_bias covers all four (Llama's and Gemma 3's; Qwen2's o has none)
            output_bias=bool(cfg.get("attention_bias")) and cfg.get("model_type") in ("llama", "gemma3_text"),
        )


def config_object(cfg: Mapping, key: str) -> Mapping:
    """The object a config holds under ``key`` ({} where it has none); ValueError where it holds
    another kind of value (a damaged or hand-edited config.json)."""
    value = cfg.get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object, got {value!r:.60}")
    return value


def native_unsupported(cfg: Mapping) -> str | None:
    """What in a Llama-family config.json the native backend does not compute (it would give other
    logits without a word), or None: a sliding window shorter than the context (Mistral 7B v0.1,
    Qwen2 with use_sliding_window), MLP biases, a gating activation other than SiLU."""
    window, kinds, kind = cfg.get("sliding_window"), cfg.get("layer_types") or (), cfg.get("model_type")
    if kinds:
        windowed = "sliding_attention" in kinds
    else:  # (Llama has no window; Qwen2 names one it does not use unless use_sliding_window says so)
        windowed = window is not None and (kind == "mistral" or (kind == "qwen2" and bool(cfg.get("use_sliding_window"))))
    if windowed and isinstance(window, int) and window < cfg.get("max_position_embeddings", 4096):
        return f"sliding-window attention (a window of {window})"
    if cfg.get("mlp_bias"):
        return "an MLP with biases (mlp_bias)"
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        return f"the activation {cfg['hidden_act']!r}"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like the reference implementation, whatever the weight dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def rope_row_order(rows: int, head_dim: int) -> torch.Tensor:
    """The row index :func:`interleave_rope_rows` applies to a ``rows``-row projection."""
    return interleave_rope_rows(torch.arange(rows).view(rows, 1), head_dim).view(rows)


def interleave_rope_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder q/k projection rows so each head's rotary pairs (j, j + D/2) become adjacent.

    Hugging Face checkpoints rotate "halves"; with adjacent pairs the rotation is one complex
    multiply instead of five element-wise ops. q·k is a sum over the same (permuted) dims, so
    attention is unchanged; only the cache stores keys in this order.
    """
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    heads = weight.shape[0] // head_dim
    return weight.view(heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)


ROPE_CHUNK = 1024  # positions whose angles are computed together, always in the same chunks
#: weights of a tied head checked (and, in the fast numerics, read and packed) at a time
HEAD_SLICE_VALUES = 1 << 22


class RopeTable:
    """Rotary angles for positions ``0 .. max_position - 1``: ``angles``, complex ``[max_position,
    D / 2]``, and the same memory as float (cos, sin) pairs, ``pairs`` ``[max_position, D]`` (what
    the kernels read).

    The table is allocated whole but computed only as far as a sequence reaches (:meth:`reach`,
    which every pass calls first), in fixed chunks of :data:`ROPE_CHUNK` positions, so a position's
    angles never depend on which were asked for before: memory never written costs nothing, and a
    model with a long context (Gemma 3: 32,768 positions, 32 MB a table) pays for what it uses."""

    def __init__(self, theta: float, head_dim: int, max_position: int):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.angles = torch.empty(max_position, head_dim // 2, dtype=torch.complex64)
        self.pairs = torch.view_as_real(self.angles).reshape(max_position, -1)
        self.filled = 0  # positions below this have their angles
        self._lock = threading.Lock()  # requests of a server share the table

    def reach(self, end: int) -> None:
        """Compute the angles of every position below ``end`` (at most ``max_position``)."""
        if end <= self.filled:
            return
        with self._lock:
            last = min(-(-end // ROPE_CHUNK) * ROPE_CHUNK, self.angles.shape[0])
            for start in range(self.filled, last, ROPE_CHUNK):
                stop = min(start + ROPE_CHUNK, last)
                angles = torch.outer(torch.arange(start, stop, dtype=torch.float32), self.inv_freq)
                self.angles[start:stop] = torch.polar(torch.ones_like(angles), angles)
            self.filled = max(self.filled, last)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on adjacent pairs. x: [B, k, H, D]; freqs: complex [1, k, 1, D/2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).to(x.dtype)


def _onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether this torch build has oneDNN's linear for ``dtype`` (CPU builds with MKL-DNN do; in
    bfloat16 only on a CPU with AVX-512: on an AVX2 one it fails to make its kernel, where torch's
    own F.linear still multiplies bfloat16)."""
    try:
        x, w = torch.ones(2, 3, dtype=dtype), torch.ones(4, 3, dtype=dtype)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


ONEDNN_LINEAR = {dtype: _onednn_linear_works(dtype) for dtype in (torch.float32, torch.bfloat16)}


def native_architecture(dtype: torch.dtype, gguf_blocks: bool = False, numerics: str = "exact") -> str:
    """The backend's name with the matmul paths it uses (verification costs depend on them)."""
    parts = ["native-llama"]
    if few_rows_matmul(dtype) is not None:
        parts.append("kernel")
    if gguf_blocks:
        parts.append("gguf-blocks")
    if ONEDNN_LINEAR.get(dtype, False):
        parts.append("onednn")
    if numerics != "exact":
        parts.append(f"numerics-{numerics}")
    return "+".join(parts)


def fast_numerics_unavailable(blocks: "BlockMatrix | None") -> str | None:
    """Why a projection cannot run the ``fast`` numerics, or None when it can."""
    if blocks is None:
        return ("it needs a GGUF model's blocks, in a type its kernels read (a .gguf file or an embedded model, "
                "float32)")
    if integer_block_matmul(blocks.kind) is None:
        if os.environ.get("DECODEKIT_KERNELS", "1") == "0":
            return "it needs the compiled kernels, which DECODEKIT_KERNELS=0 turns off"
        return "it needs a CPU with AVX2 and a C compiler"
    if blocks.shape[0] % INTEGER_GROUP:
        return f"it needs projections of a multiple of {INTEGER_GROUP} rows"
    return None


def require_fast_numerics(blocks: "BlockMatrix | None") -> None:
    """Refuse, in one line, a projection that cannot run the ``fast`` numerics."""
    reason = fast_numerics_unavailable(blocks)
    if reason is not None:
        raise NumericsUnavailable(f"the fast numerics is unavailable: {reason}; use --numerics exact")


class Projection:
    """A linear layer, run through oneDNN's matmul where this torch build has it.

    Why not ``F.linear``: float32 ``F.linear`` goes to MKL, whose kernels for a few rows are far
    from the hardware, while oneDNN's ``_linear_pointwise`` on the same ``[out, in]`` weight costs
    a fraction of that for a few rows (the figures: docs/BENCHMARKS.md, the earliest float32 runs). Cheap multi-row passes are what
    make speculative verification pay in float32. Both are plain float32 (or bfloat16) arithmetic: only
    the summation order differs.

    Passes of up to ``MAX_ROWS`` tokens go to the compiled weight-streaming kernel
    (:mod:`.kernels`) where it builds: faster than either library here for decode steps and
    small verification passes, and a token's projections come out the same in both. With
    bfloat16 weights it multiplies in float32 (exact products, float32 sums, as oneDNN's
    bfloat16 GEMM does) and rounds the result to bfloat16.

    With ``blocks`` (float32 weights that are a GGUF file's dequantised blocks, see
    :mod:`.gguf_blocks`) those passes stream the blocks instead, with bit-identical results.

    With ``numerics="fast"`` every pass, whatever its length, runs the integer kernel on the
    blocks (repacked for it), and the float32 weights are not kept.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks: BlockMatrix | None = None,
        numerics: str = "exact", blocks_only: bool = False, packed: torch.Tensor | None = None,
    ):
        self.weight = weight
        self.bias = bias
        self.any_rows = False  # whether few_rows takes passes of any length (prefill included)
        self.on_blocks = False  # whether the kernels stream GGUF blocks (the file's, or repacked)
        self._rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # weight rows, where not self.weight's
        if numerics == "fast":
            self._use_integer_kernel(blocks, packed)
            return
        self.few_rows = few_rows_matmul(weight.dtype)
        # what the few-row kernel is, as compiled code can call it (see kernels.KernelProjection)
        self.kernel: KernelProjection | None = None
        if self.few_rows is not None:
            self.kernel = (self.few_rows.address, weight, weight.shape[0], weight.shape[1])
        kernel = block_matmul(blocks.kind) if blocks is not None and weight.dtype == torch.float32 else None
        if kernel is not None:
            data, kind, n_in, self.on_blocks = blocks.data, blocks.kind, blocks.n_in, True
            self._rows = lambda rows: blocks.take(rows).dequantize()
            if blocks.shape[0] % 4 == 0 and block_matmul(kind, interleaved=True):  # four rows a stream (gemm.c)
                data, kernel = blocks.interleaved(), block_matmul(kind, interleaved=True)
                # (naming only the interleaved copy: the file's layout is not kept beside it)
                self._rows = lambda rows: BlockMatrix.from_interleaved(kind, data, rows, n_in).dequantize()
            self.few_rows = lambda weight, x: kernel(data, x, n_in)
            self.kernel = (kernel.address, data, weight.shape[0], n_in)
        if blocks_only:  # no float32 weights to fall back on: every pass streams the blocks
            if not self.on_blocks:
                raise ValueError("a projection without float32 weights needs a block kernel")
            self.any_rows = True

    def _use_integer_kernel(self, blocks: BlockMatrix | None, packed: torch.Tensor | None) -> None:
        """Run on ``blocks`` packed for the integer kernel (``packed``: already done)."""
        require_fast_numerics(blocks)
        if packed is None:
            packed = pack_integer_blocks(blocks.kind, blocks.data, blocks.n_in)
        kernel = integer_block_matmul(blocks.kind)
        kind, n_in = blocks.kind, blocks.n_in
        self.on_blocks, self.any_rows = True, True  # the file's blocks are not kept: the packed copy is what runs
        self.few_rows = lambda weight, x: kernel(packed, x, n_in)
        self.kernel = (kernel.address, packed, packed.shape[0], n_in)
        self._rows = lambda rows: integer_block_rows(kind, packed, rows, n_in)
        # only the shape is needed from here on: the float32 weights' memory goes back
        self.weight = torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta")

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of the weight matrix, float ``[len(rows), in]`` (from the blocks, bit for bit
        the dequantised rows, where the float32 weights are not kept): a tied embedding's lookup."""
        rows = rows.reshape(-1)
        if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < self.weight.shape[0]:
            raise IndexError(f"row index out of range for a matrix of {self.weight.shape[0]} rows")
        return self._rows(rows) if self._rows is not None else self.weight[rows]

    @property
    def streamed_bytes(self) -> int:
        """Bytes a few-row pass reads from this projection's weights (its blocks, where it streams them)."""
        return self.kernel[1].nbytes if self.kernel is not None else self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.few_rows is not None and (rows <= MAX_ROWS or self.any_rows):
            out = self.few_rows(self.weight, x.reshape(rows, -1).contiguous()).view(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        if ONEDNN_LINEAR.get(self.weight.dtype, False):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def read_rows(state: Mapping[str, torch.Tensor], name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start..stop`` of tensor ``name``, as float32 (a state that reads from disk reads only those)."""
    rows = state.rows(name, start, stop) if hasattr(state, "rows") else state[name][start:stop]
    return rows.float()


class SplitProjection:
    """A fused projection whose parts are blocks of different types: one :class:`Projection` per
    part, outputs side by side. Each output row is its part's, so the results are those of the
    parts alone (no fused kernel for the one-call layer path: ``kernel`` is None)."""

    kernel = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: list[BlockMatrix], numerics: str):
        bounds = torch.tensor([0] + [p.shape[0] for p in parts]).cumsum(0).tolist()
        self.parts = [
            Projection(weight[a:b], None if bias is None else bias[a:b], blocks, numerics)
            for a, b, blocks in zip(bounds, bounds[1:], parts)
        ]
        self.on_blocks, self.bias = all(p.on_blocks for p in self.parts), None  # the parts add their own bias rows
        # what the parts keep of the weights is what is kept (nothing, in the fast numerics)
        self.weight = weight if numerics == "exact" else torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    @property
    def streamed_bytes(self) -> int:
        return sum(p.streamed_bytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


TIED_HEAD = "tied head"  # the record's entry for an output head on its embedding table's blocks


class LlamaWeights:
    """Weights rearranged for fast inference: fused qkv and gate/up projections.

    ``blocks`` (GGUF blocks by Hugging Face name, float32 only) are attached to every fused
    projection whose float32 weights they reproduce exactly. ``numerics`` is one of :data:`..arguments.NUMERICS`.
    ``matches``: what an earlier check of the same files found, by matrix
    (:class:`..gguf_blocks.BlockMatches`), taken instead of checking again; each check made here
    is added to it."""

    MLP_NORM = "post_attention_layernorm.weight"  # the norm before the MLP (Llama's name for it)

    def __init__(
        self, config: LlamaConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype,
        blocks: Mapping[str, BlockMatrix] | None = None, numerics: str = "exact",
        matches: dict[str, object] | None = None,
    ):
        shapes = config.projection_shapes()

        def get(name: str) -> torch.Tensor:
            tensor = state[name]
            want = shapes.get(name.split(".", 3)[-1]) if name.startswith("model.layers.") else None
            if name.endswith("norm.weight"):  # (a kernel reads as many values as the config says)
                want = config.norm_shape(name)
            if want is not None and tuple(tensor.shape) != want:  # config.json and the weights disagree
                raise InvalidModel(f"{name} is {tuple(tensor.shape)}, where config.json's sizes make it {want}")
            if not tensor.is_floating_point():  # (quantised integers would be read as the weights themselves)
                raise InvalidModel(f"{name} holds {str(tensor.dtype).removeprefix('torch.')} values, not float weights")
            return tensor.to(dtype).contiguous()

        self._blocks = blocks if dtype == torch.float32 else None
        self._numerics = numerics
        self._matches = {} if matches is None else matches
        embed_name = "model.embed_tokens.weight"
        tied = config.tie_word_embeddings
        if not tied and "lm_head.weight" not in state:  # transformers would start a random head: refused here
            raise InvalidModel("the weights hold no lm_head.weight, and config.json does not tie the output head to the "
                               "embedding table (add \"tie_word_embeddings\": true to it if the model ties them)")
        for name in (embed_name,) if tied else (embed_name, "lm_head.weight"):  # read from the headers alone
            shape = state.shape(name) if hasattr(state, "shape") else tuple(state[name].shape)
            if shape != (config.vocab_size, config.hidden_size):
                raise InvalidModel(f"{name} is {shape}, where config.json's sizes make it "
                                   f"{(config.vocab_size, config.hidden_size)}")
        head = self._head_on_blocks(state, embed_name) if tied else None
        self.embed: torch.Tensor | None = None  # the float32 table; None where the tied head's blocks give its rows
        if head is not None:
            self.lm_head = head
        else:
            self.embed = get(embed_name)
            head_name = embed_name if tied else "lm_head.weight"
            self.lm_head = self._projection(self.embed if tied else get(head_name), [head_name])
        self.final_norm = get("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            # each check of blocks against float32 weights (the head's, then a layer's) leaves the
            # heap with free pages: given back at once, they never add up to the load's peak
            return_freed_memory()
            self.layers.append(self._layer(config, f"model.layers.{i}.", get))
        self._blocks = None  # what projections did not take is not kept

    def _layer(self, config: LlamaConfig, p: str, get: Callable[[str], torch.Tensor]) -> dict:
        """One layer's weights (``p``: its names' prefix): norms, and fused projections."""
        head_dim = config.head_dim
        qkv_names = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        qkv = self._fused_qkv(get, p + "self_attn.{}_proj.weight", head_dim)
        qkv_bias = self._fused_qkv(get, p + "self_attn.{}_proj.bias", head_dim) if config.attention_bias else None
        gate_up_names = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        return {
            "attn_norm": get(p + "input_layernorm.weight"),
            "qkv": self._projection(qkv, qkv_names, qkv_bias, rope_head_dim=head_dim),
            "o": self._projection(get(p + "self_attn.o_proj.weight"), [p + "self_attn.o_proj.weight"],
                                  get(p + "self_attn.o_proj.bias") if config.output_bias else None),
            "mlp_norm": get(p + self.MLP_NORM),
            "gate_up": self._projection(torch.cat([get(n) for n in gate_up_names]), gate_up_names),
            "down": self._projection(get(p + "mlp.down_proj.weight"), [p + "mlp.down_proj.weight"]),
        }

    def _projection(
        self, weight: torch.Tensor, names: list[str], bias: torch.Tensor | None = None, rope_head_dim: int = 0
    ) -> "Projection | SplitProjection":
        parts = None
        if self._blocks is not None:
            # q and k rows may be stored rotary-interleaved (llama.cpp's layout, which is ours) or not
            orders = []
            if rope_head_dim:
                orders = [lambda n: rope_row_order(n, rope_head_dim), lambda n: rope_row_order(n, rope_head_dim).argsort()]
            recorded = self._matches.get(names[0])  # the choices an earlier check made, None if none
            unmatched = recorded is None and names[0] in self._matches  # an earlier check found no match
            found = None if unmatched else matching_blocks([self._blocks.get(n) for n in names], weight, orders, recorded)
            self._matches[names[0]] = None if found is None else found[1]
            parts = None if found is None else found[0]
        if parts is None:
            return Projection(weight, bias, None, self._numerics)
        stacked = BlockMatrix.stack(parts)
        if stacked is None:  # parts of different types (Gemma's q, k in Q5_0 and v in Q8_0)
            return SplitProjection(weight, bias, parts, self._numerics)
        return Projection(weight, bias, stacked, self._numerics)

    def _head_on_blocks(self, state: Mapping[str, torch.Tensor], name: str) -> "Projection | None":
        """The output head tied to the embedding table ``name``, on the table's blocks alone, when
        they reproduce its float32 rows exactly (checked :data:`HEAD_SLICE_VALUES` weights at a
        time: the float32 table, the largest tensor of a model with a big vocabulary, is never held
        whole). Its rows are then the embedding lookups too. None where the blocks are missing or
        do not match.

        In the ``fast`` numerics each slice of blocks is read alone and packed once it matches, so
        the head's file blocks (most of a big-vocabulary model's file) are never all in memory
        beside their packed copy."""
        if self._blocks is None or name not in self._blocks or self._matches.get(TIED_HEAD) is False:
            return None
        kind, n_in, n_out = matrix_shape(self._blocks, name)
        if block_matmul(kind) is None:
            return None
        checked = self._matches.get(TIED_HEAD) is True  # an earlier build of these files found them to match
        fast = self._numerics == "fast"
        if fast:  # the matrix's kind and shape only: its packed copy is filled slice by slice
            blocks = BlockMatrix(kind, torch.empty(n_out, n_in // BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind],
                                                   dtype=torch.uint8, device="meta"), n_in)
            require_fast_numerics(blocks)  # before any slice is read
            packed = empty_packed(kind, n_out, n_in)
        else:
            blocks, packed = self._blocks[name], None
        step = max(INTEGER_GROUP, HEAD_SLICE_VALUES // n_in // INTEGER_GROUP * INTEGER_GROUP)  # whole groups of rows
        # each slice is read to be checked (unless a match is recorded) or packed (fast); exact then reads none
        for start in range(0, n_out, step) if not checked or fast else ():
            stop = min(start + step, n_out)
            part = matrix_rows(self._blocks, name, start, stop) if fast else blocks.take(torch.arange(start, stop))
            if not checked and not torch.equal(part.dequantize(), read_rows(state, name, start, stop)):
                self._matches[TIED_HEAD] = False
                return None
            if packed is not None:
                pack_integer_blocks(kind, part.data, n_in, into=packed, first_row=start)
        self._matches[TIED_HEAD] = True
        shape = torch.empty(n_out, n_in, dtype=torch.float32, device="meta")
        return Projection(shape, None, blocks, self._numerics, blocks_only=True, packed=packed)

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens`` (any shape): a fresh float tensor ``[*tokens.shape, D]``."""
        if self.embed is None:
            # (the width named: a lookup of no tokens is no rows)
            return self.lm_head.weight_rows(tokens).view(*tokens.shape, self.lm_head.weight.shape[1])
        return F.embedding(tokens, self.embed)

    @property
    def projections(self) -> "list[Projection | SplitProjection]":
        return [self.lm_head] + [layer[n] for layer in self.layers for n in ("qkv", "o", "gate_up", "down")]

    @staticmethod
    def _fused_qkv(get, pattern: str, head_dim: int) -> torch.Tensor:
        q, k, v = (get(pattern.format(n)) for n in "qkv")
        return torch.cat([interleave_rope_rows(q, head_dim), interleave_rope_rows(k, head_dim), v]).contiguous()
