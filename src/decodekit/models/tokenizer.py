"""A minimal tokenizer interface: what the engine needs, over transformers or a toy vocabulary."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidModel
from .chat_template import compiled, refusals_as_invalid, render_chat

if TYPE_CHECKING:
    import llguidance

GRAMMARS_KEPT = 32  # compiled grammars a tokenizer keeps (the most recently used)


class Tokenizer:
    """encode/decode text, know the end-of-sequence ids, and format a chat prompt."""

    eos_token_ids: frozenset[int] = frozenset()
    #: what a prompt starts with (Gemma's ``<bos>``; nothing for SmolLM2)
    prompt_prefix: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_as_text(self, text: str) -> list[int]:
        """The ids of ``text`` with a special token's text in it read as plain text, not as that
        token (:class:`ShieldedMessages`); the same as :meth:`encode` for a vocabulary without them."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    #: What bounds the tokens of a text from below without tokenising it (None: nothing known).
    bound: TokenBound | None = None

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))`` known without encoding it (0 where none is
        known): a prompt far past a model's context is refused before the work of tokenising it."""
        return self.bound.fewest(text) if self.bound is not None else 0

    def surely_more_tokens(self, text: str, limit: int) -> int | None:
        """:meth:`fewest_tokens` where it is more than ``limit``, else None; worked out only where
        the text's raw length allows it (normalising a long text holds the interpreter's lock)."""
        return self.bound.past(text, limit) if self.bound is not None else None

    def chat_prompt(self, messages: list[dict[str, str]]) -> str | None:
        """The prompt text for a chat (generation prompt added), or None without a chat template."""
        return None

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token's text, even where they are part of a character (``decode`` gives
        such a token U+FFFD); none for a special token, which ``decode`` gives no text either."""
        try:
            lltokenizer = self.grammar_tokenizer()
        except NotImplementedError:
            return self.decode([token]).encode("utf-8", "replace")
        if not 0 <= token < lltokenizer.vocab_size or lltokenizer.is_special_token(token):
            return self.decode([token]).encode("utf-8", "replace")
        return lltokenizer.decode_bytes([token])

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """This vocabulary as llguidance's ``LLTokenizer`` (for structured decoding), built once."""
        if getattr(self, "_grammar_tokenizer", None) is None:
            self._grammar_tokenizer = self._make_grammar_tokenizer()
        return self._grammar_tokenizer

    def _make_grammar_tokenizer(self):
        raise NotImplementedError(f"{type(self).__name__} has no grammar tokenizer")

    def special_tokens(self) -> dict[int, str]:
        """The special tokens, id -> text (found once). They decode to no text, while llguidance
        spells text with them ("<|im_end|>"), so structured decoding never allows one as text."""
        found = self.__dict__.get("_special_tokens")
        if found is None:
            found = self.__dict__["_special_tokens"] = self._find_special_tokens()
        return found

    def special_text(self) -> SpecialText | None:
        """What a chat message must not pass to the template as it is (found once; None: nothing)."""
        if "_special_text" not in self.__dict__:
            try:
                texts = {text for text in self.special_tokens().values() if text}
            except NotImplementedError:  # no vocabulary to ask
                texts = set()
            self.__dict__["_special_text"] = SpecialText(texts) if texts else None
        return self.__dict__["_special_text"]

    def _find_special_tokens(self) -> dict[int, str]:
        lltokenizer = self.grammar_tokenizer()  # every id asked: a tokenizer that knows its added tokens says faster
        return {t: lltokenizer.decode_bytes([t]).decode("utf-8", "replace")
                for t in range(lltokenizer.vocab_size) if lltokenizer.is_special_token(t)}

    def grammar_matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A new llguidance ``LLMatcher`` for ``grammar`` over this vocabulary, at the grammar's start.
        Each grammar is checked and compiled once (the last :data:`GRAMMARS_KEPT` are kept) and every
        call gets a copy of the compiled matcher: compiling is most of what a constraint costs a short
        request, and a server sees the same schema again and again. An invalid grammar raises
        ValueError with llguidance's first line."""
        from llguidance import LLMatcher

        with _GRAMMARS_LOCK:
            kept = self.__dict__.setdefault("_grammar_matchers", OrderedDict())
            matcher = kept.pop(grammar, None)
            if matcher is None:
                lltokenizer = self.grammar_tokenizer()
                error = LLMatcher.validate_grammar(grammar, lltokenizer).strip()
                if error:
                    raise ValueError(grammar_error_line(error))
                matcher = LLMatcher(lltokenizer, grammar, log_level=0)
                probe = matcher.deep_copy()
                probe.compute_bitmask()  # a grammar no text can start (a pattern matching nothing) fails here
                for failed in (matcher, probe):
                    if failed.is_error():
                        raise ValueError(matcher_error_line(failed.get_error()))
            kept[grammar] = matcher  # the most recent last
            while len(kept) > GRAMMARS_KEPT:
                kept.popitem(last=False)
            return matcher.deep_copy()


