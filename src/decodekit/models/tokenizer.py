"""A minimal tokenizer interface: what the engine needs, over transformers or a toy vocabulary."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..errors import InvalidModel


class Tokenizer:
    """encode/decode text, know the end-of-sequence ids, and format a chat prompt."""

    eos_token_ids: frozenset[int] = frozenset()
    #: what a prompt starts with (Gemma's ``<bos>``; nothing for SmolLM2)
    prompt_prefix: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def chat_prompt(self, messages: list[dict[str, str]]) -> str | None:
        """The prompt text for a chat (generation prompt added), or None without a chat template."""
        return None

    def grammar_tokenizer(self):
        """This vocabulary as llguidance's ``LLTokenizer`` (for structured decoding), built once."""
        if getattr(self, "_grammar_tokenizer", None) is None:
            self._grammar_tokenizer = self._make_grammar_tokenizer()
        return self._grammar_tokenizer

    def _make_grammar_tokenizer(self):
        raise NotImplementedError(f"{type(self).__name__} has no grammar tokenizer")


def _load_hf_tokenizer(folder: Path):
    """transformers' tokenizer for ``folder``, as ``AutoTokenizer`` makes it.

    A Llama-family folder whose ``tokenizer_config.json`` names the generic ``TokenizersBackend``
    (what decodekit writes for a GGUF file) gets that class directly: it is the class AutoTokenizer
    picks for it, and going around AutoTokenizer skips importing transformers' model
    configurations, about a second of every start (a test compares the two).
    """
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        config, model_type = {}, None  # AutoTokenizer finds what is wrong and says it
    if isinstance(config, dict) and config.get("tokenizer_class") == "TokenizersBackend" and model_type == "llama":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class HFTokenizer(Tokenizer):
    def __init__(self, folder: Path | str):
        try:
            self.hf = _load_hf_tokenizer(Path(folder))
        except Exception as err:  # tokenizers raises plain Exception for a damaged tokenizer.json
            raise InvalidModel.because(folder, "has no usable tokenizer", err) from err
        eos = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        # Chat models end turns with a template token that may differ from the configured EOS.
        for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.hf.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.hf.unk_token_id and tid is not None:
                eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        # the special tokens the tokenizer puts before a text (it knows whether its model wants a BOS)
        marked, plain = self.hf.encode("a"), self.hf.encode("a", add_special_tokens=False)
        self.prompt_prefix = tuple(marked[: marked.index(plain[0])]) if plain and plain[0] in marked else ()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def _make_grammar_tokenizer(self):
        from llguidance.hf import from_tokenizer

        return from_tokenizer(self.hf, eos_token=sorted(self.eos_token_ids))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str | None:
        if not getattr(self.hf, "chat_template", None):
            return None
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class CharTokenizer(Tokenizer):
    """One token per printable ASCII character; id 0 is end-of-sequence. For tiny test models."""

    OFFSET = 31

    def __init__(self, vocab_size: int = 96):
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [min(max(ord(c) - self.OFFSET, 1), self.vocab_size - 1) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i + self.OFFSET) for i in ids if i not in self.eos_token_ids)

    def _make_grammar_tokenizer(self):
        from llguidance import LLTokenizer, TokenizerWrapper

        char = self

        class Vocabulary:  # what llguidance's TokenizerWrapper reads
            eos_token_id, bos_token_id, special_token_ids = 0, None, [0]
            tokens = [b"<eos>"] + [chr(i + CharTokenizer.OFFSET).encode() for i in range(1, char.vocab_size)]

            def __call__(self, text: bytes) -> list[int]:
                return char.encode(text.decode("utf-8", "replace"))

        return LLTokenizer(TokenizerWrapper(Vocabulary()))
