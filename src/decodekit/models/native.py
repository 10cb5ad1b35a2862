"""A compact PyTorch Llama-family transformer (SmolLM2, Llama, Qwen2, Mistral) with a
preallocated KV cache, in the spirit of gpt-fast.

Why not transformers: one decode step through transformers costs ~47 ms here against
~39 ms for the same math in a plain loop; the difference is per-layer Python and cache
bookkeeping. Here q/k/v and gate/up are fused into one matmul each, the cache is written
in place, and rollback is just moving a length counter.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InvalidParameter
from .backend import Backend, ModelInfo, StepOutput
from .batching import PREFILL_CHUNK, PassBatcher
from .gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, BlockMatrix, matching_blocks, matrix_rows, matrix_shape
from .kivi import KiviStore, KiviView
from .kv_policy import KVPolicy, parse_kv_cache, streaming_keep
from .memory import return_freed_memory
from .threads import GOVERNOR
from .kernels import (
    INTEGER_GROUP, MAX_ROWS, DecoderLayers, KernelProjection, SequencePart, block_matmul, decoder_layers,
    few_rows_matmul, int8_cache_kernels, integer_block_matmul, integer_block_rows, kivi_attention, layer_ops,
    empty_packed, layout_independent_attention, pack_integer_blocks, quantise_int8_rows,
)

#: ``ModelInfo.max_length`` under a policy that re-assigns positions within the cache (StreamingLLM):
#: a sequence can then run past the model's context window.
UNBOUNDED_LENGTH = 1 << 40
#: ``exact``: float32 on the weights (or their GGUF blocks), bit-identical to the dequantised model.
#: ``fast``: inputs quantised to 8 bits per block of 32 and integer dot products against the GGUF
#: blocks (``kernels/gemm_q8.c``), for every pass, prefill included. Both compute every token's row
#: on its own, so speculative decoding and batching are lossless relative to plain decoding in
#: the same numerics; ``fast`` differs from ``exact`` by the inputs' quantisation.
NUMERICS = ("exact", "fast")


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
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: Mapping) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise NotImplementedError(f"rope scaling {rope['rope_type']!r} is not supported by the native backend")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
        )


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


def _onednn_linear_works() -> bool:
    """Whether this torch build has oneDNN's linear (CPU builds with MKL-DNN do)."""
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


ONEDNN_LINEAR = _onednn_linear_works()


def native_architecture(dtype: torch.dtype, gguf_blocks: bool = False, numerics: str = "exact") -> str:
    """The backend's name with the matmul paths it uses (verification costs depend on them)."""
    parts = ["native-llama"]
    if few_rows_matmul(dtype) is not None:
        parts.append("kernel")
    if gguf_blocks:
        parts.append("gguf-blocks")
    if ONEDNN_LINEAR:
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
        return "it needs a CPU with AVX512-VNNI and a C compiler"
    if blocks.shape[0] % INTEGER_GROUP:
        return f"it needs projections of a multiple of {INTEGER_GROUP} rows"
    return None


def require_fast_numerics(blocks: "BlockMatrix | None") -> None:
    """Refuse, in one line, a projection that cannot run the ``fast`` numerics."""
    reason = fast_numerics_unavailable(blocks)
    if reason is not None:
        raise InvalidParameter(f"the fast numerics is unavailable: {reason}; use --numerics exact")


class Projection:
    """A linear layer, run through oneDNN's matmul where this torch build has it.

    Why not ``F.linear``: on this project's AMD EPYC machine, float32 ``F.linear`` goes to MKL,
    whose kernels for a few rows are far from the hardware (2 rows cost 2x one row; the
    49152-wide lm head took 26.6 ms for 4 rows). oneDNN's ``_linear_pointwise`` on the same
    ``[out, in]`` weight took 8.5 ms there, and a full 4-token forward pass dropped from
    100 ms to 61 ms (one token: 46 ms). Cheap multi-row passes are what make speculative
    verification pay in float32. Both are plain float32 (or bfloat16) arithmetic: only
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
        if ONEDNN_LINEAR:
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
    projection whose float32 weights they reproduce exactly. ``numerics`` is :data:`NUMERICS`'.
    ``matches``: what an earlier check of the same files found, by matrix
    (:class:`..gguf_blocks.BlockMatches`), taken instead of checking again; each check made here
    is added to it."""

    MLP_NORM = "post_attention_layernorm.weight"  # the norm before the MLP (Llama's name for it)

    def __init__(
        self, config: LlamaConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype,
        blocks: Mapping[str, BlockMatrix] | None = None, numerics: str = "exact",
        matches: dict[str, object] | None = None,
    ):
        def get(name: str) -> torch.Tensor:
            return state[name].to(dtype).contiguous()

        self._blocks = blocks if dtype == torch.float32 else None
        self._numerics = numerics
        self._matches = {} if matches is None else matches
        embed_name = "model.embed_tokens.weight"
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
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
            "o": self._projection(get(p + "self_attn.o_proj.weight"), [p + "self_attn.o_proj.weight"]),
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
            return self.lm_head.weight_rows(tokens).view(*tokens.shape, -1)
        return F.embedding(tokens, self.embed)

    @property
    def projections(self) -> "list[Projection | SplitProjection]":
        return [self.lm_head] + [layer[n] for layer in self.layers for n in ("qkv", "o", "gate_up", "down")]

    @staticmethod
    def _fused_qkv(get, pattern: str, head_dim: int) -> torch.Tensor:
        q, k, v = (get(pattern.format(n)) for n in "qkv")
        return torch.cat([interleave_rope_rows(q, head_dim), interleave_rope_rows(k, head_dim), v]).contiguous()


