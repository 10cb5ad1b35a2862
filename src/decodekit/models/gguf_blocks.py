"""Decode from a GGUF file's own quantised blocks, bit-identical to float32.

A GGUF model's float32 weights (what decodekit computes with) are its dequantised blocks:
Q4_1 weight = d * q + m and Q8_0 weight = d * q, with float16 scales d, m and small integers q.
d * q is exact in float32, so the weight-streaming kernel can read the blocks (5 or 8.5 bits a
weight instead of 32), rebuild every weight in registers bit for bit, and sum in the float32
kernel's order (``kernels/gemm.c``). A decode step on a CPU is bound by how fast weights stream
from memory, so this makes float32 decoding several times faster with identical results.

The same holds for Q5_0 (d * (q - 16)) and for the K-quants, whose 256-weight super-blocks hold
a scale (and a minimum) per sub-block of 32 (Q4_K, Q5_K: (d * s) * q - dmin * m, 6-bit s, m) or
of 16 weights (Q6_K: (d * s) * (q - 32), 8-bit s). Each sub-block's products are exact in float32
(at most 24 significant bits), so one rounding, where the reference has one, gives its bits.

In ``exact``, the few-row passes (decode steps, verification) use the blocks and prefill the float32
weights, except for an output head tied to the embedding table, which keeps only its blocks (every
pass streams them, and embedding lookups read their rows). In ``fast``, every pass runs on the
blocks. Each fused projection's blocks are checked to dequantise exactly to its float32 weights when
the model is first built from a cached folder, and a projection that does not match keeps float32;
what the check found is kept beside the folder's files (:class:`BlockMatches`), so later loads of
the same files with the same code skip the dequantising and comparing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import MANIFEST, cached_file, read_json, read_manifest, save_tensors, update_json

#: bytes and weights per block of each type the kernels read (see ``kernels/gemm.c`` for the layouts)
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q5_0": 22, "q4_k": 144, "q5_k": 176, "q6_k": 210}
BLOCK_WEIGHTS = {"q4_1": 32, "q8_0": 32, "q5_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
SUB_BLOCK = 32  # weights rebuilt together: the kernels' unit, whatever the type's block

# GGUF tensor names -> Hugging Face Llama names (per layer; "{}" is the layer index)
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


@dataclass(frozen=True)
class BlockMatrix:
    """A ``[rows, n_in]`` weight matrix as GGUF blocks: ``data`` is uint8 ``[rows, n_in / 32 * block bytes]``."""

    kind: str
    data: torch.Tensor
    n_in: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.n_in

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, computed as GGUF's own dequantisation does (the ``gguf`` package's
        for the types it added after Q4_1 and Q8_0)."""
        rows = self.data.shape[0]
        if self.kind not in ("q4_1", "q8_0"):
            from gguf import GGMLQuantizationType, dequantize

            values = dequantize(self.data.numpy(), GGMLQuantizationType[self.kind.upper()])
            return torch.from_numpy(values.astype("float32", copy=False)).reshape(rows, self.n_in)
        blocks = self.data.view(rows, self.n_in // BLOCK_WEIGHTS[self.kind], BLOCK_BYTES[self.kind])  # (rows may be 0)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.kind == "q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (q * d).reshape(rows, self.n_in)
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        packed = blocks[..., 4:]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        return (q * d + m).reshape(rows, self.n_in)

    def interleaved(self) -> torch.Tensor:
        """``data`` with rows interleaved in fours, block by block (``[rows / 4][n_in / 32][4]
        [block bytes]``): the layout the kernels' interleaved formats read as one stream per four
        rows. Needs a row count divisible by 4."""
        rows, blocks = self.data.shape[0], self.n_in // BLOCK_WEIGHTS[self.kind]
        if rows % 4:
            raise ValueError(f"interleaving rows in fours needs a row count divisible by 4, got {rows}")
        return self.data.view(rows // 4, 4, blocks, BLOCK_BYTES[self.kind]).transpose(1, 2).contiguous().view(rows, -1)

    def take(self, rows: torch.Tensor) -> "BlockMatrix":
        """Rows ``rows`` (an index tensor, e.g. a reordering) of this matrix, as blocks."""
        return BlockMatrix(self.kind, self.data[rows.reshape(-1)], self.n_in)

    @classmethod
    def from_interleaved(cls, kind: str, data: torch.Tensor, rows: torch.Tensor, n_in: int) -> "BlockMatrix":
        """Rows ``rows`` of a matrix laid out as :meth:`interleaved` gives it (``data``), as blocks."""
        rows = rows.reshape(-1)
        blocks = data.view(data.shape[0] // 4, n_in // BLOCK_WEIGHTS[kind], 4, BLOCK_BYTES[kind])
        return cls(kind, blocks[rows // 4, :, rows % 4].reshape(rows.numel(), data.shape[1]), n_in)  # (none: 0 rows)

    @staticmethod
    def stack(parts: list["BlockMatrix"]) -> "BlockMatrix | None":
        """The parts' rows one after another (None unless all share a kind and width)."""
        if any(p.kind != parts[0].kind or p.n_in != parts[0].n_in for p in parts):
            return None
        return BlockMatrix(parts[0].kind, torch.cat([p.data for p in parts]).contiguous(), parts[0].n_in)

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str) -> "BlockMatrix":
        """Quantise float weights as llama.cpp does (for tests and tiny models): Q8_0 scales each
        block by max|w| / 127; Q4_1 maps [min, max] onto 0..15."""
        rows, n_in = weight.shape
        if n_in % SUB_BLOCK:
            raise ValueError(f"GGUF blocks need a width divisible by {SUB_BLOCK}, got {n_in}")
        w = weight.float().reshape(rows, -1, SUB_BLOCK)
        if kind == "q8_0":
            d = (w.abs().amax(-1, keepdim=True) / 127).half()
            q = torch.round(w / d.float().clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
            data = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)
        elif kind == "q4_1":
            low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            d, m = ((high - low) / 15).half(), low.half()
            q = torch.round((w - m.float()) / d.float().clamp_min(1e-30)).clamp(0, 15).to(torch.uint8)
            packed = q[..., :16] | (q[..., 16:] << 4)
            data = torch.cat([d.view(torch.uint8), m.view(torch.uint8), packed], dim=-1)
        else:
            raise ValueError(f"quantize() writes q4_1 and q8_0 blocks, not {kind!r} (see random())")
        return cls(kind, data.reshape(rows, -1).contiguous(), n_in)

    @classmethod
    def random(cls, rows: int, n_in: int, kind: str, generator: torch.Generator) -> "BlockMatrix":
        """Blocks of random bytes with small finite scales (every other bit pattern of a block is a
        valid weight): any type, for tests and tiny models."""
        size, weights = BLOCK_BYTES[kind], BLOCK_WEIGHTS[kind]
        if n_in % weights:
            raise ValueError(f"{kind} blocks need a width divisible by {weights}, got {n_in}")
        data = torch.randint(0, 256, (rows, n_in // weights, size), dtype=torch.uint8, generator=generator)
        scales = (torch.rand(rows, n_in // weights, 2, generator=generator) * 0.02 + 0.001).half().view(torch.uint8)
        at = size - 2 if kind == "q6_k" else 0  # where d (then dmin, for the K-quants with minima) sits
        data[..., at : at + 2] = scales[..., 0:2]
        if kind in ("q4_1", "q4_k", "q5_k"):
            data[..., 2:4] = scales[..., 2:4]
        return cls(kind, data.reshape(rows, -1), n_in)


FLOAT_TYPES = ("f32", "f16", "bf16")  # weights the backend takes as floats (no blocks expected)


class Blocks(dict):
    """Block matrices by Hugging Face name; ``unread``: the file's other quantised weight matrices
    (name -> (type, number of weights)), which no kernel reads, so that they run as float32."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unread: dict[str, tuple[str, int]] = {}


def read_block_matrices(gguf: Path, num_layers: int) -> Blocks:
    """The weight matrices of a GGUF file in the types of :data:`BLOCK_BYTES`, under their Hugging
    Face names (rows as stored in the file; the types left out are listed in ``unread``)."""
    from gguf import GGUFReader

    names = {}
    for gguf_name, hf_name in GGUF_TO_HF.items():
        for i in range(num_layers) if "{}" in gguf_name else [None]:
            names[gguf_name.format(i)] = hf_name.format(i)
    found = Blocks()
    for tensor in GGUFReader(gguf).tensors:
        kind = tensor.tensor_type.name.lower()
        if tensor.name in names and kind in BLOCK_BYTES:
            data = torch.from_numpy(tensor.data.copy()).view(torch.uint8)
            n_in = data.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind]
            found[names[tensor.name]] = BlockMatrix(kind, data, n_in)
        elif tensor.name in names and kind not in FLOAT_TYPES:
            found.unread[names[tensor.name]] = (kind, int(tensor.n_elements))
    return found


#: the saved blocks' file name in a model's cache folder; it names the types read, so that a version
#: reading more of them does not take a file saved by one reading fewer. Every such file starts with
#: BLOCKS_PREFIX: it holds the weights' names in another form, and is never read as float weights.
BLOCKS_PREFIX = "gguf_blocks-"
BLOCKS_FILE = f"{BLOCKS_PREFIX}{'-'.join(BLOCK_BYTES).replace('_', '')}.safetensors"


def cached_block_matrices(gguf: Path, folder: Path, num_layers: int) -> "Blocks | SavedBlocks":
    """:func:`read_block_matrices`, saved in ``folder`` (the GGUF's dequantised cache) the first
    time, and checked like every cached file (:mod:`.cache`): reading a GGUF parses all its
    metadata, the whole vocabulary included, which takes seconds; the saved blocks load in a
    fraction of that, each when it is asked for (:class:`SavedBlocks`)."""
    read = Blocks()

    def save(path: Path) -> None:
        read.update(fresh := read_block_matrices(gguf, num_layers))
        read.unread = fresh.unread
        stamps = {n: f"{b.kind}:{b.n_in}" for n, b in read.items()}
        save_tensors({n: b.data for n, b in read.items()}, path, metadata={**stamps, UNREAD_KEY: json.dumps(read.unread)})

    try:
        path = cached_file(folder / BLOCKS_FILE, save)
    except OSError:  # a read-only cache only costs reading the GGUF again next time
        return read or read_block_matrices(gguf, num_layers)
    return read or SavedBlocks(path)


UNREAD_KEY = "__unread__"  # in the saved file's metadata: Blocks.unread, as JSON


class SavedBlocks(Mapping):
    """The block matrices saved by :func:`cached_block_matrices`, each read from the file when it is
    asked for and not kept here: a model built from them never holds the file's blocks and its own
    (repacked) copies all at once."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._path = path
        with safe_open(str(path), "pt") as saved:
            self._stamps = dict(saved.metadata() or {})  # name -> "kind:n_in"
            self._names = list(saved.keys())
        self.unread = {name: tuple(kind_size) for name, kind_size in json.loads(self._stamps.pop(UNREAD_KEY, "{}")).items()}

    def __getitem__(self, name: str) -> BlockMatrix:
        from safetensors import safe_open

        if name not in self._stamps:
            raise KeyError(name)
        kind, n_in = self.stamp(name)
        with safe_open(str(self._path), "pt") as saved:
            return BlockMatrix(kind, saved.get_tensor(name), n_in)

    def stamp(self, name: str) -> tuple[str, int]:
        """Matrix ``name``'s block type and width (its number of input weights)."""
        kind, n_in = self._stamps[name].split(":")
        return kind, int(n_in)

    def rows(self, name: str, start: int, stop: int) -> BlockMatrix:
        """Rows ``start..stop`` of matrix ``name``, read from the file alone (not the whole matrix)."""
        from safetensors import safe_open

        kind, n_in = self.stamp(name)
        with safe_open(str(self._path), "pt") as saved:
            return BlockMatrix(kind, saved.get_slice(name)[start:stop].contiguous(), n_in)

    def num_rows(self, name: str) -> int:
        """How many rows matrix ``name`` has, read from the file's header."""
        from safetensors import safe_open

        with safe_open(str(self._path), "pt") as saved:
            return saved.get_slice(name).get_shape()[0]

    def __contains__(self, name: object) -> bool:  # without reading the matrix (Mapping's would)
        return name in self._stamps

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def matrix_rows(blocks: Mapping[str, BlockMatrix], name: str, start: int, stop: int) -> BlockMatrix:
    """Rows ``start..stop`` of matrix ``name``: read alone from a :class:`SavedBlocks` file (not the
    whole matrix), or taken from a mapping that holds the matrices."""
    if isinstance(blocks, SavedBlocks):
        return blocks.rows(name, start, stop)
    return blocks[name].take(torch.arange(start, stop))


def matrix_shape(blocks: Mapping[str, BlockMatrix], name: str) -> tuple[str, int, int]:
    """Matrix ``name``'s block type, width and height, without reading it from a :class:`SavedBlocks` file."""
    if isinstance(blocks, SavedBlocks):
        return blocks.stamp(name) + (blocks.num_rows(name),)
    matrix = blocks[name]
    return matrix.kind, matrix.n_in, matrix.shape[0]


RowOrder = Callable[[int], torch.Tensor]  # a row count -> the index of a reordering of that many rows


def matching_blocks(parts: list[BlockMatrix | None], weight: torch.Tensor, row_orders: list[RowOrder],
                    known: list[int] | None = None) -> tuple[list[BlockMatrix], list[int]] | None:
    """Each part's blocks, as they dequantise exactly to its rows of ``weight`` (a fused float32
    matrix made of ``parts``, each part's rows possibly reordered): for every part try its rows as
    stored (choice 0) and each reordering in ``row_orders`` (choice i + 1), keep the first that
    matches. Returns the blocks and the choices, or None when any part is missing or nothing
    matches. ``known``: the choices an earlier check of the same files made (:class:`BlockMatches`),
    taken without dequantising anything (checked afresh where they are not choices for these parts)."""
    if any(p is None for p in parts) or sum(p.shape[0] for p in parts) != weight.shape[0]:
        return None
    if isinstance(known, list) and len(known) == len(parts) and \
            all(type(c) is int and 0 <= c <= len(row_orders) for c in known):
        return [_reordered(p, row_orders, c) for p, c in zip(parts, known)], list(known)
    chosen, choices, start = [], [], 0
    for part in parts:
        target = weight[start : start + part.shape[0]]
        start += part.shape[0]
        candidates = (_reordered(part, row_orders, c) for c in range(len(row_orders) + 1))  # reordered only if needed
        match = next(((c, blocks) for c, blocks in enumerate(candidates) if torch.equal(blocks.dequantize(), target)), None)
        if match is None:
            return None
        choices.append(match[0])
        chosen.append(match[1])
    return chosen, choices


def _reordered(part: BlockMatrix, row_orders: list[RowOrder], choice: int) -> BlockMatrix:
    return part if choice == 0 else part.take(row_orders[choice - 1](part.shape[0]))


MATCHES_FILE = "block_matches.json"


class BlockMatches:
    """What the check of a cached folder's GGUF blocks against its float32 weights found, kept in
    the folder (``block_matches.json``, a checked cache entry): for each fused projection the
    choices :func:`matching_blocks` made, or None (no match); for a tied output head, whether its
    blocks matched. ``matrices`` is what a model build reads and adds to; :meth:`save` keeps it.

    A record holds only for the files and the code that made it: its key is the manifests'
    digests of the float32 weights and of the saved blocks, a digest of this module's source and
    the ``gguf`` package's version (the two dequantisers compared). A record of another key, or a
    damaged one (reported by :func:`.cache.read_json`), is checked afresh."""

    def __init__(self, folder: Path):
        self.path = folder / MATCHES_FILE
        self.key = _match_key(folder)
        saved = read_json(self.path) if self.key is not None else None
        known = saved.get("matrices") if isinstance(saved, dict) and saved.get("key") == self.key else None
        self.matrices: dict[str, object] = dict(known) if isinstance(known, dict) else {}
        self._saved = dict(self.matrices)

    def save(self) -> None:
        """Keep what this build found (nothing is written when it found nothing new)."""
        if self.key is None or self.matrices == self._saved:
            return
        record = {"key": self.key, "matrices": self.matrices}
        try:
            update_json(self.path, lambda _: record)
        except OSError:
            return  # a read-only cache only costs the check at the next load
        self._saved = dict(self.matrices)


def _match_key(folder: Path) -> str | None:
    """The key of a folder's match record (see :class:`BlockMatches`); None without the manifests
    (then nothing is recorded)."""
    from importlib.metadata import PackageNotFoundError, version

    weights, blocks = read_manifest(folder / MANIFEST), read_manifest(folder / f"{BLOCKS_FILE}.manifest.json")
    if weights is None or blocks is None or BLOCKS_FILE not in blocks:
        return None
    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        gguf_version = "none"
    parts = [f"{name}:{stamp.digest}" for name, stamp in sorted(weights.items()) if name.endswith(".safetensors")]
    parts += [f"blocks:{blocks[BLOCKS_FILE].digest}", f"gguf:{gguf_version}",
              "code:" + hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:16]]
    return "|".join(parts)
