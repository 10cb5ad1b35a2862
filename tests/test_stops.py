"""The one stop-string rule (engine/stops.py): what stops, where text and tokens are cut."""

from __future__ import annotations

import random

import pytest

from decodekit.engine import Engine
from decodekit.engine.stops import (cut_at_stop, decoded, hits_stop, settled, shown_tokens, stop_strings, through_stop,
                                     tokens_before)
from decodekit.errors import InvalidParameter
from decodekit.models import CharTokenizer


class WordTokenizer:
    """Token i is the i-th word of a fixed vocabulary (several characters a token)."""

    vocab = ["he", "llo", " wor", "ld", "!", " sea", "side"]

    def decode(self, tokens):
        return "".join(self.vocab[t] for t in tokens)


def test_one_string_is_one_stop_string():
    assert stop_strings("sea") == ("sea",)
    assert stop_strings(["a", "bc"]) == ("a", "bc")
    assert stop_strings(None) == ()
    with pytest.raises(InvalidParameter, match="stop"):
        stop_strings([1, 2])
    with pytest.raises(InvalidParameter, match="not valid UTF-8") as err:  # it could never match
        stop_strings(["ok", "a\udcff"])
    assert err.value.param == "stop"


def test_cut_keeps_text_before_the_stop_and_no_token_of_it():
    tok = WordTokenizer()
    tokens = [0, 1, 2, 3, 4]  # "hello world!"
    text, kept, hit = cut_at_stop(tok, tokens, ("orl",))
    assert (text, hit) == ("hello w", "orl")
    assert kept == [0, 1]  # " wor" straddles the cut: no token carries any part of the stop string
    assert tok.decode(kept) == "hello" and text.startswith(tok.decode(kept))
    text, kept, hit = cut_at_stop(tok, tokens, (" wor", "ld"))  # the first occurrence wins
    assert (text, kept, hit) == ("hello", [0, 1], " wor")
    assert cut_at_stop(tok, tokens, ("xyz",)) == ("hello world!", tokens, None)


def test_the_tokens_generated_end_with_the_one_that_completes_the_stop_string():
    tok = WordTokenizer()
    tokens = [0, 1, 2, 3, 4, 5, 6]  # "hello world! seaside"
    for stop, through in (("orl", [0, 1, 2, 3]), ("wor", [0, 1, 2]), ("!", [0, 1, 2, 3, 4]), ("llo w", [0, 1, 2])):
        text, kept, hit = cut_at_stop(tok, tokens, (stop,))
        assert through_stop(tok, tokens, text, hit, len(kept)) == through


def test_a_stop_string_that_occurs_twice_cuts_at_its_first_occurrence():
    """The generation stops as soon as the text contains the stop string: at its first occurrence."""
    tok = WordTokenizer()
    tokens = [0, 1, 4, 2, 3, 4]  # "hello! world!"
    assert cut_at_stop(tok, tokens, ("!",)) == ("hello", [0, 1], "!")
    assert cut_at_stop(tok, tokens, ("!", "ld")) == ("hello", [0, 1], "!")


def test_shown_tokens_take_the_cut_token_that_holds_even_one_character_of_the_text():
    """A token the stop string cuts inside is shown when any of its characters stay in the text."""
    tok = WordTokenizer()
    tokens = [0, 1, 2, 3, 4]  # "hello world!"
    text, kept, _ = cut_at_stop(tok, tokens, ("wor",))
    assert (text, kept) == ("hello ", [0, 1])  # " wor" is cut after its one character " "
    assert shown_tokens(tok, text, kept, tokens[len(kept):]) == [0, 1, 2]
    text, kept, _ = cut_at_stop(tok, tokens, ("ld",))  # the cut falls between tokens: none is shown
    assert shown_tokens(tok, text, kept, tokens[len(kept):]) == [0, 1, 2] == kept


@pytest.mark.parametrize("stop", ["", ["a", ""], ("",)])
def test_an_empty_stop_string_is_refused_not_dropped(stop):
    """The empty string is in every text: dropped, the stop the user asked for would silently never
    come; refused in one line, naming the field (the CLI, the API and the server share this check)."""
    with pytest.raises(InvalidParameter, match="a stop string is empty") as err:
        stop_strings(stop)
    assert err.value.param == "stop" and "\n" not in str(err.value)


