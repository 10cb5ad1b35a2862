"""The native backend on the embedded SmolLM2 model agrees with transformers."""

from __future__ import annotations

import pytest
import torch

from decodekit.engine import Engine
from tests.conftest import assert_transformers_greedy

pytestmark = pytest.mark.real_model
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(real_model):
    from transformers import AutoModelForCausalLM

    from decodekit.models.loading import resolve_model_folder

    return AutoModelForCausalLM.from_pretrained(resolve_model_folder(None), dtype=torch.float32).eval()


def test_native_logits_match_transformers_on_real_weights(real_model, hf_model):
    ids = real_model.prompt_ids("Explain rotary position embeddings in one paragraph.")
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    real_model.backend.reset()
    got = real_model.backend.append(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_matches_transformers_greedy_on_specbench(real_model, hf_model, specbench_prompts):
    engine = Engine(real_model)
    for prompt in specbench_prompts[:3]:
        ids = real_model.prompt_ids(prompt)
        ours = engine.generate(ids, max_new_tokens=NEW_TOKENS).tokens
        assert_transformers_greedy(hf_model, ids, ours, real_model.tokenizer.eos_token_ids, NEW_TOKENS)


def test_one_thread_or_two_gives_the_same_tokens_on_the_real_model(real_model):
    """The thread governor may switch between one thread and two from pass to pass (the kernels
    never split a row; prefill's torch matmuls are held to the same here)."""
    import torch

    from decodekit.engine import Engine

    engine, before, outputs = Engine(real_model), torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append([
                engine.generate("Explain why the sky is blue.", max_new_tokens=24).tokens,
                engine.generate("Write a line of poetry.", method="sample", temperature=0.9, seed=5, max_new_tokens=24).tokens,
                engine.generate("Count from one to ten.", method="pld", max_new_tokens=24).tokens,
            ])
    finally:
        torch.set_num_threads(before)
    assert outputs[0] == outputs[1]



@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_tokenizer_gives_what_auto_tokenizer_gives(name, specbench_prompts):
    """An embedded model's tokenizer reads its folder with the tokenizers library alone (far less
    memory than transformers' Gemma tokenizer, no AutoTokenizer start-up): it must give the same
    ids, text, chat prompt, end ids and prompt prefix as AutoTokenizer on the same folder."""
    from transformers import AutoTokenizer

    from decodekit.models.loading import embedded_gguf, resolve_model_folder
    from decodekit.models.tokenizer import FileTokenizer, file_tokenizer

    if embedded_gguf(name) is None:
        pytest.skip(f"embedded model {name} is not installed")
    folder = resolve_model_folder(name)
    ours, auto = file_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, FileTokenizer) and ours.bound is not None  # (a prompt far too long is refused untokenised)
    turn = "<|im_start|>user\nhi<|im_end|>" if name.startswith("smollm2") else "<start_of_turn>user\nhi<end_of_turn>"
    texts = [*specbench_prompts, "naïve café — 東京 🦊\n\ttabs  and  spaces", turn, "", "  lead", "\x00\x01 bytes"]
    for text in texts:
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids
        assert ours.fewest_tokens(text) <= len(ids) and ours.fewest_tokens(text * 50) <= len(ours.encode(text * 50))
        assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True)
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text), skip_special_tokens=True)
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text, "name": None}]
        if auto.chat_template:
            assert ours.chat_prompt(chat) == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        else:
            assert ours.chat_prompt(chat) is None
    marked = auto.encode("a")
    assert list(ours.prompt_prefix) == marked[: marked.index(auto.encode("a", add_special_tokens=False)[0])]
    ends = {auto.eos_token_id} | {auto.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")}
    assert ours.eos_token_ids == ends - {None, auto.unk_token_id}


def test_a_tokens_bytes_are_its_own_even_inside_a_character(real_model):
    """``Tokenizer.token_bytes`` (the server's logprobs ``bytes``): a byte-level token that holds part
    of a character gives its bytes, not U+FFFD's; the bytes of an answer's tokens join into its text."""
    tokenizer = real_model.tokenizer
    text = "naïve 🦊 東京"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces).decode("utf-8") == text
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # the case the bytes are for
    assert all(tokenizer.token_bytes(t) == b"" for t in tokenizer.eos_token_ids)
