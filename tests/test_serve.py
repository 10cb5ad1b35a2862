"""`decodekit serve` through the official `openai` client, on a tiny model served in the test:
responses, streaming, n, stop, seed, logprobs, errors, admission, cancellation, and batch
invariance (a request's tokens are the same alone and among concurrent requests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from decodekit.engine import Engine  # noqa: E402
from decodekit.errors import InvalidParameter, NumericsUnavailable  # noqa: E402
from decodekit.models import CharTokenizer, LoadedModel, kernels  # noqa: E402
from decodekit.models.tiny import tiny_llama  # noqa: E402
from decodekit.serve.app import Server  # noqa: E402
from decodekit.serve.reply import FINISHED, Outbox  # noqa: E402
from decodekit.serve.request import MAX_BODY_BYTES, parse_request  # noqa: E402

MODEL = "tiny"
PROMPTS = ["hello world hello world hello", "abcabcabcabcabc", "Q: 12+12? A: 24. Q: 13+13? A:", "the cat sat on the mat"]


def tiny_model() -> LoadedModel:
    # head size 16: the one-call layer path the batcher uses; fast numerics where the CPU has the integer kernel (AVX2)
    numerics = "fast" if kernels.integer_block_matmul("q4_1") is not None else "exact"
    backend = tiny_llama(seed=0, hidden_size=64, max_position=2048, numerics=numerics, gguf_blocks=True)
    return LoadedModel(backend, CharTokenizer(96), MODEL)


class Running:
    """A server on a free loopback port, in a thread of the test process."""

    def __init__(self, model: LoadedModel, **kw):
        self.model = model
        self.server = Server(lambda: model, **kw)
        self.server.load_now()
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.web = uvicorn.Server(uvicorn.Config(self.server.app, log_level="error"))
        self.thread = threading.Thread(target=self.web.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.web.started:
            time.sleep(0.01)
        # (a request the server never ends fails in a minute, not the client's default ten)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.web.should_exit = True
        self.thread.join(timeout=10)
        self.server.scheduler.close()

    def get(self, path: str) -> tuple[int, str, dict]:
        try:
            with urllib.request.urlopen(self.url + path) as r:
                return r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(), dict(err.headers)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    saved = os.environ.get("DECODEKIT_CACHE")
    os.environ["DECODEKIT_CACHE"] = str(tmp_path_factory.mktemp("cache"))  # the tiny model's cost table goes there
    try:
        running = Running(tiny_model(), max_batch=4, max_queue=32)
    finally:
        if saved is None:
            del os.environ["DECODEKIT_CACHE"]
        else:
            os.environ["DECODEKIT_CACHE"] = saved
    yield running
    running.stop()


@pytest.fixture(scope="module")
def alone(served):
    """The reference: the same model decoding each request by itself, outside the server."""
    engine = Engine(LoadedModel(served.model.backend.clone(), served.model.tokenizer, MODEL))
    return lambda prompt, **kw: engine.generate(prompt, chat=False, **kw)


def chat(served, prompt: str, **kw):
    return served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def test_chat_and_completions_answer_as_the_engine_alone(served, alone):
    for prompt in PROMPTS[:2]:
        want = alone(prompt, max_new_tokens=20)
        got = chat(served, prompt, max_tokens=20, temperature=0)
        assert got.choices[0].message.content == want.text
        assert got.usage.completion_tokens == len(want.tokens) and got.model == MODEL
        assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        text = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert text.choices[0].text == want.text
    ids = served.model.prompt_ids(PROMPTS[0], chat=False)
    for prompt in ([PROMPTS[0]], ids, [ids]):  # one prompt: text or token ids, alone or in a list of one
        got = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == alone(PROMPTS[0], max_new_tokens=20).text


def test_top_p_beside_temperature_0_is_greedy_and_beside_a_greedy_method_a_400(served, alone):
    """OpenAI's temperature 0 decodes greedily whatever top_p says (clients send both); a request
    that names a method decoding greedily and a top_p is refused, as the Python API refuses it."""
    got = chat(served, PROMPTS[0], max_tokens=8, temperature=0, top_p=0.5)
    assert got.choices[0].message.content == alone(PROMPTS[0], max_new_tokens=8).text
    for method in ("greedy", "pld"):
        status, text = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                              "method": method, "top_p": 0.5, "max_tokens": 2})
        assert (status, json.loads(text)["error"]["param"]) == (400, "top_p")


def test_streaming_gives_the_same_text_and_the_usage(served, alone):
    want = alone(PROMPTS[0], max_new_tokens=24)
    chunks = list(chat(served, PROMPTS[0], max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_n_seeded_samples_are_plain_samplings_with_seed_plus_i(served, alone):
    got = chat(served, PROMPTS[2], max_tokens=16, temperature=0.9, seed=11, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for i, choice in enumerate(got.choices):
        assert choice.message.content == alone(PROMPTS[2], method="sample", max_new_tokens=16, temperature=0.9, seed=11 + i).text
    again = chat(served, PROMPTS[2], max_tokens=16, temperature=0.9, seed=11, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in got.choices]
    # a search draws its own samples seeded seed, seed + 1, ...: its choices are spaced 2**32 apart,
    # so that no two of them share a sample
    options = {"method": "best-of-n", "method_options": {"n": 3}}
    got = chat(served, PROMPTS[2], max_tokens=16, temperature=0.9, seed=11, n=2, extra_body=options)
    for i, choice in enumerate(got.choices):
        want = alone(PROMPTS[2], method="best-of-n", n=3, max_new_tokens=16, temperature=0.9, seed=11 + i * 2**32)
        assert choice.message.content == want.text


def test_ignore_eos_decodes_to_the_length_asked(served, alone):
    assert alone(PROMPTS[3], max_new_tokens=200).finish_reason == "eos"  # this prompt ends early by itself
    got = chat(served, PROMPTS[3], max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 200 and got.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(served, alone):
    full = alone(PROMPTS[1], max_new_tokens=30).text
    stop = full[5:7]
    got = chat(served, PROMPTS[1], max_tokens=30, temperature=0, stop=[stop])
    assert got.choices[0].message.content == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_logprobs_are_the_models_own(served):
    got = chat(served, PROMPTS[3], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    backend = served.model.backend.clone()
    tok = served.model.tokenizer
    prompt, answer = tok.encode(PROMPTS[3]), tok.encode(got.choices[0].message.content)
    logits = backend.append(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1)
    for i, entry in enumerate(content):
        assert entry.token == tok.decode([answer[i]]) and entry.bytes == list(tok.token_bytes(answer[i]))
        assert entry.logprob == pytest.approx(want[i, answer[i]].item(), abs=1e-4)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy: the best one
        assert len(entry.top_logprobs) == 3


def test_bad_requests_are_openai_error_objects(served):
    with pytest.raises(openai.BadRequestError) as err:
        chat(served, "hi", temperature=-1)
    assert err.value.status_code == 400 and "temperature" in err.value.message and err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:  # the option at fault, though the message starts elsewhere
        chat(served, "hi", max_tokens=4, extra_body={"no_such_option": 1})
    assert err.value.param == "no_such_option"
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model=MODEL, prompt=[-1], max_tokens=4)
    assert err.value.param == "prompt" and "outside the vocabulary" in err.value.message
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        chat(served, "x" * 3000, max_tokens=10)
    assert err.value.code == "context_length_exceeded"
    for extra in ({"method": "no-such-method"}, {"budget": -1, "method": "pld"}, {"no_such_option": 1}):
        with pytest.raises(openai.BadRequestError):
            chat(served, "hi", max_tokens=4, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="tool calls"):
        chat(served, "hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError) as err:  # refused, not silently greedy
        chat(served, "hi", max_tokens=4, temperature=0.7, extra_body={"greedy": True})
    assert err.value.param == "greedy" and "temperature=0.7 would be ignored" in err.value.message
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):  # not silently none
        chat(served, "hi", max_tokens=2, top_logprobs=3)
    assert parse_request({"prompt": "hi", "greedy": True}, chat=False).params == {"greedy": True}  # no OpenAI default T
    errors = {code: metric(served, f'decodekit:request_errors_total{{status="{code}"}}') for code in (404, 405)}
    status, body, _ = served.get("/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["message"] == "no route GET /v1/nothing"
    assert post(served, "/v1/models", {})[0] == 405  # a route's errors are counted as a request's are
    assert [metric(served, f'decodekit:request_errors_total{{status="{code}"}}') for code in (404, 405)] == [
        errors[404] + 1, errors[405] + 1]
    status, body = post(served, "/v1/chat/completions/", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and json.loads(body)["error"]["message"] == "no route POST /v1/chat/completions/"  # not a 307
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, message in (({"messages": ["hi"]}, "messages[0] must be an object with a role and a content, got 'hi'"),
                           ({"response_format": "json"}, "response_format must be an object such as "
                                                         '{"type": "json_object"}, got \'json\'')):
        status, body = post(served, "/v1/chat/completions", {**base, **extra})
        error = json.loads(body)["error"]
        assert status == 400 and error["message"] == message and error["param"] == next(iter(extra)), body
    # the field at fault named, though the message starts elsewhere
    for extra, param in (({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
                         ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options"),
                         ({"method": "draft", "draft_model": "self-truncated:1000"}, "draft_model"),
                         ({"method": "kvdraft", "draft_cache": "sink:4"}, "draft_cache"),
                         ({"method": "kvdraft", "draft_cache": "full"}, "draft_cache"),
                         ({"stop": ["ok", "\udcff"]}, "stop")):  # a lone surrogate: no text the model can write
        status, body = post(served, "/v1/chat/completions", {**base, **extra})
        assert status == 400 and json.loads(body)["error"]["param"] == param, (extra, body)
    for best_of, status_wanted in ((1, 200), (0, 400), (3, 400)):  # 1 is OpenAI's default: it asks for nothing
        status, body = post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": best_of})
        assert status == status_wanted, (best_of, body)
    # OpenAI's default modalities ask for what the server gives; stream options without a stream are refused, as OpenAI does
    for extra, status_wanted in (({"modalities": ["text"]}, 200), ({"modalities": ["text", "audio"]}, 400),
                                 ({"stream_options": {"include_usage": True}}, 400),
                                 ({"stream": True, "stream_options": {"include_usage": True}}, 200)):
        status, body = post(served, "/v1/chat/completions", {**base, **extra})
        assert status == status_wanted, (extra, body)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for extra, status_wanted in (({"tool_choice": "none", "tools": []}, 200), ({"tool_choice": "auto"}, 200),
                                 ({"tool_choice": "required"}, 400), ({"tool_choice": "none", "tools": [tool]}, 400),
                                 ({"function_call": "none"}, 200)):  # "none"/"auto" without tools call no tool
        status, body = post(served, "/v1/chat/completions", {**base, **extra})
        assert status == status_wanted, (extra, body)
    assert served.client.models.retrieve(MODEL).id == MODEL
    # null is a field not given; OpenAI's metadata fields are ignored as user is; others are named
    for extra, status_wanted in (({"safety_identifier": "u1", "prompt_cache_key": "k", "top_k": None,
                                   "reasoning_effort": None, "some_future_field": None}, 200),
                                 ({"reasoning_effort": "low"}, 400)):
        status, body = post(served, "/v1/chat/completions", {**base, **extra})
        assert status == status_wanted, (extra, body)
    assert "reasoning effort (reasoning_effort) is not supported" in body
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-9' does not exist"):
        served.client.models.retrieve("gpt-9")



def post(served, path: str, body: bytes | dict) -> tuple[int, str]:
    """A raw POST (what the openai client would refuse to send), its status and body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(served.url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metric(served, series: str) -> float:
    """The value of one series of /metrics (its name with labels), 0 while it has none."""
    line = next((l for l in served.get("/metrics")[1].splitlines() if l.startswith(series + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def server_errors(served) -> float:
    return metric(served, 'decodekit:request_errors_total{status="500"}')


def test_values_no_request_should_send_are_400s_never_500s(served):
    """Values that pass a type check but break float32, 64-bit seeds or the server's machine: each a
    400 error object (in a stream: an error event, then [DONE]); none a 500 or a dropped connection."""
    before = server_errors(served)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "the the the the"}], "max_tokens": 4}
    nested = b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert post(served, "/v1/chat/completions", nested)[0] == 400
    digits = json.dumps({**base, "temperature": 0.7})[:-1].encode() + b', "seed": 1' + b"0" * 1000 + b"}"
    status, text = post(served, "/v1/chat/completions", digits)  # said by its size, not in a thousand digits
    assert status == 400 and "got an integer of 3322 bits" in json.loads(text)["error"]["message"]
    import http.client

    conn = http.client.HTTPConnection(*served.url.removeprefix("http://").split(":"), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()  # the body is never sent: the answer comes from the declared size
    response = conn.getresponse()
    assert response.status == 413 and "more than the" in json.loads(response.read())["error"]["message"]
    conn.close()
    refused = {
        "seed": {"seed": 2**64, "temperature": 0.7},
        "a temperature too large for a float": {"temperature": 10**400},
        "a sampler field in method_options": {"method": "pld", "method_options": {"temperature": 0.5}},
        "extreme penalty": {"presence_penalty": -1e308, "temperature": 1.0, "seed": 1},
        "beam's length penalty": {"method": "beam", "temperature": 0, "length_penalty": 1e308},
        "arms not a list": {"method": "auto", "temperature": 0, "arms": 5},
        "a draft model by path": {"method": "draft", "temperature": 0, "draft_model": "/etc/passwd"},
        "a drafter file": {"method": "eagle", "temperature": 0, "drafter": "/nonexistent"},
        "a judge model": {"method": "best-of-n", "scorer": "judge", "judge_model": 5},
        "an answer extractor": {"method": "self-consistency", "answer_start": "x"},
        "a truncation too deep": {"method": "draft", "temperature": 0, "draft_model": "self-truncated:100000"},
        "a role": {"messages": [{"role": "wizard", "content": "hi"}]},
        "a flag": {"stream": "yes"},
    }
    local = ("a draft model by path", "a drafter file", "a judge model", "an answer extractor")  # never opened
    for what, extra in refused.items():
        status, text = post(served, "/v1/chat/completions", {**base, **extra})
        assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error", (what, status, text)
        assert ("a request cannot choose" in json.loads(text)["error"]["message"]) == (what in local), (what, text)
    # found while decoding, in a stream: the error as an event, then the end of the stream
    endless = {"guided_grammar": 'start: a\na: "x" a\n'}  # a text that never ends, found out while decoding
    status, text = post(served, "/v1/chat/completions", {**base, **endless, "stream": True})
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "structured decoding failed" in error["message"] and set(error) == {"message", "type", "param", "code"}
    # a temperature so near 0 that logits / T overflow float32 (or T is below its normal numbers):
    # the limit, the most likely token, as greedy decoding picks it
    greedy = json.loads(post(served, "/v1/chat/completions", {**base, "temperature": 0})[1])["choices"][0]
    for tiny in (1e-38, 1e-45):
        status, text = post(served, "/v1/chat/completions", {**base, "temperature": tiny, "seed": 1})
        assert status == 200 and json.loads(text)["choices"][0]["message"] == greedy["message"], (tiny, text)
    # the largest seed: choice i samples with seed + i, wrapping around at 2**64
    status, text = post(served, "/v1/chat/completions", {**base, "seed": 2**64 - 1, "n": 2, "temperature": 0.7})
    assert status == 200 and len(json.loads(text)["choices"]) == 2
    assert server_errors(served) == before
    assert served.get("/health")[0] == 200


def test_lone_surrogates_in_a_constraint_or_a_field_name_are_400s_never_500s(served):
    """JSON may spell a lone surrogate ("\\ud800"), which UTF-8 cannot encode: in a constraint it is
    refused as the request's fault, and an error naming it (an unknown field called so) is still answered."""
    before = server_errors(served)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    for extra, param in (({"guided_regex": "a\ud800"}, "guided_regex"), ({"guided_choice": ["a", "\udcff"]}, "guided_choice"),
                         ({"guided_grammar": 'start: "\ud800"'}, "guided_grammar"), ({"x\ud800": 1}, "x\\ud800"),
                         # a schema as text, nested past what Python's json reads (the body itself is not)
                         ({"guided_json": '{"items":' * 5000 + "{}" + "}" * 5000}, "guided_json")):
        status, text = post(served, "/v1/chat/completions", {**base, **extra})
        error = json.loads(text)["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, (extra, text)
    assert "not valid UTF-8" in json.loads(post(served, "/v1/chat/completions", {**base, "guided_regex": "\ud800"})[1])["error"]["message"]
    assert server_errors(served) == before


def test_health_models_and_metrics(served):
    status, body, _ = served.get("/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    for path in ("/health", "/v1/models"):  # what health checkers send
        with urllib.request.urlopen(urllib.request.Request(served.url + path, method="HEAD")) as r:
            assert r.status == 200 and r.read() == b""
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].numerics == served.server.numerics
    assert models[0].max_model_len == 2048  # the tiny model's context (max_position), as vLLM reports it
    counts = ("decodekit:time_to_first_token_seconds_count", "decodekit:e2e_request_latency_seconds_count",
              "decodekit:time_per_output_token_seconds_count")
    before = [metric(served, c) for c in counts]
    chat(served, PROMPTS[0], max_tokens=5, temperature=0)
    for _ in chat(served, PROMPTS[0], max_tokens=5, temperature=0, stream=True):
        pass
    chat(served, PROMPTS[0], max_tokens=5, extra_body={"method": "best-of-n"})
    status, text, _ = served.get("/metrics")
    assert status == 200
    assert "decodekit:generation_tokens_total" in text and "decodekit:batched_passes_total" in text
    # every request that produced a token has its time to first token, streamed or not, search or not
    assert [metric(served, c) - b for c, b in zip(counts, before)] == [3, 3, 3]


def test_speculative_methods_are_served_too(served, alone):
    for method in ("pld", "suffix", "recycling"):
        want = alone(PROMPTS[1], method="greedy", max_new_tokens=30).text
        got = chat(served, PROMPTS[1], max_tokens=30, extra_body={"method": method, "budget": 4})
        assert got.choices[0].message.content == want, method


def test_a_requests_tokens_do_not_depend_on_the_batch(served, alone):
    """Twelve requests at once (greedy, seeded sampling, speculative; prompts of several lengths,
    one longer than a prefill chunk) give exactly what each gives alone."""
    cases = []
    for i, prompt in enumerate(PROMPTS + [PROMPTS[1] * 6]):
        cases.append((prompt, {"temperature": 0}, {}))
        cases.append((prompt, {"temperature": 0.8, "seed": i}, {"method": "sample", "temperature": 0.8, "seed": i}))
    cases += [(PROMPTS[0], {"extra_body": {"method": "pld", "budget": 6}}, {"method": "pld", "budget": 6}),
              (PROMPTS[2], {"extra_body": {"method": "recycling", "temperature": 0.7, "seed": 3}},
               {"method": "recycling", "temperature": 0.7, "seed": 3})]
    wants = [alone(p, max_new_tokens=40, **kw).text for p, _, kw in cases]
    before = served.server.scheduler.batcher.rows
    with ThreadPoolExecutor(len(cases)) as pool:
        gots = list(pool.map(lambda c: chat(served, c[0], max_tokens=40, **c[1]).choices[0].message.content, cases))
    assert gots == wants
    passes = served.server.scheduler.batcher
    assert passes.rows > before  # they went through the batcher


def test_a_full_server_answers_503_with_retry_after():
    running = Running(tiny_model(), max_batch=1, max_queue=1)
    try:
        def ask(_):
            try:
                chat(running, PROMPTS[0], max_tokens=1900, temperature=0, extra_body={"ignore_eos": True})
                return 200, None
            except openai.APIStatusError as err:
                return err.status_code, err.response.headers.get("retry-after")
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(ask, range(4)))
        assert sorted(s for s, _ in results).count(503) >= 1 and (200, None) in results
        assert all(retry == "1" for s, retry in results if s == 503)
        # more choices than the server ever holds: no retry would help, so not a 503
        with pytest.raises(openai.BadRequestError, match=r"n=3 choices exceed what this server holds at once "
                                                         r"\(1 running \+ 1 waiting\)") as refused:
            chat(running, PROMPTS[0], max_tokens=4, n=3)
        assert refused.value.body["param"] == "n"
    finally:
        running.stop()


def cancelled_count(served) -> float:
    """The metrics' count of choices whose client left."""
    return metric(served, 'decodekit:request_success_total{finished_reason="cancelled"}')


def test_browser_pages_may_call_the_api_only_from_the_origins_allowed():
    """CORS: a preflight from an allowed origin is answered with its headers; without the option,
    or from another origin, a browser gets none (and refuses the call)."""
    def preflight(running, origin: str) -> dict:
        request = urllib.request.Request(running.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        try:
            with urllib.request.urlopen(request) as reply:
                return dict(reply.headers)
        except urllib.error.HTTPError as err:
            return dict(err.headers)

    model = tiny_model()
    for origins, origin, allowed in (((), "http://ui.example", False), (("http://ui.example",), "http://ui.example", True),
                                     (("http://ui.example",), "http://evil.example", False)):
        running = Running(model, max_batch=1, max_queue=1, allowed_origins=origins)
        try:
            headers = preflight(running, origin)
            assert (headers.get("access-control-allow-origin") == origin) is allowed, (origins, origin, headers)
            # a text/plain POST needs no preflight: a page not allowed is refused before decoding
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            request = urllib.request.Request(running.url + "/v1/completions", data=body, method="POST",
                                             headers={"Origin": origin, "Content-Type": "text/plain;charset=UTF-8"})
            try:
                with urllib.request.urlopen(request) as reply:
                    status = reply.status
            except urllib.error.HTTPError as err:
                status, error = err.code, json.loads(err.read())["error"]
                assert "--allowed-origins" in error["message"]
            assert status == (200 if allowed else 403), (origins, origin)
        finally:
            running.stop()


def test_a_client_that_goes_away_frees_its_slot(served):
    """Streamed or not, a request whose client leaves stops, frees its slot and is counted as
    cancelled (just after it stops: its future's callback)."""
    scheduler = served.server.scheduler
    before = cancelled_count(served)
    stream = chat(served, PROMPTS[0], max_tokens=1900, temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client leaves after the first chunk
    impatient = served.client.with_options(timeout=0.2)
    with pytest.raises(openai.APITimeoutError):  # the client leaves before the answer
        impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=1900, temperature=0, extra_body={"ignore_eos": True})
    deadline = time.time() + 10
    while (scheduler.running or cancelled_count(served) < before + 2) and time.time() < deadline:
        time.sleep(0.02)
    assert scheduler.running == 0
    assert cancelled_count(served) == before + 2


@contextlib.contextmanager
def scheduler_of(**limits):
    """A scheduler (no HTTP) over the tiny model, closed at the end: (model, scheduler)."""
    from decodekit.serve.scheduler import Scheduler

    model = tiny_model()
    scheduler = Scheduler(model, **limits)
    try:
        yield model, scheduler
    finally:
        scheduler.close()


def started(scheduler, deadline_s: float = 30) -> None:
    """Until a submitted choice runs (the pool's thread takes it a moment later)."""
    deadline = time.time() + deadline_s
    while scheduler.running == 0 and time.time() < deadline:
        time.sleep(0.005)


def slot_holder(prompt: list[int]):
    """A greedy choice that holds its slot until it is cancelled (1,900 tokens, past any EOS)."""
    from decodekit.serve.scheduler import Job

    return Job(prompt, "greedy", {}, 1900, ignore_eos=True)


def test_a_closed_scheduler_refuses_new_choices_and_keeps_its_slots():
    """After close() a submit is refused at once (it used to take a slot, then fail to start on the
    closed batcher: the slot lost, the running count stuck, the future never answered)."""
    from decodekit.serve.scheduler import ShuttingDown

    with scheduler_of(max_batch=2, max_queue=2) as (model, scheduler):
        scheduler.close()
        with pytest.raises(ShuttingDown):
            scheduler.submit([slot_holder([1, 2, 3])])
        assert (scheduler.running, scheduler.waiting, len(scheduler._free)) == (0, 0, 2)


def test_a_request_cancelled_while_it_waits_gives_its_queue_place_back_at_once(alone):
    """A waiting choice whose client left frees its queue place then, not when a slot frees: the
    next client is admitted (it got a 503), and the cancelled choice never takes a slot."""
    from decodekit.serve.scheduler import Job, Overloaded

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        long, waiting, later = (slot_holder(prompt), Job(prompt, "greedy", {}, 4),
                                Job(prompt, "greedy", {}, 6))
        (running,) = scheduler.submit([long])
        started(scheduler)
        (queued,) = scheduler.submit([waiting])
        with pytest.raises(Overloaded):
            scheduler.submit([later])
        scheduler.cancel([waiting])
        assert (scheduler.running, scheduler.waiting) == (1, 0)
        assert queued.done()  # answered at once, and dropped from the queue (it stayed in the pool's until a slot freed)
        (admitted,) = scheduler.submit([later])
        scheduler.cancel([long])
        assert running.result(timeout=60).generation.finish_reason == "cancelled"
        assert queued.result(timeout=60).generation.finish_reason == "cancelled"
        assert waiting.started is None and not queued.result().generation.tokens  # it never took a slot
        assert admitted.result(timeout=60).generation.tokens == alone(prompt, max_new_tokens=6).tokens
        assert (scheduler.running, scheduler.waiting) == (0, 0)


def test_a_request_whose_choices_fill_every_slot_and_queue_place_is_admitted(alone):
    """Choices beyond running + waiting can never fit (refused); exactly that many fit an idle server."""
    from decodekit.errors import InvalidParameter
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        with pytest.raises(InvalidParameter, match="n=3 choices exceed"):
            scheduler.submit([Job(prompt, "greedy", {}, 4) for _ in range(3)])
        futures = scheduler.submit([Job(prompt, "greedy", {}, 4) for _ in range(2)])  # one runs, one waits
        want = alone(prompt, max_new_tokens=4).tokens
        assert [f.result(timeout=60).generation.tokens for f in futures] == [want, want]


def test_waiting_choices_start_oldest_first(alone):
    """The queue is first come, first served: when the slot frees, the choice that waited longest starts."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=2) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        long = slot_holder(prompt)
        (running,) = scheduler.submit([long])
        started(scheduler)
        older, newer = Job(prompt, "greedy", {}, 4), Job(prompt, "greedy", {}, 4)
        futures = scheduler.submit([older]) + scheduler.submit([newer])
        scheduler.cancel([long])
        for future in futures:
            future.result(timeout=60)
        assert older.started < newer.started


def test_a_prompt_goes_to_the_idle_slot_whose_cache_shares_most_of_it(alone):
    """Of two idle slots, the one that last read this prompt's start takes it (not the one freed last,
    whose cache the other conversation's next turn would then miss; without the prompt cache,
    which would hand it back)."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=2, max_queue=0, prompt_cache_mib=0) as (model, scheduler):
        first, other = (model.tokenizer.encode(p) for p in ("tell me about cats and dogs", "a different prompt"))
        # both run at once; the first ends long before the other, whose slot is freed last
        done = scheduler.submit([Job(first, "greedy", {}, 2), Job(other, "greedy", {}, 40, ignore_eos=True)])
        answers = [future.result(timeout=60).generation.tokens for future in done]
        # each conversation's next turn in turn: each finds its own slot's cache (the other's is left alone)
        for prompt, answer in ((first, answers[0]), (other, answers[1])):
            before = scheduler.prefix_tokens
            follow = prompt + answer + model.tokenizer.encode(" and fish?")
            (again,) = scheduler.submit([Job(follow, "greedy", {}, 4)])
            assert again.result(timeout=60).generation.tokens == alone(follow, max_new_tokens=4).tokens
            assert scheduler.prefix_tokens - before >= len(prompt)


def test_the_prefix_counter_sums_the_tokens_every_request_took_from_a_slot():
    """``prefix_tokens`` (the metric decodekit:prefix_cache_hit_tokens_total) is a running total:
    each request adds the prefix it took from its slot's cache, whatever earlier ones took."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        slot = scheduler._free[0].model.backend
        prompt, taken = model.tokenizer.encode(PROMPTS[3]), []
        for _ in range(3):  # a chat's turns: each prompt starts with the last one and its answer
            taken.append(slot.shared_prefix(prompt))
            (future,) = scheduler.submit([Job(prompt, "greedy", {}, 4)])
            prompt = prompt + future.result(timeout=60).generation.tokens + model.tokenizer.encode(" and?")
        assert taken[0] == 0 and taken[1] > 0 and taken[2] > taken[1]
        assert scheduler.prefix_tokens == sum(taken)


def test_a_damaged_model_found_while_decoding_is_the_servers_fault_not_the_request():
    """A model whose logits are not finite (a damaged weight) fails each request with a 500
    server_error, streamed or not (a stream fails before its first text: the status says so, as
    without stream); it was a 400 telling the client its request was bad."""
    backend = tiny_llama(seed=0)
    backend.weights.final_norm[3] = float("nan")
    running = Running(LoadedModel(backend, CharTokenizer(96), MODEL), max_batch=1, max_queue=1)
    try:
        with pytest.raises(openai.InternalServerError, match="not finite") as failed:
            chat(running, PROMPTS[0], max_tokens=4)
        assert failed.value.body["type"] == "server_error"
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}).encode()
        request = urllib.request.Request(running.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as streamed:
            urllib.request.urlopen(request)
        error = json.loads(streamed.value.read())["error"]
        assert streamed.value.code == 500 and error["type"] == "server_error" and "not finite" in error["message"]
        assert metric(running, 'decodekit:request_errors_total{status="500"}') == 2
        assert running.get("/health")[0] == 200
    finally:
        running.stop()


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_soak_mixed_valid_malformed_and_vanishing_clients(served, alone):
    """A few hundred requests from 8 clients at once: valid ones (each must equal its request run
    alone), malformed ones (each an OpenAI error object), and clients that leave mid-stream. At the
    end the server is healthy, idle, and its memory has not grown."""
    import http.client

    host, port = served.url.removeprefix("http://").split(":")
    valid = [(p, {"temperature": 0}, {}) for p in PROMPTS] + [
        (p, {"temperature": 0.8, "seed": i}, {"method": "sample", "temperature": 0.8, "seed": i}) for i, p in enumerate(PROMPTS)]
    wants = [alone(p, max_new_tokens=24, **kw).text for p, _, kw in valid]
    malformed = [b"{not json", b"[]", b'{"messages": []}', b'{"messages": [{"role": "user", "content": 5}]}',
                 b'{"messages": [{"role": "user", "content": "hi"}], "n": 99}',
                 b'{"messages": [{"role": "user", "content": "hi"}], "top_k": "many"}']

    def client(worker: int) -> list[str]:
        problems = []
        for i in range(worker, 240, 8):
            kind = i % 3
            if kind == 0:
                case = i % len(valid)
                prompt, kw, _ = valid[case]
                text = chat(served, prompt, max_tokens=24, **kw).choices[0].message.content
                if text != wants[case]:
                    problems.append(f"request {i}: {text!r} != {wants[case]!r}")
            elif kind == 1:
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request("POST", "/v1/chat/completions", malformed[i % len(malformed)], {"Content-Type": "application/json"})
                response = conn.getresponse()
                body = json.loads(response.read())
                if response.status != 400 or "message" not in body.get("error", {}):
                    problems.append(f"request {i}: {response.status} {body}")
                conn.close()
            else:
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i % 4]}], "max_tokens": 1500,
                        "stream": True, "ignore_eos": True, "temperature": 0}
                conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
                conn.getresponse().read(200)
                conn.close()  # gone mid-stream
        return problems

    client(0)  # warm-up: what the first requests allocate for good is not a leak
    before = rss_mb()
    with ThreadPoolExecutor(8) as pool:
        problems = [p for found in pool.map(client, range(8)) for p in found]
    assert problems == []
    scheduler = served.server.scheduler
    deadline = time.time() + 20
    while (scheduler.running or scheduler.waiting) and time.time() < deadline:
        time.sleep(0.05)
    assert scheduler.running == 0 and scheduler.waiting == 0
    assert served.get("/health")[0] == 200
    assert rss_mb() - before < 64


def test_serve_command_refuses_a_taken_port_and_a_missing_model_in_one_line(capsys):
    from decodekit.interfaces.cli import main

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", "/no/such/model", "--port", port]) == 2
        assert main(["serve", "--model", "smollm2-135m", "--port", port]) in (2,)  # taken (or model not installed)
        assert main(["serve", "--max-batch", "0"]) == 2
        assert main(["serve", "--stream-interval-ms", "-1"]) == 2
    finally:
        taken.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("decodekit:")]
    assert len(err) == 4 and all(line.startswith("decodekit: error:") for line in err)
    assert "--max-batch must be >= 1" in err[2]
    assert "--stream-interval-ms must be between 0 and 1000, got -1" in err[3]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["serve", "--stream-interval-ms", "1001"], "--stream-interval-ms must be between 0 and 1000, got 1001"),
    (["serve", "--stream-interval-ms", "nan"], "--stream-interval-ms must be between 0 and 1000, got nan"),
    # an origin no browser sends would leave the flag without effect, unsaid
    (["serve", "--allowed-origins", "https://a.example,localhost:3000"], "'localhost:3000' is not a web origin"),
    (["serve", "--allowed-origins", "http://localhost:3000/"], "'http://localhost:3000/' is not a web origin"),
    (["serve", "--allowed-origins", " , "], "--allowed-origins: ' , ' names no origin"),
])
def test_serve_command_refuses_bad_limits_before_it_looks_for_the_model(argv, message, capsys, monkeypatch):
    """Each limit is checked first, in one line (exit code 2): a queue of 0 or an interval past a second
    (or NaN) never reaches the model, let alone a socket."""
    from decodekit.interfaces.cli import main

    def refuse(name):
        raise AssertionError("the model was looked for before the bad flag was refused")

    monkeypatch.setattr("decodekit.models.loading.resolve_model_folder", refuse)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("decodekit: error: ") and message in err[0]


def test_serve_flags_default_to_what_the_help_and_readme_say():
    """README and --help: 127.0.0.1:8000, --max-batch 8, the queue and the 20 ms stream interval of
    decodekit.serve, no allowed origins, and no --numerics (fast where the model and CPU allow it)."""
    from decodekit.interfaces.cli import build_parser
    from decodekit.serve import MAX_BATCH, MAX_QUEUE

    args = build_parser(commands=["serve"]).parse_args(["serve"])
    assert (args.host, args.port, args.max_batch, args.max_queue) == ("127.0.0.1", 8000, 8, MAX_QUEUE)
    assert MAX_BATCH == 8
    assert args.stream_interval_ms is None and args.allowed_origins == "" and args.numerics is None
    assert (args.kv_cache, args.dtype, args.backend, args.model) == ("full", "float32", "auto", None)


def test_serve_loads_fast_numerics_by_default_and_falls_back_to_exact_with_a_note(monkeypatch, capsys):
    """Without --numerics the server asks for fast first and serves exact (saying so) where fast cannot
    run; --numerics names the one it loads."""
    import argparse

    from decodekit.serve.cli import load_for_serving

    asked = []

    def load_model(model, *, numerics, **kwargs):
        asked.append(numerics)
        if numerics == "fast" and fast_refused:
            raise NumericsUnavailable("no fast numerics here")
        return numerics

    monkeypatch.setattr("decodekit.models.load_model", load_model)
    args = argparse.Namespace(model=None, backend="auto", dtype="float32", kv_cache="full", numerics=None)
    fast_refused = False
    assert load_for_serving(args) == "fast" and asked == ["fast"]
    fast_refused, asked[:] = True, []
    assert load_for_serving(args) == "exact" and asked == ["fast", "exact"]
    assert "no fast numerics here; serving the exact numerics" in capsys.readouterr().err
    asked[:] = []
    assert load_for_serving(argparse.Namespace(**{**vars(args), "numerics": "exact"})) == "exact" and asked == ["exact"]


def test_an_error_of_the_cache_or_the_model_is_not_retried_in_exact_numerics(monkeypatch, capsys):
    """Only the fast numerics being unavailable falls back: a cache the model cannot hold fails in
    either numerics, once, in its own words (it was said twice, after a second load)."""
    import argparse

    from decodekit.serve.cli import load_for_serving

    asked = []

    def load_model(model, numerics, **kwargs):
        asked.append(numerics)
        raise InvalidParameter("kv cache sink:4,window:99999 needs up to 112533 entries")

    monkeypatch.setattr("decodekit.models.load_model", load_model)
    args = argparse.Namespace(model=None, backend="auto", dtype="float32", kv_cache="sink:4,window:99999", numerics=None)
    with pytest.raises(InvalidParameter, match="needs up to 112533 entries"):
        load_for_serving(args)
    assert asked == ["fast"] and capsys.readouterr().err == ""


def test_the_exact_fallback_loads_the_model_as_asked_but_for_its_numerics(monkeypatch, capsys):
    """Falling back from fast to exact changes the numerics only: the model, backend, dtype and kv
    cache asked for are those of the first try."""
    import argparse

    from decodekit.serve.cli import load_for_serving

    asked = []

    def load_model(model, **kwargs):
        asked.append((model, kwargs))
        if kwargs["numerics"] == "fast":
            raise NumericsUnavailable("no fast numerics here")
        return kwargs["numerics"]

    monkeypatch.setattr("decodekit.models.load_model", load_model)
    args = argparse.Namespace(model="some-model", backend="native", dtype="bfloat16", kv_cache="int8", numerics=None)
    assert load_for_serving(args) == "exact"
    (first, fast), (second, exact) = asked
    assert first == second == "some-model" and fast == {**exact, "numerics": "fast"}
    assert exact == {"backend": "native", "dtype": "bfloat16", "numerics": "exact", "kv_cache": "int8"}


class _ServerMade(Exception):
    pass


def _serve_until_the_server_is_made(monkeypatch, argv):
    """``decodekit serve ARGV`` up to the Server it makes, which is not run: what was looked up, in
    order, and the Server's settings (or main's exit status where it ended before)."""
    from decodekit.interfaces.cli import main
    from decodekit.serve import app as serve_app
    from decodekit.serve import cli as serve_cli

    steps, made = [], {}

    def listen(host, port):
        steps.append(("listen", host, port))
        return object()  # the Server is made before the socket is used

    def server(load, **kwargs):
        made.update(kwargs)
        raise _ServerMade

    monkeypatch.setattr("decodekit.models.loading.resolve_model_folder", lambda name: steps.append(("model", name)))
    monkeypatch.setattr(serve_cli, "listen", listen)
    monkeypatch.setattr(serve_app, "Server", server)
    try:
        status = main(["serve", *argv])
    except _ServerMade:
        status = None
    return steps, made, status


def test_the_serve_command_hands_its_flags_to_the_server_after_finding_the_model(monkeypatch):
    """The limits and the comma-separated origins (blanks trimmed, empty items dropped) reach the
    Server as given; --stream-interval-ms is in milliseconds; the model is found before anything
    listens."""
    from decodekit.serve import MAX_BATCH, MAX_QUEUE, STREAM_INTERVAL_S

    steps, made, status = _serve_until_the_server_is_made(monkeypatch, [
        "--model", "m", "--host", "0.0.0.0", "--port", "0", "--max-batch", "3", "--max-queue", "5",
        "--allowed-origins", " https://a.example , ,HTTP://B.example:8080 ", "--stream-interval-ms", "500"])
    assert status is None and steps == [("model", "m"), ("listen", "0.0.0.0", 0)]
    assert (made["max_batch"], made["max_queue"], made["stream_interval_s"]) == (3, 5, 0.5)
    assert made["allowed_origins"] == ["https://a.example", "http://b.example:8080"]  # as a browser spells them
    _, made, _ = _serve_until_the_server_is_made(monkeypatch, [])
    assert (made["max_batch"], made["max_queue"], made["stream_interval_s"]) == (MAX_BATCH, MAX_QUEUE, STREAM_INTERVAL_S)
    assert made["allowed_origins"] == []


def test_a_bad_kv_cache_spelling_is_one_line_before_the_model_is_looked_for(monkeypatch, capsys):
    """A misspelt --kv-cache is its own error (exit code 2), not a reason to fall back from the fast
    numerics once the model loads."""
    steps, made, status = _serve_until_the_server_is_made(monkeypatch, ["--kv-cache", "int9"])
    assert status == 2 and steps == [] and made == {}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("decodekit: error: ") and "int9" in err[0]


def test_a_port_past_65535_is_one_line(monkeypatch, capsys):
    from decodekit.interfaces.cli import main
    from decodekit.serve.cli import listen

    with pytest.raises(InvalidParameter, match="cannot listen on 127.0.0.1:70000"):
        listen("127.0.0.1", 70000)
    monkeypatch.setattr("decodekit.models.loading.resolve_model_folder", lambda name: None)
    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("decodekit: error: cannot listen on 127.0.0.1:70000")


def test_the_server_listens_on_an_ipv6_address_too():
    """--host ::1 (or ::) is an address to listen on like 127.0.0.1, and the start-up line's URL puts
    it in brackets."""
    from decodekit.serve.cli import base_url, listen

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 on this machine")
    for host, url in (("127.0.0.1", "http://127.0.0.1:{}/v1"), ("::1", "http://[::1]:{}/v1")):
        sock = listen(host, 0)
        try:
            port = sock.getsockname()[1]
            assert base_url(sock) == url.format(port)
            with socket.create_connection((host, port), timeout=5):
                sock.accept()[0].close()
        finally:
            sock.close()


@pytest.fixture
def signal_handlers():
    """The shutdown signals' handlers as they were before the test: shut_down_on_signals installs its
    own for the process, and one left behind turns a later test's Ctrl-C into a server's shutdown."""
    from decodekit.serve.cli import SHUTDOWN_SIGNALS

    numbers = [getattr(signal, name) for name in SHUTDOWN_SIGNALS]
    saved = {number: signal.getsignal(number) for number in numbers}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_a_second_signal_stops_waiting_and_a_sigint_ignored_from_the_start_stays_ignored(capsys, monkeypatch,
                                                                                         signal_handlers):
    """SIGTERM or SIGINT: the first asks uvicorn to finish the requests in progress, and stops those
    still running a second before its grace ends; a second signal stops them at once and the server
    soon after; a SIGINT the process was started ignoring (a background job) is left ignored. The
    handler itself (on the main thread, which runs the requests) only sets flags: the rest, its
    message too, is left to timer threads."""
    from types import SimpleNamespace

    from decodekit.serve import cli as serve_cli

    scheduled = []  # what the handler leaves to timer threads: (seconds, action)
    monkeypatch.setattr(serve_cli, "later", lambda seconds, action: scheduled.append((seconds, action)))
    stopped = []
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    web = SimpleNamespace(should_exit=False, force_exit=False)
    serve_cli.shut_down_on_signals(web, lambda: stopped.append(True), loading=lambda: False)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    handler = signal.getsignal(signal.SIGTERM)
    handler(signal.SIGTERM, None)
    assert web.should_exit and not web.force_exit and not stopped
    # a second before the grace's end, the answers stopped; at once, the message
    assert [seconds for seconds, _ in scheduled] == [serve_cli.SHUTDOWN_GRACE_S - 1, 0]
    for _, action in scheduled:
        action()
    assert stopped == [True]
    scheduled.clear()
    handler(signal.SIGTERM, None)  # the second: the answers stopped at once, the server soon after
    assert [seconds for seconds, _ in scheduled] == [0, serve_cli.STOP_NOW_S] and not web.force_exit
    for _, action in scheduled:
        action()
    assert stopped == [True, True] and web.force_exit
    scheduled.clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored: Ctrl-C shuts down too
    web = SimpleNamespace(should_exit=False, force_exit=False)
    serve_cli.shut_down_on_signals(web, lambda: None, loading=lambda: False)
    signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    assert web.should_exit and not web.force_exit
    for _, action in scheduled:
        action()
    err = capsys.readouterr().err
    assert err.count("SIGTERM, shutting down") == 1 and err.count("SIGINT, shutting down") == 1
    monkeypatch.undo()
    ran = threading.Event()
    serve_cli.later(0, ran.set)  # on a thread of its own, never the signal handler's (the main thread)
    assert ran.wait(10)


def test_a_signal_while_the_model_loads_stops_the_load_itself(monkeypatch, signal_handlers):
    """No answers to finish yet, and the main thread is the one loading: the signal interrupts it
    there (a KeyboardInterrupt naming the signal), instead of waiting for the load to end."""
    from types import SimpleNamespace

    from decodekit.serve import cli as serve_cli

    scheduled = []
    monkeypatch.setattr(serve_cli, "later", lambda seconds, action: scheduled.append((seconds, action)))
    web = SimpleNamespace(should_exit=False, force_exit=False)
    serve_cli.shut_down_on_signals(web, lambda: pytest.fail("no answers to stop"), loading=lambda: True)
    with pytest.raises(KeyboardInterrupt, match="^SIGTERM, shutting down"):
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert web.should_exit and not scheduled


def test_answers_stopped_by_a_shutdown_end_as_503s_a_stream_with_its_error_event():
    """Server.stop_answers (the end of a shutdown's grace): a stream in progress ends with an error
    event and [DONE], never a connection cut mid-text; a whole answer in progress and a new request
    are 503s with code server_shutting_down; text posted once the event loop has closed is dropped."""
    from decodekit.serve.scheduler import Job, ShuttingDown

    running = Running(tiny_model(), max_batch=2, max_queue=4)
    try:
        long = {"prompt": "hello", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(running.url + "/v1/completions", json.dumps({**long, "stream": True}).encode(),
                                         {"Content-Type": "application/json"})
        with ThreadPoolExecutor(1) as pool, urllib.request.urlopen(request) as stream:
            whole = pool.submit(post, running, "/v1/completions", long)
            assert stream.readline().startswith(b"data: {")
            deadline = time.perf_counter() + 30
            while running.server.scheduler.running < 2 and time.perf_counter() < deadline:
                time.sleep(0.01)
            assert running.server.scheduler.running == 2  # both decoding (1,900 tokens take a while)
            running.server.stop_answers()
            events = [line for line in stream.read().decode().split("\n") if line]
            status, body = whole.result(timeout=60)
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
        assert events[-1] == "data: [DONE]"
        assert status == 503 and json.loads(body)["error"]["code"] == "server_shutting_down"
        status, body = post(running, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and json.loads(body)["error"]["code"] == "server_shutting_down"
        # a request read while the answers were stopped (past the server's first check) is refused too
        with pytest.raises(ShuttingDown):
            running.server.scheduler.submit([Job([1, 2], "greedy", {}, 2)])
    finally:
        running.stop()
    from decodekit.serve.errors import ApiError

    loading = Server(tiny_model)  # stopped before its model loaded: refused as shutting down, not as loading
    loading.stop_answers()
    with pytest.raises(ApiError) as refused_early:
        loading.ready()
    assert (refused_early.value.status, refused_early.value.code) == (503, "server_shutting_down")
    import asyncio

    loop = asyncio.new_event_loop()
    loop.close()
    outbox = Outbox(loop, 0.0)
    outbox.post(outbox.channel(), (0, "text"))  # nobody reads it: no error either


def test_the_outbox_hands_over_a_first_text_and_an_end_at_once_and_gathers_the_rest():
    """What a stream writes when: a choice's first text at once (time to first token), later text
    gathered for the interval (here longer than the test), a choice's end at once and with
    everything posted before it, in order; with interval 0, everything at once."""
    import asyncio

    async def main():
        loop = asyncio.get_running_loop()
        channel = Outbox(loop, interval_s=3600.0).channel()

        async def post(*items):  # from another thread, as a request thread does
            await loop.run_in_executor(None, lambda: [channel.post(item) for item in items])

        await post((0, "a"))
        assert await asyncio.wait_for(channel.take(), 10) == [(0, "a")]
        # three posts before the loop can hand anything over (from a thread, the loop could run the
        # hand-over that "x" asks for between "x" and "c", and "c" would rightly wait the interval)
        for item in ((0, "b"), (1, "x"), (0, "c")):  # choice 1's first text brings choice 0's along
            channel.post(item)
        assert await asyncio.wait_for(channel.take(), 10) == [(0, "b"), (1, "x"), (0, "c")]
        await post((0, "d"), (1, "y"))
        with pytest.raises(asyncio.TimeoutError):  # neither is a first text: they wait for the interval
            await asyncio.wait_for(channel.take(), 0.3)
        await post((1, FINISHED))
        assert await asyncio.wait_for(channel.take(), 10) == [(0, "d"), (1, "y"), (1, FINISHED)]

        every = Outbox(loop, interval_s=0.0).channel()
        for item in ((0, "a"), (0, "b"), (0, FINISHED)):
            await loop.run_in_executor(None, every.post, item)
            assert await asyncio.wait_for(every.take(), 10) == [item]

    asyncio.run(main())


@pytest.mark.real_model
def test_serve_command_on_the_embedded_model(real_model, tmp_path):
    """The real command in a subprocess: /health answers 200 once the model is in, the start-up line
    names the numerics, the answer is the engine's, and SIGTERM in the middle of a stream lets it
    finish, refuses new connections and ends the process with status 0."""
    import subprocess
    import sys

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "decodekit", "serve", "--port", str(port), "--max-batch", "2"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url, deadline, statuses = f"http://127.0.0.1:{port}", time.time() + 180, set()
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(url + "/health") as r:
                    statuses.add(r.status)
                    break
            except urllib.error.HTTPError as err:
                statuses.add(err.code)
            except OSError:
                pass
            time.sleep(0.1)
        assert 200 in statuses
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "What is 2+2?"}],
                                             max_tokens=12, temperature=0)
        numerics = client.models.list().data[0].numerics
        from decodekit.models import load_model

        engine = Engine(load_model(numerics=numerics))
        assert got.choices[0].message.content == engine.generate("What is 2+2?", max_new_tokens=12).text
        chunks = iter(client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "A story."}],
                                                     max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        next(chunks)  # the request is in progress
        proc.send_signal(signal.SIGTERM)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"  # every token came
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"{numerics} numerics, http://127.0.0.1:{port}/v1" in err
    assert "SIGTERM, shutting down" in err and "Traceback" not in err


@pytest.mark.real_model
def test_serve_stopped_while_its_model_loads_ends_with_status_0(real_model):
    import subprocess
    import sys

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "decodekit", "serve", "--port", str(port)], stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline, loading = time.time() + 120, False
        while time.time() < deadline and not loading:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break  # loaded already: too late to test this
            except urllib.error.HTTPError as err:
                loading = err.code == 503
            except OSError:
                time.sleep(0.02)
        if not loading:
            pytest.skip("the model loaded before a request saw it loading")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "SIGTERM, shutting down" in err and "error" not in err, err


def test_response_format_and_guided_fields_constrain_the_answer(served):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"x-guidance": {"whitespace_flexible": False}, "type": "object",
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    for method in ("greedy", "pld"):
        got = chat(served, "hello", max_tokens=40, temperature=0, extra_body={"method": method},
                   response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
        jsonschema.validate(json.loads(got.choices[0].message.content), {k: v for k, v in schema.items() if k != "x-guidance"})
    got = chat(served, "hello", max_tokens=20, temperature=0.8, seed=2, extra_body={"guided_choice": ["red", "blue"]})
    assert got.choices[0].message.content in ("red", "blue")
    with pytest.raises(openai.BadRequestError, match="invalid regex constraint") as err:
        chat(served, "hello", max_tokens=5, extra_body={"guided_regex": "[0-9"})
    assert err.value.param == "guided_regex"  # the field the bad constraint came from
    bad_schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "bogus"}}}
    with pytest.raises(openai.BadRequestError, match="invalid json schema constraint") as err:
        chat(served, "hello", max_tokens=5, response_format=bad_schema)
    assert err.value.param == "response_format"
    with pytest.raises(openai.BadRequestError, match="at most one"):
        chat(served, "hello", max_tokens=5, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    # a constraint found broken while decoding (a text that never ends) names its field too, streamed or not
    endless = {"guided_grammar": 'start: a\na: "x" a\n'}
    with pytest.raises(openai.BadRequestError, match="^Error code: 400 .*structured decoding failed") as err:
        chat(served, "hello", max_tokens=5, extra_body=endless)
    assert err.value.param == "guided_grammar"
    with pytest.raises(openai.APIError, match="structured decoding failed") as err:
        list(chat(served, "hello", max_tokens=5, stream=True, extra_body=endless))
    assert err.value.body["param"] == "guided_grammar"
    # ignore_eos stops where the constraint's text ends
    got = chat(served, "hello", max_tokens=20, temperature=0, extra_body={"guided_choice": ["red", "blue"], "ignore_eos": True})
    assert got.choices[0].message.content in ("red", "blue") and got.choices[0].finish_reason == "stop"


def test_a_methods_options_come_as_extra_fields_or_in_an_object_of_their_own(served, alone):
    with pytest.raises(openai.BadRequestError, match="unknown method 'nope'") as err:
        chat(served, "hello", max_tokens=5, extra_body={"method": "nope"})
    assert err.value.param == "method"
    # a method's options in an object of their own: a search method's n apart from OpenAI's
    got = chat(served, "hello", max_tokens=8, temperature=0, extra_body={"method": "beam", "method_options": {"n": 2}})
    assert got.choices[0].message.content == alone("hello", method="beam", n=2, max_new_tokens=8).text
    with pytest.raises(openai.BadRequestError, match="n must be") as err:  # it reaches the method, not the choices
        chat(served, "hello", max_tokens=5, n=2, extra_body={"method": "beam", "method_options": {"n": 0}})
    assert err.value.param == "method_options"
    with pytest.raises(openai.BadRequestError, match="both in the body and in method_options") as err:
        chat(served, "hello", max_tokens=5, extra_body={"method": "pld", "max_ngram": 2, "method_options": {"max_ngram": 3}})
    assert err.value.param == "method_options"
    # the body's own fields are read from the body: in method_options they would be dropped or overridden
    for field, value in (("temperature", 0.5), ("seed", 3), ("top_p", 0.5), ("presence_penalty", 1.0), ("stop", "x")):
        with pytest.raises(openai.BadRequestError, match=f"{field} is a field of the request body") as err:
            chat(served, "hello", max_tokens=5, seed=4, extra_body={"method": "pld", "method_options": {field: value}})
        assert err.value.param == "method_options"
    # an option found bad by the method names the object it came in
    with pytest.raises(openai.BadRequestError, match="top_k must be") as err:
        chat(served, "hello", max_tokens=5, temperature=0.7, extra_body={"method": "pld", "method_options": {"top_k": 0}})
    assert err.value.param == "method_options"


def test_out_of_range_unknown_and_colliding_fields_and_wide_searches_are_400s(served, alone):
    """OpenAI's ranges for its sampling fields (whatever the temperature), a field that is no one's
    named as such, an option called like the registry's own argument (``name``), a ``greedy`` flag
    that is no bool, and a search wider than the body's n: each a 400 naming its field, never a 500."""
    before = server_errors(served)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    refused = [({"temperature": 2.5}, "temperature"), ({"top_p": 1.5, "temperature": 0}, "top_p"),
               ({"top_p": -0.1, "temperature": 0}, "top_p"), ({"presence_penalty": 3}, "presence_penalty"),
               ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"name": "x"}, "name"),
               ({"greedy": "x", "temperature": 0}, None), ({"method": "beam", "name": "x"}, None),
               ({"method": "pld", "temperature": 0, "method_options": {"name": "x"}}, "name"),
               ({"method": "beam", "method_options": {"n": 17}}, "method_options"),
               ({"method": "step-beam", "method_options": {"n": 8}}, "method_options")]  # 8 beams x 4 steps
    for extra, param in refused:
        status, text = post(served, "/v1/chat/completions", {**base, **extra})
        error = json.loads(text)["error"]
        assert status == 400 and error["type"] == "invalid_request_error", (extra, status, text)
        assert param is None or error["param"] == param, (extra, error)
    assert "unknown field 'name'" in json.loads(post(served, "/v1/chat/completions", {**base, "name": "x"})[1])["error"]["message"]
    assert "at most 16 candidates at once, got n 8 x expand 4" in json.loads(
        post(served, "/v1/chat/completions", {**base, "method": "step-beam", "method_options": {"n": 8}})[1])["error"]["message"]
    for extra in ({"temperature": 2}, {"presence_penalty": -2, "frequency_penalty": 2, "temperature": 0}):  # the ends: taken
        assert post(served, "/v1/chat/completions", {**base, **extra, "seed": 1})[0] == 200, extra
    # a search's candidates are rows of its slot's cache: freed when it ends, not held until the slot's next request
    got = chat(served, "hello", max_tokens=6, temperature=0, extra_body={"method": "beam", "method_options": {"n": 3}})
    assert got.choices[0].message.content == alone("hello", method="beam", n=3, max_new_tokens=6).text
    assert all(engine.model.backend.batch_size == 1 for engine in served.server.scheduler._free)
    assert server_errors(served) == before


