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
