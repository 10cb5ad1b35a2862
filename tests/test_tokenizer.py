"""The tokenizer of a GGUF model's folder, read with the tokenizers library alone (FileTokenizer),
against transformers' AutoTokenizer on the same folder: a small folder made here, whose chat
template uses the special tokens (the embedded models are compared in test_real_model.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from decodekit.models.tokenizer import CharTokenizer, FileTokenizer, HFTokenizer, file_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def tokenizer_folder(folder: Path, **config) -> Path:
    """A byte-level BPE tokenizer with a BOS before every text, as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rust = Tokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<unk>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rust.train_from_iterator(["the cat sat on the mat", "a bird in the hand", "naïve café"] * 20, trainer)
    rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", rust.token_to_id("<s>"))])
    folder.mkdir(exist_ok=True)
    rust.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "pad_token": "</s>", **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def test_a_folders_tokenizer_gives_what_auto_tokenizer_gives(tmp_path):
    from llguidance.hf import from_tokenizer
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path / "tok")
    ours, auto = file_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, FileTokenizer)
    for text in ["the cat sat", "naïve café 🦊", "</s> inside <s>", "", "  two  spaces"]:
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.decode(ids + [auto.eos_token_id]) == auto.decode(ids + [auto.eos_token_id], skip_special_tokens=True)
        chat = [{"role": "user", "content": text}]
        assert ours.chat_prompt(chat) == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.chat_prompt([{"role": "user", "content": "hi"}]).startswith("<s>user: hi</s>")  # the variables reach it
    assert list(ours.prompt_prefix) == [auto.bos_token_id]
    assert ours.eos_token_ids == {auto.eos_token_id, auto.convert_tokens_to_ids("<|im_end|>")}
    theirs = from_tokenizer(auto, eos_token=sorted(ours.eos_token_ids))
    grammar = ours.grammar_tokenizer()
    assert grammar.vocab_size == theirs.vocab_size and grammar.eos_tokens == theirs.eos_tokens
    assert grammar.tokenize_str("the mat") == theirs.tokenize_str("the mat")
    with pytest.raises(ValueError, match="at least one message"):
        ours.chat_prompt([])


def test_a_turn_end_that_is_the_unknown_token_ends_no_turn_as_with_auto_tokenizer(tmp_path):
    """AutoTokenizer cannot tell the unknown token from a turn end it does not know, so HFTokenizer
    leaves the unknown token's id out of the end-of-sequence ids: a folder's own tokenizer does too."""
    folder = tokenizer_folder(tmp_path / "tok", unk_token="<|im_end|>")
    ours, auto = file_tokenizer(folder), HFTokenizer(folder)
    assert isinstance(ours, FileTokenizer)
    assert ours.eos_token_ids == auto.eos_token_ids == {ours._rust.token_to_id("</s>")}


@pytest.mark.parametrize("config", [{"add_bos_token": False}, {"split_special_tokens": True},
                                    {"tokenizer_class": "LlamaTokenizer"}, {"clean_up_tokenization_spaces": True}])
def test_a_setting_that_changes_auto_tokenizer_sends_the_folder_to_it(tmp_path, config):
    assert isinstance(file_tokenizer(tokenizer_folder(tmp_path / "tok", **config)), HFTokenizer)


def test_a_gemma_folder_whose_pipeline_is_not_gemmas_goes_to_auto_tokenizer(tmp_path):
    """transformers' GemmaTokenizer keeps the file's vocabulary but builds its own normaliser,
    pre-tokeniser and decoder: a file with others is read as it would read it."""
    assert isinstance(file_tokenizer(tokenizer_folder(tmp_path / "tok", tokenizer_class="GemmaTokenizer")), HFTokenizer)


def test_a_damaged_tokenizer_file_is_one_clear_error(tmp_path):
    from decodekit.errors import InvalidModel

    folder = tokenizer_folder(tmp_path / "tok")
    (folder / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(InvalidModel, match="has no usable tokenizer"):
        file_tokenizer(folder)


def test_a_folders_tokenizer_is_read_once_while_its_files_stay_the_same(tmp_path):
    """A second load of the same folder shares the tokenizer read first; a file written since
    (the same bytes, or damaged ones) is read again, never answered from what was read before."""
    from decodekit.errors import InvalidModel

    folder = tokenizer_folder(tmp_path / "tok")
    first = file_tokenizer(folder)
    assert file_tokenizer(str(folder)) is first
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text)
    stat = (folder / "tokenizer.json").stat()  # rewritten: a later modification time (set: a clock tick is coarse)
    os.utime(folder / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = file_tokenizer(folder)
    assert again is not first and again.encode("the cat") == first.encode("the cat")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template.replace("assistant:", "bot:"))
    assert file_tokenizer(folder) is not again  # any of its files
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(InvalidModel, match="has no usable tokenizer"):
        file_tokenizer(folder)