def test_a_prompt_that_starts_like_a_slots_last_one_reuses_its_cache(served, alone):
    """A chat's next turn (or the same prompt again) takes the shared prefix from a slot's cache and
    reads only the rest: same answer as alone, fewer prompt tokens read."""
    scheduler = served.server.scheduler
    first = "tell me about cats and dogs and birds"
    answer = chat(served, first, max_tokens=12, temperature=0).choices[0].message.content
    before = scheduler.prefix_tokens
    follow = first + answer + " and fish?"
    got = chat(served, follow, max_tokens=12, temperature=0).choices[0].message.content
    assert got == alone(follow, max_new_tokens=12).text
    assert scheduler.prefix_tokens - before >= len(first)
    status, text, _ = served.get("/metrics")
    assert "decodekit:prefix_cache_hit_tokens_total" in text


def test_after_a_search_the_next_turn_reads_its_whole_prompt(served, alone):
    """A search leaves in the cache whatever it read last (a judge's question, another particle),
    not the prompt and its answer: the next turn on that slot must not take any of it for its own."""
    for first, options in (("judge the cats and dogs", {"n": 2, "scorer": "judge"}),
                           ("particles of cats and dogs", {"n": 3, "delimiter": " ", "max_step_tokens": 4})):
        method = "best-of-n" if "scorer" in options else "particle"
        answer = chat(served, first, max_tokens=12, temperature=1.0, seed=1,
                      extra_body={"method": method, "method_options": options}).choices[0].message.content
        follow = first + answer + " and fish?"
        got = chat(served, follow, max_tokens=12, temperature=0).choices[0].message.content
        assert got == alone(follow, max_new_tokens=12).text, method