def test_an_empty_stop_string_never_cuts():
    """The empty string is in every text: given among the stop strings, it must not cut the text
    at its start (stop_strings refuses it; cut_at_stop passes it over too)."""
    tok = WordTokenizer()
    tokens = [0, 1, 2, 3, 4]  # "hello world!"
    assert cut_at_stop(tok, tokens, ("",)) == ("hello world!", tokens, None)
    assert cut_at_stop(tok, tokens, ("", "ld")) == cut_at_stop(tok, tokens, ("ld",)) == ("hello wor", [0, 1, 2], "ld")


def test_shown_tokens_leave_the_kept_tokens_as_they_were():
    """shown_tokens returns a new list: the cut's kept tokens (the generation's tokens) are not
    extended with the cut-off ones that the text shows."""
    tok = WordTokenizer()
    tokens = [0, 1, 2, 3, 4]
    text, kept, _ = cut_at_stop(tok, tokens, ("wor",))
    before = list(kept)
    shown = shown_tokens(tok, text, kept, tokens[len(kept):])
    assert shown == before + [2] and kept == before and shown is not kept


def test_hits_stop_looks_at_the_tail_only_as_far_as_needed():
    tok = WordTokenizer()
    assert hits_stop(tok, [0, 1, 5], ("sea",))
    assert not hits_stop(tok, [0, 1, 5], ())
    assert not hits_stop(tok, [0] + [4] * 100, ("he",))  # beyond the window: found at the final cut instead
    assert hits_stop(tok, [0] + [4] * 100, ("he" + "!" * 100,))  # a long stop string widens the window
    assert hits_stop(tok, [0] + [4] * 100, ("he",), added=101)  # and so do the tokens one step added


def test_tokens_that_decode_to_nothing_do_not_hide_a_stops_start():
    """The window is sized in characters: 70 tokens of no text (an EOS kept under ignore_eos, special
    tokens) between "a" and "b" left "a" outside 64 tokens, so the stop "ab" went by, was streamed,
    and the text was cut at the end only (the stream and the answer then differed)."""
    tok = CharTokenizer(96)
    a, b = tok.encode("ab")
    assert tok.decode([0]) == ""
    assert hits_stop(tok, [a] + [0] * 70 + [b], ("ab",))
    assert not hits_stop(tok, [a] + [0] * 70 + [a], ("ab",))


def test_the_earliest_stop_in_the_text_wins_whatever_its_place_in_the_list():
    """The text is cut at the first occurrence of any stop string, not at the first string listed."""
    tok = WordTokenizer()
    tokens = [0, 1, 2, 3, 4]  # "hello world!"
    assert cut_at_stop(tok, tokens, ("ld", "!", " wor")) == ("hello", [0, 1], " wor")
    assert cut_at_stop(tok, tokens, ("!", "ld")) == ("hello wor", [0, 1, 2], "ld")


def test_a_single_stop_string_in_python_is_not_split_into_characters(tiny_model):
    engine = Engine(tiny_model)
    full = engine.generate("hello", max_new_tokens=40, chat=False)
    # a stop string one of whose characters occurs earlier: split into characters, it would cut there
    stop = next(full.text[i : i + 3] for i in range(3, len(full.text) - 3)
                if min(full.text.find(c) for c in full.text[i : i + 3]) < full.text.find(full.text[i : i + 3]))
    as_string = engine.generate("hello", max_new_tokens=40, chat=False, stop=stop)
    as_list = engine.generate("hello", max_new_tokens=40, chat=False, stop=[stop])
    assert as_string.text == as_list.text == full.text[: full.text.find(stop)]
    assert as_string.tokens == as_list.tokens


class ByteTokenizer:
    """Token i is the byte i: a character outside ASCII takes several tokens, and a text that ends
    inside one decodes with U+FFFD at its end, as byte-level tokenizers do."""

    def decode(self, tokens):
        return bytes(tokens).decode("utf-8", errors="replace")


class RunTokenizer(ByteTokenizer):
    """As Gemma's byte fallback decodes: a run of bytes that is not all whole characters becomes one
    U+FFFD per byte, the whole characters at its start included."""

    def decode(self, tokens):
        data = bytes(tokens)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:  # (at the end here) the run of non-ASCII bytes it lies in
            start = err.start
            while start > 0 and data[start - 1] >= 0x80:
                start -= 1
            return data[:start].decode("utf-8") + "\ufffd" * (len(data) - start)


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), RunTokenizer()])
def test_a_cut_keeps_every_token_of_the_whole_characters_before_it(tokenizer):
    text = "ab 𓀀X 𐍈𠀀 ꙮY end"
    tokens = list(text.encode())
    for stop in ("X", "Y", "𠀀", " e"):
        cut_text, kept, hit = cut_at_stop(tokenizer, tokens, (stop,))
        assert (cut_text, hit) == (text[: text.index(stop)], stop)
        assert bytes(kept) == cut_text.encode()  # not one token fewer: the last character's bytes too