_GRAMMARS_LOCK = threading.Lock()  # requests decoding on threads of their own share a tokenizer
_AS_TEXT_LOCK = threading.Lock()


def matcher_error_line(error: str) -> str:
    """The first line of an llguidance matcher's error (the lines after it dump the parser's state),
    said in words where llguidance's is a bare code."""
    first = (error.strip().splitlines() or ["unknown error"])[0]
    if first == "NoExtensionBias":
        return "no text can continue the output here (the grammar or pattern matches nothing from this point)"
    return first


def grammar_error_line(error: str) -> str:
    """llguidance's complaint about a grammar as one line: its first line (where), with the cause
    where a later line gives it as ``error: ...`` (a regular expression's parse errors, whose first
    line ends in "regex parse error:" and whose cause comes after a picture of the pattern)."""
    lines = [line.strip() for line in error.strip().splitlines()]
    first = lines[0] if lines else "invalid grammar"
    # a long pattern it quotes is cut (a request's 100,000-character regex, echoed whole)
    first = re.sub(r'"([^"]{81,})"', lambda m: f'"{m.group(1)[:60]}..." ({len(m.group(1))} characters)', first)
    cause = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{first.rstrip(':')}: {cause}" if cause else first


def special_prefix(marked: list[int], plain: list[int]) -> tuple[int, ...]:
    """What a tokenizer puts before a text's own ids: ``marked`` is a short text encoded with the
    special tokens, ``plain`` without (it knows whether its model wants a BOS)."""
    return tuple(marked[: marked.index(plain[0])]) if plain and plain[0] in marked else ()


#: the named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: tokens that end a chat turn where the configured end of sequence may be another
TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")


SHIELD_OPEN, SHIELD_CLOSE = "\ue000", "\ue001"  # private-use characters around a set-aside text's index


class SpecialText:
    """Whether a text holds a special token's text, or one of the two characters
    :class:`ShieldedMessages` marks its places with. A regular expression of Gemma's 6,000 special
    tokens tries each at every character (seconds a long prompt); this looks only where one of their
    first characters is, and only at their lengths."""

    def __init__(self, texts: set[str]):
        self.texts = frozenset(texts | {SHIELD_OPEN, SHIELD_CLOSE})
        self.lengths = sorted({len(text) for text in self.texts})
        self.starts = re.compile("[" + "".join(sorted({re.escape(text[0]) for text in self.texts})) + "]")

    def found_in(self, text: str) -> bool:
        return any(text[i:i + n] in self.texts for i in (start.start() for start in self.starts.finditer(text))
                   for n in self.lengths)