def test_without_max_tokens_a_windowed_cache_decodes_as_many_tokens_as_the_models_context(tmp_path, monkeypatch):
    """A sink:S,window:W cache has no end of context: a request without max_tokens stops after the
    model's own context's worth of tokens instead of running until the client goes away."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    backend = tiny_llama(seed=0, hidden_size=64, max_position=96).with_kv_cache("sink:4,window:32")
    assert backend.info.trained_length == 96 and backend.info.max_length > 10**9
    running = Running(LoadedModel(backend, CharTokenizer(96), MODEL), max_batch=1)
    try:
        for prompt in ("hi", "y" * 200):  # a prompt longer than the context too: the window makes room
            # a chat (a completion's default is OpenAI's 16); a client timeout, should it run on
            out = running.client.with_options(timeout=60).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 96
    finally:
        running.stop()


def test_a_search_under_a_cache_of_one_sequence_is_a_400_before_it_is_queued():
    """The server's --kv-cache int8 holds one sequence a slot: a search of n > 1 is refused when the
    request is read, not after it has waited for a slot and read its prompt; n = 1 is served."""
    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import check_method, parse_request

    model = LoadedModel(tiny_llama(seed=0, hidden_size=64).with_kv_cache("int8"), CharTokenizer(96), MODEL)
    if model.backend.kv_policy.spec != "int8":
        pytest.skip("the int8 cache needs the compiled kernels")
    for method, options, width in (("beam", {}, 4), ("step-beam", {"n": 1, "expand": 2}, 2)):
        spec = parse_request({"prompt": "hi", "method": method, "method_options": options}, chat=False)
        with pytest.raises(ApiError, match=f"kv cache int8 holds one sequence; this method needs {width} at once") as err:
            check_method(spec, model)
        assert (err.value.status, err.value.param) == (400, "method")
    check_method(parse_request({"prompt": "hi", "method": "beam", "method_options": {"n": 1}}, chat=False), model)


def test_a_developer_message_is_a_system_message():
    from decodekit.serve.request import chat_messages

    assert chat_messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_an_unknown_role_is_refused_in_the_python_apis_words():
    """One check for the server and the Python API (engine/api.py's chat_role): the same line, here
    naming the request's messages (test_bad_input.py has the API's)."""
    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import chat_messages

    for role in ("bot", None, ["user"]):
        with pytest.raises(ApiError) as err:
            chat_messages([{"role": "user", "content": "hi"}, {"role": role, "content": "x"}])
        assert (err.value.status, err.value.param) == (400, "messages")
        assert str(err.value) == f"messages[1] must have a role, one of system, developer, user, assistant; got {role!r}"


def test_messages_the_chat_template_refuses_are_a_400_naming_them(served, monkeypatch):
    """Gemma's and Mistral's templates call raise_exception when roles do not alternate: the
    client's mistake (a 400 naming its messages), not the server's (it was a 500)."""
    from decodekit.models.chat_template import render_chat

    alternating = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                   "{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(served.model.tokenizer, "chat_prompt", lambda messages: render_chat(alternating, messages))
    errors = server_errors(served)
    status, text = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                                                      {"role": "user", "content": "again"}]})
    error = json.loads(text)["error"]
    assert (status, error["param"], error["type"]) == (400, "messages", "invalid_request_error")
    assert error["message"] == "the model's chat template refuses these messages: Conversation roles must alternate user/assistant"
    assert server_errors(served) == errors


def test_a_completions_tokens_join_to_its_text_and_their_offsets_index_it():
    from decodekit.serve.reply import token_texts

    class Bytes:  # token i is byte i: a character outside ASCII takes several tokens
        def token_bytes(self, token):
            return bytes([token])

    text = "Hi 😀 a中b"
    pieces, offsets = token_texts(Bytes(), list(text.encode()))
    assert "".join(pieces) == text and len(pieces) == len(text.encode())
    assert all(text[at:].startswith(piece) for piece, at in zip(pieces, offsets))
    assert pieces[3:7] == ["", "", "", "😀"]  # the emoji is its last byte's
    unfinished, _ = token_texts(Bytes(), list("ab😀".encode())[:-1])
    assert "".join(unfinished) == "ab\ufffd"  # as the output's text ends


class Words:
    """A tokenizer of five multi-character tokens: "He", "llo", " wor", "ld", "!"."""

    vocab = ["He", "llo", " wor", "ld", "!"]

    def decode(self, tokens):
        return "".join(self.vocab[t] for t in tokens)

    def token_bytes(self, token):
        return self.vocab[token].encode()


def test_a_stop_inside_a_token_leaves_its_shown_part_in_the_logprobs_and_usage_counts_every_token():
    """The text keeps a cut token's characters before the stop string: its log-probability is given,
    its text as far as the output's goes (the pieces join to the text), and usage counts every token
    generated, the ones cut off included, as OpenAI bills them."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.engine.stops import cut_at_stop, shown_tokens
    from decodekit.serve.reply import token_texts

    words = Words()
    generated = [0, 1, 2, 3, 4]
    text, kept, hit = cut_at_stop(words, generated, ["rld"])
    g = Generation(text, kept, GenerationStats(), "stop", cut_off=generated[len(kept):])
    assert (text, kept, g.generated) == ("Hello wo", [0, 1], 5)
    shown = shown_tokens(words, g.text, g.tokens, g.cut_off)
    pieces, offsets = token_texts(words, shown, len(g.text))
    assert shown == [0, 1, 2] and pieces == ["He", "llo", " wo"] and offsets == [0, 2, 5]
    assert shown_tokens(words, "Hello", [0, 1], [2, 3]) == [0, 1]  # a cut between tokens shows none of them


