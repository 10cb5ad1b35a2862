"""KV-cache policies: which of a sequence's keys and values the native backend keeps.

A policy is a rule over the cache's *slots* (the entries it holds, in order) and the *tokens*
of the sequence (``Backend.length`` counts tokens, which stays the sequence's length whatever
was evicted). The backend asks the policy before each pass whether to compact, and moves the
kept entries to the front, in slot order. What every policy guarantees, so that speculative
decoding and rollback keep working: the last ``recent`` tokens are always held, in the last
slots, so rolling back up to that many tokens only moves a counter.

Spellings (``--kv-cache``, ``kv_cache=``; :data:`POLICY_HELP` lists them):

* ``full``: every entry (the default; what every lossless claim is relative to).
* ``int8``: every entry, each key and value row in 8 bits with a float scale.
* ``int4[:group=G,residual=R]``, ``int2[...]``: every entry, KIVI's 4-bit (2-bit) keys per channel
  and values per token, the most recent tokens in float.
* ``sink:S,window:W[,every:E]``: StreamingLLM.
* ``h2o:budget=B,window=W``: H2O heavy hitters.
* ``snapkv:budget=B,window=O[,kernel=K]``: SnapKV.

Each policy changes the output relative to the full cache (it drops what a token could attend
to); ``kvdraft`` uses a compressed cache only to draft, and stays lossless.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import InvalidParameter
from .batching import PREFILL_CHUNK
from .kernels import MAX_ROWS

POLICY_HELP = {
    "full": "every key and value (default)",
    "int8": "every key and value, each row in int8 with a float32 scale (3.8x less memory at head size 64)",
    "int4[:group=G,residual=R]": "KIVI: keys in 4 bits per channel over groups of G tokens, values per token, the last "
                                 "R to R+G-1 tokens in float32 (defaults {kivi.group}, {kivi.residual})",
    "int2[:group=G,residual=R]": "KIVI at 2 bits (the paper's setting; coarser: see docs/BENCHMARKS.md)",
    "sink:S,window:W[,every:E]": "StreamingLLM: S attention sinks + the last W tokens, positions within the cache; "
                                 "runs past the context window at constant memory",
    "h2o:budget=B,window=W": "H2O: the W most recent tokens + the B-W with the most accumulated attention, per head",
    "snapkv:budget=B,window=O[,kernel=K]": "SnapKV: after the prompt, per head the prompt positions the last O prompt "
                                           "tokens attend to most (pooled over K), within B entries (defaults O "
                                           "{snapkv.window}, K {snapkv.kernel})",
}


@dataclass(frozen=True)
class KVPolicy:
    """The full cache: nothing is evicted."""

    @property
    def spec(self) -> str:
        return "full"

    @property
    def recent(self) -> int:
        """Tokens always held in the last slots (how far a compacted cache can roll back)."""
        return 0

    #: True: kept keys are moved to the positions of their slots (StreamingLLM); False: every
    #: token keeps its position in the sequence (H2O, SnapKV), so the context window still binds.
    reassigns_positions = False
    #: Whether the backend must report attention weights to the policy (H2O on every pass).
    observes_every_pass = False
    #: Bits a stored key or value element takes where the cache quantises them (8:
    #: :class:`Int8Policy`, 4 or 2: :class:`KiviPolicy`); None: the model's own dtype.
    code_bits: ClassVar[int | None] = None
    #: Whether every query reads the entries before a recent float window from KIVI's codes.
    kivi: ClassVar[bool] = False

    @property
    def quantised(self) -> bool:
        return self.code_bits is not None

    def one_sequence(self) -> bool:
        """Whether the cache holds one sequence only (every policy but the full cache)."""
        return self.evicts() or self.quantised

    def check_sequences(self, count: int) -> None:
        """Refuse a method that decodes ``count`` sequences at once where this cache holds one (what
        a search's width asks for, checked before the model loads and again as its rows are made)."""
        if count != 1 and self.one_sequence():
            raise InvalidParameter(f"kv cache {self.spec} holds one sequence; this method needs {count} at once "
                                   f"(searches over several sequences run with the full cache)")

    def evicts(self) -> bool:
        return False

    def rolls_back_anywhere(self) -> bool:
        """Whether the cache can be truncated to any earlier length (full, int8); otherwise only to
        the last ``recent`` tokens before the last pass."""
        return not self.evicts()

    def one_token_passes_rolled_back(self) -> int | None:
        """How many one-token passes can be appended and then all rolled back, leaving the cache as it
        was (a drafter's chain, run under :meth:`.native.NativeLlama.compaction_held`): any number
        (None) where nothing is compacted mid-chain; KIVI's ``recent`` tokens held in float, plus
        the last pass (its codes are written as passes go)."""
        return None if self.rolls_back_anywhere() or self.evicts() else self.recent + 1

    def peak_slots(self, longest_pass: int) -> int | None:
        """The most entries the cache can hold with passes of up to ``longest_pass`` tokens (None:
        as many as the sequence has)."""
        return None

    def compact_before(self, slots: int, incoming: int) -> bool:
        """Whether the ``slots`` committed entries are compacted before a pass of ``incoming`` tokens."""
        return False

    def keep(self, slots: int, mass: torch.Tensor | None) -> torch.Tensor:
        """The slots to keep, ascending: ``[n]`` (the same for every head) or ``[L, H_kv, n]``."""
        return torch.arange(slots)

    def prefill_chunk(self) -> int | None:
        """How many prompt tokens go in one pass at most (None: all at once)."""
        return None

    def observation_rows(self, slots_before: int, incoming: int, first_pass: bool) -> int:
        """How many of a pass's last rows report their attention to the policy (SnapKV: the
        prompt's last O, H2O: every row)."""
        return incoming if self.observes_every_pass else 0

    def compress_after(self, slots: int, first_pass: bool) -> bool:
        """Whether the cache is compacted right after a pass (SnapKV: after the prompt)."""
        return False


@dataclass(frozen=True)
class Int8Policy(KVPolicy):
    """Keys and values quantised to 8 bits per (token, head) row: int8 values and one float32
    scale, ``max|x| / 127``, round to nearest even; the attention kernel reads them directly.

    The per-token int8 baseline of the KV-quantisation literature (e.g. the per-token
    quantisation KIVI, Liu et al., 2024, compares against; KIVI's own scheme, keys per channel and
    a float residual window, is :class:`KiviPolicy`). Changes the output (each
    entry is off by up to half its row's step); every row is quantised on its own when written,
    so speculative decoding with this cache is lossless relative to plain decoding with it.
    Needs the compiled kernels and a float32 model; passes are read 64 tokens at a time.
    """

    @property
    def spec(self) -> str:
        return "int8"

    code_bits = 8


@dataclass(frozen=True)
class KiviPolicy(KVPolicy):
    """KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"), at
    ``bits`` 4 (``int4``) or 2 (``int2``, the paper's headline): keys quantised per channel over
    groups of ``group`` tokens, values per token, both asymmetric (a scale and a minimum, round to
    nearest even), the most recent tokens kept in float32 (the residual). The attention kernel
    reads the codes directly (:mod:`.kivi`). Changes the output (each entry is off by up to half
    its step).

    Choices the paper leaves open, or that this project makes differently:
    * Which positions a query reads quantised depends on its own position only: those below
      ``quantised_end(p) = floor((p + 1 - residual) / group) * group``, so each query sees between
      ``residual`` and ``residual + group - 1`` float tokens (the paper's residual fills to R and
      is then flushed whole; here it slides a group at a time). A token's logits are thus the same
      whatever passes the sequence was read in: speculation over this cache is lossless relative
      to plain decoding with it, and a prompt's chunks do not change its result.
    * Values are quantised per token over the whole head (the paper groups channels too).
    * ``residual`` at least 64, the longest pass, so a group is quantised only once all its
      tokens are written; a rollback reaches back ``residual - 64`` tokens before the last pass
      (64 by default: a verification pass, a layer-skipping draft).
    Needs the compiled kernels, a float32 model whose layers all attend to the whole cache (not
    Gemma 3's sliding windows) and passes of one sequence (served requests are batched as usual).
    """

    group: int = 32
    residual: int = 128
    bits: int = 4

    def __post_init__(self) -> None:
        _check(self, ("group", self.group >= 1, "at least 1"),
               ("residual", self.residual >= MAX_ROWS, f"at least {MAX_ROWS} (the longest pass)"),
               ("bits", self.bits in (2, 4), "4 or 2"))

    @property
    def spec(self) -> str:
        if (self.group, self.residual) == (32, 128):
            return f"int{self.bits}"
        return f"int{self.bits}:group={self.group},residual={self.residual}"

    @property
    def code_bits(self) -> int:  # type: ignore[override]
        return self.bits

    kivi = True

    @property
    def recent(self) -> int:
        """A rollback reaches back this far before the last pass: the residual beyond the longest
        pass (a later query still reads those tokens in float, and they are not quantised yet)."""
        return self.residual - MAX_ROWS

    def rolls_back_anywhere(self) -> bool:
        return False

    def quantised_end(self, positions: torch.Tensor) -> torch.Tensor:
        """Per query position, the first position it reads in float (those below are read quantised)."""
        return (positions + 1 - self.residual).clamp(min=0) // self.group * self.group


@dataclass(frozen=True)
class StreamingPolicy(KVPolicy):
    """StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

    Keeps the first ``sink`` tokens (the attention sinks) and the most recent ``window`` tokens;
    positions are those within the cache, as the paper assigns them ("we focus on positions within
    the cache rather than those in the original text"), so generation runs past the model's
    context window at constant memory. Changes the output once a sequence passes
    ``sink + window`` tokens.

    Choices the paper leaves open: the cache is compacted when it holds ``sink + window + every``
    entries, back to ``sink + window`` (the reference implementation evicts every step; moving
    and re-rotating the window every step would cost more than the step), so a token attends to
    the sinks and between ``window`` and ``window + every - 1`` recent tokens. Keys are stored
    rotated; on compaction the moved keys are rotated back by the distance they moved (RoPE is a
    rotation by position, so this places them at their new slots). A prompt is read ``every``
    tokens a pass (``window // 8`` where ``every`` is not given; at most 32, the same alone and
    served), so a prompt longer than the context window works too.
    """

    sink: int = 4
    window: int = 1024
    every: int = 0  # 0: window // 8 (at least 1)

    def __post_init__(self) -> None:
        _check(self, ("sink", self.sink >= 0, "a non-negative integer"), ("window", self.window >= 1, "at least 1"),
               ("every", self.every >= 0, "at least 1 (or 0: window // 8)"))

    @property
    def step(self) -> int:
        return self.every or max(1, self.window // 8)

    @property
    def spec(self) -> str:
        return f"sink:{self.sink},window:{self.window}" + (f",every:{self.every}" if self.every else "")

    @property
    def recent(self) -> int:
        return self.window

    reassigns_positions = True

    def evicts(self) -> bool:
        return True

    def compact_before(self, slots: int, incoming: int) -> bool:
        return slots >= self.sink + self.window + self.step

    def peak_slots(self, longest_pass: int) -> int | None:
        # a pass starts below sink + window + step entries; a prompt's passes are prefill_chunk() long
        return self.sink + self.window + self.step - 1 + max(longest_pass, self.prefill_chunk())

    def keep(self, slots: int, mass: torch.Tensor | None) -> torch.Tensor:
        return streaming_keep(slots, self.sink, self.window)

    def prefill_chunk(self) -> int | None:
        """``step`` tokens, at most :data:`.batching.PREFILL_CHUNK` (a wider window's prompt is not read in
        longer passes, so they add no more to the peak)."""
        return min(self.step, PREFILL_CHUNK)


@dataclass(frozen=True)
class HeavyHitterPolicy(KVPolicy):
    """H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

    Keeps, per head, the ``window`` most recent tokens and the ``budget - window`` others with the
    largest attention accumulated over every query so far (the prompt's included); evicts before
    every pass that starts with more than ``budget`` entries. Changes the output once a sequence
    passes ``budget`` tokens; positions stay those in the sequence.

    Choices the paper leaves open: with grouped-query attention a key/value head is shared by a
    group of query heads, so its score is the sum of the group's attention; rows of a verification
    pass or of a drafted chain that are later rolled back still count (the accumulated score is a
    heuristic either way); kept entries stay in sequence order; a prompt is read 64 tokens a pass
    (the kernels' passes, in either numerics, alone and served alike), evicted down to the budget
    between them as during generation (the reference reads the prompt whole first: its peak memory
    is the whole prompt's).
    The attention weights are computed beside the kernels' attention (in torch, float32), so this
    policy runs the layer-by-layer path.
    """

    budget: int = 512
    window: int = 64

    def __post_init__(self) -> None:
        _check(self, ("window", self.window >= 1, "at least 1"),
               ("budget", self.budget >= self.window, f"at least the window ({self.window})"))

    @property
    def spec(self) -> str:
        return f"h2o:budget={self.budget},window={self.window}"

    @property
    def recent(self) -> int:
        return self.window

    observes_every_pass = True

    def evicts(self) -> bool:
        return True

    def compact_before(self, slots: int, incoming: int) -> bool:
        return slots > self.budget

    def keep(self, slots: int, mass: torch.Tensor | None) -> torch.Tensor:
        assert mass is not None
        return heavy_hitter_keep(mass[..., :slots], self.budget, self.window)


@dataclass(frozen=True)
class SnapKVPolicy(KVPolicy):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    After the prompt, keeps per head the ``budget - window`` prompt positions that the prompt's
    last ``window`` tokens (the observation window) attend to most, scores smoothed by average
    pooling over ``kernel`` positions, plus the window itself. Generated tokens are all kept (the
    paper compresses the prompt only). A prompt of at most ``budget`` tokens is left whole.
    Changes the output; positions stay those in the sequence.

    Choices the paper leaves open: pooling and kernel as the reference code's defaults (average,
    5); with grouped-query attention a key/value head's score sums its group's query heads; kept
    entries stay in sequence order (the reference keeps them in score order, which changes only
    the summation order); the prompt is the request's first pass.
    """

    budget: int = 1024
    window: int = 32
    kernel: int = 5

    def __post_init__(self) -> None:
        _check(self, ("window", self.window >= 1, "at least 1"),
               ("budget", self.budget > self.window, f"more than the window ({self.window})"),
               ("kernel", self.kernel >= 1 and self.kernel % 2 == 1, "a positive odd number"))

    @property
    def spec(self) -> str:
        return f"snapkv:budget={self.budget},window={self.window}" + (f",kernel={self.kernel}" if self.kernel != 5 else "")

    @property
    def recent(self) -> int:
        return self.window

    def evicts(self) -> bool:
        return True

    def observation_rows(self, slots_before: int, incoming: int, first_pass: bool) -> int:
        return min(self.window, incoming) if first_pass and slots_before + incoming > self.budget else 0

    def compress_after(self, slots: int, first_pass: bool) -> bool:
        return first_pass and slots > self.budget

    def keep(self, slots: int, mass: torch.Tensor | None) -> torch.Tensor:
        assert mass is not None
        return snapkv_keep(mass[..., :slots], self.budget, self.window, self.kernel)


def _check(policy: KVPolicy, *rules: tuple[str, bool, str]) -> None:
    """Refuse ``policy`` at the first ``(field, holds, what it must be)`` that does not hold, naming the
    field and its value (a policy made in Python, not spelt, is checked the same)."""
    for name, holds, need in rules:
        if not holds:
            raise InvalidParameter(f"kv cache {policy.spec!r}: {name} must be {need}, got {getattr(policy, name)}")


# The rules, as pure functions (tests check them against slow loops) ------------------------------


def streaming_keep(slots: int, sink: int, window: int) -> torch.Tensor:
    """The first ``sink`` slots and the last ``window`` (all of them when there are no more)."""
    if slots <= sink + window:
        return torch.arange(slots)
    return torch.cat([torch.arange(sink), torch.arange(slots - window, slots)])


def heavy_hitter_keep(mass: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """Per head (``mass [L, H, n]``), the last ``window`` slots and the ``budget - window`` earlier
    ones with the largest mass (ties to the earlier slot), ascending: ``[L, H, budget]``."""
    n = mass.shape[-1]
    if n <= budget:
        return torch.arange(n).expand(*mass.shape[:-1], n)
    older = mass[..., : n - window]
    # stable descending sort: equal masses keep the earlier slot first
    chosen = older.sort(dim=-1, descending=True, stable=True).indices[..., : budget - window]
    recent = torch.arange(n - window, n).expand(*mass.shape[:-1], window)
    return torch.cat([chosen.sort(dim=-1).values, recent], dim=-1)


def snapkv_keep(mass: torch.Tensor, budget: int, window: int, kernel: int) -> torch.Tensor:
    """Per head (``mass [L, H, n]``: the observation window's attention summed over its rows),
    the ``budget - window`` prefix slots with the largest pooled mass and the last ``window``:
    H2O's rule on the prefix's mass smoothed by average pooling over ``kernel`` slots."""
    n = mass.shape[-1]
    if n <= budget:
        return torch.arange(n).expand(*mass.shape[:-1], n)
    prefix = mass[..., : n - window]
    L, H, m = prefix.shape
    pooled = F.avg_pool1d(prefix.reshape(L * H, 1, m), kernel, stride=1, padding=kernel // 2).view(L, H, m)
    return heavy_hitter_keep(torch.cat([pooled, mass[..., n - window :]], dim=-1), budget, window)


# Spellings -----------------------------------------------------------------------------------------


def _defaults(policy: type) -> SimpleNamespace:
    return SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(policy)})


# (the defaults the help names are the policies' own)
POLICY_HELP = {spelling: text.format(kivi=_defaults(KiviPolicy), snapkv=_defaults(SnapKVPolicy))
               for spelling, text in POLICY_HELP.items()}


def parse_kv_cache(spec: "str | KVPolicy | None") -> KVPolicy:
    """A policy from its spelling (see the module docstring); InvalidParameter in one line otherwise."""
    if spec is None or isinstance(spec, KVPolicy):
        return spec or KVPolicy()
    text = str(spec).strip()
    kind, _, rest = text.partition(":")
    if text == "full":
        return KVPolicy()
    if text == "int8":
        return Int8Policy()
    if kind in ("int4", "int2") and (rest or not text.endswith(":")):  # "int4:" names no field after its colon
        return KiviPolicy(**_fields(text, rest, "=", ("group", "residual")), bits=int(kind[3:]))
    if kind == "sink":  # sink:S,window:W[,every:E]
        fields = _fields(text, rest, ":", ("window", "every"), first="sink")
        _required(text, fields, "window")
        return StreamingPolicy(**fields)
    if kind == "h2o":
        fields = _fields(text, rest, "=", ("budget", "window"))
        _required(text, fields, "budget", "window")
        return HeavyHitterPolicy(**fields)
    if kind == "snapkv":
        fields = _fields(text, rest, "=", ("budget", "window", "kernel"))
        _required(text, fields, "budget")
        return SnapKVPolicy(**fields)
    raise InvalidParameter(f"unknown kv cache {text!r}; choose from: {', '.join(POLICY_HELP)}")


def _fields(text: str, rest: str, sep: str, names: tuple[str, ...], first: str | None = None) -> dict[str, int]:
    parts = rest.split(",") if rest else []
    fields: dict[str, int] = {}
    # a sign is read, so that the policy names a negative value as out of its range
    if first is not None:  # "sink:4,window:..." puts the first value right after the kind
        if not parts or not re.fullmatch(INTEGER, parts[0]):
            raise InvalidParameter(f"kv cache {text!r}: expected {first}:N first")
        fields[first] = int(parts.pop(0))
    for part in parts:
        name, eq, value = part.partition(sep)
        if eq and name in fields:  # as --opt refuses a key given twice: never one value silently over another
            raise InvalidParameter(f"kv cache {text!r}: {name} is given twice; give one")
        if not eq or name not in names or not re.fullmatch(INTEGER, value):
            raise InvalidParameter(f"kv cache {text!r}: cannot read {part!r} (expected {sep.join(('NAME', 'N'))} "
                                   f"with NAME one of {', '.join(names)})")
        fields[name] = int(value)
    for name, value in fields.items():  # the kernels count entries in 32-bit integers
        if value > FIELD_LIMIT:
            raise InvalidParameter(f"kv cache {text!r}: {name} {value} is out of range (at most {FIELD_LIMIT})")
    return fields


FIELD_LIMIT = 2**31 - 1
INTEGER = r"-?[0-9]+"  # a field's value (ASCII digits only: int() would read other scripts' too)


def _required(text: str, fields: dict[str, int], *names: str) -> None:
    """The fields a spelling must give (the others take the policy's defaults)."""
    for name in names:
        if name not in fields:
            raise InvalidParameter(f"kv cache {text!r}: {name} is missing")