def test_kept_tokens_never_end_inside_a_character_whose_last_token_carries_the_stop_string():
    """Byte-level BPE may merge bytes across characters: a token that ends one character and begins
    the stop string's is dropped, and so are the tokens of the character it ends; the kept tokens'
    text is a prefix of the cut text (never one ending in a replacement character)."""

    class Pieces(ByteTokenizer):
        pieces = [b"ok ", "ア".encode()[:2], "ア".encode()[2:] + "バ".encode()[:1], "バ".encode()[1:] + b"!"]

        def decode(self, tokens):
            return super().decode(b"".join(self.pieces[t] for t in tokens))

    tok = Pieces()
    assert tok.decode([0, 1, 2, 3]) == "ok アバ!" and tok.decode([0, 1]) == "ok \ufffd"
    text, kept, hit = cut_at_stop(tok, [0, 1, 2, 3], ("バ",))
    assert (text, kept, hit) == ("ok ア", [0], "バ")  # token 2 holds ア's last byte and バ's first
    assert text.startswith(tok.decode(kept))
    assert shown_tokens(tok, text, kept, [1, 2, 3]) == [0, 1, 2]  # ア is shown with the tokens that hold it


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), RunTokenizer()])
def test_text_ending_inside_a_character_keeps_the_whole_characters_before_it(tokenizer):
    from decodekit.engine.core import TextStreamer

    tokens = list("ab 𐍈𠀀".encode())[:-2]  # 𠀀 cut after two of its four bytes
    text = cut_at_stop(tokenizer, tokens, ())[0]
    assert text.startswith("ab 𐍈") and set(text[len("ab 𐍈"):]) == {"\ufffd"}
    pieces = []
    streamer = TextStreamer(tokenizer, [], pieces.append)
    for n in range(1, len(tokens) + 1):
        streamer.update(tokens[:n])
    streamer.update(tokens, final_text=text)
    assert "".join(pieces) == text  # the stream and the final text agree


def test_a_replacement_character_at_the_start_of_the_text_keeps_the_cut_in_place():
    """A model may write a byte that is no UTF-8 at the start (decoded as U+FFFD, never completed):
    only replacement characters at the end stand for an unfinished character, so the cut is at the
    stop string's place in the whole text, and the kept tokens spell the text before it."""
    tokenizer, tokens = ByteTokenizer(), [0xFF] + list(b"ab!cd")
    full = tokenizer.decode(tokens)
    assert full == "\ufffdab!cd"
    assert cut_at_stop(tokenizer, tokens, ("!",)) == ("\ufffdab", tokens[:3], "!")
    assert hits_stop(tokenizer, tokens, ("!",)) and not hits_stop(tokenizer, tokens[:3], ("!",))
    text, kept, hit = cut_at_stop(tokenizer, tokens, ("b!",))
    assert (text, hit) == (full[: full.index("b!")], "b!") and tokenizer.decode(kept) == text
    assert through_stop(tokenizer, tokens, text, hit, len(kept)) == tokens[:4]


def test_no_stop_string_is_found_in_a_character_not_yet_whole():
    text = "ab 😀 c"
    tokens = list(text.encode())
    unfinished = tokens[: text.encode().index("😀".encode()) + 2]  # two of the emoji's four bytes
    assert ByteTokenizer().decode(unfinished).endswith("\ufffd")
    assert not hits_stop(ByteTokenizer(), unfinished, ("\ufffd",))
    assert cut_at_stop(ByteTokenizer(), tokens, ("\ufffd",)) == (text, tokens, None)


@pytest.mark.parametrize("text, stop", [("アバラリ", "ラリ"), ("🎌 🌐🎌🎌", "🎌🎌"), ("ab😀cd", "😀c")])
def test_a_stream_holds_back_a_stop_strings_start_before_an_unfinished_character(text, stop):
    """What is streamed, byte by byte, is never part of the stop string: the text held back for a
    stop string that may be starting is judged on the whole characters before an unfinished one."""
    from decodekit.engine.core import TextStreamer

    tokenizer, tokens, pieces = ByteTokenizer(), list(text.encode()), []
    streamer = TextStreamer(tokenizer, [stop], pieces.append)
    for n in range(1, len(tokens) + 1):  # the engine's loop: a step, the stop check, the stream
        if hits_stop(tokenizer, tokens[:n], (stop,)):
            break
        streamer.update(tokens[:n])
        assert text[: text.index(stop)].startswith("".join(pieces))  # nothing sent is taken back
    streamer.update(tokens[:n], final_text=cut_at_stop(tokenizer, tokens[:n], (stop,))[0])
    assert "".join(pieces) == text[: text.index(stop)]