def test_a_legacy_top_logprobs_key_spells_a_partial_characters_bytes():
    """Byte tokens of one character all decode to U+FFFD: keyed by that text, one alternative would
    hide another (and the chosen one's value be lost); OpenAI spells them by their bytes."""
    from decodekit.serve.reply import top_key

    class Bytes:
        def token_bytes(self, token):
            return {0: b"\xf0\x9f", 1: b"\x8c\x8d", 2: b"ok"}[token]

    assert [top_key(Bytes(), t) for t in (0, 1, 2)] == ["bytes:\\xf0\\x9f", "bytes:\\x8c\\x8d", "ok"]


def test_a_chat_logprob_entry_for_each_cut_token_shows_its_own_part():
    """A stop string cut inside a token whose character began in the token before: both are in
    the logprobs, each with its own piece of the text (they held one piece for both, and the
    first byte token's replacement character was taken for a whole character)."""
    import types

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.engine.stops import cut_at_stop
    from decodekit.serve.reply import Reply
    from decodekit.serve.scheduler import Outcome

    class Pieces:
        vocab = [b"a", b"\xc3", b"\xa9!"]  # "a", then "é!" split inside the é

        def decode(self, tokens):
            return b"".join(self.vocab[t] for t in tokens).decode("utf-8", "replace")

        def token_bytes(self, token):
            return self.vocab[token]

    generated = [0, 1, 2]
    text, kept, _ = cut_at_stop(Pieces(), generated, ["!"])
    g = Generation(text, kept, GenerationStats(), "stop", cut_off=generated[len(kept):])
    outcome = Outcome(g, [(-0.1, []), (-0.2, []), (-0.3, [])], 0.0)
    content = Reply._logprobs(types.SimpleNamespace(chat=True, tokenizer=Pieces()), outcome)["content"]
    assert (text, kept) == ("aé", [0]) and [c["token"] for c in content] == ["a", "", "é"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode()


def test_when_one_choice_fails_the_others_are_still_counted(served, monkeypatch):
    """n = 2, not streamed, the second choice failing while decoding: the reply is the error, and
    the first choice, which decoded to its end, is in the metrics all the same."""
    from concurrent.futures import Future

    from decodekit.errors import DecodeKitError

    scheduler = served.server.scheduler
    submit = scheduler.submit

    def second_fails(jobs):
        futures = submit(jobs[:1])
        failed: Future = Future()
        failed.set_exception(DecodeKitError("the logits are not finite"))
        return futures + [failed]

    monkeypatch.setattr(scheduler, "submit", second_fails)
    before = (metric(served, "decodekit:generation_tokens_total"), metric(served, 'decodekit:request_success_total{finished_reason="length"}'))
    with pytest.raises(openai.APIStatusError, match="not finite"):
        chat(served, PROMPTS[1], max_tokens=5, n=2, temperature=0, extra_body={"ignore_eos": True})
    after = (metric(served, "decodekit:generation_tokens_total"), metric(served, 'decodekit:request_success_total{finished_reason="length"}'))
    assert (after[0] - before[0], after[1] - before[1]) == (5, 1)


def refused(body: dict, chat: bool = False) -> str | None:
    """The ``param`` of the 400 that parse_request answers ``body`` with (AssertionError if it accepts it)."""
    from decodekit.serve.errors import ApiError

    with pytest.raises(ApiError) as err:
        parse_request(body, chat=chat)
    assert err.value.status == 400
    return err.value.param


def test_integer_fields_take_both_ends_of_their_range_and_nothing_past_them():
    """max_tokens >= 1, n in [1, 16], seed in [0, 2**64), logprobs and top_logprobs in [0, 20]: the
    ends are values a client may send (as OpenAI takes them); a boolean is not an integer."""
    from decodekit.samplers.params import SEED_LIMIT

    spec = parse_request({"prompt": "hi", "max_tokens": 1, "n": 1, "seed": 0, "logprobs": 0}, chat=False)
    assert (spec.max_tokens, spec.n, spec.params["seed"], spec.top_logprobs) == (1, 1, 0, 0)
    spec = parse_request({"prompt": "hi", "n": 16, "seed": SEED_LIMIT - 1, "logprobs": 20}, chat=False)
    assert (spec.n, spec.params["seed"], spec.top_logprobs) == (16, SEED_LIMIT - 1, 20)
    assert parse_request({"prompt": "hi", "max_completion_tokens": 1}, chat=False).max_tokens == 1
    for field, value in (("max_tokens", 0), ("max_completion_tokens", 0), ("n", 0), ("n", 17), ("seed", -1),
                         ("seed", SEED_LIMIT), ("logprobs", -1), ("logprobs", 21), ("n", True), ("max_tokens", 2.0)):
        assert refused({"prompt": "hi", field: value}) == field, (field, value)
    from decodekit.serve.errors import ApiError

    for field in ("max_tokens", "max_completion_tokens"):  # a 4,000-digit limit is said by its size
        assert parse_request({"prompt": "hi", field: 2**31 - 1}, chat=False).max_tokens == 2**31 - 1
        with pytest.raises(ApiError, match=f"{field} must be an integer in \\[1, 2147483647\\], got an integer of 13288 bits"):
            parse_request({"prompt": "hi", field: 10**4000}, chat=False)
    assert refused({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
                   chat=True) == "top_logprobs"


def test_stop_takes_up_to_four_strings():
    """OpenAI's limit: a string or a list of at most 4; an empty one, which every text contains, is
    refused before anything is queued or streamed (the engine's check)."""
    assert parse_request({"prompt": "hi", "stop": list("abcd")}, chat=False).stop == list("abcd")
    assert parse_request({"prompt": "hi", "stop": "ab"}, chat=False).stop == ["ab"]
    assert refused({"prompt": "hi", "stop": list("abcde")}) == "stop"
    assert refused({"prompt": "hi", "stop": ""}) == refused({"prompt": "hi", "stop": ["a", ""], "stream": True}) == "stop"


@pytest.mark.parametrize("field, value", [(field, value) for field in ("stop", "stream_options", "method_options")
                                          for value in (0, 1, False, True, "") if (field, value) != ("stop", "")])
def test_a_field_of_the_wrong_type_is_refused_whatever_its_value(field, value):
    """0, false or "" is no list or object either (a stop may be a string): refused as 1 is, never
    read as "not given" (null is)."""
    body = {"prompt": "hi", "stream": True} if field == "stream_options" else {"prompt": "hi"}
    assert refused({**body, field: value}) == field
    assert parse_request({**body, field: None}, chat=False).prompt == "hi"


def test_logprob_fields_that_would_be_ignored_are_refused():
    """top_logprobs without logprobs: true (even 0, as OpenAI answers it), and a completion's logprobs
    (even 0) with stream: a 400, never a reply without the log-probabilities asked for."""
    messages = [{"role": "user", "content": "hi"}]
    assert refused({"messages": messages, "top_logprobs": 0}, chat=True) == "top_logprobs"
    assert parse_request({"messages": messages, "logprobs": True, "top_logprobs": 0}, chat=True).top_logprobs == 0
    assert parse_request({"messages": messages, "logprobs": True}, chat=True).top_logprobs == 0
    assert parse_request({"messages": messages, "logprobs": False}, chat=True).top_logprobs is None
    assert refused({"prompt": "hi", "logprobs": 0, "stream": True}) == "logprobs"


def test_max_tokens_defaults_to_16_for_a_completion_and_to_the_context_for_a_chat():
    """OpenAI's defaults: a legacy completion's max_tokens is 16; a chat's is the rest of the context
    (None here, filled in once the prompt is tokenised); max_completion_tokens is the newer name."""
    assert parse_request({"prompt": "hi"}, chat=False).max_tokens == 16
    assert parse_request({"prompt": "hi", "max_completion_tokens": 40}, chat=False).max_tokens == 40
    assert parse_request({"messages": [{"role": "user", "content": "hi"}]}, chat=True).max_tokens is None


def test_openai_sampling_defaults_pass_nothing_on_to_the_sampler():
    """top_p 1 and penalties 0 are OpenAI's defaults, which change nothing: not passed on as options
    (a greedy method would refuse them as ignored); temperature 0 is greedy decoding, with no seed."""
    spec = parse_request({"prompt": "hi", "temperature": 0, "top_p": 1, "presence_penalty": 0,
                          "frequency_penalty": 0.0}, chat=False)
    assert (spec.method, spec.params) == ("greedy", {})
    assert parse_request({"prompt": "hi", "method": "pld", "top_p": 1}, chat=False).params == {}
    spec = parse_request({"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.5, "seed": 3}, chat=False)
    assert (spec.method, spec.params) == ("sample", {"temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.5, "seed": 3})


def test_structured_output_fields_are_read_as_their_kinds_one_at_most():
    """response_format json_object / json_schema and vLLM's guided_* fields; a response_format needs its
    type (text: no constraint); two constraints at once are refused, never one of them dropped."""
    schema = {"type": "object"}
    read = lambda **body: parse_request({"prompt": "hi", **body}, chat=False).constraint  # noqa: E731
    assert read(response_format={"type": "json_object"}) == {"json": None}
    assert read(response_format={"type": "json_schema", "json_schema": {"schema": schema}}) == {"json_schema": schema}
    # a boolean schema is a JSON schema (true: any value), as guided_json and --json-schema take it
    assert read(response_format={"type": "json_schema", "json_schema": {"schema": True}}) == {"json_schema": True}
    assert refused({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": 1}}}) == "response_format"
    assert read(response_format={"type": "text"}) is None
    assert read(guided_json=schema) == {"json_schema": schema}
    assert read(guided_regex="a+") == {"regex": "a+"} and read(guided_choice=["a", "b"]) == {"choice": ["a", "b"]}
    assert refused({"prompt": "hi", "response_format": {}}) == "response_format"
    assert refused({"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a+"}) == "response_format"


def test_a_completion_takes_one_prompt_and_null_flags_are_false():
    """One prompt per request (a list of two is refused, not cut to the first); an empty list of token
    ids is no prompt; best_of must be the integer 1 (true is not); a flag set to null is not given."""
    assert parse_request({"prompt": ["hi"]}, chat=False).prompt == "hi"
    assert parse_request({"prompt": [[1, 2]]}, chat=False).prompt == [1, 2]
    for prompt in (["a", "b"], [], [[1], [2]], [True, False], [[1, True]]):  # (JSON's true is no token id)
        assert refused({"prompt": prompt}) == "prompt", prompt
    assert refused({"prompt": "hi", "best_of": True}) == "best_of"
    spec = parse_request({"prompt": "hi", "stream": None, "ignore_eos": None}, chat=False)
    assert spec.stream is False and spec.ignore_eos is False


def test_an_error_about_a_chats_prompt_names_its_messages():
    """A chat has no prompt field: the error object's param is the field the client sent."""
    from decodekit.serve.request import field_named

    err = InvalidParameter("the prompt is empty", param="prompt")
    assert field_named(err, {"messages": []}, chat=True) == "messages"
    assert field_named(err, {"prompt": ""}, chat=False) == "prompt"


def test_a_body_still_coming_when_the_server_stops_is_a_503_not_a_cancelled_task():
    """A client that sent half its body when a shutdown began is answered with a 503 as soon as the
    server is stopping, instead of being cancelled (a traceback in the log) when the grace ends."""
    import asyncio

    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import read_body

    class Stalled:
        headers = {"content-length": "1000"}

        async def stream(self):
            yield b'{"messages":'
            await asyncio.sleep(3600)
            yield b"[]}"

    async def stopped_after(seconds: float):
        start = asyncio.get_running_loop().time()
        with pytest.raises(ApiError) as err:
            await read_body(Stalled(), stopping=lambda: asyncio.get_running_loop().time() - start > seconds)
        return err.value

    err = asyncio.run(asyncio.wait_for(stopped_after(0.3), timeout=30))
    assert (err.status, err.code) == (503, "server_shutting_down")


def test_a_body_of_exactly_the_limit_is_read():
    """The limit is the largest body read (a 413 past it, not at it)."""
    import asyncio

    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import read_body

    class Declared:
        def __init__(self, size):
            self.headers = {"content-length": str(size)}

        async def stream(self):
            yield b"{}"

    assert asyncio.run(read_body(Declared(MAX_BODY_BYTES))) == {}
    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(Declared(MAX_BODY_BYTES + 1)))
    assert err.value.status == 413


def test_usage_counts_every_choices_tokens_and_the_prompt_once():
    """OpenAI's usage for n choices: the prompt once, the completion tokens of all of them, and their sum."""
    import types

    from decodekit.serve.reply import Reply

    outcomes = [types.SimpleNamespace(generation=types.SimpleNamespace(generated=k)) for k in (4, 7)]
    usage = Reply.usage(types.SimpleNamespace(prompt_ids=[1, 2, 3]), outcomes)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 11, "total_tokens": 14}


def test_a_cancelled_choice_finishes_with_stop_not_length():
    """OpenAI has no "cancelled" finish reason: a choice ended before its max_tokens reports "stop"
    ("length" would say it ran out of tokens), as "eos" and a stop string do; "length" stays "length"."""
    import types

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.reply import Reply
    from decodekit.serve.scheduler import Job, Outcome

    reply = Reply.__new__(Reply)  # just what a whole reply reads: no server running
    reply.server = types.SimpleNamespace(metrics=None, model_id="tiny", numerics="exact")
    reply.chat, reply.spec, reply.prompt_ids, reply.started = False, types.SimpleNamespace(method="greedy"), [1, 2], 0.0
    reply.id, reply.created, reply.tokenizer = "cmpl-test", 0, None
    reasons = ("cancelled", "eos", "stop", "length")
    outcomes = [Outcome(Generation.cancelled(), None, 0.0)]
    outcomes += [Outcome(Generation("ab", [3, 4], GenerationStats(), reason), None, 0.0) for reason in reasons[1:]]
    jobs = [Job([1, 2], "greedy", {}, 8) for _ in outcomes]
    body = Reply.whole(reply, outcomes, jobs)
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop", "stop", "length"]
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 6


def test_stream_chunks_carry_a_null_usage_when_usage_is_asked_for():
    """With stream_options.include_usage every chunk has "usage": null and only the last one a usage, as OpenAI sends them."""
    import types

    from decodekit.serve.reply import Reply

    for include_usage in (True, False):
        reply = types.SimpleNamespace(chat=True, spec=types.SimpleNamespace(include_usage=include_usage),
                                      _envelope=lambda chunk=False: {"object": "chat.completion.chunk"})
        body = json.loads(Reply._chunk(reply, 0, "hi", None).removeprefix("data: "))
        assert ("usage" in body) == include_usage and body.get("usage") is None
        assert body["choices"] == [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None, "logprobs": None}]


def test_metrics_time_per_output_token_is_over_the_tokens_after_the_first():
    """vLLM's TPOT: (latency - time to first token) / (tokens - 1), none for a one-token answer, the
    tokens a stop string cut off counted (they were decoded in that time); the speculative counters
    take the drafted and the accepted tokens each."""
    import types

    from decodekit.serve.metrics import ServerMetrics

    scheduler = types.SimpleNamespace(running=0, waiting=0, prefix_tokens=0, prompt_cache=None, batcher=types.SimpleNamespace(passes=0, rows=0))
    metrics = ServerMetrics(scheduler)

    def generation(n, extra, cut_off=0):
        return types.SimpleNamespace(generated=n, tokens=list(range(n - cut_off)), finish_reason="length",
                                     stats=types.SimpleNamespace(extra=extra))

    metrics.finished(prompt_tokens=3, generation=generation(5, {"drafted": 6, "accepted": 4}), queued_s=0.0, ttft_s=1.0, e2e_s=3.0)
    metrics.finished(prompt_tokens=3, generation=generation(1, {}), queued_s=0.0, ttft_s=1.0, e2e_s=1.5)
    metrics.finished(prompt_tokens=3, generation=generation(4, {}, cut_off=2), queued_s=0.0, ttft_s=1.0, e2e_s=2.5)
    value = metrics.registry.get_sample_value
    assert value("decodekit:time_per_output_token_seconds_count") == 2
    assert value("decodekit:time_per_output_token_seconds_sum") == pytest.approx((3.0 - 1.0) / 4 + (2.5 - 1.0) / 3)
    assert value("decodekit:time_to_first_token_seconds_count") == 3
    assert (value("decodekit:spec_decode_num_draft_tokens_total"), value("decodekit:spec_decode_num_accepted_tokens_total")) == (6, 4)
    assert value("decodekit:generation_tokens_total") == 10 and value("decodekit:prompt_tokens_total") == 9


def test_slots_whose_caches_would_not_fit_in_memory_are_refused_before_they_are_made(monkeypatch):
    """--max-batch makes a clone with a cache of its own per slot: a count whose caches exceed the
    memory available is refused in one line naming the flag and both sizes, before the clones are
    made (here: memory for 3 slots' caches; 4 refused, 3 served). The scheduler checks, so the Python
    API's Server is covered as well as the CLI."""
    from decodekit.errors import InvalidParameter
    from decodekit.models import native
    from decodekit.serve.scheduler import Scheduler

    model = tiny_model()
    slot = model.backend.clone()
    monkeypatch.setattr(native, "available_memory", lambda: 3 * (slot._k.nbytes + slot._v.nbytes))
    clones, clone = [], type(slot).clone
    monkeypatch.setattr(type(slot), "clone", lambda self: clones.append(clone(self)) or clones[-1])
    with pytest.raises(InvalidParameter, match=r"^4 sequences of \d+ positions need a [\d.]+ MiB KV cache, more than the "
                                               r"[\d.]+ MiB of memory available; ask for a smaller --max-batch \(each of its 4 "):
        Scheduler(model, max_batch=4)
    assert len(clones) == 1  # only the one whose cache was sized
    Scheduler(model, max_batch=3).close()


def test_a_backend_that_cannot_batch_its_passes_serves_one_choice_at_a_time():
    """The module's rule: without a batch key the passes cannot run together, so one slot: a second
    choice waits for the first instead of running beside it."""
    from decodekit.serve.scheduler import Job, Scheduler

    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), MODEL)  # head size 8: no batched layer path
    assert model.backend.batch_key is None
    scheduler = Scheduler(model, max_batch=4, max_queue=4)
    try:
        assert scheduler.max_batch == 1
        prompt = model.tokenizer.encode(PROMPTS[0])
        long, short = slot_holder(prompt), Job(prompt, "greedy", {}, 3, ignore_eos=True)
        futures = scheduler.submit([long, short])
        started(scheduler)
        assert (scheduler.running, scheduler.waiting) == (1, 1)
        scheduler.cancel([long])
        assert len(futures[1].result(timeout=60).generation.tokens) == 3  # it ran once the slot was free
    finally:
        scheduler.close()


def test_a_waiting_choice_whose_future_was_cancelled_never_takes_a_slot(alone):
    """A caller may cancel a waiting choice's future itself: when the slot frees, that choice is
    skipped (never started) and the next one runs."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=2) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        long, dropped, later = (slot_holder(prompt), Job(prompt, "greedy", {}, 4),
                                Job(prompt, "greedy", {}, 5))
        (running,) = scheduler.submit([long])
        started(scheduler)
        (dropped_future,) = scheduler.submit([dropped])
        (later_future,) = scheduler.submit([later])
        assert dropped_future.cancel()
        scheduler.cancel([long])
        assert later_future.result(timeout=60).generation.tokens == alone(prompt, max_new_tokens=5).tokens
        assert dropped.started is None and dropped_future.cancelled()
        assert (scheduler.running, scheduler.waiting) == (0, 0)


def test_a_choice_that_fails_gives_its_slot_back_before_its_caller_hears_of_it(alone):
    """A choice whose decoding raises (an option only the engine can judge) frees its slot: when its
    caller gets the error, nothing runs, and the next choice runs as it would alone."""
    from decodekit.errors import DecodeKitError
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        (failing,) = scheduler.submit([Job(prompt, "greedy", {"top_k": -3}, 4)])
        with pytest.raises(DecodeKitError):
            failing.result(timeout=60)
        assert (scheduler.running, scheduler.waiting, len(scheduler._free)) == (0, 0, 1)
        (next_one,) = scheduler.submit([Job(prompt, "greedy", {}, 4)])
        assert next_one.result(timeout=60).generation.tokens == alone(prompt, max_new_tokens=4).tokens


def test_a_choices_slot_is_free_when_its_caller_hears_it_ended_and_its_wait_is_its_queue_time():
    """The scheduler's promise: a caller that submits again the moment its answer comes finds the
    slot free (the slot is given back before the future is answered); the outcome's queue time is
    from submission to start, not to the end."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=0) as (model, scheduler):
        job = Job(model.tokenizer.encode(PROMPTS[1]), "greedy", {}, 6)
        (future,) = scheduler.submit([job])
        seen = []
        future.add_done_callback(lambda f: seen.append((scheduler.running, len(scheduler._free))))
        outcome = future.result(timeout=60)
        assert seen == [(0, 1)]
        assert outcome.queued_s == job.started - job.submitted


def test_cancelling_a_choice_whose_future_its_caller_cancelled_is_quiet():
    """A waiting choice whose caller cancelled its future, then cancelled through the scheduler (a
    client gone): no error, the queue place freed, the choice marked to stop."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        long, waiting = slot_holder(prompt), Job(prompt, "greedy", {}, 4)
        (running,) = scheduler.submit([long])
        started(scheduler)
        (queued,) = scheduler.submit([waiting])
        assert queued.cancel()
        scheduler.cancel([waiting])
        assert waiting.cancelled.is_set() and (scheduler.running, scheduler.waiting) == (1, 0)
        scheduler.cancel([long])
        assert running.result(timeout=60).generation.finish_reason == "cancelled"


def test_after_a_request_with_logprobs_the_slot_keeps_its_prompt_and_answer():
    """The log-probabilities' teacher-forced pass reads prompt and answer: the slot's cache is said to
    hold them, so the conversation's next turn reads only what is new."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=0) as (model, scheduler):
        slot = scheduler._free[0].model.backend
        prompt = model.tokenizer.encode(PROMPTS[3])
        (future,) = scheduler.submit([Job(prompt, "greedy", {}, 5, ignore_eos=True, top_logprobs=0)])
        answer = future.result(timeout=60).generation.tokens
        follow = prompt + answer + model.tokenizer.encode(" and?")
        assert slot.shared_prefix(follow) == len(prompt) + len(answer)  # a greedy decode alone leaves its last token unread


def test_closing_the_scheduler_cancels_the_choices_that_wait():
    """On close, what waits is dropped: its callers' futures are cancelled, not left unanswered."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        long = slot_holder(prompt)
        scheduler.submit([long])
        started(scheduler)
        (queued,) = scheduler.submit([Job(prompt, "greedy", {}, 4)])
        scheduler.close()
        scheduler.cancel([long])
        assert queued.cancelled() and scheduler.waiting == 0


def test_until_its_model_loads_the_server_answers_503_and_says_when_the_load_failed():
    """/health, /metrics and the API answer 503 while the model loads; once the load failed,
    /health says "error" (a health checker stops waiting) and the API gives the reason."""
    from decodekit.errors import InvalidModel

    def load():
        raise InvalidModel("the weights are truncated")

    server = Server(load, max_batch=1, max_queue=1)
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    web = uvicorn.Server(uvicorn.Config(server.app, log_level="error"))
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.01)

    def get(path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(url + path) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    try:
        assert get("/health") == (503, {"status": "loading"})
        status, body = get("/metrics")
        assert status == 503 and "the model is loading" in body["error"]["message"]
        with pytest.raises(InvalidModel):
            server.load_now()
        assert get("/health") == (503, {"status": "error"})
        status, body = get("/v1/models")
        assert status == 503 and "failed to load: the weights are truncated" in body["error"]["message"]
    finally:
        web.should_exit = True
        thread.join(timeout=10)


class Client:
    """A request's side that the server asks whether its client is still there."""

    def __init__(self, gone: bool = False):
        self.gone = gone

    async def is_disconnected(self) -> bool:
        return self.gone


class Recording:
    """A scheduler that records the jobs it is asked to cancel."""

    def __init__(self):
        self.cancelled = []

    def cancel(self, jobs):
        self.cancelled.append(jobs)


def test_a_request_whose_wait_is_cancelled_cancels_its_choices():
    """Whatever ends the wait for a request's choices (its client gone, or its task cancelled as the
    server stops), the choices are cancelled: they never run on for nobody."""
    import asyncio
    from concurrent.futures import Future

    from decodekit.serve.app import wait_or_cancel

    scheduler, jobs = Recording(), ["a choice"]

    async def cancelled_wait():
        task = asyncio.create_task(wait_or_cancel(Client(), scheduler, jobs, [Future()]))
        await asyncio.sleep(0)  # the wait starts
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_wait())
    assert scheduler.cancelled == [jobs]



def test_a_stream_whose_client_goes_before_its_first_text_cancels_its_choices():
    """A stream waits for its first delivery before its response starts (an error found by then is
    the request's status): a client gone meanwhile, its request still queued, is a ClientGone, and
    its choices are cancelled and counted as they stop, as a stream's client gone later."""
    import asyncio
    from concurrent.futures import Future

    from decodekit.serve.app import first_delivery
    from decodekit.serve.errors import ClientGone
    from decodekit.serve.reply import Outbox

    class Counting:
        stopped = []

        def record_when_stopped(self, futures, first):
            self.stopped.append(dict(futures))

        watch = staticmethod(lambda futures, deltas: None)

    scheduler, jobs, futures, reply = Recording(), ["a choice"], [Future()], Counting()

    async def waited():
        deltas = Outbox(asyncio.get_running_loop(), 0.0).channel()  # nothing is ever delivered
        with pytest.raises(ClientGone):
            await first_delivery(Client(gone=True), scheduler, jobs, futures, deltas, reply)

    asyncio.run(waited())
    assert scheduler.cancelled == [jobs] and reply.stopped == [{0: futures[0]}]


def test_a_stream_stopped_by_a_shutdown_before_its_first_text_is_a_503():
    """A stream's choices cut short by a shutdown before any text: the request's status is the 503 a
    whole answer gets (it was a 200 stream holding the error); its first text, when one came first,
    is handed on with the time it came, and so is an error that came after text in one delivery."""
    import asyncio
    from concurrent.futures import Future
    from types import SimpleNamespace

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.app import first_delivery
    from decodekit.serve.errors import ApiError
    from decodekit.serve.reply import FINISHED, Outbox, Reply
    from decodekit.serve.scheduler import Outcome

    cancelled = [], []

    def stopped(outcomes):
        if any(o.generation.finish_reason == "cancelled" for o in outcomes):
            raise ApiError(503, "the server is shutting down", "server_error", code="server_shutting_down")

    server = SimpleNamespace(refuse_if_stopped=stopped)
    scheduler = SimpleNamespace(cancel=lambda jobs: cancelled[0].append(jobs))
    reply = SimpleNamespace(server=server, body={}, chat=False, watch=Reply.watch,
                            record_when_stopped=lambda futures, first: cancelled[1].append(dict(futures)))

    async def first(outcome, text=None):
        deltas, future = Outbox(asyncio.get_running_loop(), 0.0).channel(), Future()
        if text is not None:
            deltas.post((0, text))
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return await first_delivery(Client(), scheduler, ["a job"], [future], deltas, reply)

    cut = Outcome(Generation("", [], GenerationStats(), "cancelled"), None, 0.0)
    with pytest.raises(ApiError) as refused:
        asyncio.run(first(cut))
    assert refused.value.status == 503 and cancelled[0] == [["a job"]] and len(cancelled[1]) == 1
    done = Outcome(Generation("a", [5], GenerationStats(), "length"), None, 0.0)
    before = time.perf_counter()
    items, at = asyncio.run(first(done, "a"))
    assert items == [(0, "a"), (0, FINISHED)] and before <= at <= time.perf_counter()
    assert cancelled[0] == [["a job"]]  # nothing cancelled this time
    # an error after some text, handed over with it: the stream starts and says it (as when it comes later)
    items, _ = asyncio.run(first(InvalidParameter("structured decoding failed"), "x"))
    assert items == [(0, "x"), (0, FINISHED)] and cancelled[0] == [["a job"]]
    with pytest.raises(ApiError) as refused:  # the same error before any text: the request's 400
        asyncio.run(first(InvalidParameter("structured decoding failed")))
    assert refused.value.status == 400

def test_without_max_tokens_a_chat_decodes_to_the_end_of_the_context():
    """OpenAI's default for a chat: as many tokens as the context holds after the prompt."""
    running = Running(LoadedModel(tiny_llama(seed=0, max_position=96), CharTokenizer(96), MODEL), max_batch=1, max_queue=1)
    try:
        reply = chat(running, PROMPTS[0], temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 96
        assert reply.choices[0].finish_reason == "length"
        # a prompt that fills the context leaves no room for one token: refused, not answered with nothing
        fill = "x" * (96 - reply.usage.prompt_tokens + len(PROMPTS[0]))
        with pytest.raises(openai.BadRequestError) as err:
            chat(running, fill, temperature=0)
        assert err.value.code == "context_length_exceeded"
    finally:
        running.stop()


@pytest.mark.parametrize("cache", ["h2o:budget=24,window=8", "snapkv:budget=24,window=8", "sink:4,window:16", "full"])
def test_logprobs_are_those_of_the_cache_that_chose_the_tokens(cache):
    """A greedy answer's tokens are each their own most likely token in the reported logprobs, also
    under a cache that drops entries as decoding goes on (one pass over prompt and answer would
    still hold what decoding had dropped)."""
    from decodekit.serve.scheduler import token_logprobs

    tok = CharTokenizer(96)
    model = LoadedModel(tiny_llama(seed=0).with_kv_cache(cache), tok, "tiny")
    prompt = tok.encode("the cat sat on the mat and the dog")
    tokens = Engine(model).generate(prompt, max_new_tokens=40, ignore_eos=True, chat=False).tokens
    rows = token_logprobs(model.backend, prompt, tokens, top=1)
    assert len(rows) == len(tokens) == 40
    assert [alternatives[0][0] for _, alternatives in rows] == tokens
    assert all(value == alternatives[0][1] for value, alternatives in rows)


def bare_reply(chat: bool, include_usage: bool = False, method: str = "greedy", metrics=None, tokenizer=None):
    """A :class:`Reply` with just what its bodies and chunks read: no server running."""
    import types

    from decodekit.serve.reply import Reply

    reply = Reply.__new__(Reply)
    reply.server = types.SimpleNamespace(metrics=metrics, model_id="tiny", numerics="exact",
                                         scheduler=types.SimpleNamespace(cancel=lambda jobs: None),
                                         refuse_if_stopped=lambda outcomes: None,  # (never shutting down)
                                         count_error=lambda status: metrics and metrics.errors.labels(str(status)).inc())
    reply.chat, reply.prompt_ids, reply.started, reply.body = chat, [1, 2], 0.0, {}
    reply.spec = types.SimpleNamespace(method=method, include_usage=include_usage)
    reply.id, reply.created, reply.tokenizer = "cmpl-test", 0, tokenizer
    return reply


def fake_metrics():
    import types

    from decodekit.serve.metrics import ServerMetrics

    batcher = types.SimpleNamespace(passes=3, rows=7)
    return ServerMetrics(types.SimpleNamespace(running=2, waiting=5, prefix_tokens=0, prompt_cache=None, batcher=batcher))


def test_response_and_chunk_objects_are_named_as_openai_names_them():
    """OpenAI's object names: chat.completion and chat.completion.chunk for a chat; a legacy
    completion is text_completion, its stream chunks included."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.scheduler import Job, Outcome

    outcome = Outcome(Generation("ab", [3, 4], GenerationStats(), "eos"), None, 0.0)
    for chat, whole, chunk in ((True, "chat.completion", "chat.completion.chunk"), (False, "text_completion", "text_completion")):
        reply = bare_reply(chat)
        assert reply.whole([outcome], [Job([1, 2], "greedy", {}, 8)])["object"] == whole
        assert json.loads(reply._chunk(0, "a", None).removeprefix("data: "))["object"] == chunk


def test_a_choices_last_chunk_has_an_empty_delta_or_an_empty_text():
    """OpenAI ends a streamed choice with its finish reason and no content: a chat's delta is {}
    (never "content": null), a legacy completion's text is "" (never null)."""
    end = json.loads(bare_reply(True)._chunk(1, None, "stop").removeprefix("data: "))["choices"][0]
    assert end == {"index": 1, "delta": {}, "finish_reason": "stop", "logprobs": None}
    end = json.loads(bare_reply(False)._chunk(1, None, "length").removeprefix("data: "))["choices"][0]
    assert end == {"index": 1, "text": "", "finish_reason": "length", "logprobs": None}


def run_stream(reply, takes: list, outcomes: list, monkeypatch, clock=None) -> list[dict]:
    """The events of ``reply.stream`` over a channel that hands over ``takes`` in turn, for choices
    that ended with ``outcomes`` (the last event, [DONE], as the string)."""
    import asyncio
    from concurrent.futures import Future

    from decodekit.serve import reply as reply_module
    from decodekit.serve.scheduler import Job

    class Scripted:
        def post(self, item):  # (the ends the futures post: scripted in takes instead)
            pass

        async def take(self):
            return takes.pop(0)

    if clock is not None:
        monkeypatch.setattr(reply_module, "time", clock)
    futures = []
    for outcome in outcomes:
        future: Future = Future()
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        futures.append(future)
    jobs = [Job([1, 2], reply.spec.method, {}, 8) for _ in outcomes]

    async def main():
        return [text async for text in reply.stream(None, jobs, futures, Scripted(), takes.pop(0), None)]

    events = [e.removeprefix("data: ") for part in asyncio.run(main()) for e in part.split("\n\n") if e]
    return [json.loads(e) for e in events[:-1]] + [events[-1]]


def test_a_streamed_chat_gives_every_choice_its_role_then_its_text_its_end_and_the_usage(monkeypatch):
    """n streamed chat choices: each choice's first chunk carries its role (OpenAI's clients read
    every choice's), then its text, its finish reason, then one usage chunk for all of them, and [DONE]."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.reply import FINISHED
    from decodekit.serve.scheduler import Outcome

    outcomes = [Outcome(Generation(text, tokens, GenerationStats(), reason), None, 0.0)
                for text, tokens, reason in (("ab", [3, 4], "length"), ("c", [5], "eos"))]
    takes = [[(0, "a"), (1, "c")], [(0, "b"), (1, FINISHED)], [(0, FINISHED)]]
    events = run_stream(bare_reply(True, include_usage=True), takes, outcomes, monkeypatch)
    assert events[-1] == "[DONE]"
    choices = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events[:-2]]
    assert choices[:2] == [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant", "content": ""}, None)]
    assert choices[2:] == [(0, {"content": "a"}, None), (1, {"content": "c"}, None), (0, {"content": "b"}, None),
                           (1, {}, "stop"), (0, {}, "length")]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_a_stream_without_include_usage_sends_no_usage_chunk(monkeypatch):
    """Usage is streamed only when stream_options.include_usage asks for it: else the choices' chunks, then [DONE]."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.reply import FINISHED
    from decodekit.serve.scheduler import Outcome

    outcome = Outcome(Generation("a", [3], GenerationStats(), "eos"), None, 0.0)
    for chat in (True, False):
        events = run_stream(bare_reply(chat), [[(0, "a")], [(0, FINISHED)]], [outcome], monkeypatch)
        assert events[-1] == "[DONE]"
        assert all(len(e["choices"]) == 1 and "usage" not in e for e in events[:-1])


def test_a_streamed_choices_time_to_first_token_is_its_first_text(monkeypatch):
    """The time to first token of a stream: when its first text was handed over, not a later one."""
    import itertools
    import types

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.reply import FINISHED
    from decodekit.serve.scheduler import Outcome

    ticks = itertools.count(1)  # the clock reads 1 at the first text, 2 at the second, 3 at the end
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)), time=lambda: 0.0)
    metrics = fake_metrics()
    outcome = Outcome(Generation("ab", [3, 4], GenerationStats(), "length"), None, 0.0)
    run_stream(bare_reply(False, metrics=metrics), [[(0, "a")], [(0, "b")], [(0, FINISHED)]], [outcome], monkeypatch, clock)
    value = metrics.registry.get_sample_value
    assert value("decodekit:time_to_first_token_seconds_sum") == 1.0
    assert value("decodekit:e2e_request_latency_seconds_sum") == 3.0


