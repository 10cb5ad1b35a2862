"""The logits-processor interface and shared helpers.

A processor maps logits ``[B, V]`` to new logits ``[B, V]``; a removed token gets ``-inf``.
Processors chain (the Hugging Face logits-processor pattern): each one sees the previous one's
output, so a truncation sampler works on the distribution renormalised over what earlier
processors left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

NEG_INF = float("-inf")


class LogitsProcessor(ABC):
    """One step of logit processing.

    ``needs_history`` is True when the output depends on the prompt/generated ids; processors
    that leave it False never look at ``histories`` (callers may pass an empty list or None).
    Implementations return a new tensor and never modify ``logits`` in place.
    """

    needs_history: bool = False
    looks_ahead: bool = False  # True where :meth:`prepare` does something
    refuses_tokens: bool = False  # True where :meth:`allowed_prefix` can answer less than the whole
    pointwise: bool = False  # True where a token's output depends on its own logit (and the row's history) alone

    @abstractmethod
    def __call__(self, logits: torch.Tensor, histories: Sequence[torch.Tensor]) -> torch.Tensor:
        """Return processed logits ``[B, V]`` (float32, ``-inf`` for removed tokens)."""

    def describe(self) -> dict[str, Any]:
        """The processor's parameters under their ``Sampler.from_params`` names."""
        return {}

    def broken_by(self, generated: list[int]) -> str | None:
        """Why a request's ``generated`` tokens break what this processor promises (a constraint),
        or None. The decode loop asks at the end: a broken promise is a bug, and is not returned."""
        return None

    def forced(self, generated: list[int]) -> list[int]:
        """Tokens this processor leaves as the only continuation after ``generated`` (a grammar's
        fixed text), as a likely draft: speculative decoding still verifies them. None by default."""
        return []

    def allowed_prefix(self, generated: list[int], continuation: list[int]) -> int:
        """How many tokens of ``continuation``, in order, may follow ``generated`` for this processor
        (a grammar refuses some; others refuse none). Speculative decoding drops drafts past that
        point before verifying them: an optimisation only, since a refused draft is never accepted
        anyway, so an answer that allows too much costs a verification row and nothing else."""
        return len(continuation)

    def prepare(self, rows: Sequence[Sequence[int]]) -> None:
        """A hint that the next call will see rows with these generated tokens (given before the
        forward pass that makes their logits): a processor may start its work on them now, in the
        background. It never changes what a call returns. Nothing by default."""

    def surely_allows(self, token: int, history: Sequence[torch.Tensor]) -> bool:
        """True where this processor's output surely keeps ``token``'s logit as it is, for a row with
        ``history`` (one row), known without processing the row; False where it does not, or where
        only processing the row can tell (the default)."""
        return False

    def greedy_choice(self, logits: torch.Tensor, history: Sequence[torch.Tensor]) -> int | None:
        """The argmax of this processor's output for one row ``logits [V]`` (``history``: its one
        row), where the processor can find it without writing that output (a mask: the best allowed
        token); None where it cannot, and the caller processes the row. The sampler asks only when
        this is its one processor and it decodes greedily."""
        return None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items())
        return f"{type(self).__name__}({args})"


# --------------------------------------------------------------------------- helpers


def keep_only(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """New logits with every token outside ``keep`` set to -inf; a row's most likely tokens are
    always kept (all of them where several tie: which one is kept must not depend on token ids)."""
    keep = keep | (logits == logits.amax(dim=-1, keepdim=True))
    return logits.masked_fill(~keep, NEG_INF)


def sorted_probs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs, sorted_probs, sorted_idx)``: softmax of the logits and its descending sort.

    The sort is stable, so equal probabilities keep ascending token-id order.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    sp, si = torch.sort(probs, dim=-1, descending=True, stable=True)
    return probs, sp, si


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each row (0·log 0 = 0); shape ``[B, 1]``."""
    return -torch.xlogy(probs, probs).sum(dim=-1, keepdim=True)


class Histories(Sequence[torch.Tensor]):
    """Each batch row's token history (prompt + generated ids) and its prompt length.

    It reads as a list of 1-D id tensors, the whole history, which is what the repetition
    penalty and no-repeat-n-gram count; :meth:`generated` gives only the ids after the prompt,
    which is what the frequency and presence penalties count. The decoding loops build one per
    call; a plain sequence of tensors passed instead stands for histories without a prompt.
    Rows are read when first used (tensors are made only for processors that ask for them), so a
    caller must not change a row it passed until the call that takes the histories has returned.
    """

    def __init__(self, rows: Sequence[Sequence[int] | torch.Tensor], prompt_len: int | Sequence[int] = 0) -> None:
        self.given = list(rows)  # read when first used
        self._tensors: list[torch.Tensor] | None = None
        lens = [prompt_len] * len(self.given) if isinstance(prompt_len, int) else list(prompt_len)
        if len(lens) != len(self.given):
            raise ValueError(f"expected {len(self.given)} prompt lengths, got {len(lens)}")
        self.prompt_lens = lens

    @property
    def rows(self) -> list[torch.Tensor]:
        """Each row as a 1-D id tensor (made once, when first asked for)."""
        if self._tensors is None:
            self._tensors = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in self.given]
        return self._tensors

    def __len__(self) -> int:
        return len(self.given)

    def __getitem__(self, i):  # type: ignore[override]
        return self.rows[i]

    def generated(self) -> list[torch.Tensor]:
        """Each row's ids after its prompt."""
        return [row[n:] for row, n in zip(self.rows, self.prompt_lens)]

    def generated_lists(self) -> list[list[int]]:
        """Each row's ids after its prompt, as ints (without making tensors of rows given as lists)."""
        return [r.reshape(-1)[n:].tolist() if isinstance(r, torch.Tensor) else list(r[n:])
                for r, n in zip(self.given, self.prompt_lens)]


def generated_ids(histories: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The generated part of each row: :meth:`Histories.generated`, or a plain sequence as is."""
    return histories.generated() if isinstance(histories, Histories) else histories


def generated_lists(histories: Sequence[torch.Tensor]) -> list[list[int]]:
    """:func:`generated_ids` as lists of ints."""
    if isinstance(histories, Histories):
        return histories.generated_lists()
    return [torch.as_tensor(h).reshape(-1).tolist() for h in histories]


def count_history(
    histories: Sequence[torch.Tensor], batch: int, vocab: int, device: torch.device,
    window: int | None = None,
) -> torch.Tensor:
    """Float ``[B, V]`` counts of each token id in each row's history (last ``window`` ids only)."""
    if histories is None or len(histories) != batch:
        got = "None" if histories is None else len(histories)
        raise ValueError(f"expected {batch} histories (one per batch row), got {got}")
    rows = [torch.as_tensor(h, device=device).reshape(-1).long() for h in histories]
    if window is not None:
        rows = [h[-window:] for h in rows]
    lengths = torch.tensor([h.numel() for h in rows], device=device)
    counts = torch.zeros(batch * vocab, device=device, dtype=torch.float32)
    if int(lengths.sum()) == 0:
        return counts.view(batch, vocab)
    toks = torch.cat(rows)
    if int(toks.min()) < 0 or int(toks.max()) >= vocab:
        raise ValueError(f"history token ids must be in [0, {vocab}), got {int(toks.min())}..{int(toks.max())}")
    row_ids = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    counts.index_add_(0, row_ids * vocab + toks, torch.ones_like(toks, dtype=torch.float32))
    return counts.view(batch, vocab)

