"""The trained drafters' networks: an EAGLE feature drafter, Medusa heads and Hydra heads, in plain
PyTorch.

All three read the target's *features* (its final norm's output, the output head's input) and score a
reduced vocabulary: the ``vocab`` most frequent tokens of the training data, through the target's
own (frozen) output-head rows for those tokens. Drafting over the whole vocabulary would read the
whole head (a fifth of a small model's weights) at every draft level; the reduced head is the
frequency-ranked draft vocabulary of FR-Spec (Zhao et al., 2025) and EAGLE-3. A token outside it is
never drafted (the target still produces it: drafts are only proposals).
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class EagleConfig:
    hidden: int  # the target's feature size
    heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        check_sizes(self, "hidden", "heads", "head_dim", "intermediate")
        if self.head_dim % 2:  # the rotary embedding turns pairs of a head's values
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        for name in ("rope_theta", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class MedusaConfig:
    hidden: int
    heads: int  # K: head k predicts the token k + 2 positions after the feature's

    def __post_init__(self) -> None:
        check_sizes(self, "hidden", "heads")


@dataclass(frozen=True)
class HydraConfig:
    hidden: int
    heads: int  # K: head k predicts the token k + 2 positions after the feature's, from the k + 1 tokens between

    def __post_init__(self) -> None:
        check_sizes(self, "hidden", "heads")


def check_sizes(config: object, *names: str) -> None:
    """A network config's sizes are positive integers (ValueError otherwise: a damaged drafter file's)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def as_dict(config: EagleConfig | MedusaConfig | HydraConfig) -> dict:
    return asdict(config)


def distilled(log_q: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The cross-entropy of the drafter's ``log_q`` against the target's distribution ``p`` (what EAGLE
    and Hydra distil), summed with ``weight`` over ``count`` positions, and the weighted share of
    positions where their top tokens agree."""
    cross_entropy = (-(p * log_q).sum(-1) * weight).sum() / count
    with torch.no_grad():
        agree = ((log_q.argmax(-1) == p.argmax(-1)).float() * weight).sum() / count
    return cross_entropy, float(agree)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines ``[n, 1, head_dim / 2]`` of the rotary angles at ``positions`` ``[n]``
    (computed once per pass: queries and keys share them)."""
    half = head_dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv  # [n, half]
    return angles.cos()[:, None], angles.sin()[:, None]  # broadcast over heads


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split pairs) of ``x`` ``[..., n, heads, head_dim]`` by :func:`rotary_angles`."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class DecoderLayer(nn.Module):
    """One pre-norm Llama decoder layer (attention + SwiGLU MLP) that takes keys and values from
    before its input (a cache) and returns its own, so drafting can grow a tree level by level."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        inner = c.heads * c.head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(c.hidden, c.eps), RMSNorm(c.hidden, c.eps)
        self.qkv = nn.Linear(c.hidden, 3 * inner, bias=False)
        self.o = nn.Linear(inner, c.hidden, bias=False)
        self.gate_up = nn.Linear(c.hidden, 2 * c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``x`` ``[B, n, D]`` at ``positions`` ``[n]``; ``past`` keys/values ``[B, H, m, d]``;
        ``visible`` ``[n, m + n]`` (True: may attend). Returns (output ``[B, n, D]``, (k, v) of the new rows)."""
        c = self.c
        B, n, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, n, 3, c.heads, c.head_dim).unbind(2)
        cos, sin = rotary_angles(positions, c.head_dim, c.rope_theta)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, n, d]
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + self.o(attn.transpose(1, 2).reshape(B, n, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), (k, v)


class ReducedHead(nn.Module):
    """The target's output-head rows for the draft vocabulary (frozen, not saved with the drafter:
    taken from the target when the drafter is attached to it)."""

    def __init__(self, vocab: torch.Tensor):
        super().__init__()
        self.register_buffer("vocab", vocab.long(), persistent=True)  # draft index -> token id
        self.rows: torch.Tensor | None = None  # [N, D], set by attach()
        self.matrix: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by on_kernels()

    def attach(self, rows: torch.Tensor) -> None:
        self.rows = rows.float().contiguous()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.matrix is not None:
            return self.matrix(features)
        if self.rows is None:
            raise RuntimeError("the draft head has no target rows: call attach() first")
        return F.linear(features, self.rows)


class KernelLinear(nn.Module):
    """A trained linear layer run by the target backend's kernels (inference only)."""

    def __init__(self, matrix: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None):
        super().__init__()
        self.matrix = matrix
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matrix(x)
        return out if self.bias is None else out + self.bias


def on_kernels(net: nn.Module, matrix: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]) -> nn.Module:
    """Run every linear layer and the draft head of a trained ``net`` through ``matrix(weight)``
    (the target backend's few-row kernels: a draft level reads a few megabytes, not tens)."""
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, KernelLinear(matrix(child.weight), child.bias))
            elif isinstance(child, ReducedHead) and child.rows is not None:
                child.matrix = matrix(child.rows)
    return net