def test_choices_cancelled_mid_stream_are_counted_each_with_its_own_first_token_time():
    """A stream that ends early (its client gone) counts each choice when its thread stops, with the
    time to first token that choice had: choice 0 had text at 1 s, choice 1 none yet."""
    from concurrent.futures import Future

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.scheduler import Outcome

    metrics = fake_metrics()
    futures = {0: Future(), 1: Future()}
    bare_reply(True, metrics=metrics).record_when_stopped(futures, {0: 1.0})
    for future in futures.values():  # the threads stop after the stream has gone
        future.set_result(Outcome(Generation("a", [3], GenerationStats(), "cancelled"), None, 0.0))
    value = metrics.registry.get_sample_value
    assert value("decodekit:e2e_request_latency_seconds_count") == 2
    assert value("decodekit:time_to_first_token_seconds_count") == 1
    assert value("decodekit:time_to_first_token_seconds_sum") == 1.0


def test_an_error_in_a_stream_is_counted_by_its_status(monkeypatch):
    """A stream that fails after it began answers with an error event and [DONE], and the error is
    in the metrics as one answered before the stream would be."""
    from decodekit.errors import DecodeKitError
    from decodekit.serve.reply import FINISHED

    metrics = fake_metrics()
    events = run_stream(bare_reply(True, metrics=metrics), [[(0, FINISHED)]],
                        [DecodeKitError("the logits are not finite")], monkeypatch)
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "the logits are not finite"
    assert metrics.registry.get_sample_value("decodekit:request_errors_total", {"status": "400"}) == 1