def test_the_char_tokenizer_never_spells_the_end_of_sequence():
    """Id 0 is the tiny models' end of sequence: a character below the printable range (a newline
    in a prompt) takes the lowest text id, never 0, and one above it the highest."""
    tok = CharTokenizer(96)
    assert tok.encode("\n\x1f a") == [1, 1, 1, ord("a") - 31]
    assert tok.encode("é") == [95] and 0 not in tok.encode("line one\nline two")


def gemma_folder(folder: Path, byte_fallback: bool = True) -> Path:
    """A tiny tokenizer with the pipeline transformers' GemmaTokenizer builds (spaces as "▁", bytes
    of characters outside the vocabulary spelt as <0xNN> tokens where ``byte_fallback``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)},
             "▁": 260, "a": 261, "t": 262, "▁a": 263, "at": 264}
    rust = Tokenizer(models.BPE(vocab, [("▁", "a"), ("a", "t")], unk_token="<unk>", byte_fallback=byte_fallback,
                                fuse_unk=True))
    rust.normalizer = normalizers.Replace(" ", "▁")
    rust.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous", invert=False)
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    rust.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
    folder.mkdir(exist_ok=True)
    rust.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def test_a_gemma_folder_reads_bytes_outside_its_vocabulary_as_byte_tokens_or_goes_to_auto_tokenizer(tmp_path):
    """GemmaTokenizer's model falls back to byte tokens for text outside its vocabulary: a folder
    with that pipeline is read as it is, and one whose model lacks the byte fallback (it would read
    such text as <unk>) goes to AutoTokenizer."""
    ours = file_tokenizer(gemma_folder(tmp_path / "gemma"))
    assert isinstance(ours, FileTokenizer)
    ids = ours.encode("at é")
    assert ids[-2:] == [4 + 0xC3, 4 + 0xA9] and ours.decode(ids) == "at é"  # é is C3 A9 in UTF-8
    assert isinstance(file_tokenizer(gemma_folder(tmp_path / "plain", byte_fallback=False)), HFTokenizer)


def test_the_char_tokenizers_end_of_sequence_is_its_one_special_token():
    """Id 0 ends a sequence: the special token, which decodes to no text and has no bytes, while
    every other id spells its character."""
    tok = CharTokenizer(96)
    assert tok.decode([ord("h") - 31, ord("i") - 31, 0]) == "hi"
    assert tok.special_tokens() == {0: "<eos>"}
    assert tok.token_bytes(0) == b"" and tok.token_bytes(ord("a") - 31) == b"a"


def test_a_folders_special_tokens_are_its_special_added_tokens_only(tmp_path):
    """An added token that is not special (a tool-call marker) is text: it decodes, and structured
    decoding may spell with it; only the special ones are listed, as AutoTokenizer has them."""
    from tokenizers import AddedToken, Tokenizer

    folder = tokenizer_folder(tmp_path / "tok")
    rust = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rust.add_tokens([AddedToken("<tool>", special=False)])
    rust.save(str(folder / "tokenizer.json"))
    ours, auto = file_tokenizer(folder), HFTokenizer(folder)
    assert isinstance(ours, FileTokenizer)
    assert ours.special_tokens() == auto.special_tokens()
    assert set(ours.special_tokens().values()) == {"<s>", "</s>", "<unk>", "<|im_end|>"}


def test_a_message_key_whose_value_is_none_is_left_out_as_auto_tokenizer_leaves_it(tmp_path):
    """apply_chat_template drops a message's keys whose value is None (an assistant turn without
    content): the template sees them undefined, never as the text "None"."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path / "tok")
    ours, auto = file_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert ours.chat_prompt(chat) == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert "None" not in ours.chat_prompt(chat)