class ShieldedMessages:
    """Chat messages, each whose content holds a special token's text (``<|im_end|>``) set aside
    while the chat template renders them and then tokenised as plain text: a message cannot close
    its own turn or open another one, as it could where its text was read with the template's markup
    (a server's client writing the assistant's turn, say). The chat's markup is the template's alone.

    Messages without such text render and tokenise exactly as they would unshielded. A set-aside
    content is tokenised in one piece, as plain text is; its whitespace at either end stays in the
    message (a template that trims contents trims it as before), and the rest stands in the rendered
    template as ``SHIELD_OPEN index SHIELD_CLOSE``; a message that holds those two characters is set
    aside too, so no text can pose as a mark."""

    def __init__(self, tokenizer: Tokenizer, messages: list[dict[str, str]]):
        self.tokenizer, self.set_aside = tokenizer, []
        special = tokenizer.special_text()
        self.messages = messages if special is None else [
            {**message, "content": self._mark(message["content"])}
            if isinstance(message.get("content"), str) and special.found_in(message["content"]) else message
            for message in messages]

    def _mark(self, content: str) -> str:
        core = content.strip()
        start = len(content) - len(content.lstrip())
        self.set_aside.append(core)
        return f"{content[:start]}{SHIELD_OPEN}{len(self.set_aside) - 1}{SHIELD_CLOSE}{content[start + len(core):]}"

    def unmarked(self, text: str) -> str:
        """The rendered ``text`` with each set-aside content back in its place (what a lower bound on
        its tokens is worked out from)."""
        return _MARK.sub(lambda mark: self.set_aside[int(mark.group(1))], text) if self.set_aside else text

    def encode(self, text: str) -> list[int]:
        """The ids of the rendered ``text``: the template's pieces as :meth:`Tokenizer.encode` reads
        them, each set-aside content as :meth:`Tokenizer.encode_as_text` does."""
        if not self.set_aside:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        for i, piece in enumerate(_MARK.split(text)):
            if i % 2:
                ids += self.tokenizer.encode_as_text(self.set_aside[int(piece)])
            elif piece:
                ids += self.tokenizer.encode(piece)
        return ids