def test_a_replys_time_to_first_token_counts_its_reading_wait_and_prefill():
    """Not streamed, a method decoding token by token: its first token came after the request was
    read (job submitted), its wait and its prompt's reading; a search settles its answer last (at the
    end); an answer without tokens has none."""
    import time

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.scheduler import Job, Outcome

    reply = bare_reply(False)
    reply.started = 10.0
    job = Job([1, 2], "greedy", {}, 8, submitted=12.5)
    outcome = Outcome(Generation("ab", [3, 4], GenerationStats(prefill_s=0.25), "length"), None, 1.0)
    assert reply.first_token_s(outcome, job) == 2.5 + 1.0 + 0.25
    assert reply.first_token_s(Outcome(Generation.cancelled(), None, 1.0), job) is None
    search = bare_reply(False, method="best-of-n")
    search.started = time.perf_counter() - 100.0  # arrived 100 s ago, submitted at once, no wait, no prefill
    job = Job([1, 2], "best-of-n", {}, 8, submitted=search.started)
    assert search.first_token_s(Outcome(Generation("ab", [3, 4], GenerationStats(), "length"), None, 0.0), job) >= 100.0


def test_legacy_logprobs_show_a_cut_tokens_text_only_as_far_as_the_text_goes():
    """A completion's logprobs.tokens join to its text: a token a stop string cut inside shows only
    its characters before the stop, and text_offset indexes the text."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.engine.stops import cut_at_stop
    from decodekit.serve.scheduler import Outcome

    generated = [0, 1, 2, 3, 4]
    text, kept, _ = cut_at_stop(Words(), generated, ["rld"])
    g = Generation(text, kept, GenerationStats(), "stop", cut_off=generated[len(kept):])
    outcome = Outcome(g, [(-0.1, []), (-0.2, []), (-0.3, [])], 0.0)
    logprobs = bare_reply(False, tokenizer=Words())._logprobs(outcome)
    assert logprobs["tokens"] == ["He", "llo", " wo"] and "".join(logprobs["tokens"]) == text
    assert logprobs["text_offset"] == [0, 2, 5] and logprobs["token_logprobs"] == [-0.1, -0.2, -0.3]


def test_a_chat_logprob_entry_of_a_kept_token_has_the_tokens_own_bytes():
    """OpenAI's bytes field: the token's own bytes, so that byte tokens of one character each keep
    theirs (their bytes join to the character; their text is the tokenizer's)."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.scheduler import Outcome

    class Bytes:
        vocab = [b"\xc3", b"\xa9"]  # "é" in two tokens

        def decode(self, tokens):
            return b"".join(self.vocab[t] for t in tokens).decode("utf-8", "replace")

        def token_bytes(self, token):
            return self.vocab[token]

    outcome = Outcome(Generation("é", [0, 1], GenerationStats(), "eos"), [(-0.1, []), (-0.2, [])], 0.0)
    content = bare_reply(True, tokenizer=Bytes())._logprobs(outcome)["content"]
    assert [c["bytes"] for c in content] == [[0xC3], [0xA9]]
    assert [c["token"] for c in content] == ["\ufffd", "\ufffd"]


def test_request_fields_of_the_wrong_type_are_400s_naming_them():
    """Each field's own type checked, the error naming it (never a 500 from reading it as another type)."""
    messages = [{"role": "user", "content": "hi"}]
    assert refused({"prompt": "hi", "stop": ["a", 1]}) == "stop"
    assert refused({"prompt": "hi", "stream": True, "stream_options": "yes"}) == "stream_options"
    assert refused({"prompt": "hi", "method": 5}) == "method"
    assert refused({"prompt": "hi", "method_options": ["top_k"]}) == "method_options"
    assert refused({"prompt": "hi", "response_format": {"type": "json_schema"}}) == "response_format"
    assert refused({"messages": []}, chat=True) == "messages"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    assert refused({"messages": [{"role": "user", "content": [image]}]}, chat=True) == "messages"
    assert parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, chat=True).prompt == messages


def test_an_option_given_in_the_body_and_in_method_options_is_refused():
    """Two values for one option: refused, never one of them silently taken."""
    assert refused({"prompt": "hi", "top_k": 3, "method_options": {"top_k": 4}}) == "method_options"
    assert parse_request({"prompt": "hi", "method_options": {"top_k": 4}}, chat=False).params["top_k"] == 4