class EagleNet(nn.Module):
    """EAGLE's draft network (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking
    Feature Uncertainty"): ``fc(concat(e, f))`` of the next token's embedding ``e`` and the current
    feature ``f``, then one decoder layer, predicting the next feature; the target's frozen head
    (here its draft-vocabulary rows) turns a feature into logits.

    Choices: the decoder layer keeps its input norm (EAGLE-1 drops it in its first layer); its
    attention is multi-head with the target's head size, its rotary base 10,000."""

    def __init__(self, config: EagleConfig, vocab: torch.Tensor):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden, config.hidden, bias=True)
        self.layer = DecoderLayer(config)
        self.head = ReducedHead(vocab)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Predicted next features ``[B, n, D]`` for the pairs (feature j, embedding of token j + 1),
        and the new rows' keys and values."""
        return self.layer(self.fc(torch.cat([embeds, features], dim=-1)), positions, visible, past)

    def loss(self, features: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
             noise: float = 0.1, classification_weight: float = 0.1, unroll: int = 1) -> tuple[torch.Tensor, dict]:
        """EAGLE's training loss on sequences: ``features`` ``[B, L, D]`` (the target's), ``embeds``
        ``[B, L, D]`` (of the tokens, position j holding token j's), ``mask`` ``[B, L]`` (which
        positions are scored). Pair j = (f_j + uniform noise, e_{j+1}) predicts f_{j+1}: smooth-L1
        regression on the feature plus ``classification_weight`` times the cross-entropy against
        the target's distribution over the draft vocabulary (softmax of the head on f_{j+1}).

        ``unroll`` > 1 also trains on the network's own predictions, as drafting feeds them back
        beyond the first level: step s pairs the (detached) features predicted at step s - 1 with
        the next tokens (a short form of EAGLE-3's training-time test); the steps' losses are summed.
        Each step's pairs attend to what a draft level's pair sees (:meth:`unrolled`)."""
        inputs = features[:, :-1]
        if noise:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
        total = features.new_zeros(())
        metrics: dict = {}
        for step, predicted in enumerate(self.unrolled(inputs, embeds, unroll)):
            loss, figures = self._scored(predicted, features[:, 1 + step :], mask[:, 1 + step :].float(),
                                         classification_weight)
            total = total + loss
            metrics.update({(name if step == 0 else f"{name}_{step + 1}"): value for name, value in figures.items()})
        return total, metrics

    def unrolled(self, inputs: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The features predicted at each of ``steps`` steps over a sequence: step 0's pairs are
        (``inputs[j]``, ``embeds[j + 1]``) at position j, step s's (step s - 1's prediction at j,
        detached; ``embeds[j + s + 1]``) at position j + s.

        A pair of step s at position p sees what the pair of a depth-s draft node at p sees: step 0's
        pairs at positions up to p - s (the target's features: the prefix drafting starts from) and,
        of each later step t <= s, the one pair at position p - s + t (the node's ancestor at depth t,
        itself at t = s). So step s's query j reads step 0's keys 0..j and each later step's key j."""
        out: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for step in range(steps):
            L = inputs.shape[1]
            if L < 1:
                break
            visible = torch.cat([torch.ones(L, L, dtype=torch.bool).tril()] + [torch.eye(L, dtype=torch.bool)] * step, 1)
            past = None if step == 0 else (torch.cat([k[:, :, :L] for k in keys], 2),
                                           torch.cat([v[:, :, :L] for v in values], 2))
            predicted, (k, v) = self(inputs, embeds[:, 1 + step :], torch.arange(step, step + L), visible, past)
            keys.append(k)
            values.append(v)
            out.append(predicted)
            inputs = predicted.detach()[:, :-1]
        return out

    def _scored(self, predicted: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                classification_weight: float) -> tuple[torch.Tensor, dict]:
        count = weight.sum().clamp(min=1)
        regression = (F.smooth_l1_loss(predicted, target, reduction="none").mean(-1) * weight).sum() / count
        with torch.no_grad():
            p = torch.softmax(self.head(target), dim=-1)
        classification, agree = distilled(torch.log_softmax(self.head(predicted), dim=-1), p, weight, count)
        figures = {"regression": float(regression.detach()), "cross_entropy": float(classification.detach()),
                   "top1": agree}
        return regression + classification_weight * classification, figures


class MedusaNet(nn.Module):
    """Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with
    Multiple Decoding Heads"): K residual blocks ``h + SiLU(W h + b)`` on the target's last feature;
    head k (0-based) predicts the token k + 2 positions ahead (the target's own head gives the next).

    Choice: the heads share the target's frozen output head (here its draft-vocabulary rows) instead
    of one trained copy each (Medusa-1), which keeps a drafter a few megabytes; W starts at zero so
    each head starts as the target's head on the current feature."""

    def __init__(self, config: MedusaConfig, vocab: torch.Tensor):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(config.hidden, config.hidden) for _ in range(config.heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.head = ReducedHead(vocab)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., K, N]`` for features ``[..., D]``."""
        states = torch.stack([features + F.silu(block(features)) for block in self.blocks], dim=-2)
        return self.head(states)

    def loss(self, features: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
             decay: float = 0.8) -> tuple[torch.Tensor, dict]:
        """Medusa-1's loss: the sum over heads of ``decay ** k`` times head k's cross-entropy against
        the token k + 2 positions ahead. ``targets`` ``[B, L]`` are draft-vocabulary indices of the
        tokens (-1: outside it, not scored); ``mask`` ``[B, L]``: which features are scored (padding never is,
        as feature or as label)."""
        logits = self(features)  # [B, L, K, N]
        total = features.new_zeros(())
        top1: dict = {}
        for k in range(self.config.heads):
            shift = k + 2
            if features.shape[1] <= shift:
                break
            labels = targets[:, shift:].clone()
            # scored: a scored feature whose token `shift` ahead is a real one (not a shorter sample's padding)
            labels[~(mask[:, :-shift] & mask[:, shift:]) | (labels < 0)] = -100
            head_logits = logits[:, :-shift, k]
            scored = labels != -100
            if not scored.any():  # nothing to score for this head (a mean over nothing is NaN)
                continue
            loss = F.cross_entropy(head_logits.reshape(-1, head_logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
            total = total + decay**k * loss
            with torch.no_grad():
                top1[f"top1_head{k}"] = float(((head_logits.argmax(-1) == labels) & scored).sum() / scored.sum().clamp(min=1))
        return total, top1


class HydraNet(nn.Module):
    """Hydra heads (Ankner et al., 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa
    Decoding"): Medusa's heads, each also reading the tokens of the candidate path before its own.
    Head k (0-based) reads ``concat(f_t, e(x_{t+1}), ..., e(x_{t+k+1}))``, the target's feature at
    position t and the embeddings of the k + 1 tokens after it (the first is the target's own next
    token, the others the path's drafted ones), through Hydra's residual block
    ``P x + c + SiLU(W x + b)``, and predicts token t + k + 2 through the target's head.

    Choices: one block per head (Hydra's ``hydra_num_layers`` = 1), no prefix-attention layer (Hydra++'s
    other change, which makes it EAGLE's network); P written as the projection onto f_t plus a learned
    D (``f_t + D x``: the same functions, but no 1 among the small weights of a matrix the ``fast``
    numerics quantise in blocks of 32), D and W one matrix (one product a head), both starting at zero
    with the biases, so that each head starts as the target's head on the feature; the heads share the
    target's frozen output head (its draft-vocabulary rows), as :class:`MedusaNet` does; trained with
    Hydra++'s teacher objective (the cross-entropy against the target's own distribution at the
    predicted position, :meth:`loss`), not against the data's tokens."""

    def __init__(self, config: HydraConfig, vocab: torch.Tensor):
        super().__init__()
        self.config = config
        hidden = config.hidden
        # head k's rows: D (the residual's learned part), then W
        self.blocks = nn.ModuleList(nn.Linear((k + 2) * hidden, 2 * hidden) for k in range(config.heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.head = ReducedHead(vocab)

    def forward(self, k: int, inputs: torch.Tensor) -> torch.Tensor:
        """Head ``k``'s draft-vocabulary logits ``[..., N]`` for inputs ``[..., (k + 2) D]`` (the
        feature, then the k + 1 tokens' embeddings)."""
        residual, gate = self.blocks[k](inputs).chunk(2, dim=-1)
        return self.head(inputs[..., : self.config.hidden] + residual + F.silu(gate))

    def loss(self, features: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The sum over heads of head k's cross-entropy against the target's distribution over the
        draft vocabulary at the position it predicts (softmax of the head on f_{t+k+1}), teacher-forced:
        the path's tokens are the data's. ``features``, ``embeds`` ``[B, L, D]`` (position j holding
        token j's embedding), ``mask`` ``[B, L]``: position t is scored for head k where t and
        t + k + 2 both are (padding never is)."""
        total = features.new_zeros(())
        top1: dict = {}
        with torch.no_grad():
            teacher = torch.softmax(self.head(features), dim=-1)  # the target's next-token distribution
        for k in range(self.config.heads):
            shift = k + 2
            if features.shape[1] <= shift:
                break
            span = features.shape[1] - shift
            inputs = torch.cat([features[:, :span]] + [embeds[:, j : j + span] for j in range(1, shift)], dim=-1)
            weight = (mask[:, :span] & mask[:, shift:]).float()
            if not weight.any():  # nothing to score for this head (a mean over nothing is NaN)
                continue
            p = teacher[:, shift - 1 : shift - 1 + span]  # f_{t+k+1}'s distribution: token t + k + 2
            loss, top1[f"top1_head{k}"] = distilled(torch.log_softmax(self(k, inputs), dim=-1), p, weight, weight.sum())
            total = total + loss
        return total, top1


Net = EagleNet | MedusaNet | HydraNet
#: each drafter kind's network and config, by the name ``--kind`` and ``--method`` use
NETWORKS: dict[str, tuple[type[Net], type]] = {"eagle": (EagleNet, EagleConfig), "medusa": (MedusaNet, MedusaConfig),
                                               "hydra": (HydraNet, HydraConfig)}
