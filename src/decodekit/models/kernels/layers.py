"""``layer_ops.c`` and ``forward.c``: a layer's element-wise work (residual add + RMSNorm, SiLU or
GeLU gating, rotary embedding + cache write) in one call each, and every decoder layer of a
few-row pass in one call, through the same kernels in the same order."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from .attention import AttentionKernel, Int8CacheKernels, check_rope_store, check_slots, kivi_attention
from .build import _address, _library

class LayerOps:
    """``layer_ops.c`` for one dtype: a layer's element-wise steps on ``rows`` x ``dim`` tensors.

    Each returns a new tensor (``add_rms_norm`` also updates ``x`` in place) and computes every
    row on its own, so a token's values do not depend on the rest of the pass."""

    def __init__(self, lib: ctypes.CDLL, suffix: str):
        self._add_rms_norm = getattr(lib, f"decodekit_add_rms_norm_{suffix}")
        self._add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]
        self._silu_mul = getattr(lib, f"decodekit_silu_mul_{suffix}")
        self._gelu_mul = getattr(lib, f"decodekit_gelu_mul_{suffix}")
        for fn in (self._silu_mul, self._gelu_mul):
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
        self._rope_store = getattr(lib, f"decodekit_rope_store_{suffix}")
        self._rope_store.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6
        for fn in (self._add_rms_norm, self._silu_mul, self._gelu_mul, self._rope_store):
            fn.restype = None
        self.addresses = {name: _address(getattr(self, "_" + name))
                          for name in ("add_rms_norm", "silu_mul", "gelu_mul", "rope_store")}

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``rms_norm(x) * weight``. x contiguous."""
        h = torch.empty_like(x)
        if delta is not None:
            delta = delta.contiguous()
        dim = x.shape[-1]
        self._add_rms_norm(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), h.data_ptr(),
            x.numel() // dim, dim, eps,
        )
        return h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` where ``gate_up = [gate | up]`` on the last axis."""
        return self._gate_mul(self._silu_mul, gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` where ``gate_up = [gate | up]`` on the last axis."""
        return self._gate_mul(self._gelu_mul, gate_up)

    @staticmethod
    def _gate_mul(fn, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        gate_up = gate_up.contiguous()
        fn(gate_up.data_ptr(), out.data_ptr(), out.numel() // inter, inter)
        return out

    def rope_store(
        self, qkv: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, n_heads: int,
    ) -> torch.Tensor:
        """Rotate q and k of ``qkv [rows, (H + 2 H_kv) D]`` (adjacent-pair layout) by ``freqs``
        (float ``[max_position, D]`` of (cos, sin) pairs) at ``positions``; write k, v to cache
        slots ``start + row`` of ``k_cache``/``v_cache`` (``[H_kv, cap, D]``, one layer and
        sequence); return q as float32 ``[rows, H, D]`` (rounded to the cache dtype first, as
        the torch path does). Needs D a multiple of 16."""
        n_kv_heads, cap, head_dim = k_cache.shape
        if head_dim % 16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("rope_store needs head_dim a multiple of 16 and contiguous caches")
        rows = check_rope_store(qkv, freqs, positions, start, n_heads, n_kv_heads, head_dim, cap)
        q = torch.empty(rows, n_heads, head_dim, dtype=torch.float32)
        positions = positions.to(torch.int64).contiguous()
        qkv = qkv.contiguous()
        self._rope_store(
            qkv.data_ptr(), freqs.data_ptr(), positions.data_ptr(), q.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), rows, n_heads, n_kv_heads, head_dim, cap, start,
        )
        return q


@cache
def layer_ops(dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> LayerOps | None:
    """:class:`LayerOps` for ``dtype`` (float32 or bfloat16) where both sizes are multiples of 16,
    else None."""
    if hidden_size % 16 or intermediate_size % 16:
        return None
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    lib = _library("layer_ops")
    return None if lib is None else LayerOps(lib, "f32" if dtype == torch.float32 else "bf16")


# decodekit.h's structures, field for field (checked against the C sizes when forward.c loads).
class _Projection(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("n_out", ctypes.c_int64), ("n_in", ctypes.c_int64)]


LAYER_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")  # a Gemma layer's, in _Layer's order


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p)] + [
        (name, _Projection) for name in ("qkv", "o", "gate_up", "down", "k", "v")
    ] + [(name, ctypes.c_void_p) for name in LAYER_NORMS + ("freqs",)] + [("local", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("add_rms_norm", "gate_mul", "rope_store", "attention")] + [
        (name, ctypes.c_int64) for name in ("hidden", "inter", "n_heads", "n_kv_heads", "head_dim", "element_size")
    ] + [("eps", ctypes.c_double), ("scale", ctypes.c_double), ("window", ctypes.c_int64)]


class _KiviCodes(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("attention", "k_codes", "v_codes", "k_params", "v_params")] + [
        (name, ctypes.c_int64)
        for name in ("codes_stride", "k_params_stride", "v_params_stride", "group", "bits", "cap_q", "base")
    ] + [("qend", ctypes.c_void_p)]


class _Sequence(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "start", "cap", "layer_stride")] + [
        (name, ctypes.c_void_p) for name in ("positions", "visible", "k_cache", "v_cache", "kivi")
    ]


MIRRORED_STRUCTS = (_Projection, _Layer, _Model, _KiviCodes, _Sequence)  # decodekit_struct_sizes' order


def _check_struct_sizes(lib: ctypes.CDLL) -> None:
    """Refuse a forward.c whose structures the ctypes mirrors above no longer match (a field added
    on one side only would have C read the wrong memory)."""
    sizes = (ctypes.c_int64 * len(MIRRORED_STRUCTS))()
    lib.decodekit_struct_sizes(sizes)
    for struct, size in zip(MIRRORED_STRUCTS, sizes):
        if ctypes.sizeof(struct) != size:
            raise RuntimeError(f"decodekit bug: {struct.__name__[1:]} is {size} bytes in decodekit.h, "
                               f"{ctypes.sizeof(struct)} in its ctypes mirror")


@dataclass
class SequencePart:
    """One sequence's rows in a batched pass (:meth:`DecoderLayers.run_batch`): ``rows`` new tokens
    at ``positions`` (int64), written to cache slots ``start..`` of its own ``k_cache``/``v_cache``
    (``[layers, H_kv, cap, D]``, contiguous per layer), seeing ``visible`` (``[rows, start + rows]``
    bool, or None for every cached key). ``kivi``: under the int4 and int2 caches, their codes
    (:class:`..kivi.KiviView`); the cache is then their float residual."""

    rows: int
    start: int
    positions: torch.Tensor
    visible: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kivi: object = None


def _check_part(p: SequencePart, freqs: torch.Tensor) -> None:
    """What forward.c writes and reads for a sequence must lie inside its tensors (the C code trusts
    it, as rope_store's does: :func:`check_slots`), its mask of one byte a row and key, and the
    values' cache shaped as the keys'."""
    check_slots("decoder layers kernel", p.rows, p.positions, p.start, p.k_cache.shape[2], freqs)
    if p.v_cache.shape != p.k_cache.shape:
        raise ValueError(f"decoder layers kernel: a values' cache {tuple(p.v_cache.shape)} unlike the keys' "
                         f"{tuple(p.k_cache.shape)}")
    if p.visible is not None and tuple(p.visible.shape) != (p.rows, p.start + p.rows):
        raise ValueError(f"decoder layers kernel: a mask [{p.rows}, {p.start + p.rows}] (rows, keys), "
                         f"got {tuple(p.visible.shape)}")


def _kivi_codes(view, head_dim: int, keep: list) -> _KiviCodes:
    """forward.c's view of a sequence's int4 codes (``view``: a :class:`..kivi.KiviView`)."""
    store, qend = view.store, view.qend.to(torch.int32).contiguous()
    attention = kivi_attention(head_dim)
    if attention is None:
        raise ValueError("decoder layers kernel: the int4 cache's attention kernel is unavailable")
    keep += [store.k_codes, store.v_codes, store.k_params, store.v_params, qend]
    return _KiviCodes(attention.address, store.k_codes.data_ptr(), store.v_codes.data_ptr(), store.k_params.data_ptr(),
                      store.v_params.data_ptr(), store.k_codes.stride(0), store.k_params.stride(0),
                      store.v_params.stride(0), store.group, store.bits, store.capacity, view.base, qend.data_ptr())


# A projection as the kernels see it: (the few-row matmul's C function address, the weights it
# reads, out features, in features).
KernelProjection = tuple[int, torch.Tensor, int, int]


class DecoderLayers:
    """``forward.c``: every decoder layer of a few-row pass in one call, with the same kernels in
    the same order as the layer-by-layer path (bit-identical results, a few microseconds of
    Python dispatch per kernel saved). Holds references to every tensor it points at."""

    def __init__(self, fn, model: _Model, layers: list[_Layer], keep: list[torch.Tensor]):
        self._fn, self._model, self._keep = fn, model, keep
        self._layers = (_Layer * len(layers))(*layers)
        self.num_layers = len(layers)

    def run(
        self, x: torch.Tensor, pending: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
        visible: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
        skip: frozenset[int] = frozenset(), kivi=None,
    ) -> bool:
        """Run the layers not in ``skip`` on ``x [rows, hidden]`` (the residual stream, updated in
        place; all tensors contiguous, in the model dtype); ``pending [rows, hidden]`` receives
        the last layer's MLP output (still to be added to x). ``k_cache``/``v_cache``: ``[layers,
        H_kv, cap, D]`` of one sequence (contiguous per layer); the new keys go to slots
        ``start..``. ``visible``: ``[rows, start + rows]`` bool, or None for all keys. Runs as
        many layers as the cache has (a truncated copy of a model shares its layers). Returns
        whether any layer ran (if none, ``pending`` holds nothing). ``kivi``: the int4 cache's
        codes (the caches are then their residual)."""
        part = SequencePart(x.shape[0], start, positions, visible, k_cache, v_cache, kivi)
        return self.run_batch(x, pending, freqs, [part], skip)

    def run_batch(self, x: torch.Tensor, pending: torch.Tensor, freqs: torch.Tensor, parts: list[SequencePart],
                  skip: frozenset[int] = frozenset()) -> bool:
        """:meth:`run` for the rows of several sequences stacked in ``x`` (``parts`` in row order),
        each with its own cache: a sequence's results are bit for bit those it gets alone. The
        caches must all have the same number of layers (at most this model's)."""
        if sum(p.rows for p in parts) != x.shape[0]:
            raise ValueError("decoder layers kernel: the parts' rows do not add up to the batch's")
        num_layers = parts[0].k_cache.shape[0]
        keep, structs = [], []
        for p in parts:
            if p.k_cache.shape[0] != num_layers or num_layers > self.num_layers:
                raise ValueError(f"decoder layers kernel: a cache of {p.k_cache.shape[0]} layers for {self.num_layers} layers")
            _check_part(p, freqs)
            positions = p.positions.to(torch.int64).contiguous()
            mask = None if p.visible is None else p.visible.to(torch.bool).contiguous()
            keep += [positions, mask]
            kivi = None
            if p.kivi is not None:
                if p.k_cache.dtype != torch.float32:
                    raise ValueError("decoder layers kernel: the int4 cache's residual is float32")
                kivi = _kivi_codes(p.kivi, p.k_cache.shape[3], keep)
                keep.append(kivi)
            structs.append(_Sequence(p.rows, p.start, p.k_cache.shape[2], p.k_cache.stride(0), positions.data_ptr(),
                                     None if mask is None else mask.data_ptr(), p.k_cache.data_ptr(), p.v_cache.data_ptr(),
                                     None if kivi is None else ctypes.addressof(kivi)))
        flags = None
        if skip:
            flags = torch.zeros(num_layers, dtype=torch.uint8)
            flags[[i for i in skip if i < num_layers]] = 1
        ran = self._fn(
            ctypes.byref(self._model), self._layers, num_layers, None if flags is None else flags.data_ptr(),
            x.data_ptr(), pending.data_ptr(),
            freqs.data_ptr(), (_Sequence * len(structs))(*structs), len(structs), torch.get_num_threads(),
        )
        if ran < 0:
            raise MemoryError("decoder layers kernel: could not allocate its scratch buffers")
        return ran > 0


def decoder_layers(
    dtype: torch.dtype, ops: LayerOps, attention: AttentionKernel, *, hidden: int, inter: int, n_heads: int,
    n_kv_heads: int, head_dim: int, eps: float, layers: list[dict], int8_cache: Int8CacheKernels | None = None,
    scale: float | None = None, gelu: bool = False, window: int = 0,
) -> DecoderLayers | None:
    """:class:`DecoderLayers` over ``layers`` (each a dict of ``attn_norm``, ``mlp_norm`` tensors
    and ``qkv``, ``o``, ``gate_up``, ``down`` :data:`KernelProjection` s), or None where the
    kernel is unavailable. ``int8_cache``: the cache is int8 (its rope_store and attention run).

    A Gemma 3 layer's dict may also hold ``k``, ``v`` (projections of their own; ``qkv`` is then q
    alone), the tensors of :data:`LAYER_NORMS`, ``freqs`` (its rotary table) and ``local`` (a
    sliding-window layer: it sees the last ``window`` positions). ``scale``: the attention scale
    (default ``head_dim ** -0.5``); ``gelu``: GeLU gating instead of SiLU."""
    lib = _library("forward")
    if lib is None:
        return None
    if window and int8_cache is not None:  # forward.c's window offset counts rows of head_dim model-dtype values
        raise ValueError("decoder layers kernel: sliding windows over the int8 cache are not supported")
    _check_struct_sizes(lib)
    fn = lib.decodekit_decoder_layers_batch
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    model = _Model(
        ops.addresses["add_rms_norm"], ops.addresses["gelu_mul" if gelu else "silu_mul"],
        int8_cache.rope_store_address if int8_cache else ops.addresses["rope_store"],
        int8_cache.attention_address if int8_cache else attention.address,
        hidden, inter, n_heads, n_kv_heads, head_dim, torch.tensor([], dtype=dtype).element_size(), eps,
        head_dim**-0.5 if scale is None else scale, window,
    )
    keep, structs = [], []
    for layer in layers:
        projections = {}
        for name in ("qkv", "o", "gate_up", "down", "k", "v"):
            if name not in layer:
                continue
            address, weights, n_out, n_in = layer[name]
            keep.append(weights)
            projections[name] = _Projection(address, weights.data_ptr(), n_out, n_in)
        tensors = {name: layer[name] for name in LAYER_NORMS + ("freqs",) if layer.get(name) is not None}
        keep += [layer["attn_norm"], layer["mlp_norm"], *tensors.values()]
        structs.append(_Layer(layer["attn_norm"].data_ptr(), layer["mlp_norm"].data_ptr(), **projections,
                              **{name: t.data_ptr() for name, t in tensors.items()}, local=int(layer.get("local", 0))))
    return DecoderLayers(fn, model, structs, keep)