def test_openai_sampling_fields_keep_the_method_asked_for():
    """Temperature 0 makes plain sampling greedy and leaves another method as it is (a search draws
    at its sample_temperature); OpenAI's default temperature 1 is for plain sampling only; both
    penalties are passed on; an unseeded sampling request gets a seed of its own."""
    spec = parse_request({"prompt": "hi", "method": "best-of-n", "temperature": 0}, chat=False)
    assert (spec.method, spec.params) == ("best-of-n", {"temperature": 0.0})
    spec = parse_request({"prompt": "hi", "method": "pld"}, chat=False)
    assert (spec.method, spec.params) == ("pld", {})
    spec = parse_request({"prompt": "hi", "temperature": 0.5, "frequency_penalty": 0.5, "seed": 1}, chat=False)
    assert spec.params == {"temperature": 0.5, "frequency_penalty": 0.5, "seed": 1}
    seeds = {parse_request({"prompt": "hi", "temperature": 0.7}, chat=False).params["seed"] for _ in range(3)}
    assert len(seeds) > 1  # (three equal draws of 2**31: once in 2**62)


def test_an_errors_param_is_the_request_field_it_is_about():
    """The error object's param: method_options for a search option named like a body field (the
    search's n, not the choices' n), the constraint's own field, none where no field is named."""
    from decodekit.errors import DecodeKitError
    from decodekit.serve.request import field_named

    assert field_named(DecodeKitError("n must be >= 1"), {"n": 2, "method_options": {"n": 0}}, False) == "method_options"
    assert field_named(DecodeKitError("n must be >= 1"), {"n": 2}, False) == "n"
    assert field_named(DecodeKitError("structured decoding failed"), {"prompt": "hi"}, False) is None
    bad = InvalidParameter("the regex does not compile", param="constraint")
    assert field_named(bad, {"prompt": "hi", "guided_regex": "("}, False) == "guided_regex"
    assert field_named(bad, {"prompt": "hi", "response_format": {"type": "json_object"}}, False) == "response_format"


def test_an_unsupported_field_at_0_or_empty_text_is_refused():
    """Only OpenAI's defaults (null, false, empty lists and objects) ask for nothing: "" or 0 are values
    asked for (a suffix of "" is not no suffix), so they are refused as the field is."""
    assert refused({"prompt": "hi", "suffix": ""}) == "suffix"
    assert refused({"prompt": "hi", "echo": 0}) == "echo"
    assert parse_request({"prompt": "hi", "echo": False, "suffix": None, "tools": []}, chat=False).prompt == "hi"


def test_a_body_must_be_an_object_and_a_streamed_body_may_be_exactly_the_limit():
    """A JSON body that is not an object is a 400; a body sent without its size is read up to the
    limit, included, and a 413 past it."""
    import asyncio

    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import read_body

    class Sent:
        def __init__(self, data: bytes):
            self.headers, self.data = {}, data

        async def stream(self):
            for at in range(0, len(self.data), 1 << 20):
                yield self.data[at : at + (1 << 20)]

    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(Sent(b"[1]")))
    assert err.value.status == 400
    assert asyncio.run(read_body(Sent(b"{}" + b" " * (MAX_BODY_BYTES - 2)))) == {}
    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(Sent(b"{}" + b" " * (MAX_BODY_BYTES - 1))))
    assert err.value.status == 413


def test_a_prompt_too_long_names_the_field_the_client_sent_and_every_error_is_counted(served):
    """context_length_exceeded names messages for a chat and prompt for a completion; each request
    answered with an error counts once under its status in /metrics."""
    errors = 'decodekit:request_errors_total{status="400"}'
    before = metric(served, errors)
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
                              ("/v1/completions", {"prompt": "x" * 3000}, "prompt")):
        status, text = post(served, path, {**body, "max_tokens": 10})
        error = json.loads(text)["error"]
        assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", param), text
    assert metric(served, errors) - before == 2


def test_metrics_gauges_and_histograms_read_their_own_figures():
    """Each series its own figure: running and waiting requests, the batcher's passes and rows, the
    queue time (not the latency), and each finish reason under its own label."""
    import types

    metrics = fake_metrics()
    g = types.SimpleNamespace(generated=2, tokens=[1, 2], finish_reason="eos", stats=types.SimpleNamespace(extra={}))
    metrics.finished(prompt_tokens=3, generation=g, queued_s=0.5, ttft_s=None, e2e_s=3.0)
    value = metrics.registry.get_sample_value
    assert (value("decodekit:num_requests_running"), value("decodekit:num_requests_waiting")) == (2, 5)
    assert (value("decodekit:batched_passes_total"), value("decodekit:batched_rows_total")) == (3, 7)
    assert value("decodekit:request_queue_time_seconds_sum") == 0.5
    assert value("decodekit:e2e_request_latency_seconds_sum") == 3.0
    assert value("decodekit:request_success_total", {"finished_reason": "eos"}) == 1


def test_a_waiting_choices_queue_time_runs_until_a_slot_frees():
    """queued_s is from submission to the start in a slot: a choice that waited for a busy slot
    starts only after that slot's choice was stopped, not when it was submitted."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=1) as (model, scheduler):
        prompt = model.tokenizer.encode(PROMPTS[0])
        long, waiting = slot_holder(prompt), Job(prompt, "greedy", {}, 4)
        (running,) = scheduler.submit([long])
        started(scheduler)
        (queued,) = scheduler.submit([waiting])
        stopped_at = time.perf_counter()
        scheduler.cancel([long])
        outcome = queued.result(timeout=60)
        assert running.result(timeout=60).generation.finish_reason == "cancelled"
        assert waiting.started > stopped_at > waiting.submitted
        assert outcome.queued_s == waiting.started - waiting.submitted


def test_a_choice_cancelled_before_it_decodes_has_no_logprobs():
    """Log-probabilities come with an answer: a cancelled choice (its client gone) gets none, and no teacher-forced pass."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=0) as (model, scheduler):
        job = Job(model.tokenizer.encode(PROMPTS[1]), "greedy", {}, 6, top_logprobs=2)
        job.cancelled.set()  # the client left before the choice took its slot
        (future,) = scheduler.submit([job])
        outcome = future.result(timeout=60)
        assert outcome.generation.finish_reason == "cancelled" and outcome.logprobs is None


def test_streamed_choices_each_carry_their_own_index(served):
    """n = 2 streamed: each chunk names the choice its text is of (each choice's text callback keeps
    its own index), so the texts joined by index are the choices the same request gets unstreamed."""
    ask = {"max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2}
    want = [c.message.content for c in chat(served, PROMPTS[2], **ask).choices]
    texts, ends = ["", ""], [None, None]
    for chunk in chat(served, PROMPTS[2], stream=True, **ask):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            ends[c.index] = c.finish_reason or ends[c.index]
    assert want[0] != want[1] and texts == want and None not in ends


def test_a_chats_max_completion_tokens_is_its_limit():
    """max_completion_tokens is OpenAI's newer name for a chat's max_tokens (the one its current
    clients send): a chat takes it as its limit, not the rest of the context."""
    messages = [{"role": "user", "content": "hi"}]
    assert parse_request({"messages": messages, "max_completion_tokens": 5}, chat=True).max_tokens == 5
    # both given: the newer name wins, as vLLM has it (the older one is deprecated for chats)
    assert parse_request({"messages": messages, "max_tokens": 2, "max_completion_tokens": 5}, chat=True).max_tokens == 5
    assert parse_request({"prompt": "hi", "max_tokens": 7, "max_completion_tokens": 3}, chat=False).max_tokens == 3
    assert parse_request({"prompt": "hi", "max_tokens": 7}, chat=False).max_tokens == 7


def test_logprobs_without_top_logprobs_give_each_tokens_own(served):
    """logprobs: true without top_logprobs (a chat), or a completion's logprobs 0: every token's own
    log-probability, with no alternatives; 0 alternatives is not "no logprobs"."""
    got = chat(served, PROMPTS[3], max_tokens=4, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    text = served.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True})
    assert len(text.choices[0].logprobs.token_logprobs) == 4


def test_a_get_of_a_post_route_is_a_405_error_object(served):
    """A route asked with the wrong method (a browser's GET of the chat API): 405, an OpenAI error
    object saying which route was asked for, as a missing route's 404 does."""
    status, body, _ = served.get("/v1/chat/completions")
    error = json.loads(body)["error"]
    assert status == 405 and error["message"] == "no route GET /v1/chat/completions"
    assert error["type"] == "invalid_request_error"


def test_an_unforeseen_exception_is_a_counted_500_naming_its_type(served, monkeypatch):
    """An error no check foresaw is a 500 server_error naming its type (no traceback), and it is
    counted in /metrics as every error answered is."""
    def broken(jobs):
        raise RuntimeError("boom")

    monkeypatch.setattr(served.server.scheduler, "submit", broken)
    before = server_errors(served)
    status, body = post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    error = json.loads(body)["error"]
    assert status == 500 and error["type"] == "server_error" and error["message"] == "internal error: RuntimeError: boom"
    assert server_errors(served) - before == 1


@pytest.mark.parametrize("fault", ["InvalidModel", "CacheError", "ModelNotFound", "ClusterError"])
def test_a_servers_fault_found_while_decoding_is_a_500_with_no_retry_after(served, monkeypatch, fault):
    """A damaged model (or cache, or a model file gone, or a cluster lost) found while decoding is a
    500 server_error, not the request's 400; Retry-After is for a 503 only (loading or full: come back
    later), not for a fault a retry would meet again."""
    from concurrent.futures import Future

    from decodekit import errors

    def damaged(jobs):
        failed: Future = Future()
        failed.set_exception(getattr(errors, fault)("the weights are damaged"))
        return [failed for _ in jobs]

    monkeypatch.setattr(served.server.scheduler, "submit", damaged)
    request = urllib.request.Request(served.url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 500 and error["type"] == "server_error" and "damaged" in error["message"]
    assert err.value.headers.get("Retry-After") is None


def test_a_stream_is_sent_as_server_sent_events_that_no_cache_keeps(served):
    """A stream's reply is text/event-stream with Cache-Control: no-cache, so that a proxy between
    the server and its client passes each event on instead of holding the reply."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True}).encode()
    request = urllib.request.Request(served.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as reply:
        assert reply.status == 200 and reply.read().decode().endswith("data: [DONE]\n\n")
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        assert reply.headers["Cache-Control"] == "no-cache"


def test_a_method_set_to_null_is_a_method_not_given():
    """A null field is a field not given, ``method`` too: plain sampling at OpenAI's default
    temperature, or greedy decoding at temperature 0 (not a 400 "method must be a string")."""
    spec = parse_request({"prompt": "hi", "method": None, "seed": 1}, chat=False)
    assert (spec.method, spec.params) == ("sample", {"temperature": 1.0, "seed": 1})
    assert parse_request({"prompt": "hi", "method": None, "temperature": 0}, chat=False).method == "greedy"


def test_truncation_options_beside_temperature_0_are_read_as_the_engine_reads_them(served, alone):
    """Temperature 0 reaches the method as the Python API takes it: plain sampling or a speculative
    method with a truncation option beside it decodes greedily (not a 400 saying no temperature was
    given), and a search method's samples, drawn at its sample_temperature, keep the top_p asked for."""
    greedy = alone(PROMPTS[0], max_new_tokens=8).text
    for options in ({"top_k": 3}, {"method": "sample", "min_p": 0.2}, {"method": "pld", "top_k": 3}):
        got = chat(served, PROMPTS[0], max_tokens=8, temperature=0, extra_body=options)
        assert got.choices[0].message.content == greedy, options
    spec = parse_request({"prompt": "hi", "method": "best-of-n", "temperature": 0, "top_p": 0.5}, chat=False)
    assert spec.params["top_p"] == 0.5
    # plain sampling at temperature 0 with only top_p (which OpenAI clients often send) is plain greedy decoding
    spec = parse_request({"prompt": "hi", "temperature": 0, "top_p": 0.5}, chat=False)
    assert spec.method == "greedy" and "top_p" not in spec.params
    search = {"method": "best-of-n", "n": 3, "max_new_tokens": 8, "temperature": 0, "seed": 5}
    got = served.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, seed=5,
                                           top_p=0.3, extra_body={"method": "best-of-n", "method_options": {"n": 3}})
    assert got.choices[0].text == alone(PROMPTS[2], **search, top_p=0.3).text


def test_a_boolean_is_not_a_sampling_number():
    """temperature, top_p and the penalties are numbers: true is refused (it would be read as 1),
    the error naming the field, as a boolean for an integer field is."""
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        assert refused({"prompt": "hi", field: True}) == field, field


def test_a_messages_text_parts_join_as_they_are_written():
    """A content given as text parts is their text end to end (no separator added between them)."""
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    spec = parse_request({"messages": [{"role": "user", "content": parts}]}, chat=True)
    assert spec.prompt == [{"role": "user", "content": "Hello, world"}]


def test_a_streamed_request_with_a_bad_option_is_a_400_before_its_stream_starts(served):
    """The method's options and the sampler's parameters are checked before anything is queued: a
    bad one in a streamed request is a 400 error object, not a 200 stream that ends in an error event;
    and so is one found as decoding starts, before the stream's first text."""
    base = {"prompt": "hi", "max_tokens": 2, "stream": True}
    for extra, param in (({"method": "pld", "budget": -1}, "budget"), ({"temperature": 0.7, "top_k": 0}, "top_k")):
        status, body = post(served, "/v1/completions", {**base, **extra})
        assert status == 400 and json.loads(body)["error"]["param"] == param, (extra, status, body)
    # found once decoding starts, before any text (the tiny model has no trained drafter): the status
    # is the request's, as without stream, and the stream never starts
    errors = metric(served, 'decodekit:request_errors_total{status="400"}')
    for stream in (False, True):
        status, body = post(served, "/v1/completions", {**base, "stream": stream, "method": "eagle"})
        assert status == 400 and "no eagle drafter for" in json.loads(body)["error"]["message"], (stream, body)
    assert metric(served, 'decodekit:request_errors_total{status="400"}') == errors + 2
    assert served.get("/health")[0] == 200


def test_a_body_that_is_not_utf8_is_a_400_not_json():
    """A body whose bytes are not UTF-8 is not JSON: a 400 naming it so, never an unforeseen 500."""
    import asyncio

    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import read_body

    class Sent:
        headers = {}

        async def stream(self):
            yield b'{"prompt": "\xff"}'

    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(Sent()))
    assert err.value.status == 400 and "not valid JSON" in str(err.value)