_MARK = re.compile(f"{SHIELD_OPEN}(\\d+){SHIELD_CLOSE}")


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer folder, as transformers' ``AutoTokenizer`` reads it."""

    def __init__(self, folder: Path | str):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(folder)
        except Exception as err:  # tokenizers raises plain Exception for a damaged tokenizer.json
            raise InvalidModel.because(folder, "has no usable tokenizer", err) from err
        eos = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        for token in TURN_ENDS:
            tid = self.hf.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.hf.unk_token_id and tid is not None:
                eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        marked, plain = self.hf.encode("a"), self.hf.encode("a", add_special_tokens=False)
        self.prompt_prefix = special_prefix(marked, plain)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_as_text(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def _make_grammar_tokenizer(self):
        from llguidance.hf import from_tokenizer

        return from_tokenizer(self.hf, eos_token=sorted(self.eos_token_ids))

    def _find_special_tokens(self) -> dict[int, str]:
        return {t: added.content for t, added in self.hf.added_tokens_decoder.items() if added.special}

    def chat_prompt(self, messages: list[dict[str, str]]) -> str | None:
        if not getattr(self.hf, "chat_template", None):
            return None
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class FileTokenizer(Tokenizer):
    """A tokenizer folder that decodekit wrote from a GGUF file (its ``tokenizer.json``, its
    ``tokenizer_config.json`` and chat template), read with the ``tokenizers`` library alone.

    It gives the ids, text and chat prompts ``AutoTokenizer`` gives on the same folder (tests
    compare them on both embedded models), with the chat template rendered in transformers'
    environment rebuilt (:mod:`.chat_template`), for much less: transformers' Gemma tokenizer
    rebuilds its 262k-token vocabulary in Python (far more memory, docs/BENCHMARKS.md), and no
    start pays for importing transformers.
    :func:`file_tokenizer` says where it applies.
    """

    def __init__(self, rust, config: dict, template: str | None):
        self._rust = rust
        self._rust.no_padding()  # AutoTokenizer's encode pads and truncates only when asked to
        self._rust.no_truncation()
        self._special = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        self._template = template
        if template:  # compiled now, not in the first request (a syntax error: the model's, one line)
            with refusals_as_invalid():
                compiled(template)
        eos = {self._id("eos_token")}
        # as HFTokenizer does (AutoTokenizer cannot tell the unknown token from one it does not know)
        eos |= {self._rust.token_to_id(token) for token in TURN_ENDS} - {self._id("unk_token")}
        self.eos_token_ids = frozenset(eos - {None})
        marked, plain = self._rust.encode("a").ids, self._rust.encode("a", add_special_tokens=False).ids
        self.prompt_prefix = special_prefix(marked, plain)
        self.bound = TokenBound.of(rust)  # (read now: a large vocabulary takes a moment, not the first request's)

    def _id(self, name: str) -> int | None:
        return self._rust.token_to_id(self._special[name]) if name in self._special else None

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the interpreter's lock while it works (encode holds it): a server's
        # other requests go on while a long prompt is tokenised on another thread
        return self._rust.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_as_text(self, text: str) -> list[int]:
        with _AS_TEXT_LOCK:  # a copy that reads special tokens' text as text: made once (seconds for Gemma's)
            plain = self.__dict__.get("_as_text")
            if plain is None:
                from tokenizers import Tokenizer as RustTokenizer

                plain = self.__dict__["_as_text"] = RustTokenizer.from_str(self._rust.to_str())
                plain.encode_special_tokens = True
        return plain.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._rust.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str | None:
        if not self._template:
            return None
        if not messages:
            raise ValueError("a chat needs at least one message")  # as apply_chat_template says
        # as apply_chat_template does: keys whose value is None are left out, special tokens are variables
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        return render_chat(self._template, chat, add_generation_prompt=True, **self._special)

    def _make_grammar_tokenizer(self):
        from llguidance import LLTokenizer

        return LLTokenizer(self._rust.to_str(), eos_token=sorted(self.eos_token_ids))

    def _find_special_tokens(self) -> dict[int, str]:
        return {t: added.content for t, added in self._rust.get_added_tokens_decoder().items() if added.special}


#: Pre-tokenizers that keep every character of the text in some piece (Split may drop its matches).
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"})


@dataclass(frozen=True)
class TokenBound:
    """A lower bound on the tokens a ``tokenizers`` tokenizer makes of a text: its normalised text
    (NFKC, say, may shorten it) over ``longest``, the most characters a vocabulary entry holds.

    It holds where every character of the normalised text is covered by some token, none by more
    than one entry's characters: a byte-level BPE (an entry holds one character per byte, and a
    character is one byte or more) or a BPE or Unigram model with byte fallback, after a
    pre-tokenizer that drops nothing, with no added token that swallows the whitespace beside it
    (lstrip, rstrip). Elsewhere (an unknown-token model that folds a run of unknown characters into
    one token, WordPiece, a pre-tokenizer that drops whitespace) there is no bound: :meth:`of`
    gives None."""

    normalizer: object | None
    longest: int

    @classmethod
    def of(cls, rust) -> TokenBound | None:
        # (from the parts, not the whole tokenizer as JSON: a 262k-token vocabulary takes a second so)
        pre = json.loads(rust.pre_tokenizer.__getstate__()) if rust.pre_tokenizer is not None else None
        kind, byte_fallback = type(rust.model).__name__, getattr(rust.model, "byte_fallback", False)
        byte_level = any(node.get("type") == "ByteLevel" for node in _nodes(pre))
        covered = kind == "BPE" and (byte_fallback or byte_level) or kind == "Unigram" and byte_fallback
        keeping = all(node.get("type") in KEEPING_PRE_TOKENIZERS and node.get("behavior") != "Removed"
                      for node in _nodes(pre))
        swallowing = any(token.lstrip or token.rstrip for token in rust.get_added_tokens_decoder().values())
        if not covered or not keeping or swallowing:
            return None
        longest = max(map(len, rust.get_vocab(with_added_tokens=True)), default=0)
        return cls(rust.normalizer, longest) if longest else None

    def fewest(self, text: str) -> int:
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        return -(-len(text) // self.longest)

    def past(self, text: str, limit: int) -> int | None:
        """:meth:`fewest` where it is more than ``limit``; None without normalising a text whose raw
        length could not make it so (a normaliser that lengthens it only loses this early refusal:
        the exact count still refuses)."""
        if -(-len(text) // self.longest) <= limit:
            return None
        fewest = self.fewest(text)
        return fewest if fewest > limit else None


def _nodes(pre_tokenizer: dict | None) -> list[dict]:
    """A pre-tokenizer's parts, a Sequence's own included."""
    if not pre_tokenizer:
        return []
    return [pre_tokenizer, *(node for part in pre_tokenizer.get("pretokenizers") or () for node in _nodes(part))]


def _token_text(token) -> str:
    """A special token of ``tokenizer_config.json``: a string, or an added token's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


#: what the tokenizer configs decodekit writes hold; a key beyond these (``add_bos_token``,
#: ``split_special_tokens``, ...) changes what AutoTokenizer does, so such a folder goes to it
FILE_CONFIG_KEYS = frozenset({"backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length",
                              "clean_up_tokenization_spaces", "chat_template", *SPECIAL_TOKEN_NAMES})


def _gemma_pipeline(rust) -> bool:
    """Whether ``tokenizer.json`` has the pipeline transformers' ``GemmaTokenizer`` builds around its
    vocabulary and merges (it keeps only those, and the post-processor, from the file)."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    want = (normalizers.Replace(" ", "▁"), pre_tokenizers.Split(" ", "merged_with_previous", invert=False),
            decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]))
    have = (rust.normalizer, rust.pre_tokenizer, rust.decoder)
    model = rust.model
    return (all(h is not None and h.__getstate__() == w.__getstate__() for h, w in zip(have, want))
            and type(model).__name__ == "BPE" and model.byte_fallback and model.fuse_unk and not model.dropout)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def file_tokenizer(folder: Path | str) -> Tokenizer:
    """The tokenizer of a folder decodekit wrote from a GGUF file: a :class:`FileTokenizer` where
    AutoTokenizer would read the same ``tokenizer.json`` as it is, through the generic backend
    or Gemma's (the classes transformers writes for the GGUF files decodekit converts) with no
    setting that changes its behaviour; else :class:`HFTokenizer`.

    Read once per process while its files stay as they are (inode, size, modification time): a model
    loaded again, say in the other numerics, shares it (Gemma's 262k-token file takes most of a
    second to parse). Tokenizers hold nothing of a request, so sharing one changes no output."""
    folder = Path(folder).resolve()
    return _read_tokenizer(folder, tuple(_stamp(folder / name) for name in TOKENIZER_FILES))


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns  # (a file replaced whole is a new inode)


@lru_cache(maxsize=4)
def _read_tokenizer(folder: Path, stamps: tuple) -> Tokenizer:
    """:func:`file_tokenizer` for ``folder`` whose files had ``stamps`` (the cache's key)."""
    from tokenizers import Tokenizer as RustTokenizer

    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.exists() else config.get("chat_template")
        plain = (isinstance(config, dict) and config.keys() <= FILE_CONFIG_KEYS
                 and config.get("tokenizer_class") in ("TokenizersBackend", "GemmaTokenizer")
                 and not config.get("clean_up_tokenization_spaces") and isinstance(template, (str, type(None)))
                 and (folder / "tokenizer.json").is_file())
    except (OSError, ValueError, AttributeError):
        plain = False  # HFTokenizer says what is wrong
    if not plain:
        return HFTokenizer(folder)
    try:
        rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as err:  # tokenizers raises plain Exception for a damaged tokenizer.json
        raise InvalidModel.because(folder, "has no usable tokenizer", err) from err
    if config["tokenizer_class"] == "GemmaTokenizer" and not _gemma_pipeline(rust):
        return HFTokenizer(folder)
    return FileTokenizer(rust, config, template)


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