def test_a_step_that_adds_many_tokens_is_checked_for_a_stop_string_in_all_of_them(tiny_model):
    """A speculative step can accept more tokens than the stop check's window: a stop string near
    the start of the step ends the request there, and the stream never carries it."""
    from decodekit.engine.core import Request, StepDecoder, StepMethod
    from decodekit.samplers import Sampler

    burst = tiny_model.tokenizer.encode("ab STOP " + "x" * 150)

    class Burst(StepMethod):
        steps = 0

        def step(self, state):
            Burst.steps += 1
            state.commit(burst)
            return burst

    pieces: list[str] = []
    request = Request(tiny_model.tokenizer.encode("hi"), Sampler.from_params(), max_new_tokens=400, stop="STOP",
                      on_text=pieces.append)
    got = StepDecoder(Burst()).generate(tiny_model, request)
    assert (got.text, got.finish_reason, Burst.steps) == ("ab ", "stop", 1)
    assert "".join(pieces) == "ab "


def test_a_long_stop_string_of_many_byte_characters_is_found_in_its_window():
    """A character takes up to four byte tokens: the window for a stop string of 21 characters
    (81 bytes here) holds all its tokens, and more than MIN_WINDOW of them."""
    stop = "x" + "\U0001F600" * 20
    tokens = list(("so " + stop).encode())
    assert len(stop.encode()) == 81
    assert hits_stop(ByteTokenizer(), tokens, (stop,))
    assert not hits_stop(ByteTokenizer(), tokens[:-1], (stop,))  # its last character not whole yet


def tokens_before_one_prefix_at_a_time(tokenizer, tokens, text, cut):
    """What :func:`cut_at_stop` keeps, by its definition: every prefix decoded in turn."""
    kept = 0
    for k in range(1, len(tokens) + 1):
        prefix = tokenizer.decode(tokens[:k])
        if len(settled(prefix)) > cut:
            break
        if len(prefix) <= cut and text.startswith(prefix):
            kept = k
    return kept


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), RunTokenizer()])
def test_the_tokens_kept_before_a_cut_are_those_of_every_prefix_decoded_in_turn(tokenizer):
    rng = random.Random(0)
    for _ in range(150):
        tokens = list("".join(rng.choice("ab é𐍈ア!") for _ in range(rng.randint(1, 12))).encode())
        tokens = tokens[: rng.randint(1, len(tokens))]  # at times ending inside a character
        text = decoded(tokenizer, tokens)
        for cut in range(len(settled(text)) + 1):
            expected = tokens_before_one_prefix_at_a_time(tokenizer, tokens, text, cut)
            assert tokens_before(tokenizer, tokens, text, cut) == expected, (tokens, cut)


def test_a_long_answer_is_cut_with_a_few_decodes():
    class Counting(ByteTokenizer):
        calls = 0

        def decode(self, tokens):
            self.calls += 1
            return super().decode(tokens)

    tok = Counting()
    for after in ("", " and more" * 200):  # the stop at the end (a decode's last step), or before (a search's joined steps)
        tokens = list(("word " * 2000 + "STOP" + after).encode())
        tok.calls = 0
        text, kept, hit = cut_at_stop(tok, tokens, ("STOP",))
        assert (hit, kept) == ("STOP", tokens[: 5 * 2000]) and text == "word " * 2000
        assert tok.calls < 40  # a bisection, not one decode per token


def test_a_stop_before_empty_tokens_is_found_when_a_step_adds_text_as_long_as_the_stop():
    """"a", 70 tokens with no text (EOS kept under ignore_eos), then one step adds "bc": the window
    the check reads reaches back to "a"."""
    tok = CharTokenizer(96)
    a, b, c = tok.encode("abc")
    assert hits_stop(tok, [a] + [0] * 70 + [b, c], ("ab",), added=2)


def test_text_ending_three_bytes_into_a_four_byte_character_keeps_the_whole_characters_before_it():
    tokens = list("ab 𐍈𠀀".encode())[:-1]  # 𠀀 cut after three of its four bytes
    text = cut_at_stop(RunTokenizer(), tokens, ())[0]
    assert text.startswith("ab 𐍈") and set(text[len("ab 𐍈"):]) == {"\ufffd"}