def test_another_models_name_is_a_404_with_its_code(served):
    """A request or a card for a model this server does not serve: 404 with OpenAI's code
    model_not_found and param model, which clients read to tell it from a missing route."""
    status, body = post(served, "/v1/completions", {"model": "gpt-9", "prompt": "hi", "max_tokens": 2})
    error = json.loads(body)["error"]
    assert status == 404 and (error["code"], error["param"], error["type"]) == ("model_not_found", "model",
                                                                                  "invalid_request_error")
    status, body, _ = served.get("/v1/models/gpt-9")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    for model in (5, ["gpt-9"], {"name": "gpt-9"}):  # not a name at all: a malformed field
        status, body = post(served, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "model" and "model must be a string" in error["message"]


# The prompt cache: what a slot held before another prompt overwrote it -------------------------

def test_a_cached_prefix_restored_in_another_cache_reads_the_rest_to_the_same_bits():
    """A slot's entries copied out (snapshot) and into another clone (restore): the prompt's rest read
    there gives the logits, and then the decode, of the whole prompt read in a fresh cache."""
    model = tiny_model()
    prompt = model.tokenizer.encode(PROMPTS[2])
    source, target, fresh = (model.backend.clone() for _ in range(3))
    source.prefill(prompt[:20])
    source.keep(prompt[:20])
    target.prefill(model.tokenizer.encode(PROMPTS[1]))  # it held something else before
    target.restore(source.snapshot())
    assert target.shared_prefix(prompt) == 20 and target.length == 20
    got, want = target.prefill(prompt), fresh.prefill(prompt)
    assert torch.equal(got, want) and target.length == fresh.length == len(prompt)
    token = torch.tensor([[int(want.argmax())]])
    assert torch.equal(target.append(token).logits, fresh.append(token).logits)


def test_a_snapshot_fits_only_caches_of_its_own_model_and_policy():
    model = tiny_model()
    source = model.backend.clone()
    source.prefill([5, 6, 7])
    assert source.snapshot() is None  # nothing said to be kept
    source.keep([5, 6, 7])
    snap = source.snapshot()
    assert snap.ids == (5, 6, 7) and snap.nbytes > 0
    import dataclasses

    assert dataclasses.replace(snap, features=torch.zeros(3, 4)).nbytes == snap.nbytes + 48  # (the features count)
    other = tiny_model().backend  # the same shapes, other weights
    with pytest.raises(ValueError, match="another model"):
        other.restore(snap)
    with pytest.raises(ValueError, match="another model"):
        model.backend.truncated(1).restore(snap)  # its first layer only (the same weights)
    windowed = model.backend.with_kv_cache("sink:2,window:8")  # evicts: its entries are not the prompt's
    windowed.prefill([5, 6, 7])
    windowed.keep([5, 6, 7])
    assert windowed.snapshot() is None
    with pytest.raises(ValueError, match="another model, policy"):
        windowed.restore(snap)


def prefix(ids, nbytes):
    from decodekit.models.backend import CachedPrefix

    return CachedPrefix(tuple(ids), "owner", (torch.zeros(nbytes, dtype=torch.uint8),))


def test_the_prompt_cache_keeps_the_longest_entries_within_its_budget_least_recently_used_out_first():
    from decodekit.serve.prompt_cache import PromptCache

    cache = PromptCache(budget_bytes=300)
    cache.put(prefix([1, 2, 3], 100))
    cache.put(prefix([1, 2, 3, 4, 5], 100))  # covers the first: it replaces it
    cache.put(prefix([1, 2], 100))  # covered by an entry: nothing to add
    assert len(cache) == 1 and cache.nbytes == 100
    cache.put(prefix([7, 8, 9], 100))
    cache.put(prefix([4, 4, 4], 100))
    entry, shared = cache.longest([1, 2, 3, 4, 9, 9])  # the oldest, now the most recently used
    assert entry.ids == (1, 2, 3, 4, 5) and shared == 4
    cache.put(prefix([6, 6], 100))  # over the budget: the least recently used ([7, 8, 9]) goes
    assert cache.longest([7, 8, 9, 1]) == (None, 0) and cache.longest([4, 4, 4, 4])[1] == 3
    assert cache.nbytes == 300 and len(cache) == 3
    assert cache.longest([1, 2, 3, 4, 5])[1] == 4  # never the prompt's last token: it is read for its logits
    # an entry sharing no more than the prompt's slot does is not used: neither found nor made recent
    assert cache.longest([6, 6, 6], beyond=2) == (None, 0)
    cache.put(prefix([5, 5], 100))  # so the least recently used, [6, 6], goes
    assert cache.longest([6, 6, 6]) == (None, 0) and cache.longest([4, 4, 4, 4])[1] == 3
    cache.put(prefix([9], 301))  # larger than the whole budget: not kept, nothing dropped for it
    assert len(cache) == 3 and cache.covers([4, 4]) and not cache.covers([4, 4, 4, 4])


def test_a_machine_short_of_memory_keeps_nothing_more_in_the_prompt_cache(monkeypatch):
    from decodekit import machine
    from decodekit.serve.prompt_cache import MEMORY_RESERVE, PromptCache

    cache = PromptCache(budget_bytes=10**6)
    monkeypatch.setattr(machine, "available_memory", lambda: MEMORY_RESERVE + 99)
    cache.put(prefix([1, 2, 3], 100))
    assert len(cache) == 0
    monkeypatch.setattr(machine, "available_memory", lambda: MEMORY_RESERVE + 100)
    cache.put(prefix([1, 2, 3], 100))
    assert len(cache) == 1


def test_a_prompt_whose_slot_was_taken_by_others_starts_from_the_prompt_cache(alone):
    """One slot, three conversations in turn: the first's cache is overwritten by the second's, goes to
    the prompt cache, and the first's next turn starts from it; answers as alone."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=0) as (model, scheduler):
        first, second = (model.tokenizer.encode(p) for p in ("tell me about cats and dogs", PROMPTS[1]))
        (future,) = scheduler.submit([Job(first, "greedy", {}, 6, ignore_eos=True)])
        answer = future.result(timeout=60).generation.tokens
        (future,) = scheduler.submit([Job(second, "greedy", {}, 6, ignore_eos=True)])
        future.result(timeout=60)
        assert len(scheduler.prompt_cache) == 1
        before = scheduler.prefix_tokens
        follow = first + answer + model.tokenizer.encode(" and fish?")
        (again,) = scheduler.submit([Job(follow, "greedy", {}, 8, ignore_eos=True)])
        answer = again.result(timeout=60).generation.tokens
        assert answer == alone(follow, max_new_tokens=8, ignore_eos=True).tokens
        assert scheduler.prefix_tokens - before == len(first) + 6 - 1  # (the last answer token: unread)
        assert len(scheduler.prompt_cache) == 2  # the second conversation, overwritten in turn
        # the turn after: the slot holds more of it than the prompt cache's entry of its start
        before, third = scheduler.prefix_tokens, follow + answer + model.tokenizer.encode(" ok?")
        (turn,) = scheduler.submit([Job(third, "greedy", {}, 4)])
        assert turn.result(timeout=60).generation.tokens == alone(third, max_new_tokens=4).tokens
        assert scheduler.prefix_tokens - before == len(follow) + len(answer) - 1


def test_a_prompt_sharing_a_few_tokens_of_a_long_entry_copies_only_those(alone):
    """A long conversation in the prompt cache, and a prompt that shares its first tokens only: the
    slot takes those (not the whole entry, to be overwritten at once, its cache grown for it), and
    answers as alone."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=0) as (model, scheduler):
        slot = scheduler._free[0].model.backend
        long = model.tokenizer.encode("tell me about cats " * 40)  # longer than a fresh cache's capacity
        for prompt in (long, model.tokenizer.encode(PROMPTS[1])):  # the second overwrites the first
            scheduler.submit([Job(prompt, "greedy", {}, 3, ignore_eos=True)])[0].result(timeout=60)
        assert len(scheduler.prompt_cache) == 1
        fresh_capacity, before = slot._k.shape[3], scheduler.prefix_tokens
        prompt = long[:12] + model.tokenizer.encode("dogs?")
        (future,) = scheduler.submit([Job(prompt, "greedy", {}, 4, ignore_eos=True)])
        assert future.result(timeout=60).generation.tokens == alone(prompt, max_new_tokens=4, ignore_eos=True).tokens
        assert scheduler.prefix_tokens - before == 12
        assert slot._k.shape[3] == fresh_capacity < len(long)


def test_a_slot_holding_more_than_the_whole_budget_is_not_copied_out(monkeypatch):
    """A copy the prompt cache would refuse anyway is never made (a transient copy of a long
    conversation, past the budget, on the thread that runs every slot's passes)."""
    from decodekit.serve.scheduler import Job

    model = tiny_model()
    source = model.backend.clone()
    source.prefill([5, 6, 7, 8])
    source.keep([5, 6, 7, 8])
    size = source.snapshot().nbytes
    assert source.snapshot(max_bytes=size).nbytes == size and source.snapshot(max_bytes=size - 1) is None
    with scheduler_of(max_batch=1, max_queue=0, prompt_cache_mib=0.01) as (model, scheduler):
        slot = scheduler._free[0].model.backend
        made = []
        snapshot = slot.snapshot
        monkeypatch.setattr(slot, "snapshot", lambda **kw: made.append(snapshot(**kw)) or made[-1])
        for prompt in ("tell me about cats and dogs and fish", "ab", "tell me about cats and dogs"):
            scheduler.submit([Job(model.tokenizer.encode(prompt), "greedy", {}, 3)])[0].result(timeout=60)
        assert len(made) == 2 and made[0] is None and made[1].nbytes <= scheduler.prompt_cache.budget_bytes
        assert len(scheduler.prompt_cache) == 1  # the short one


def test_without_a_prompt_cache_a_taken_slot_forgets(alone):
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=1, max_queue=0, prompt_cache_mib=0) as (model, scheduler):
        first, second = (model.tokenizer.encode(p) for p in ("tell me about cats and dogs", PROMPTS[1]))
        for prompt in (first, second):
            scheduler.submit([Job(prompt, "greedy", {}, 4)])[0].result(timeout=60)
        before = scheduler.prefix_tokens
        (again,) = scheduler.submit([Job(first + [5], "greedy", {}, 4)])
        assert again.result(timeout=60).generation.tokens == alone(first + [5], max_new_tokens=4).tokens
        assert scheduler.prefix_tokens == before and scheduler.prompt_cache is None


def test_of_idle_slots_sharing_nothing_the_one_freed_first_is_taken():
    """The cache used last stays in its slot for a conversation's next turn."""
    from decodekit.serve.scheduler import Job

    with scheduler_of(max_batch=2, max_queue=0, prompt_cache_mib=0) as (model, scheduler):
        a, b = (model.tokenizer.encode(p) for p in ("tell me about cats", "the weather today"))
        for prompt in (a, b):  # one after the other: a's slot is freed first
            scheduler.submit([Job(prompt, "greedy", {}, 3)])[0].result(timeout=60)
        scheduler.submit([Job(model.tokenizer.encode("zzz unrelated"), "greedy", {}, 3)])[0].result(timeout=60)
        slots = [engine.model.backend for engine in scheduler._free]
        assert any(s.shared_prefix(b + [1]) == len(b) for s in slots)  # b's cache was kept
        assert not any(s.shared_prefix(a + [1]) == len(a) for s in slots)


def test_a_shutdown_refuses_an_answer_with_any_choice_cut_short():
    """An answer of n choices with any of them cut short by the shutdown is a 503, not a 200 with part of its text."""
    from decodekit.serve.app import Server
    from decodekit.serve.errors import ApiError

    server = Server(tiny_model)
    server.stopping = True
    outcome = lambda reason: SimpleNamespace(generation=SimpleNamespace(finish_reason=reason))  # noqa: E731
    server.refuse_if_stopped([outcome("length"), outcome("eos")])  # nothing cut short: answered
    with pytest.raises(ApiError) as refused:
        server.refuse_if_stopped([outcome("length"), outcome("cancelled")])
    assert refused.value.status == 503


def test_prompt_cache_gauges_read_their_own_figures():
    from decodekit.serve.metrics import ServerMetrics

    class Cache(list):
        nbytes = 1000

    batcher = SimpleNamespace(passes=0, rows=0)
    scheduler = SimpleNamespace(running=0, waiting=0, prefix_tokens=7, prompt_cache=Cache([1, 2]), batcher=batcher)
    metrics = ServerMetrics(scheduler)
    value = metrics.registry.get_sample_value
    assert value("decodekit:prompt_cache_bytes") == 1000 and value("decodekit:prompt_cache_entries") == 2
    assert value("decodekit:prefix_cache_hit_tokens_total") == 7


def test_a_search_of_exactly_16_candidates_is_taken():
    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import check_method, parse_request

    model = tiny_model()
    check_method(parse_request({"prompt": "hi", "method": "beam", "method_options": {"n": 16}}, chat=False), model)
    with pytest.raises(ApiError):
        check_method(parse_request({"prompt": "hi", "method": "beam", "method_options": {"n": 17}}, chat=False), model)


def test_a_choice_cancelled_while_it_waits_counts_its_wait_as_queue_time():
    """The queue-time histogram reads each choice's wait, a choice cancelled before it ran included."""
    from decodekit.serve.scheduler import Job, Scheduler

    scheduler = Scheduler(tiny_model(), max_batch=1, max_queue=1, prompt_cache_mib=0)
    ids = list(range(10, 30))
    long, short = Job(ids, "greedy", {}, 1500, ignore_eos=True), Job(ids, "greedy", {}, 2)
    (running,), (waiting,) = scheduler.submit([long]), scheduler.submit([short])
    time.sleep(0.3)
    scheduler.cancel([short])
    assert waiting.result(timeout=5).queued_s >= 0.3
    scheduler.cancel([long])
    running.result(timeout=60)
    scheduler.close()


def test_a_prompt_that_extends_all_its_slot_holds_copies_nothing_to_the_prompt_cache():
    """A chat's next turn goes on from its slot: nothing of it is copied to the prompt cache."""
    from decodekit.serve.scheduler import Job, Scheduler

    scheduler = Scheduler(tiny_model(), max_batch=1, prompt_cache_mib=64)
    scheduler.submit([Job(list(range(10, 30)), "greedy", {}, 4)])[0].result(timeout=60)
    kept = list(scheduler._free[0].model.backend.kept_ids)
    scheduler.submit([Job(kept + [40, 41], "greedy", {}, 4)])[0].result(timeout=60)
    assert len(scheduler.prompt_cache) == 0
    scheduler.close()

def test_a_prompt_cache_entry_of_exactly_the_budget_is_kept_and_the_others_make_room():
    """The budget is the most the cache holds: an entry of exactly the budget is kept (only one past it
    is refused), the entries before it dropped to make room for it."""
    from decodekit.serve.prompt_cache import PromptCache

    cache = PromptCache(budget_bytes=300)
    cache.put(prefix([1, 2], 100))
    cache.put(prefix([3, 4], 300))
    assert len(cache) == 1 and cache.nbytes == 300 and cache.covers([3, 4]) and not cache.covers([1, 2])
    cache.put(prefix([5, 6], 301))
    assert len(cache) == 1 and cache.covers([3, 4])


def test_a_prompt_cache_entry_put_again_keeps_its_place_in_the_order():
    """An entry whose tokens the cache holds already adds nothing: it is not made the most recently
    used (only a hit, longest(), does that), so it is still the first to go."""
    from decodekit.serve.prompt_cache import PromptCache

    cache = PromptCache(budget_bytes=200)
    first = prefix([1, 2], 100)
    cache.put(first)
    cache.put(prefix([3, 4], 100))
    cache.put(prefix([1, 2], 100))  # covered by the entry [1, 2]: nothing to add
    assert len(cache) == 2 and cache.nbytes == 200
    cache.put(prefix([5, 6], 100))  # over the budget: the least recently used, [1, 2], goes
    assert not cache.covers([1, 2]) and cache.covers([3, 4]) and cache.covers([5, 6])


def test_a_replys_id_fingerprint_model_and_message_are_as_openai_writes_them():
    """A chat's id starts "chatcmpl-", a completion's "cmpl-"; every body and chunk names the model
    and the numerics as its system_fingerprint; a chat's message carries the assistant's role."""
    import types

    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.reply import Reply
    from decodekit.serve.scheduler import Job, Outcome

    server = types.SimpleNamespace(metrics=None, model_id="tiny", numerics="exact",
                                   scheduler=types.SimpleNamespace(model=types.SimpleNamespace(tokenizer=None)))
    spec = types.SimpleNamespace(method="greedy", include_usage=False)
    outcome = Outcome(Generation("ab", [3, 4], GenerationStats(), "eos"), None, 0.0)
    for chat, start in ((True, "chatcmpl-"), (False, "cmpl-")):
        reply = Reply(server, chat, spec, [1, 2], 0.0, {})
        assert reply.id.startswith(start) and len(reply.id) == len(start) + 24
        body = reply.whole([outcome], [Job([1, 2], "greedy", {}, 8)])
        chunk = json.loads(reply._chunk(0, "a", None).removeprefix("data: "))
        for event in (body, chunk):
            assert (event["id"], event["model"], event["system_fingerprint"]) == (reply.id, "tiny", "decodekit-exact")
            assert isinstance(event["created"], int)
        if chat:
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
        else:
            assert body["choices"][0]["text"] == "ab" and "message" not in body["choices"][0]


def test_openai_fields_that_change_no_answer_are_accepted_and_passed_on_to_nothing():
    """user, store, metadata and OpenAI's other bookkeeping fields mean nothing for a local model:
    accepted (an OpenAI client sends them) and never read as a sampler parameter or a method option."""
    body = {"prompt": "hi", "temperature": 0, "user": "u1", "safety_identifier": "s", "store": True,
            "metadata": {"k": "v"}, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
            "parallel_tool_calls": True, "service_tier": "auto"}
    spec = parse_request(body, chat=False)
    assert (spec.method, spec.params) == ("greedy", {})
    spec = parse_request({**body, "messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert (spec.method, spec.params) == ("greedy", {})


def test_a_shutdown_answer_is_the_servers_error_to_retry():
    from decodekit.serve.errors import error_body, shutting_down

    err = shutting_down()
    assert (err.status, err.kind, err.code, err.param) == (503, "server_error", "server_shutting_down", None)
    assert error_body(str(err), err.kind, err.param, err.code)["type"] == "server_error"


def test_top_logprobs_name_each_alternative_with_its_own_value():
    """Each token's alternatives, best first: in a chat each an entry of its own token, bytes and
    log-probability; in a legacy completion a map from each alternative's text to its value."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.scheduler import Outcome

    logprobs = [(-0.5, [(2, -0.25), (0, -0.5)]), (-0.75, [(1, -0.75), (4, -2.0)])]
    outcome = Outcome(Generation("Hello", [0, 1], GenerationStats(), "eos"), logprobs, 0.0)
    content = bare_reply(True, tokenizer=Words())._logprobs(outcome)["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("He", -0.5, list(b"He")), ("llo", -0.75, list(b"llo"))]
    assert content[0]["top_logprobs"] == [{"token": " wor", "logprob": -0.25, "bytes": list(b" wor")},
                                          {"token": "He", "logprob": -0.5, "bytes": list(b"He")}]
    assert content[1]["top_logprobs"] == [{"token": "llo", "logprob": -0.75, "bytes": list(b"llo")},
                                          {"token": "!", "logprob": -2.0, "bytes": list(b"!")}]
    legacy = bare_reply(False, tokenizer=Words())._logprobs(outcome)
    assert legacy == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -0.75],
                      "top_logprobs": [{" wor": -0.25, "He": -0.5}, {"llo": -0.75, "!": -2.0}], "text_offset": [0, 2]}


def test_a_streamed_completion_is_its_texts_then_its_end_then_done(monkeypatch):
    """A legacy completion's stream has no role chunk (a chat's delta thing): each text as a chunk,
    the choice's end with its finish reason and an empty text, the usage when asked, then [DONE]."""
    from decodekit.engine.core import Generation, GenerationStats
    from decodekit.serve.reply import FINISHED
    from decodekit.serve.scheduler import Outcome

    outcome = Outcome(Generation("ab", [3, 4], GenerationStats(), "length"), None, 0.0)
    events = run_stream(bare_reply(False, include_usage=True), [[(0, "a")], [(0, "b"), (0, FINISHED)]], [outcome], monkeypatch)
    assert [e["choices"] for e in events[:-1]] == [
        [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "b", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
        []]
    assert events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in events[:-2]) and events[-1] == "[DONE]"


def test_an_errors_param_is_the_field_its_message_begins_with_quoted_or_not():
    """An error that names no field begins with it, bare, followed by a colon, or quoted: the param
    is the field's name, as the request spells it."""
    from decodekit.errors import DecodeKitError
    from decodekit.serve.request import field_named

    body = {"prompt": "hi", "top_k": 0}
    for message in ("top_k must be >= 1", "top_k: must be >= 1", "'top_k' must be >= 1"):
        assert field_named(DecodeKitError(message), body, chat=False) == "top_k", message
    assert field_named(DecodeKitError("'min_p' must be >= 0"), body, chat=False) is None  # not a field sent