class NativeLlama(Backend):
    """The native backend: :class:`Backend` over :class:`LlamaWeights` with a preallocated cache.

    ``gguf_blocks``: the model's GGUF blocks (:func:`..gguf_blocks.read_block_matrices`), for
    float32 decode steps that stream them instead of float32 weights, with identical results.
    ``numerics``: one of :data:`NUMERICS` (``fast`` needs ``gguf_blocks``).

    The cache grows by doubling when full, so no capacity has to be guessed up front.

    ``batcher``: set on clones that serve concurrent requests; their passes then run together
    with the other clones' (:mod:`.batching`), with the same results as alone.

    ``kv_cache``: a :mod:`.kv_policy` (or its spelling) deciding which entries the cache keeps.
    The cache then holds ``slots`` entries for ``length`` tokens; a pass writes after the last
    slot, at the positions the policy assigns (the token's own, or its slot's).
    """

    weights_class = LlamaWeights
    batcher: PassBatcher | None = None
    _observed_rows = False  # set during a pass whose attention weights go to the cache policy

    def __init__(
        self,
        config: LlamaConfig,
        state: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        name: str = "llama",
        initial_capacity: int = 512,
        gguf_blocks: Mapping[str, BlockMatrix] | None = None,
        numerics: str = "exact",
        kv_cache: KVPolicy | str | None = None,
        block_matches: dict[str, object] | None = None,
    ):
        if numerics not in NUMERICS:
            raise InvalidParameter(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        if numerics == "fast" and dtype != torch.float32:
            raise InvalidParameter("the fast numerics runs on float32 activations; use --dtype float32")
        # Some real weights hold subnormal floats; multi-row matmul kernels run ~3x slower on them.
        torch.set_flush_denormal(True)
        self.config = config
        self.dtype = dtype
        self.numerics = numerics
        self.kv_policy = parse_kv_cache(kv_cache)
        self.weights = self.weights_class(config, state, dtype, gguf_blocks, numerics, block_matches)
        # fast runs on every projection's (packed) blocks; exact on those that matched
        uses_blocks = numerics == "fast" or any(p.on_blocks for p in self.weights.projections)
        self.info = ModelInfo(
            name=name,
            vocab_size=config.vocab_size,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            max_length=config.max_position,
            dtype=dtype,
            architecture=native_architecture(dtype, uses_blocks, numerics),
        )
        self._rope = RopeTable(config.rope_theta, config.head_dim, config.max_position)
        self._ropes = [self._rope]  # every table a pass reads (Gemma adds its local layers')
        self._freqs, self._freqs_pairs = self._rope.angles, self._rope.pairs
        self._initial_capacity = initial_capacity
        self._attend = layout_independent_attention(dtype, config.head_dim)
        self._ops = layer_ops(dtype, config.hidden_size, config.intermediate_size)
        self._stack = self._float_stack = self._decoder_layers()
        self._use_policy(self.kv_policy)
        self.reset(1)

    def _use_policy(self, policy: KVPolicy) -> None:
        """Set the cache policy and what depends on it (the int8 and int4 caches have kernels of their own)."""
        self.kv_policy = policy
        self.info = self._info_for(policy)
        self._int8 = self._kivi_attention = None
        float32 = self.dtype == torch.float32
        if policy.code_bits == 8:
            self._int8 = int8_cache_kernels(self.config.head_dim) if float32 else None
        elif policy.kivi:
            self._kivi_attention = kivi_attention(self.config.head_dim) if float32 else None
        kernels = self._int8 or self._kivi_attention
        if policy.quantised and (kernels is None or self._ops is None):
            raise InvalidParameter(f"kv cache {policy.spec} needs a float32 model, the compiled kernels (a C "
                                   "compiler, AVX-512) and a head size that is a multiple of 16")
        # the int4 cache's passes carry their codes to forward.c (a KiviView), over the float path
        self._stack = self._decoder_layers(self._int8) if self._int8 is not None else self._float_stack
        self._row = self._int8.row if self._int8 is not None else self.config.head_dim  # cache elements a row

    def _decoder_layers(self, int8_cache=None) -> DecoderLayers | None:
        """The one-call path through every layer (``kernels/forward.c``), where every piece of
        the layer-by-layer kernel path is available (and no projection has a bias); over the int8
        cache's kernels with ``int8_cache``."""
        c, w = self.config, self.weights
        names = ("qkv", "o", "gate_up", "down")
        if self._ops is None or self._attend is None:
            return None
        if any(layer[n].kernel is None or layer[n].bias is not None for layer in w.layers for n in names):
            return None
        layers = [
            {"attn_norm": layer["attn_norm"], "mlp_norm": layer["mlp_norm"], **{n: layer[n].kernel for n in names}}
            for layer in w.layers
        ]
        return decoder_layers(
            self.dtype, self._ops, self._attend, hidden=c.hidden_size, inter=c.intermediate_size, n_heads=c.num_heads,
            n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps, layers=layers,
            int8_cache=int8_cache,
        )

    def _info_for(self, policy: KVPolicy) -> ModelInfo:
        peak = policy.peak_slots(1)  # what plain decoding needs; a longer pass is checked when it comes
        if peak is not None and peak > self.config.max_position:
            raise InvalidParameter(f"kv cache {policy.spec} needs up to {peak} entries, more than the model's context "
                                   f"of {self.config.max_position}")
        limit = UNBOUNDED_LENGTH if policy.reassigns_positions else self.config.max_position
        return dataclasses.replace(self.info, max_length=limit)

    def with_kv_cache(self, policy: KVPolicy | str) -> "NativeLlama":
        """This model with another cache policy, sharing its weights, with a cache and a memory
        of its own (:meth:`Backend.clone`): the drafter of ``kvdraft``."""
        view = copy.copy(self)
        view._use_policy(parse_kv_cache(policy))
        return view.clone()

    def truncated(self, num_layers: int) -> "NativeLlama":
        """This model's first ``num_layers`` layers (+ final norm + lm head), sharing its weights
        and rope tables, with a cache and a memory of its own (:meth:`Backend.clone`)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise InvalidParameter(f"cannot truncate a model of {self.config.num_layers} layers to {num_layers}")
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, num_layers=num_layers)
        view.weights = copy.copy(self.weights)
        view.weights.layers = self.weights.layers[:num_layers]
        view.info = dataclasses.replace(self.info, num_layers=num_layers, name=f"{self.info.name}[:{num_layers}]")
        return view.clone()  # the decoder-layers kernel runs as many layers as the cache has

    # Cache management ---------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch_size(self) -> int:
        return self._k.shape[1]

    def cache_bytes(self) -> int:
        """Bytes the committed keys and values take (what a policy saves; capacity not counted):
        under ``int4``, the quantised tokens and the float residual's slots."""
        c = self.config
        held = 2 * c.num_layers * self.batch_size * c.num_kv_heads * self._slots * self._row * self._k.element_size()
        return held + (self._kivi.nbytes() if self._kivi is not None else 0)

    @property
    def slots(self) -> int:
        """Entries the cache holds (``length`` under the full cache; fewer once a policy evicts)."""
        return self._slots

    @torch.inference_mode()
    def reset(self, batch_size: int = 1) -> None:
        if batch_size != 1 and self.kv_policy.one_sequence():
            raise InvalidParameter(f"kv cache {self.kv_policy.spec} holds one sequence; this method needs {batch_size}")
        self.kept_ids = None
        self.last_features = None
        self._length = self._slots = 0
        self._tail_from = 0  # tokens from here on sit in the last slots, in order (rollback reaches that far)
        self._first_pass = True
        self._pending_tree = None
        capacity = min(self._initial_capacity, self.config.max_position)
        c, policy = self.config, self.kv_policy
        # int4, int2: the quantised tokens; the float cache then holds the residual, slot 0 at position _base
        self._kivi = KiviStore(c.num_layers, c.num_kv_heads, c.head_dim, policy.group, policy.bits) \
            if self._kivi_attention is not None else None
        self._base = 0
        if self._kivi is not None:  # the most the residual holds (_quantise_ahead): no more is allocated
            capacity = min(capacity, policy.recent + policy.residual + 2 * policy.group + MAX_ROWS)
        self._allocate(batch_size, capacity)

    def _allocate(self, batch_size: int, capacity: int) -> None:
        c = self.config
        shape = (c.num_layers, batch_size, c.num_kv_heads, capacity, self._row)
        self._k = torch.zeros(shape, dtype=self.dtype)
        self._v = torch.zeros(shape, dtype=self.dtype)
        if self.kv_policy.evicts():
            # per slot and head: the token it holds, and the attention it has received (H2O, SnapKV)
            self._held = torch.zeros(c.num_layers, c.num_kv_heads, capacity, dtype=torch.long)
            self._mass = torch.zeros(c.num_layers, c.num_kv_heads, capacity)

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self._k.shape[3]
        if needed <= capacity:
            return
        if needed > self.config.max_position:
            if self.kv_policy.evicts():
                raise ValueError(f"kv cache {self.kv_policy.spec}: {needed} entries exceed the model's context of "
                                 f"{self.config.max_position}")
            raise ValueError(f"sequence of {needed} tokens exceeds the model's context of {self.config.max_position}")
        # room to grow past a long prompt: otherwise its first decode step copies the whole cache
        new_capacity = min(max(needed + needed // 4 + 64, 2 * capacity), self.config.max_position)
        old = (self._k, self._v) + ((self._held, self._mass) if self.kv_policy.evicts() else ())
        self._allocate(old[0].shape[1], new_capacity)
        self._k[:, :, :, :capacity] = old[0]
        self._v[:, :, :, :capacity] = old[1]
        if self.kv_policy.evicts():
            self._held[..., :capacity] = old[2]
            self._mass[..., :capacity] = old[3]

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        if length < self._tail_from:
            raise ValueError(f"cannot roll back to {length} tokens: kv cache {self.kv_policy.spec} has evicted "
                             f"entries after token {self._tail_from}")
        self._slots -= self._length - length
        self._length = length
        self._pending_tree = None

    @torch.inference_mode()
    def reorder(self, rows: torch.Tensor) -> None:
        if rows.numel() != 1 and self.kv_policy.one_sequence():
            raise InvalidParameter(f"kv cache {self.kv_policy.spec} holds one sequence; this method needs {rows.numel()}")
        self._k = self._k[:, rows].contiguous()
        self._v = self._v[:, rows].contiguous()

    # Forward passes -------------------------------------------------------------------------

    def reuses_prefix(self) -> bool:
        # batched (served) and fast passes read prompts in chunks through the row-independent kernels
        if self.kv_policy.evicts() or self._kivi is not None:  # the cache does not hold the prompt's float entries
            return False
        return self._stack is not None and (self.batcher is not None or self.numerics == "fast")

    @property
    def batch_key(self) -> object:
        """Passes of backends with the same key can run in one batched pass (the same layers)."""
        return self._stack

    def _one_call(self, tokens: torch.Tensor, hidden_layers, skip_layers) -> bool:
        """Whether a pass can take the one-call layer path: one sequence, no layer skipped, no
        hidden state asked for."""
        return (self._stack is not None and tokens.shape[0] == 1 and not hidden_layers and not skip_layers
                and not self._observed_rows)

    def _batched(self, tokens: torch.Tensor, hidden_layers, skip_layers) -> bool:
        """Whether this pass goes through the batcher (the one-call path, all of the model's layers)."""
        return (self.batcher is not None and self._one_call(tokens, hidden_layers, skip_layers)
                and self.config.num_layers == self._stack.num_layers)

    def _prefill_chunk(self, tokens: torch.Tensor, hidden_layers, skip_layers) -> int | None:
        """How many tokens of a long ``append`` go in one pass, or None for all at once.

        Batched (serving): :data:`.batching.PREFILL_CHUNK`, so that a long prompt joins the batch a
        chunk at a time and the others keep decoding meanwhile. ``fast`` numerics and the int8
        cache: the kernels' row limit, so that a prompt is read by the same kernels as every other
        pass; rows are independent there, so any chunking gives the same bits, alone or served.
        A cache that evicts while it reads a prompt (StreamingLLM) reads it in chunks of its own,
        at most ``PREFILL_CHUNK``, alone and served alike: where it compacts depends on them."""
        evicting = self.kv_policy.prefill_chunk()
        if evicting is not None:
            return min(evicting, PREFILL_CHUNK)
        if self._batched(tokens, hidden_layers, skip_layers):
            return PREFILL_CHUNK
        chunks = [None]
        if self.numerics == "fast" and self._one_call(tokens, hidden_layers, skip_layers):
            chunks.append(MAX_ROWS)
        if self.kv_policy.quantised:  # only the kernels read and write the int8 and int4 caches
            chunks.append(MAX_ROWS)
        return min((c for c in chunks if c is not None), default=None)

    @torch.inference_mode()
    def append(self, tokens, *, hidden_layers=(), skip_layers=frozenset(), last_only=False) -> StepOutput:
        policy, k, first = self.kv_policy, tokens.shape[1], self._first_pass
        observed = policy.observation_rows(self._slots, k, first)
        self._first_pass = False
        if 0 < observed < k:  # only the pass's last rows report their attention (SnapKV's window)
            parts = [self._append(tokens[:, :-observed], hidden_layers, skip_layers, last_only, False),
                     self._append(tokens[:, -observed:], hidden_layers, skip_layers, last_only, True)]
            out = _joined(parts, last_only)
        else:
            out = self._append(tokens, hidden_layers, skip_layers, last_only, observed > 0)
        if policy.compress_after(self._slots, first):
            self._compact()
        self.last_features = out.features
        return out

    def _append(self, tokens: torch.Tensor, hidden_layers, skip_layers, last_only: bool, observe: bool) -> StepOutput:
        chunk = self._prefill_chunk(tokens, hidden_layers, skip_layers)
        if chunk is not None and tokens.shape[1] > chunk:
            parts = [self._append(part, hidden_layers, skip_layers, last_only, observe) for part in tokens.split(chunk, dim=1)]
            return _joined(parts, last_only)
        def causal(start: int, k: int) -> torch.Tensor | None:
            # k == 1 attends to everything cached; otherwise causal within the new block.
            return None if k == 1 else torch.ones(k, start + k, dtype=torch.bool).tril(diagonal=start)

        return self._commit_pass(tokens, causal, hidden_layers, skip_layers, last_only, observe, causal=True)

    def _commit_pass(self, tokens: torch.Tensor, visibility, hidden_layers=(), skip_layers=frozenset(),
                     last_only: bool = False, observe: bool = False, causal: bool = False) -> StepOutput:
        """One pass of ``tokens`` ``[B, k]`` after the cache, committed: room made first (a policy may
        compact), then written at the next slots and positions, seeing ``visibility(start, k)`` (the
        mask over the ``start`` committed slots and the new ones; None: all)."""
        k = tokens.shape[1]
        self._make_room(k)
        start, position = self._next_slot()
        self._check_positions(position + k)
        positions = torch.arange(position, position + k)
        self._written(start, torch.arange(self._length, self._length + k))
        self._observed_rows = observe
        try:
            out = self._forward(tokens, positions, visibility(start, k), hidden_layers, skip_layers, last_only,
                                causal=causal)
        finally:
            self._observed_rows = False
        self._length += k
        self._slots += k
        self._pending_tree = None
        return out

    # What a cache policy needs: slots apart from tokens, compaction, attention weights -------------

    @torch.inference_mode()
    def append_windowed(self, tokens: torch.Tensor, sink: int, window: int) -> StepOutput:
        """Append ``tokens`` ``[1, k]`` attending only to the first ``sink`` and the last ``window``
        cached entries (and causally to each other), at the positions this cache assigns (the
        tokens' own under ``full`` and ``int8``): StreamingLLM's attention over this cache, without evicting anything (``kvdraft``'s draft passes, which
        the drafter rolls back). Committed like :meth:`append`. Not under ``int4``, whose
        quantised tokens every query sees."""
        if self._kivi is not None:
            raise InvalidParameter(f"kv cache {self.kv_policy.spec}: windowed passes are not supported")
        def sinks_and_window(start: int, k: int) -> torch.Tensor:
            visible = torch.zeros(k, start + k, dtype=torch.bool)
            visible[:, streaming_keep(start, sink, window)] = True
            visible[:, start:] = torch.ones(k, k, dtype=torch.bool).tril()
            return visible

        return self._commit_pass(tokens, sinks_and_window)

    @torch.inference_mode()
    def adopt(self, source: "NativeLlama", token_ids: Sequence[int]) -> None:
        """Start this cache from ``source``'s committed entries (a full cache of this model, batch 1,
        holding ``token_ids``), keeping what this cache's policy keeps, without reading the tokens
        again: how a compressed cache is made from the target's after its prompt (``kvdraft``).
        SnapKV reads the prompt's last ``window`` tokens again, for their attention; H2O's
        accumulated attention starts here."""
        if (source.kv_policy.one_sequence() or source.config != self.config or source.batch_size != 1
                or source.length != len(token_ids)):
            raise ValueError("adopt() needs a full cache of the same model holding one sequence")
        if self._kivi is not None:
            raise InvalidParameter(f"kv cache {self.kv_policy.spec} cannot be made from another cache; read the tokens")
        policy, n = self.kv_policy, source.length
        self.reset(1)
        observed = 0 if policy.observes_every_pass else policy.observation_rows(0, n, True)
        copied = n - observed
        if policy.reassigns_positions and policy.compact_before(copied, 1):
            keep = policy.keep(copied, None)  # only what is kept is copied
        else:
            keep = torch.arange(copied)
        self._ensure_capacity(keep.numel())
        span = slice(0, keep.numel())
        for mine, theirs in ((self._k, source._k), (self._v, source._v)):
            rows = theirs[:, :, :, keep]
            mine[:, :, :, span] = quantise_int8_rows(rows) if self._int8 is not None else rows
        if policy.evicts():
            self._held[..., span] = keep
        if policy.reassigns_positions:
            self._rotate_keys(keep.numel(), keep - torch.arange(keep.numel()))
        self._length, self._slots = copied, keep.numel()
        self._tail_from = copied - policy.recent if keep.numel() < copied else 0
        if observed:  # read again, observed, and compressed after (SnapKV)
            self.append(torch.tensor([list(token_ids[copied:n])]), last_only=True)
        else:
            self._first_pass = False

    def _next_slot(self) -> tuple[int, int]:
        return self._slots, self._slots if self.kv_policy.reassigns_positions else self._length

    def _check_positions(self, end: int) -> None:
        """Positions below ``end`` must have rotary angles (computed here, where they are not yet): a
        cache that evicts but keeps positions (H2O, SnapKV) is as bound by the context window as
        the full cache."""
        if end > self.config.max_position:
            hint = "" if self.kv_policy.reassigns_positions else "; a sink:S,window:W cache runs past it"
            raise ValueError(f"sequence of {end} tokens exceeds the model's context of {self.config.max_position}{hint}")
        for table in self._ropes:
            table.reach(end)

    def _make_room(self, incoming: int) -> None:
        if self.kv_policy.compact_before(self._slots, incoming):
            self._compact()
        if self._kivi is not None:
            self._quantise_ahead(incoming)

    def _quantise_ahead(self, incoming: int) -> None:
        """int4, before a pass of up to ``incoming`` new positions: quantise the groups its last
        query reads quantised (all written, as residual >= the longest pass), and drop the float
        rows no later query reads, a group or more at a time. Rolling back can then reach back
        ``recent`` tokens before this pass, never into the quantised ones (they would need their
        float rows again): the lowest later query is at ``_tail_from``."""
        policy, store = self.kv_policy, self._kivi
        self._tail_from = max(self._tail_from, self._length - policy.recent)
        end = int(policy.quantised_end(torch.tensor(self._length + incoming - 1)))
        if end > store.tokens:
            span = slice(store.tokens - self._base, end - self._base)
            store.append(self._k[:, 0, :, span], self._v[:, 0, :, span])
        drop = int(policy.quantised_end(torch.tensor(self._tail_from))) - self._base
        if drop >= policy.group:  # moving the residual costs a copy of it: not every pass
            kept = slice(drop, self._slots)
            for cache in (self._k, self._v):
                cache[:, :, :, : self._slots - drop] = cache[:, :, :, kept].clone()
            self._base += drop
            self._slots -= drop

    def _written(self, slot: int, tokens: torch.Tensor) -> None:
        """Slots ``slot..`` are about to receive the entries of ``tokens`` (sequence indices)."""
        if self.kv_policy.evicts():
            self._ensure_capacity(slot + tokens.numel())
            span = slice(slot, slot + tokens.numel())
            self._held[..., span] = tokens
            self._mass[..., span] = 0.0

    @torch.inference_mode()
    def _compact(self) -> None:
        """Keep the slots the policy chooses, moved to the front in order."""
        keep = self.kv_policy.keep(self._slots, self._mass[..., : self._slots] if self.kv_policy.evicts() else None)
        n = keep.shape[-1]
        if n < self._slots:
            if keep.dim() == 1:  # the same slots in every layer and head
                for cache in (self._k, self._v):
                    cache[:, :, :, :n] = cache[:, :, :, keep]
                for table in (self._held, self._mass):
                    table[..., :n] = table[..., keep]
                if self.kv_policy.reassigns_positions:
                    self._rotate_keys(n, keep - torch.arange(n))
            else:  # per layer and head: [L, H_kv, n]
                L, B, H, _, D = self._k.shape
                index = keep[:, None, :, :, None].expand(L, B, H, n, D)
                for cache in (self._k, self._v):
                    cache[:, :, :, :n] = cache[:, :, :, : self._slots].gather(3, index)
                for table in (self._held, self._mass):
                    table[..., :n] = table[..., : self._slots].gather(2, keep)
            self._slots = n
        self._tail_from = max(self._tail_from, self._length - self.kv_policy.recent)

    def _rotate_keys(self, n: int, moved_by: torch.Tensor) -> None:
        """Rotate the keys of slots ``0..n`` back by the distance each moved (a RoPE rotation by
        position composes: this places each at its new slot's position)."""
        keys = self._k[:, :, :, :n]
        if moved_by.numel():  # the angles of distances no pass of this model has reached (an adopted cache's)
            self._rope.reach(int(moved_by.max()) + 1)
        pairs = torch.view_as_complex(keys.float().reshape(*keys.shape[:-1], -1, 2).contiguous())
        rotated = torch.view_as_real(pairs * self._freqs[moved_by].conj()).flatten(-2)
        keys.copy_(rotated.to(keys.dtype))

    def _observe(self, layer: int, q: torch.Tensor, end: int, mask: torch.Tensor | None) -> None:
        """Add the attention weights of the pass's rows ``q [k, H, D]`` over slots ``0..end`` to the
        policy's mass (summed over rows and each key/value head's group of query heads). Computed
        in torch beside the kernels' attention: only which entries to keep depends on it."""
        c = self.config
        keys = self._k[layer, 0, :, :end].float()
        rows = q.shape[0]
        grouped = q.float().reshape(rows, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        for r in range(0, rows, 256):  # bounded memory for a long prompt
            scores = torch.einsum("rhgd,hnd->rhgn", grouped[r : r + 256], keys) * c.head_dim**-0.5
            if mask is not None:
                scores = scores.masked_fill(~mask[r : r + 256, None, None, :end], float("-inf"))
            self._mass[layer, :, :end] += scores.softmax(-1).sum(dim=(0, 2))

    def _run_tree(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> StepOutput:
        start, position = self._next_slot()
        self._check_positions(int(positions.max()) + 1)
        self._written(start, self._length + positions - position)
        self._observed_rows = self.kv_policy.observes_every_pass
        try:
            return self._forward(tokens, positions, visible, (), frozenset(), False)
        finally:
            self._observed_rows = False

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        span = slice(dst, dst + src.numel())
        self._k[:, :, :, span] = self._k[:, :, :, src]
        self._v[:, :, :, span] = self._v[:, :, :, src]
        if self.kv_policy.evicts():
            for table in (self._held, self._mass):
                table[..., span] = table[..., src]

    def _set_length(self, slots: int) -> None:
        self._length += slots - self._slots
        self._slots = slots

    def weight_traffic(self) -> tuple[int, int]:
        projections = self.weights.projections
        return sum(p.streamed_bytes for p in projections), sum(p.weight.numel() for p in projections)

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        hidden_layers: Sequence[int],
        skip_layers: frozenset[int],
        last_only: bool,
        causal: bool = False,
    ) -> StepOutput:
        """``causal``: ``mask`` is plain causal attention over the new tokens after the cache."""
        if self._batched(tokens, hidden_layers, skip_layers):
            self._ensure_capacity(self._slots + tokens.shape[1])
            logits, features = self.batcher.run(self, tokens[0], positions, mask, self._slots, last_only)
            return StepOutput(logits=logits[None], features=features[None])
        # The kernels' thread count for this pass. The governor compares the times of one pass kind
        # under each count: plain steps over this cache are timed, not the one-token passes that
        # cost less (a kvdraft draft attending to a window, a layer-skipping draft), which would
        # make one thread look faster whenever it happened to time one of them.
        plain_step = tokens.numel() == 1 and not skip_layers and mask is None
        with GOVERNOR.governed((self.info.name, self.kv_policy.spec), timed=plain_step):
            w = self.weights
            batch, k = tokens.shape
            start = self._slots
            self._ensure_capacity(start + k)
            # Passes the matmul kernels take also get the element-wise kernels, so a token's
            # arithmetic is the same in a plain step and in any verification pass.
            ops = self._ops if k <= MAX_ROWS else None

            x = self._embed(tokens)
            if self._stack is not None and batch == 1 and ops is not None and not hidden_layers and not self._observed_rows:
                # the same kernels as the loop below, called from C in one go
                pending = torch.empty_like(x)
                ran = self._stack.run(
                    x[0], pending[0], self._freqs_pairs, positions, mask, self._k[:, 0], self._v[:, 0], start, skip_layers,
                    kivi=self._kivi_view(positions),
                )
                return self._logits(x, pending if ran else None, ops, last_only, {})
            pending = None  # the last MLP output, added to x inside the next norm (one fused call)
            hidden: dict[int, torch.Tensor] = {}
            if 0 in hidden_layers:
                hidden[0] = x.clone()
            for i, layer in enumerate(w.layers):
                if i not in skip_layers:
                    pending = self._layer(i, layer, x, pending, positions, mask, start, ops, causal)
                if i + 1 in hidden_layers:
                    if pending is not None:
                        x.add_(pending)  # rounds as the fused add does
                        pending = None
                    hidden[i + 1] = x.clone()
            return self._logits(x, pending, ops, last_only, hidden)

    @torch.inference_mode()
    def forward_batch(self, passes: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the waiting passes of several clones of this model (:class:`.batching.PassBatcher`)
        as one: returns each pass's logits ``[k, V]`` (``[1, V]`` where it wants the last only)
        and features ``[k, D]``."""
        with GOVERNOR.governed((self.info.name, self.kv_policy.spec), timed=False):
            w = self.weights
            x = self._embed(torch.cat([p.tokens for p in passes]))
            pending = torch.empty_like(x)
            parts = [SequencePart(len(p.tokens), p.start, p.positions, p.visible, p.backend._k[:, 0], p.backend._v[:, 0],
                                  p.backend._kivi_view(p.positions)) for p in passes]
            ran = self._stack.run_batch(x, pending, self._freqs_pairs, parts)
            h = self._add_norm(x, pending if ran else None, w.final_norm, self._ops)
            ends = torch.tensor([len(p.tokens) for p in passes]).cumsum(0).tolist()
            wanted = [list(range(end - 1, end)) if p.last_only else list(range(end - len(p.tokens), end))
                      for p, end in zip(passes, ends)]
            logits = self._head(h[[i for rows in wanted for i in rows]])
            return list(zip(logits.split([len(rows) for rows in wanted]), h.split([len(p.tokens) for p in passes])))

    def _kivi_view(self, positions: torch.Tensor) -> KiviView | None:
        """Under the int4 cache, what a pass at ``positions`` reads from its codes; None otherwise."""
        if self._kivi is None:
            return None
        return KiviView(self._kivi, self._base, self.kv_policy.quantised_end(positions))

    def _layer(self, i: int, layer: dict, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
               mask: torch.Tensor | None, start: int, ops, causal: bool) -> torch.Tensor:
        """Layer ``i`` on the residual stream ``x`` (``pending``, the last layer's output, is added
        first, inside the norm): returns this layer's output, to be added in turn."""
        h = self._add_norm(x, pending, layer["attn_norm"], ops)
        attn = self._attention(i, layer["qkv"](h), positions, mask, start, ops, causal)
        h = self._add_norm(x, layer["o"](attn), layer["mlp_norm"], ops)
        gate_up = layer["gate_up"](h)
        if ops is not None:
            return layer["down"](ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return layer["down"](F.silu(gate) * up)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embed(tokens).float()

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head.weight_rows(ids).float()

    def matrix(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = weight.detach().float().contiguous()
        rows, n_in = weight.shape
        if n_in % 32 or rows % 16 or self.dtype != torch.float32:  # not a shape the block kernels take
            return super().matrix(weight)
        blocks = BlockMatrix.quantize(weight, "q8_0")  # a drafter need not be exact: 8 bits read a quarter of 32
        numerics = self.numerics if fast_numerics_unavailable(blocks) is None else "exact"
        return Projection(blocks.dequantize(), None, blocks, numerics)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: a fresh tensor, updated in place by the layers."""
        return self.weights.embedding(tokens)

    def _logits(self, x: torch.Tensor, pending: torch.Tensor | None, ops, last_only: bool, hidden: dict) -> StepOutput:
        w = self.weights
        features = self._add_norm(x, pending, w.final_norm, ops)
        h = features[:, -1:] if last_only else features
        return StepOutput(logits=self._head(h), hidden=hidden, features=features)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (float32) from the final norm's output."""
        return self.weights.lm_head(h).float()

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, ops) -> torch.Tensor:
        """``x += delta`` in place (the residual add), then the RMSNorm of x."""
        if ops is not None:
            return ops.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _attention(
        self, i: int, qkv: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, start: int, ops,
        causal: bool = False,
    ) -> torch.Tensor:
        """Layer ``i``'s attention for the fused projection ``qkv [B, k, (H + 2 H_kv) D]``: rotate
        q and k, write k and v to cache slots ``start..start+k``, attend over the cache under
        ``mask`` (plain causal where ``causal``). Returns ``[B, k, H D]`` in the model dtype."""
        c = self.config
        batch, k = qkv.shape[:2]
        end = start + k
        q_size = c.num_heads * c.head_dim
        scale = self._attention_scale
        pairs = self._rope_pairs(i)
        lo, windowed = 0, self._window(i, positions, mask, start)
        if windowed is not None:  # a sliding-window layer: keys from slot lo on, under its own mask
            (lo, mask), causal = windowed, False
        if self._kivi is not None:  # the int4 cache: float residual written as usual, read with the codes
            if ops is None or batch != 1:
                raise ValueError("the int4 cache takes passes of one sequence and at most 64 tokens")
            q = ops.rope_store(qkv, pairs, positions, self._k[i, 0], self._v[i, 0], start, c.num_heads)
            heads = self._kivi_attention(q, self._kivi_view(positions), i, self._k[i, 0], self._v[i, 0], end, mask, scale)
            return heads.view(batch, k, q_size)
        if self._int8 is not None:  # the int8 cache: its kernels only (passes are read MAX_ROWS at a time)
            if ops is None or batch != 1:
                raise ValueError("the int8 cache takes passes of one sequence and at most 64 tokens")
            q = self._int8.rope_store(qkv, pairs, positions, self._k[i, 0], self._v[i, 0], start, c.num_heads)
            heads = self._int8.attention(q, self._k[i, 0, :, lo:end], self._v[i, 0, :, lo:end], mask, scale)
            return heads.view(batch, k, q_size)
        if self._attend is not None and batch == 1 and k <= MAX_ROWS:
            # One sequence, few tokens: the layout-independent kernel (see kernels/attention.c).
            if ops is not None:
                q = ops.rope_store(qkv, pairs, positions, self._k[i, 0], self._v[i, 0], start, c.num_heads)
            else:
                q = self._rope_and_store(i, qkv, positions, start)[0][0]
            if self._observed_rows:
                self._observe(i, q, end, mask)
            heads = self._attend(q, self._k[i, 0, :, lo:end], self._v[i, 0, :, lo:end], mask, scale)
            return heads.to(qkv.dtype).view(batch, k, q_size)
        _, q = self._rope_and_store(i, qkv, positions, start)
        if self._observed_rows:
            self._observe(i, q[0].transpose(0, 1), end, mask)
        # A prompt's first pass: causal attention without a mask, which torch runs blockwise (flash
        # attention), instead of materialising every head's k x k score matrix.
        plain_causal = causal and start == 0
        return F.scaled_dot_product_attention(
            q, self._k[i, :, :, lo:end], self._v[i, :, :, lo:end], attn_mask=None if plain_causal else mask,
            is_causal=plain_causal, enable_gqa=c.num_heads != c.num_kv_heads, scale=scale,
        ).transpose(1, 2).reshape(batch, k, q_size)

    @property
    def _attention_scale(self) -> float:
        return self.config.head_dim**-0.5

    def _rope_pairs(self, i: int) -> torch.Tensor:
        """Layer ``i``'s rotary table as (cos, sin) pairs ``[max_position, D]`` (one for all layers here)."""
        return self._freqs_pairs

    def _rope_angles(self, i: int) -> torch.Tensor:
        """Layer ``i``'s rotary table as complex numbers ``[max_position, D / 2]``."""
        return self._freqs

    def _window(self, i: int, positions: torch.Tensor, mask: torch.Tensor | None, start: int):
        """For a layer that attends to a sliding window of keys: ``(lo, mask)``, the first slot it
        can see and its mask over slots ``lo..``; None where the layer sees what ``mask`` says
        (every layer of a Llama)."""
        return None

    def _rope_and_store(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, start: int):
        """The torch path of rotary embedding and cache write. Returns (q [B, k, H, D], q [B, H, k, D])."""
        c = self.config
        batch, k = qkv.shape[:2]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        freqs = self._rope_angles(i)[positions].view(1, k, 1, -1)
        # Rotate q and k heads together: one complex multiply for both.
        qk = apply_rope(qkv[..., : q_size + kv_size].view(batch, k, -1, c.head_dim), freqs)
        q, kk = qk.transpose(1, 2).split((c.num_heads, c.num_kv_heads), dim=1)
        v = qkv[..., q_size + kv_size :]
        self._k[i, :, :, start : start + k] = kk
        self._v[i, :, :, start : start + k] = v.view(batch, k, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return qk[:, :, : c.num_heads], q


def _joined(parts: list[StepOutput], last_only: bool) -> StepOutput:
    """One pass's output from the outputs of its consecutive pieces."""
    if last_only:
        logits = parts[-1].logits
    else:
        logits = torch.cat([p.logits for p in parts], dim=1)
    hidden = {layer: torch.cat([p.hidden[layer] for p in parts], dim=1) for layer in parts[-1].hidden}
    features = None if any(p.features is None for p in parts) else torch.cat([p.features for p in parts], dim=1)
    return StepOutput(logits=logits, hidden=hidden, features=features)
