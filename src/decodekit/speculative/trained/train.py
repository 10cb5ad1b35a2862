"""Training a drafter on self-distilled data: ``decodekit train-drafter``.

The target is frozen: its features were recorded while it wrote the data (:mod:`.data`), its token
embeddings and output-head rows are read from it. Only the drafter's own weights learn (AdamW,
a time budget, sequences in batches of similar length). The last few conversations are held aside:
the drafter is evaluated on their queries by decoding with it (mean accepted tokens per verification,
greedy, against plain greedy's tokens).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from ...errors import InvalidParameter
from ...models.backend import Backend
from ...models.kernels import MAX_ROWS
from ...samplers.params import SEED_LIMIT
from .data import Corpus, Sample, check_prompts
from .networks import NETWORKS, EagleConfig, EagleNet, HydraConfig, HydraNet, MedusaConfig, MedusaNet, Net

KINDS = tuple(NETWORKS)
#: Each head drafts one token further. Hydra's head k reads k + 2 embeddings: a fourth head would add
#: half again to its file.
DEFAULT_HEADS = {"medusa": 4, "hydra": 3}
#: The command-line flags of the settings that have one (the others are the Python API's alone).
FLAGS = {"tokens": "--tokens", "vocab": "--vocab", "heads": "--heads", "unroll": "--unroll", "held_out": "--eval-queries"}


@dataclass
class Settings:
    kind: str  # eagle | medusa | hydra
    tokens: int = 360_000  # self-distilled tokens to generate
    prompts: str = "magpie"  # magpie | tasks (see .data)
    minutes: float = 15.0  # training time (after the data)
    steps: int | None = None  # or fewer optimiser steps: then the net is the same on any machine
    vocab: int = 8192  # draft vocabulary: the most frequent tokens of the data
    batch_tokens: int = 2048
    max_len: int = 512
    lr: float = 2e-3
    heads: int | None = None  # Medusa's and Hydra's (None: DEFAULT_HEADS); EAGLE has none
    unroll: int = 1  # EAGLE: steps trained on its own predicted features (1: the original EAGLE loss)
    held_out: int = 8  # conversations kept aside for the evaluation
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameter(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        check_prompts(self.prompts)
        if self.steps is not None and self.steps < 1:
            raise InvalidParameter("--steps must be at least 1")
        if self.kind not in DEFAULT_HEADS and self.heads is not None:
            raise InvalidParameter(f"--heads applies to --kind {' or '.join(DEFAULT_HEADS)} (EAGLE drafts with one "
                                   "layer, level by level)")
        if self.heads is None:
            self.heads = DEFAULT_HEADS.get(self.kind)
        for name in ("tokens", "vocab", "batch_tokens", "max_len", "heads", "unroll", "held_out"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidParameter(f"{FLAGS.get(name, name)} must be at least 1, got {value}")
        if not 0 <= self.seed < SEED_LIMIT:  # (torch's generators take 64 bits)
            raise InvalidParameter(f"--seed must be in [0, {SEED_LIMIT - 1}], got {self.seed}")
        if self.heads is not None and self.heads > MAX_ROWS - 1:  # before the data is made, not after
            raise InvalidParameter(f"--heads must be at most {MAX_ROWS - 1}, got {self.heads}: head i drafts the "
                                   f"token i + 1 ahead, and no verification pass holds more than {MAX_ROWS} tokens")
        if not self.minutes > 0:
            raise InvalidParameter("--minutes must be positive")
        if math.isinf(self.minutes) and self.steps is None:
            raise InvalidParameter("--minutes inf needs --steps: training would never end")
        if self.unroll > MAX_ROWS - 1:  # each unrolled step keeps its logits for the backward pass
            raise InvalidParameter(f"--unroll must be at most {MAX_ROWS - 1}, got {self.unroll}: no draft is deeper, "
                                   f"as no verification pass holds more than {MAX_ROWS} tokens")
        if self.kind != "eagle" and self.unroll != 1:
            raise InvalidParameter(f"--unroll applies to --kind eagle ({self.kind}'s heads read no features of their own)")


@dataclass
class Outcome:
    net: Net
    steps: int = 0
    seconds: float = 0.0
    tokens_seen: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    metrics: dict = field(default_factory=dict)


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of the samples' scored part (ties: smaller id first),
    topped up with the smallest unused ids when the data has fewer distinct tokens."""
    counts = Counter(t for s in samples for t in s.tokens[s.scored_from :])
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:size]
    chosen = set(ranked)
    for token in range(vocab_size):
        if len(ranked) >= min(size, vocab_size):
            break
        if token not in chosen:
            ranked.append(token)
    return torch.tensor(sorted(ranked[:size]))


