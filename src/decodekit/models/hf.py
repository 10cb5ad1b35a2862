"""The :class:`Backend` interface over any transformers causal LM (e.g. Gemma 3).

Slower than the native backend (transformers' per-layer overhead and cache objects) but
works for every architecture transformers knows that accepts a 4-D attention mask.

Every layer's cache keeps every key (a plain ``DynamicCache``: a sliding-window layer's own cache
would keep only the last window of them, which rollbacks and trees cannot work with); a model
with sliding-window layers (Gemma 3) gets a mask of each kind, the window applied by position.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from ..errors import InvalidModel
from .backend import Backend, ModelInfo, StepOutput

T = TypeVar("T")


#: transformers models whose every layer attends to the last config.sliding_window positions (when
#: it is set) without a list of layer kinds: the window goes into the mask decodekit passes them.
WINDOW_EVERY_LAYER = frozenset({"mistral", "mixtral", "phi3", "starcoder2"})


# Reading transformers' loading report, here beside the backend that loads through transformers;
# loading.py's GGUF dequantisation uses it too (loading imports this module, never the reverse).


def quietly_loaded(load: Callable[[], T]) -> T:
    """``load()`` with transformers' own load report and progress bars silenced: what is wrong with
    the weights is said by :func:`check_loading_report`, in one line, and the CLI's stderr is for
    errors (a GGUF file's first load drew two bars, before the one line of a damaged file's error),
    so are the warnings of the libraries it runs (numpy's on a damaged block's NaN, torch's...).
    The GGUF converter's bar is plain tqdm, not transformers' switchable one: turned off in its module."""
    import functools
    import warnings

    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    gguf_bar = getattr(gguf_loading, "tqdm", None)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    if gguf_bar is not None:
        gguf_loading.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load()
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
        if gguf_bar is not None:
            gguf_loading.tqdm = gguf_bar


def check_loading_report(source: Path, report: dict, *, tied: bool, num_layers: int | None) -> None:
    """Refuse a model transformers could load only by making weights up: a tensor the model needs
    and the file lacks (a damaged name, fewer layers than its config says) is initialised at
    random, without an error; one of another shape likewise. Layers past the config's
    ``num_layers`` (:func:`stored_layers`; None: not known) are left out unread, without an error:
    refused too."""
    missing = [k for k in report.get("missing_keys", ()) if not (tied and k == "lm_head.weight")]
    mismatched = [k for k, *_ in report.get("mismatched_keys", ())]
    if missing or mismatched:
        which = missing or mismatched
        raise InvalidModel(f"{source}: {len(which)} weight tensor(s) " + ("missing" if missing else "of the wrong shape")
                           + f" ({', '.join(listed(which))}): damaged weights")
    if num_layers is not None:
        refuse_layers_past(source, report.get("unexpected_keys", ()), num_layers)


def stored_layers(config) -> int | None:
    """The layers a transformers config has weights for: its decoder layers, and the
    multi-token-prediction layers some checkpoints store after them (DeepSeek-V3's, GLM-4.5's);
    None where the config counts no layers of text."""
    try:
        text = config.get_text_config()
    except (AttributeError, ValueError):  # (a config with no text part: transformers' ways of saying so)
        return None
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return None
    extra = getattr(text, "num_nextn_predict_layers", None) or getattr(text, "num_mtp_layers", None) or 0
    return layers + (extra if isinstance(extra, int) else 0)


LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")


def refuse_layers_past(source: Path, names: Iterable[str], num_layers: int) -> None:
    """Refuse weights (by ``names``) that hold layers at or past ``num_layers``: a config that counts
    too few layers would load as a cut-down model, its last layers left out without a word."""
    past = [name for name in names if (found := LAYER_KEY.search(name)) and int(found.group(1)) >= num_layers]
    if past:
        raise InvalidModel(f"{source}: the weights hold layers past the config's {num_layers} (num_hidden_layers): "
                           f"{', '.join(listed(past))}; a damaged config")


def listed(names: Iterable[str]) -> list[str]:
    """The first three of ``names`` in order, and "..." for the rest."""
    names = sorted(names)
    return names[:3] + (["..."] if len(names) > 3 else [])


class HFBackend(Backend):
    def __init__(self, model, name: str = "hf"):
        from transformers import DynamicCache

        self.model = model.eval()
        self._cache_cls = DynamicCache
        cfg = model.config.get_text_config()
        self.dtype = next(model.parameters()).dtype
        # the last `window` positions seen by the sliding-window layers: some of them (Gemma 3, Qwen2:
        # the config lists each layer's kind) or, for the models that window every layer by their
        # config's sliding_window alone (Mistral's family), all of them
        kinds = set(getattr(cfg, "layer_types", None) or ())
        windowed = "sliding_attention" in kinds or (not kinds and cfg.model_type in WINDOW_EVERY_LAYER)
        self.window = getattr(cfg, "sliding_window", None) if windowed else None
        self.mixed_layers = len(kinds) > 1
        self.info = ModelInfo(
            name=name,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            max_length=getattr(cfg, "max_position_embeddings", 4096),
            dtype=self.dtype,
            architecture=f"hf-{cfg.model_type}",
        )
        self.reset(1)

    @classmethod
    def from_folder(cls, folder: Path, *, dtype: torch.dtype = torch.float32) -> "HFBackend":
        from transformers import AutoModelForCausalLM

        torch.set_flush_denormal(True)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar for the weights of a local folder: the CLI's stderr is for errors
        try:
            # (mismatched sizes reported, not raised: the check below names the tensor)
            model, report = quietly_loaded(lambda: AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True))
        # transformers' ways of refusing a folder (ArithmeticError: a config of no heads divides by zero)
        except (OSError, ValueError, KeyError, TypeError, ArithmeticError) as err:
            raise InvalidModel.because(folder, "transformers cannot load this model", err) from err
        check_loading_report(folder, report, tied=model.config.tie_word_embeddings, num_layers=stored_layers(model.config))
        return cls(model, name=Path(folder).name)

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch_size(self) -> int:
        return self._batch

    def reset(self, batch_size: int = 1) -> None:
        self._cache = self._cache_cls()
        self._length = 0
        self._batch = batch_size
        self._pending_tree = None

    def _mask(self, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Boolean [q, kv] visibility to the additive float mask transformers expects; with
        sliding-window layers, one mask per kind of layer (the new tokens at ``positions``, the
        cached ones at their slots)."""
        if self.window is None:
            return self._additive(allowed)
        keys = torch.cat([torch.arange(allowed.shape[1] - allowed.shape[0]), positions.view(-1)])
        near = positions.view(-1, 1) - keys.view(1, -1) < self.window
        if not self.mixed_layers:
            return self._additive(allowed & near)
        return {"full_attention": self._additive(allowed), "sliding_attention": self._additive(allowed & near)}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None].expand(self._batch, 1, -1, -1)

    @torch.inference_mode()
    def _run(self, tokens, positions, allowed, hidden_layers=(), last_only=False) -> StepOutput:
        self._drop_past(self._length)  # a verified tree's entries, never committed: the new tokens take their slots
        out = self.model(
            input_ids=tokens,
            position_ids=positions.expand(tokens.shape[0], -1),
            attention_mask=self._mask(allowed, positions[0]),
            cache=self._cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=1 if last_only else 0,
        )
        hidden = {layer: out.hidden_states[layer] for layer in hidden_layers} if hidden_layers else {}
        return StepOutput(logits=out.logits.float(), hidden=hidden)

    def append(self, tokens: torch.Tensor, *, hidden_layers: Sequence[int] = (), skip_layers: frozenset[int] = frozenset(),
               last_only: bool = False) -> StepOutput:
        if skip_layers:
            raise NotImplementedError("layer skipping needs the native backend")
        start, k = self._length, tokens.shape[1]
        allowed = torch.ones(k, start + k, dtype=torch.bool).tril(diagonal=start)
        out = self._run(tokens, torch.arange(start, start + k)[None], allowed, hidden_layers, last_only)
        self._length += k
        self._pending_tree = None
        return out

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:  # (the cache may hold a verified tree's uncommitted entries past it)
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        self._drop_past(length)
        self._length = length
        self._pending_tree = None

    def _drop_past(self, length: int) -> None:
        """The cache's entries past ``length`` removed (rolled back, or a tree's left uncommitted)."""
        removed = self._cache.get_seq_length() - length
        if removed:
            self._cache.crop(-removed)

    def _run_tree(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> StepOutput:
        return self._run(tokens, positions[None], visible)

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        for layer in self._cache.layers:
            for tensor in (layer.keys, layer.values):
                tensor[:, :, dst : dst + src.numel()] = tensor[:, :, src]

    def _set_length(self, length: int) -> None:
        self._length = length
        self.truncate(length)  # drop the rejected nodes' entries from the dynamic cache

    @torch.inference_mode()
    def reorder(self, rows: torch.Tensor) -> None:
        for layer in self._cache.layers:
            layer.keys = layer.keys[rows].contiguous()
            layer.values = layer.values[rows].contiguous()
        self._batch = rows.numel()