def new_net(kind: str, backend: Backend, vocab: torch.Tensor, settings: Settings) -> Net:
    """A freshly initialised drafter for ``backend``, attached to its head rows."""
    hidden = backend.info.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)  # the seed's initial weights, whatever ran before
        if kind == "eagle":
            head_dim = 64 if hidden % 64 == 0 else hidden // max(1, hidden // 64)
            net: Net = EagleNet(EagleConfig(hidden, hidden // head_dim, head_dim, 2 * hidden), vocab)
        elif kind == "medusa":
            net = MedusaNet(MedusaConfig(hidden, settings.heads), vocab)
        else:
            net = HydraNet(HydraConfig(hidden, settings.heads), vocab)
    net.head.attach(backend.head_rows(vocab))
    return net


def batches(samples: list[Sample], settings: Settings, rng: random.Random) -> Iterator[list[Sample]]:
    """Endless batches of about ``batch_tokens`` tokens, of samples of similar length."""
    order = sorted(samples, key=lambda s: len(s.tokens))
    groups, group, size = [], [], 0
    for sample in order:
        n = min(len(sample.tokens), settings.max_len)
        if group and size + n > settings.batch_tokens:
            groups.append(group)
            group, size = [], 0
        group.append(sample)
        size += n
    if group:
        groups.append(group)
    while True:
        rng.shuffle(groups)
        yield from groups


def padded(group: list[Sample], backend: Backend, max_len: int) -> tuple[torch.Tensor, ...]:
    """(features [B, L, D], embeddings [B, L, D], token ids [B, L], scored mask [B, L]) of a group,
    each sample cut to ``max_len`` and padded at the end (padding is never scored)."""
    L = min(max(len(s.tokens) for s in group), max_len)
    D = backend.info.hidden_size
    features = torch.zeros(len(group), L, D)
    tokens = torch.zeros(len(group), L, dtype=torch.long)
    mask = torch.zeros(len(group), L, dtype=torch.bool)
    for b, s in enumerate(group):
        n = min(len(s.tokens), L)
        features[b, :n] = s.features[:n].float()
        tokens[b, :n] = torch.tensor(s.tokens[:n])
        mask[b, s.scored_from : n] = True
    with torch.no_grad():
        embeds = backend.token_embeddings(tokens)
    return features, embeds, tokens, mask


def vocab_index(net: Net, vocab_size: int) -> torch.Tensor:
    """Token id -> draft-vocabulary index (-1: outside the draft vocabulary)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[net.head.vocab] = torch.arange(len(net.head.vocab))
    return index


def batch_loss(net: Net, batch: tuple[torch.Tensor, ...], index: torch.Tensor,
               unroll: int = 1, training: bool = True) -> tuple[torch.Tensor, dict]:
    """The net's loss on a batch; EAGLE's inputs carry their training noise only while ``training``."""
    features, embeds, tokens, mask = batch
    if isinstance(net, EagleNet):
        return net.loss(features, embeds, mask, unroll=unroll, **({} if training else {"noise": 0.0}))
    if isinstance(net, HydraNet):
        return net.loss(features, embeds, mask)
    return net.loss(features, index[tokens], mask)


def train(net: Net, samples: list[Sample], backend: Backend, settings: Settings,
          progress: Callable[[int, float, dict], None] | None = None) -> Outcome:
    """Train ``net`` on ``samples`` for ``settings.minutes``, or ``settings.steps`` optimiser steps if
    they come first; returns what happened. The learning rate decays over whichever of the two is
    set (the steps, when both are): a step count gives the same schedule, and so the same net, on a
    fast machine and a busy one."""
    if not samples:
        raise InvalidParameter("no training samples")
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    index = vocab_index(net, backend.info.vocab_size)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    outcome = Outcome(net)
    budget = settings.minutes * 60
    t0 = time.perf_counter()
    net.train()
    for group in batches(samples, settings, rng):
        elapsed = time.perf_counter() - t0
        if elapsed >= budget or outcome.steps == settings.steps:
            break
        done = outcome.steps / settings.steps if settings.steps else elapsed / budget
        # a short warm-up, then cosine decay over the budget
        scale = min(1.0, (outcome.steps + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        for g in optimizer.param_groups:
            g["lr"] = settings.lr * max(scale, 0.02)
        batch = padded(group, backend, settings.max_len)
        loss, metrics = batch_loss(net, batch, index, settings.unroll)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        value = float(loss.detach())
        if outcome.steps == 0:
            outcome.first_loss = value
        outcome.last_loss, outcome.metrics = value, metrics
        outcome.steps += 1
        outcome.tokens_seen += int(batch[3].sum())
        if progress:
            progress(outcome.steps, value, metrics)
    outcome.seconds = time.perf_counter() - t0
    net.eval()
    return outcome


def mean_loss(net: Net, samples: list[Sample], backend: Backend, settings: Settings) -> float:
    """The loss over ``samples`` (no training): what a test compares before and after."""
    index = vocab_index(net, backend.info.vocab_size)
    with torch.no_grad():
        losses = [float(batch_loss(net, padded([s], backend, settings.max_len), index, training=False)[0])
                  for s in samples]
    return sum(losses) / len(losses)


def split(corpus: Corpus, held_out: int) -> tuple[list[Sample], list[Sample]]:
    """(training samples, held-aside samples): the last ``held_out`` are held aside (fewer when the
    corpus is small, always at least one for training)."""
    held = min(held_out, max(0, len(corpus.samples) - 1))
    cut = len(corpus.samples) - held
    return corpus.samples[:cut], corpus.samples[cut:]


def report(settings: Settings, corpus: Corpus, outcome: Outcome, evaluation: dict) -> dict:
    """What the drafter file records about its training."""
    recorded = asdict(settings)
    if math.isinf(settings.minutes):  # no time limit (--steps bounds it): JSON has no infinity
        recorded["minutes"] = None
    return {
        "settings": recorded,
        "data_tokens": corpus.tokens,
        "conversations": len(corpus.samples),
        "queries_drafted": corpus.queries_drafted,
        "data_seconds": round(corpus.seconds, 1),
        "train_seconds": round(outcome.seconds, 1),
        "train_steps": outcome.steps,
        "train_tokens_seen": outcome.tokens_seen,
        "loss_first": round(outcome.first_loss, 4),
        "loss_last": round(outcome.last_loss, 4),
        "evaluation": evaluation,
        "command": " ".join(["decodekit", *sys.argv[1:]]) if sys.argv and "train-drafter" in sys.argv else "",
    }
