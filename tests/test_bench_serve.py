"""Tests for ``decodekit bench-serve`` (decodekit.serve.load) against a fake OpenAI-compatible
server started in the test: request counts, token counts, timings, results.json, the chart,
--compare, percentiles and bad input."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import socket
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from decodekit.bench.questions import load_questions, resolve_question_file
from decodekit.errors import InvalidParameter
from decodekit.serve.load import SCHEMA, RequestTiming, add_arguments, percentile, run, send

FIRST_SLEEP = 0.05  # before the first content chunk: the fake server's time to first token
CHUNK_SLEEP = 0.01  # between content chunks
CONTENT = ["Hello", ",", " world", "!"]
USAGE_TOKENS = 6  # more than the chunks, as a server sending several tokens a chunk would say
FAIL_EVERY = 5
N_QUESTIONS = len(load_questions(resolve_question_file(None), limit=1))


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, usage: bool = True, done: bool = True, port: int = 0):
        super().__init__(("127.0.0.1", port), FakeHandler)
        self.usage, self.done = usage, done
        self.lock = threading.Lock()
        self.posts: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def send_json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self.send_json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.posts.append(body)
            n = len(srv.posts)
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        ended = False

        def end() -> None:
            """The request leaves the count just before the last bytes the client waits for: with
            them it may send its next request before this handler has returned."""
            nonlocal ended
            if not ended:
                ended = True
                with srv.lock:
                    srv.in_flight -= 1

        try:
            if n % FAIL_EVERY == 0:
                end()
                self.send_json(503, {"error": {"message": "overloaded", "type": "server_error"}})
            else:
                self.stream(srv.usage, srv.done, end)
        finally:
            end()

    def stream(self, usage: bool, done: bool, end) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def event(delta: dict | None, **extra) -> None:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "fake-model",
                     "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}], **extra}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        event({"role": "assistant"})  # no content: must not count as the first token
        time.sleep(FIRST_SLEEP)
        for i, piece in enumerate(CONTENT):
            if i:
                time.sleep(CHUNK_SLEEP)
            event({"content": piece})
        event({})
        if usage:
            event(None, usage={"prompt_tokens": 9, "completion_tokens": USAGE_TOKENS, "total_tokens": 9 + USAGE_TOKENS})
        if done:  # else the connection closes mid-answer, as when a server dies
            end()
            self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    servers = []

    def start(usage: bool = True, done: bool = True) -> FakeServer:
        return serving(FakeServer(usage, done), servers)

    yield start
    stop_serving(servers)


def serving(srv, servers: list):
    """``srv`` answering on a thread of its own, noted in ``servers`` to be stopped."""
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    servers.append(srv)
    return srv


def stop_serving(servers: list) -> None:
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_percentile_known_lists():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_tpot_is_time_after_the_first_token_per_later_token():
    assert RequestTiming(e2e_s=1.0, ttft_s=0.2, tokens=5).tpot_s == pytest.approx(0.2)
    assert RequestTiming(e2e_s=1.0).tpot_s is None


def test_a_one_token_answer_has_no_tpot_and_stays_out_of_the_levels_tpot():
    """vLLM's benchmark_serving.py: TPOT only for answers of more than one token. After a one-token
    answer's only token comes the stream's end, no token: as a TPOT it would pull the level's down."""
    from decodekit.serve.load import summarize

    assert RequestTiming(e2e_s=1.0, ttft_s=0.2, tokens=1).tpot_s is None
    assert RequestTiming(e2e_s=1.0, ttft_s=0.2, tokens=0).tpot_s is None  # a server whose usage says none
    level = summarize([RequestTiming(e2e_s=1.0, ttft_s=0.2, tokens=5), RequestTiming(e2e_s=0.3, ttft_s=0.2, tokens=1)],
                      wall_s=1.0, load={"concurrency": 2})
    assert level["tpot_ms"] == {"p50": 200.0, "p90": 200.0, "p99": 200.0}
    assert level["ok"] == 2 and level["e2e_ms"]["p50"] == 650.0  # the answer counts everywhere else


def test_run_against_fake_server(fake_server, tmp_path, capsys):
    srv = fake_server()
    t0 = time.perf_counter()
    assert run(parse("--url", srv.url, "--concurrency", "1,3", "--limit", "1", "--out", str(tmp_path), "--method", "pld")) == 0
    elapsed = time.perf_counter() - t0

    # a warm-up request, then every question once per level, with the model from GET /models and the flags asked for
    assert len(srv.posts) == 1 + 2 * N_QUESTIONS
    body = srv.posts[0]
    assert body["model"] == "fake-model" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 128 and body["temperature"] == 0 and body["method"] == "pld"
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"]
    assert srv.max_in_flight == 3

    result = json.loads((tmp_path / "results.json").read_text())
    assert result["schema"] == SCHEMA and result["model"] == "fake-model" and result["url"] == srv.url
    assert result["label"] == srv.url.split("/")[2]
    assert "--model fake-model" in result["command"] and "--concurrency 1,3" in result["command"]
    assert result["load"] == "concurrency" and result["warmup"] == 1
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    # the server fails every 5th POST: the warm-up is the first, the levels run one after the other,
    # so the failures fall by count
    failures = [sum(1 for n in range(start + 1, start + N_QUESTIONS + 1) if n % FAIL_EVERY == 0)
                for start in (1, 1 + N_QUESTIONS)]
    for lv, failed in zip(result["levels"], failures):
        assert lv["failed"] == failed and lv["ok"] == N_QUESTIONS - failed
        assert lv["request_s"] == pytest.approx(lv["ok"] / lv["wall_s"], rel=1e-2)
        assert lv["errors"] == ["HTTP 503: overloaded"] * failed
        assert lv["output_tokens"] == lv["ok"] * USAGE_TOKENS  # usage wins over the 4 content chunks
        assert lv["output_tok_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"], rel=1e-3)
        assert set(lv["ttft_ms"]) == {"p50", "p90", "p99"}
        assert lv["ttft_ms"]["p50"] >= FIRST_SLEEP * 1e3
        assert lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p90"] <= lv["ttft_ms"]["p99"]
        stream_s = FIRST_SLEEP + CHUNK_SLEEP * (len(CONTENT) - 1)
        assert lv["e2e_ms"]["p50"] >= stream_s * 1e3
        # the time after the first token, spread over USAGE_TOKENS - 1 later tokens (never more than
        # the whole request's: a lower bound from the server's sleeps fails when the client reads its
        # first chunk late on a busy machine; RequestTiming.tpot_s's arithmetic is tested above)
        assert 0 < lv["tpot_ms"]["p50"] <= lv["e2e_ms"]["p50"] / (USAGE_TOKENS - 1)
    assert sum(lv["wall_s"] for lv in result["levels"]) <= elapsed
    # three workers overlap requests: the level takes well under three times one request each
    assert result["levels"][1]["wall_s"] < result["levels"][0]["wall_s"]
    assert result["levels"][0]["most_in_flight"] == 1 and 1 < result["levels"][1]["most_in_flight"] <= 3

    table = capsys.readouterr().out
    assert "| concurrency | ok | failed | most in flight | output tok/s | requests/s |" in table
    assert f"| 3 | {result['levels'][1]['ok']} | {result['levels'][1]['failed']} |" in table
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokens_counted_from_chunks_without_usage(fake_server):
    srv = fake_server(usage=False)
    out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error is None and out.tokens == len(CONTENT)
    assert FIRST_SLEEP <= out.ttft_s <= out.e2e_s


def test_stream_cut_before_done_is_an_error(fake_server):
    srv = fake_server(done=False)
    out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error == "the stream ended before data: [DONE]"


def test_errors_are_recorded_and_a_level_with_no_answer_ends_the_run_in_one_line(tmp_path):
    # --model given: no model list to fetch, so every request reaches the closed port and fails
    with pytest.raises(InvalidParameter, match="^every request at concurrency 2 failed, the first with: ConnectionRefusedError"):
        run(parse("--url", closed_port_url(), "--model", "m", "--concurrency", "2,4", "--limit", "1", "--out", str(tmp_path),
                  "--warmup", "0"))
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]  # recorded, and no further level run
    assert level["ok"] == 0 and level["failed"] == N_QUESTIONS and level["output_tok_s"] == 0
    assert level["ttft_ms"]["p50"] is None and len(level["errors"]) == 5
    assert level["errors"][0].startswith("ConnectionRefusedError")


def level(c: int, tok_s: float, ttft: float) -> dict:
    ms = {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3}
    return {"concurrency": c, "ok": 4, "failed": 0, "most_in_flight": c, "output_tok_s": tok_s, "request_s": tok_s / 100,
            "ttft_ms": ms, "tpot_ms": ms, "e2e_ms": ms, "errors": []}


def test_compare_two_results_files(tmp_path, capsys):
    a = {"schema": SCHEMA, "label": "decodekit", "url": "u", "model": "m", "command": "c",
         "levels": [level(1, 50.0, 20.0), level(4, 150.0, 40.0)]}
    b = {**a, "label": "llama-server", "levels": [level(1, 60.0, 15.0)]}
    paths = []
    for name, data in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "results.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "cmp"
    # a closed port: --compare must send nothing
    assert run(parse("--url", closed_port_url(), "--out", str(out), "--compare", *map(str, paths))) == 0
    table = capsys.readouterr().out
    assert "| concurrency | measure | decodekit | llama-server |" in table
    assert "| 1 | output tok/s | 50.0 | 60.0 |" in table
    assert "| 4 | output tok/s | 150.0 | – |" in table  # llama-server has no level 4
    assert "| 1 | TTFT p99 ms | 60.0 | 45.0 |" in table
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    # the same label twice (two runs of one URL): told apart by folder
    run(parse("--out", str(out), "--compare", str(paths[0]), str(paths[0])))
    assert "| decodekit | decodekit (a) |" in capsys.readouterr().out


def test_compare_unreadable_file(tmp_path):
    with pytest.raises(InvalidParameter, match="cannot read"):
        run(parse("--compare", str(tmp_path / "missing.json"), "--out", str(tmp_path)))
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(InvalidParameter, match="not a bench-serve results file"):
        run(parse("--compare", str(tmp_path / "other.json"), "--out", str(tmp_path)))


@pytest.mark.parametrize("argv, match", [
    (["--concurrency", "0"], "--concurrency levels must be positive"),
    (["--concurrency", "1,two"], "--concurrency must be comma-separated"),
    (["--max-tokens", "0"], "--max-tokens must be positive"),
    (["--url", "localhost:8000"], "--url must be an http"),
    (["--url", "http:///v1"], "--url must be an http"),  # no host to send to
    (["--timeout", "0"], "--timeout must be in"),
    (["--temperature", "-0.5"], "--temperature must be 0"),
    (["--request-rate", "0"], "--request-rate levels must be positive"),
    (["--request-rate", "nan"], "--request-rate levels must be positive"),
    (["--request-rate", "1e-12"], "at least one a day"),  # (its arrivals overflowed time.sleep: a traceback)
    (["--request-rate", "2,fast"], "--request-rate must be comma-separated"),
    (["--request-rate", "2", "--concurrency", "4"], "--concurrency and --request-rate are two ways"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
])
def test_bad_options_are_one_line(tmp_path, argv, match):
    with pytest.raises(InvalidParameter, match=match) as err:
        run(parse(*argv, "--out", str(tmp_path / "out")))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_unreachable_url_when_fetching_models(tmp_path):
    url = closed_port_url()
    with pytest.raises(InvalidParameter, match="cannot fetch the model list") as err:
        run(parse("--url", url, "--limit", "1", "--out", str(tmp_path / "out")))
    assert f"{url}/models" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_timeout_of_exactly_a_day_is_taken():
    """--timeout is in (0, 86400] seconds: the day itself is allowed, a second more is not."""
    from decodekit.serve.load import MAX_TIMEOUT_S, check_options

    check_options(parse("--timeout", str(MAX_TIMEOUT_S)))
    with pytest.raises(InvalidParameter, match="--timeout must be in"):
        check_options(parse("--timeout", str(MAX_TIMEOUT_S + 1)))


def test_a_levels_throughput_counts_only_the_requests_that_succeeded_and_compare_shows_every_sent():
    """Output tokens/s is the tokens of the requests that succeeded over the wall time (a failed request's
    partial tokens are not output); --compare's "failed / sent" row counts every request sent."""
    from decodekit.serve.load import compare_table, summarize

    level = summarize([RequestTiming(e2e_s=1.0, ttft_s=0.5, tokens=10), RequestTiming(e2e_s=1.0, tokens=6, error="HTTP 503: full")],
                      wall_s=2.0, load={"concurrency": 2})
    assert (level["ok"], level["failed"], level["output_tokens"], level["output_tok_s"]) == (1, 1, 10, 5.0)
    table = compare_table([{"label": "a", "levels": [level]}])
    assert "| 2 | failed / sent | 1 / 2 |" in table.splitlines()
    # a level timed at no wall time (a coarse clock) has no rate rather than a division by zero
    assert summarize([RequestTiming(e2e_s=0.0, ttft_s=0.0, tokens=3)], wall_s=0.0, load={"concurrency": 1})["output_tok_s"] == 0.0


def test_compare_rows_go_by_rising_concurrency_whatever_order_the_files_list_them():
    """Every concurrency level of every file, one block each, smallest first."""
    from decodekit.serve.load import compare_table

    table = compare_table([{"label": "a", "levels": [level(4, 1.0, 1.0), level(1, 1.0, 1.0)]},
                           {"label": "b", "levels": [level(2, 1.0, 1.0)]}])
    rows = [line.split(" | ")[0] for line in table.splitlines() if "output tok/s" in line]
    assert rows == ["| 1", "| 2", "| 4"]


def test_a_level_latencies_are_those_of_the_requests_that_succeeded():
    """TTFT and latency percentiles describe the answers served: a refused request's quick 503 is not a latency."""
    from decodekit.serve.load import summarize

    level = summarize([RequestTiming(e2e_s=2.0, ttft_s=1.0, tokens=3), RequestTiming(e2e_s=0.5, ttft_s=0.1, tokens=1, error="cut")],
                      wall_s=2.0, load={"concurrency": 2})
    assert level["e2e_ms"] == {"p50": 2000.0, "p90": 2000.0, "p99": 2000.0}
    assert level["ttft_ms"] == {"p50": 1000.0, "p90": 1000.0, "p99": 1000.0}
    # milliseconds to two decimals: a fast server's sub-millisecond differences still show
    assert summarize([RequestTiming(e2e_s=0.0012345)], wall_s=1.0, load={"concurrency": 1})["e2e_ms"]["p50"] == 1.23


def test_a_servers_error_is_its_message_or_the_first_line_of_its_body():
    """error_message: OpenAI's error.message when the body is one, else the start of what the server said."""
    from decodekit.serve.load import error_message

    assert error_message(b'{"error": {"message": "model not loaded"}}') == "model not loaded"
    assert error_message(b"\n502 Bad Gateway\n<html>details</html>\n") == "502 Bad Gateway"
    assert error_message(b"") == "(empty body)"
    assert error_message(b"x" * 500 + b"\nmore") == "x" * 200  # a long first line is cut, not copied whole


def stream_lines(*chunks: dict | str) -> list[bytes]:
    """Server-sent events as http.client yields them, line by line."""
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n".encode() for c in chunks]


def test_an_error_chunk_in_the_stream_fails_the_request():
    """A server that fails mid-answer says so in a chunk with an error object: the request failed, whatever follows."""
    from decodekit.serve.load import read_stream

    out = RequestTiming()
    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    read_stream(stream_lines(content, {"error": {"message": "out of memory"}}, content, "[DONE]"), out, time.perf_counter(), 60)
    assert out.error == "error in stream: out of memory"


def test_a_stream_that_outlasts_the_timeout_is_a_failure():
    """--timeout bounds the whole request (the socket's timeout only bounds each read): a stream still
    going past it is cut and counted as failed. The request here started 10 s before a 1 s timeout."""
    from decodekit.serve.load import read_stream

    out = RequestTiming()
    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    read_stream(stream_lines(content, content, "[DONE]"), out, time.perf_counter() - 10, 1.0)
    assert out.error == "timed out after 1 s"


def test_a_model_list_answered_with_an_http_error_is_one_line_naming_the_status(fake_server):
    """GET {url}/models that answers an error (a wrong --url path) is said with its status and the server's message."""
    from decodekit.serve.load import first_model

    srv = fake_server()
    wrong = srv.url.removesuffix("/v1") + "/v2"  # the fake server answers 404 there
    with pytest.raises(InvalidParameter, match=rf"^GET {re.escape(wrong)}/models answered HTTP 404: not found; give --model$"):
        first_model(wrong, timeout=10)


def test_a_url_with_a_trailing_slash_reaches_the_same_api(fake_server):
    """--url is the base URL up to /v1: a trailing slash names the same API, not a path with an empty segment."""
    from decodekit.serve.load import first_model

    srv = fake_server()
    assert first_model(srv.url + "/", timeout=10) == "fake-model"
    out = send(srv.url + "/", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error is None


def test_the_recorded_command_reproduces_the_run_method_included():
    """results.json's command spells out every option, the decoding method too: parsed again, it gives the same run."""
    from decodekit.serve.load import command_line

    args = parse("--url", "http://h:1/v1", "--method", "pld", "--limit", "3", "--temperature", "0.5")
    argv = shlex.split(command_line(args, ["--url", args.url, "--model", "m", "--label", "lab"]))
    again = parse(*argv[2:])
    assert argv[:2] == ["decodekit", "bench-serve"] and again.method == "pld" and again.model == "m"
    assert vars(again) | {"model": None, "label": None} == vars(args) | {"concurrency": "1,2,4,8,16"}  # the default, spelt out
    rated = parse("--url", "http://h:1/v1", "--request-rate", "2,inf", "--seed", "3", "--warmup", "0")
    again = parse(*shlex.split(command_line(rated, ["--url", rated.url]))[2:])
    assert (again.request_rate, again.seed, again.warmup, again.concurrency) == ("2,inf", 3, 0, None)


@pytest.mark.parametrize("content, problem", [("{not json", "is not a JSON file"),
                                              (json.dumps({"schema": SCHEMA}), "is not a bench-serve results file"),
                                              (json.dumps({"schema": SCHEMA, "levels": {}}), "is not a bench-serve results file")])
def test_a_results_file_that_is_not_json_or_lacks_its_levels_is_one_line(tmp_path, content, problem):
    """--compare reads only bench-serve results files (JSON, its schema, a list of levels): any other file is one line."""
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(InvalidParameter, match=re.escape(f"{path} {problem}")) as err:
        run(parse("--compare", str(path), "--out", str(tmp_path / "cmp")))
    assert "\n" not in str(err.value)


def clocked_stream(monkeypatch, lines: list[bytes]):
    """``lines`` as http.client yields them, the load generator's clock reading i while line i is read."""
    import decodekit.serve.load as load

    now = [0.0]
    monkeypatch.setattr(load, "time", argparse.Namespace(perf_counter=lambda: now[0]))

    def reader():
        for i, line in enumerate(lines):
            now[0] = float(i)
            yield line
    return reader()


def test_a_chunk_with_empty_content_is_neither_the_first_token_nor_a_token(monkeypatch):
    """TTFT runs up to the first chunk with content: OpenAI's opening chunk (role, content "") carries no text."""
    from decodekit.serve.load import read_stream

    def delta(**d) -> dict:
        return {"choices": [{"index": 0, "delta": d}]}
    lines = stream_lines(delta(role="assistant", content=""), delta(content="Hi"), delta(content="!"), "[DONE]")
    out = RequestTiming()
    read_stream(clocked_stream(monkeypatch, lines), out, 0.0, 60)
    assert out.error is None and out.ttft_s == 1.0 and out.tokens == 2


def test_a_null_usage_in_every_chunk_is_no_count_and_the_last_usage_wins():
    """With include_usage, OpenAI-compatible servers send "usage": null in each chunk and the counts in the last one."""
    from decodekit.serve.load import read_stream

    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}}], "usage": None}
    out = RequestTiming()
    read_stream(stream_lines(content, content, {"choices": [], "usage": {"completion_tokens": 5}}, "[DONE]"),
                out, time.perf_counter(), 60)
    assert out.error is None and out.tokens == 5


def test_a_stream_of_keep_alive_comments_past_the_timeout_is_a_failure(monkeypatch):
    """--timeout bounds the whole request even while the server sends only comments (a keep-alive
    while the request waits): each read returns, so the socket's own timeout never fires."""
    from decodekit.serve.load import read_stream

    import decodekit.serve.load as load

    lines = [b": keep-alive\n"] * 10 + stream_lines("[DONE]")  # the clock reads i at line i
    out = RequestTiming()
    read_stream(clocked_stream(monkeypatch, lines), out, 0.0, 2.5)
    assert out.error == "timed out after 2.5 s"
    assert load.time.perf_counter() == 3.0  # given up at the first line past the timeout, not at the stream's end


def test_a_chunk_that_is_not_an_openai_object_fails_the_request_not_the_run(one_answer_server):
    """JSON of another shape (null, a list, choices that are not objects) is the request's error: an
    exception would end the whole load test with a traceback."""
    from decodekit.serve.load import read_stream

    srv = one_answer_server(200, b"data: null\n\ndata: [DONE]\n\n", "text/event-stream")
    out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error == "ValueError: a stream chunk that is not a JSON object: null"
    for odd in ({"choices": ["x"]}, {"choices": {"0": {}}}, {"choices": [{"delta": "x"}]}, {"choices": None}):
        out = RequestTiming()
        read_stream(stream_lines(odd, "[DONE]"), out, time.perf_counter(), 60)
        assert out.error is None and out.tokens == 0 and out.ttft_s is None


def test_comments_and_event_lines_in_the_stream_are_skipped():
    """Server-sent events may hold comments (": keep-alive") and event names: only data lines are chunks."""
    from decodekit.serve.load import read_stream

    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    lines = [b": keep-alive\n", b"event: message\n", *stream_lines(content), b"\n", *stream_lines("[DONE]")]
    out = RequestTiming()
    read_stream(lines, out, time.perf_counter(), 60)
    assert out.error is None and out.tokens == 1


class OneAnswerServer(ThreadingHTTPServer):
    """Answers every GET and POST with one status and body."""

    daemon_threads = True

    def __init__(self, status: int, body: bytes, content_type: str):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self) -> None:
                if self.command == "POST":
                    self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            do_GET = do_POST = answer
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


@pytest.fixture
def one_answer_server():
    servers = []

    def start(status: int, body: bytes, content_type: str = "application/json") -> OneAnswerServer:
        return serving(OneAnswerServer(status, body, content_type), servers)

    yield start
    stop_serving(servers)


def test_a_stream_that_is_not_json_is_a_failed_request_not_an_exception(one_answer_server):
    """send turns every failure into the outcome's error: a load test goes on past a server's garbled stream."""
    srv = one_answer_server(200, b"data: {not json\n\n", "text/event-stream")
    out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error is not None and out.error.startswith("JSONDecodeError")


def test_a_request_refused_with_a_client_error_is_its_status_and_message(one_answer_server):
    """Only a 200 is a stream: a 400 (a bad --method, --model) is recorded as its status and the server's message."""
    srv = one_answer_server(400, b'{"error": {"message": "unknown method", "type": "invalid_request_error"}}')
    out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error == "HTTP 400: unknown method"


def test_a_model_list_with_no_model_is_one_line(one_answer_server):
    """GET /models listing nothing cannot name a model to send: one line asking for --model."""
    from decodekit.serve.load import first_model

    srv = one_answer_server(200, b'{"object": "list", "data": []}')
    with pytest.raises(InvalidParameter, match=rf"^{re.escape(srv.url)}/models lists no model; give --model$"):
        first_model(srv.url, timeout=10)


def test_infinite_temperature_is_refused():
    """--temperature is 0 or a finite positive number: inf would reach the server as a value JSON cannot carry."""
    from decodekit.serve.load import check_options

    with pytest.raises(InvalidParameter, match="--temperature must be 0"):
        check_options(parse("--temperature", "inf"))


def test_the_in_flight_note_appears_only_past_the_number_of_questions(fake_server, tmp_path, capsys):
    """A level with as many workers as questions has them all in flight; only a level past that is told to raise --limit."""
    srv = fake_server()
    levels = f"{N_QUESTIONS},{N_QUESTIONS + 1}"
    assert run(parse("--url", srv.url, "--concurrency", levels, "--limit", "1", "--out", str(tmp_path))) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("concurrency ")]
    assert notes == [f"concurrency {N_QUESTIONS}: {N_QUESTIONS} requests",
                     f"concurrency {N_QUESTIONS + 1}: {N_QUESTIONS} requests (so at most {N_QUESTIONS} in flight, "
                     f"not {N_QUESTIONS + 1}: raise --limit)"]


def test_the_markdown_table_gives_each_latency_as_p50_p90_p99():
    """The printed table's latency cells are the level's 50th, 90th and 99th percentiles, in that order."""
    from decodekit.serve.load import markdown_table

    table = markdown_table({"label": "srv", "model": "m", "levels": [level(2, 100.0, 20.0)]})
    assert "| 2 | 4 | 0 | 2 | 100.0 | 1.0 | 20.0 / 40.0 / 60.0 | 20.0 / 40.0 / 60.0 | 20.0 / 40.0 / 60.0 |" in table.splitlines()


class HoldingServer(ThreadingHTTPServer):
    """Opens every stream, then holds it for HOLD_S before it answers: requests in flight for a while."""

    daemon_threads = True
    HOLD_S = 8.0

    def __init__(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                with server.lock:
                    server.posts += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n')
                    self.wfile.flush()
                    time.sleep(server.HOLD_S)
                    self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n')
                except OSError:  # the client went away
                    pass
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock, self.posts = threading.Lock(), 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


def test_ctrl_c_during_a_level_cuts_the_requests_in_flight_instead_of_waiting_for_them():
    """An interrupt ends the run now: the requests in flight are cut (the pool would otherwise wait for
    each answer, up to --timeout, before the program could end) and the questions not sent stay unsent."""
    import signal

    from decodekit.serve.load import run_level

    servers: list = []
    srv = serving(HoldingServer(), servers)
    main = threading.main_thread().ident

    def interrupt_once_both_are_in_flight() -> None:
        deadline = time.perf_counter() + 5
        while srv.posts < 2 and time.perf_counter() < deadline:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    try:
        threading.Thread(target=interrupt_once_both_are_in_flight, daemon=True).start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            run_level(srv.url, [body] * 6, concurrency=2, timeout=60)
        assert time.perf_counter() - t0 < HoldingServer.HOLD_S / 2
        time.sleep(0.2)
        assert srv.posts == 2  # nothing sent after the interrupt
    finally:
        stop_serving(servers)


def test_the_charts_lines_join_the_levels_by_rising_concurrency(tmp_path, monkeypatch):
    """Levels given in any order (--concurrency 4,1,2) are drawn left to right, as the table of a
    --compare lists them: a line through them in the order run would zigzag across the chart."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from decodekit.serve.load import plot

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    result = {"label": "a", "model": "m", "levels": [level(4, 30.0, 3.0), level(1, 10.0, 1.0), level(2, 20.0, 2.0)]}
    plot([result], tmp_path / "throughput.png")
    throughput, ttft = (ax.lines[0] for ax in figures[0].axes)
    assert list(throughput.get_xdata()) == [1, 2, 4] and list(throughput.get_ydata()) == [10.0, 20.0, 30.0]
    assert list(ttft.get_xdata()) == [1, 2, 4] and list(ttft.get_ydata()) == [1.0, 2.0, 3.0]


# --start: servers bench-serve runs itself ------------------------------------------------------

#: A fake server in a process of its own, as --start runs a peer: it writes its pid, then serves.
FAKE_PEER = ("import os, sys; sys.path.insert(0, {tests!r}); import test_bench_serve as t; "
             "open(sys.argv[2], 'w').write(str(os.getpid())); t.FakeServer(port=int(sys.argv[1])).serve_forever()")


def fake_peers(monkeypatch, tmp_path, **commands):
    """PEERS replaced by fakes: a name mapped to "fake" runs FAKE_PEER, to None is not installed,
    to a list runs that command; returns where each fake writes its pid."""
    import sys

    from decodekit.serve import peers

    pids = {name: tmp_path / f"{name}.pid" for name in commands}

    def command_of(name, spec):
        def command(gguf, port, slots):
            if spec == "fake":
                return [sys.executable, "-c", FAKE_PEER.format(tests=str(Path(__file__).parent)), str(port), str(pids[name])]
            return spec
        return command

    monkeypatch.setattr(peers, "PEERS", {name: peers.Peer(name, command_of(name, spec), "not installed here")
                                         for name, spec in commands.items()})
    return pids


def gone(pid_file) -> bool:
    import os

    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


def test_started_servers_are_measured_one_after_another_and_stopped(monkeypatch, tmp_path, capsys):
    pids = fake_peers(monkeypatch, tmp_path, first="fake", absent=None, second="fake")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    out = tmp_path / "out"
    assert run(parse("--start", "first,absent,second", "--serve-model", str(tmp_path / "m.gguf"), "--concurrency", "1,2",
                     "--limit", "1", "--out", str(out), "--timeout", "30")) == 0
    captured = capsys.readouterr()
    assert "absent: skipped, not installed here" in captured.err
    for name in ("first", "second"):
        result = json.loads((out / name / "results.json").read_text())
        assert result["label"] == name and [lv["concurrency"] for lv in result["levels"]] == [1, 2]
        assert all(lv["ok"] + lv["failed"] == N_QUESTIONS and lv["ok"] > 0 for lv in result["levels"])
        assert str(pids[name]) in result["server_command"]
        # the run again, for this server alone (the port it had is gone)
        again = parse(*shlex.split(result["command"])[2:])
        assert (again.start, again.serve_model, again.concurrency) == (name, str(tmp_path / "m.gguf"), "1,2")
        assert gone(pids[name])  # stopped before the next one started, and before the run ended
    assert "| first | second |" in captured.out  # the comparison of the two
    assert (out / "throughput.png").stat().st_size > 0
    assert not (out / "absent").exists()


def test_a_started_server_that_exits_before_it_answers_is_one_line(monkeypatch, tmp_path):
    import sys

    fake_peers(monkeypatch, tmp_path, broken=[sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(InvalidParameter, match="broken exited with status 3 before it answered: no model here"):
        run(parse("--start", "broken", "--serve-model", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")))


def test_an_interrupted_run_stops_the_server_it_started(monkeypatch, tmp_path):
    from decodekit.serve import load

    pids = fake_peers(monkeypatch, tmp_path, only="fake")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(load, "run_level", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(parse("--start", "only", "--serve-model", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")))
    assert gone(pids["only"])


@pytest.mark.parametrize("argv, message", [
    (["--start", "decodekit,vllm"], "--start takes comma-separated servers"),
    (["--start", "decodekit,decodekit"], "each once"),
    (["--start", "decodekit", "--serve-model", "/no/such.gguf"], "--serve-model must be an embedded model or a .gguf"),
    (["--start", "decodekit", "--model", "x"], "--model names the server at --url; with --start"),
    (["--start", "decodekit", "--url", "http://h:1/v1"], "--url names the server at --url; with --start"),
    (["--start", "decodekit", "--label", "x"], "--label names the server at --url; with --start"),
    (["--serve-model", "x.gguf"], "--serve-model applies with --start"),
])
def test_bad_start_options_are_one_line(argv, message, tmp_path):
    with pytest.raises(InvalidParameter, match=re.escape(message)):
        run(parse(*argv, "--out", str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


# --request-rate: an open loop of Poisson arrivals --------------------------------------------

def test_arrivals_are_a_poisson_process_of_the_rate():
    """Exponential gaps of mean 1 / rate (their spread equals their mean, unlike evenly spaced or
    uniform gaps), the first request at once, the same times for the same seed; all at once for inf."""
    import statistics

    from decodekit.serve.load import arrival_offsets

    offsets = arrival_offsets(4000, 8.0, seed=0)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.08)
    assert arrival_offsets(50, 8.0, seed=0) == offsets[:50] != arrival_offsets(50, 8.0, seed=1)
    assert arrival_offsets(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_most_in_flight_counts_overlapping_requests_and_not_one_that_ends_as_another_starts():
    from decodekit.serve.load import most_in_flight

    timing = lambda sent, e2e: RequestTiming(e2e_s=e2e, sent_at=sent)  # noqa: E731
    assert most_in_flight([timing(0.0, 1.0), timing(1.0, 1.0), timing(2.0, 1.0)]) == 1
    assert most_in_flight([timing(0.0, 2.0), timing(0.5, 1.0), timing(1.0, 3.0), timing(3.5, 1.0)]) == 3
    assert most_in_flight([]) == 0


def test_a_rate_level_sends_each_request_at_its_arrival_whatever_is_in_flight(monkeypatch):
    """Open loop: request i goes at its arrival time (not before, and not held back by the slow
    answers before it), so answers longer than the gaps pile up in flight. (The answers take 0.6 s
    and the tolerance is 0.35 s, so that a machine under load does not fail the test: held back,
    request 1 would leave 0.5 s late.)"""
    from decodekit.serve import load

    offsets = [0.0, 0.1, 0.2, 1.0, 1.1]
    monkeypatch.setattr(load, "arrival_offsets", lambda n, rate, seed: offsets[:n])
    sent: list[tuple[int, float]] = []

    def slow_send(url, body, timeout, in_flight=None):
        out = RequestTiming(sent_at=time.perf_counter(), ttft_s=0.01, tokens=4)
        sent.append((body["i"], out.sent_at))
        time.sleep(0.6)
        out.e2e_s = time.perf_counter() - out.sent_at
        return out

    monkeypatch.setattr(load, "send", slow_send)
    t0 = time.perf_counter()
    level = load.run_rate_level("http://unused/v1", [{"i": i} for i in range(5)], 4.0, 0, timeout=10)
    assert [i for i, _ in sent] == [0, 1, 2, 3, 4]
    for (i, at), offset in zip(sent, offsets):
        assert offset <= at - t0 < offset + 0.35, i
    assert level["request_rate"] == 4.0 and level["ok"] == 5 and level["most_in_flight"] == 3
    assert level["output_tokens"] == 20


def test_rate_levels_against_a_server_and_compared(fake_server, tmp_path, capsys):
    srv = fake_server()
    out = tmp_path / "rate"
    assert run(parse("--url", srv.url, "--request-rate", "inf,200", "--limit", "1", "--out", str(out), "--warmup", "0")) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["load"] == "request_rate" and result["seed"] == 0 and "--request-rate inf,200" in result["command"]
    assert [lv["request_rate"] for lv in result["levels"]] == ["inf", 200.0]  # JSON has no infinity
    assert len(srv.posts) == 2 * N_QUESTIONS
    assert all(lv["ok"] + lv["failed"] == N_QUESTIONS for lv in result["levels"])
    first = result["levels"][0]  # all sent at once: every answer that streams overlaps the others
    assert first["most_in_flight"] >= first["ok"] and srv.max_in_flight >= first["ok"]
    table = capsys.readouterr().out
    assert "| request rate /s | ok |" in table and "\n| inf | " in table and "\n| 200 | " in table
    # compared with itself: one table of rates; beside a file of concurrency levels: refused in one line
    run(parse("--out", str(tmp_path / "cmp"), "--compare", str(out / "results.json"), str(out / "results.json")))
    assert "| inf | output tok/s |" in capsys.readouterr().out
    (tmp_path / "conc.json").write_text(json.dumps({"schema": SCHEMA, "label": "c", "model": "m", "levels": [level(1, 5.0, 1.0)]}))
    with pytest.raises(InvalidParameter, match="different ways"):
        run(parse("--out", str(tmp_path / "cmp"), "--compare", str(out / "results.json"), str(tmp_path / "conc.json")))


def test_a_warm_up_is_sent_before_the_levels_and_a_failed_one_ends_the_run_in_one_line(fake_server, tmp_path):
    srv = fake_server()
    assert run(parse("--url", srv.url, "--concurrency", "2", "--limit", "1", "--out", str(tmp_path / "a"), "--warmup", "3")) == 0
    result = json.loads((tmp_path / "a" / "results.json").read_text())
    assert len(srv.posts) == 3 + N_QUESTIONS and result["warmup"] == 3
    assert result["levels"][0]["ok"] + result["levels"][0]["failed"] == N_QUESTIONS  # the warm-up is not counted
    with pytest.raises(InvalidParameter, match="^the warm-up request failed: ConnectionRefusedError"):
        run(parse("--url", closed_port_url(), "--model", "m", "--limit", "1", "--out", str(tmp_path / "b")))
    assert not (tmp_path / "b" / "results.json").exists()


def test_llama_cpp_pythons_server_lets_each_request_finish_and_is_skipped_without_its_server_modules(monkeypatch):
    """Its server answers one request at a time and, by default, cuts the streamed one short when
    another arrives: started with that off. Without its server's modules it would exit at start: skipped."""
    import importlib.util

    from decodekit.serve import peers

    present = set(peers.LLAMA_CPP_SERVER_MODULES)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in present else None)
    argv = peers.llama_cpp_python_command(Path("m.gguf"), 8123, 8)
    assert argv[argv.index("--interrupt_requests") + 1] == "False" and argv[argv.index("--port") + 1] == "8123"
    present.discard("sse_starlette")
    assert peers.llama_cpp_python_command(Path("m.gguf"), 8123, 8) is None


# damaged input and misbehaving servers ---------------------------------------------------------

def results_file(tmp_path, name: str, **changes) -> Path:
    """A valid results file of two concurrency levels, with ``changes`` made to it (a value of None
    drops the key); ``levels`` may instead be a function of the two levels."""
    data = {"schema": SCHEMA, "label": "a", "url": "u", "model": "m", "load": "concurrency", "command": "c",
            "levels": [level(1, 50.0, 20.0), level(2, 90.0, 30.0)]}
    for key, value in changes.items():
        data[key] = value(data[key]) if callable(value) else value
    path = tmp_path / name
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def edit_first(**changes):
    """The levels with ``changes`` made to the first (a value of None drops the key)."""
    def edit(levels):
        first = {k: v for k, v in {**levels[0], **changes}.items() if v is not None}
        return [first, *levels[1:]]
    return edit


@pytest.mark.parametrize("changes, where", [
    ({"levels": edit_first(concurrency=None)}, "at levels/0: 'concurrency' is a required property"),
    ({"label": None}, "at (top): 'label' is a required property"),
    ({"levels": lambda levels: [5, *levels[1:]]}, "at levels/0: 5 is not of type 'object'"),
    ({"levels": edit_first(ttft_ms=None)}, "at levels/0: 'ttft_ms' is a required property"),
    ({"levels": edit_first(ttft_ms={"p50": 1})}, "at levels/0/ttft_ms: 'p90' is a required property"),
    ({"levels": edit_first(concurrency="abc")}, "at levels/0/concurrency: 'abc' is not of type 'integer'"),
    ({"levels": edit_first(ok=True)}, "at levels/0/ok: True is not of type 'integer'"),
    ({"levels": edit_first(output_tok_s=-4.0)}, "at levels/0/output_tok_s: -4.0 is less than the minimum of 0"),
    ({"levels": lambda levels: [levels[0], levels[0]]}, "lists concurrency 1 twice"),
    ({"levels": []}, "at levels: [] should be non-empty"),
    ({"load": ["concurrency"]}, "has levels of an unknown load ['concurrency'] (known: concurrency, request_rate)"),
    ({"load": "request_rate", "levels": lambda levels: [{**levels[0], "request_rate": "fast"}]},
     "at levels/0/request_rate: 'fast' is not valid under any of the given schemas"),  # a number or "inf"
    ({"load": "request_rate"}, ": 'request_rate' is a required property"),  # levels keyed by concurrency
])
def test_a_damaged_results_file_is_refused_in_one_line_before_anything_is_printed(tmp_path, capsys, changes, where):
    """--compare checks what it reads against the results file's schema (as bench --compare does): an
    edited or damaged file is named with where it is wrong, not met as a traceback halfway through the table."""
    good = results_file(tmp_path, "good.json")
    damaged = results_file(tmp_path, "damaged.json", **changes)
    with pytest.raises(InvalidParameter) as err:
        run(parse("--compare", str(good), str(damaged), "--out", str(tmp_path / "cmp")))
    assert str(err.value).startswith(f"{damaged} ") and str(err.value).endswith(where), str(err.value)
    assert "\n" not in str(err.value)
    assert capsys.readouterr().out == "" and not (tmp_path / "cmp").exists()


def test_a_rate_levels_inf_and_the_files_a_run_writes_pass_the_check(fake_server, tmp_path, capsys):
    """What bench-serve writes is what it reads: an infinite rate (the string "inf") and a run's own file."""
    rated = results_file(tmp_path, "rate.json", load="request_rate",
                         levels=lambda levels: [{**lv, "request_rate": rate} for lv, rate in zip(levels, ("inf", 2.5))])
    srv = fake_server()
    assert run(parse("--url", srv.url, "--concurrency", "2", "--limit", "1", "--out", str(tmp_path / "run"))) == 0
    own = tmp_path / "run" / "results.json"
    assert run(parse("--compare", str(own), str(results_file(tmp_path, "old.json", load=None)), "--out", str(tmp_path / "c"))) == 0
    assert run(parse("--compare", str(rated), "--out", str(tmp_path / "r"))) == 0
    assert "| inf | output tok/s | 50.0 |" in capsys.readouterr().out


def test_a_disk_that_fills_midway_leaves_the_levels_already_written(fake_server, tmp_path, monkeypatch):
    """results.json is written after every level, so that an interrupted run keeps what it measured:
    a write cut short at the second level leaves the first level's file whole, not half of the second's."""
    write_text, writes = Path.write_text, []

    def second_cut_short(self, text, *args, **kwargs):
        writes.append(self.name)
        if len(writes) == 2:
            write_text(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", second_cut_short)
    srv = fake_server()
    with pytest.raises(OSError, match="No space left"):
        run(parse("--url", srv.url, "--concurrency", "1,2", "--limit", "1", "--out", str(tmp_path / "run")))
    monkeypatch.undo()
    assert len(writes) == 2
    kept = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [level["concurrency"] for level in kept["levels"]] == [1]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["results.json"]


def test_compare_refuses_an_out_that_is_a_file_before_it_prints(tmp_path, capsys):
    good = results_file(tmp_path, "good.json")
    with pytest.raises(InvalidParameter, match=re.escape(f"--out '{good}' is not a writable folder")):
        run(parse("--compare", str(good), "--out", str(good)))
    assert capsys.readouterr().out == ""


class TricklingServer(ThreadingHTTPServer):
    """Sends a byte every 0.05 s for up to TRICKLE_S and never a line break: in the stream's first
    data line, or (``in_headers``) in a header line, before the response's headers have ended."""

    daemon_threads = True
    TRICKLE_S = 20.0

    def __init__(self, in_headers: bool):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if in_headers:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(b"data: ")
                try:
                    for _ in range(int(TricklingServer.TRICKLE_S / 0.05)):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:  # the client gave up
                    pass
                self.close_connection = True
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


@pytest.mark.parametrize("in_headers", [False, True], ids=["in_a_data_line", "in_the_headers"])
def test_a_server_trickling_bytes_without_a_line_break_is_cut_at_the_timeout(in_headers):
    """--timeout bounds the whole request whatever the server sends: bytes that keep coming without
    a line break keep every socket read returning, and no line ever ends to check the clock at."""
    servers: list = []
    srv = serving(TricklingServer(in_headers), servers)
    try:
        t0 = time.perf_counter()
        out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=0.5)
        elapsed = time.perf_counter() - t0
    finally:
        stop_serving(servers)
    assert out.error == "timed out after 0.5 s"
    assert elapsed < TricklingServer.TRICKLE_S / 2  # generous: cut near 0.5 s, not at the trickle's end


@pytest.mark.parametrize("usage, reason", [
    (-1000, "usage.completion_tokens -1000 is not a count of tokens"),
    (True, "usage.completion_tokens true is not a count of tokens"),
    (2.5, "usage.completion_tokens 2.5 is not a count of tokens"),
    ("3", 'usage.completion_tokens "3" is not a count of tokens'),
    (0, "usage.completion_tokens is 0, yet 2 chunks of content were streamed"),
])
def test_a_usage_that_is_not_a_count_or_contradicts_the_stream_fails_the_request(one_answer_server, usage, reason):
    """The server's usage is its word on the output tokens, checked before it is counted: a negative
    count would make a negative tok/s, true would count as 1, and 0 would erase the content streamed."""
    from decodekit.serve.load import read_stream, summarize

    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    lines = stream_lines(content, content, {"choices": [], "usage": {"completion_tokens": usage}}, "[DONE]")
    with pytest.raises(ValueError, match=f"^{re.escape(reason)}$"):
        read_stream(lines, RequestTiming(), time.perf_counter(), 60)
    srv = one_answer_server(200, b"".join(line + b"\n" for line in lines), "text/event-stream")
    out = send(srv.url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, timeout=10)
    assert out.error == f"ValueError: {reason}"  # recorded as the request's failure, as a garbled stream is
    level = summarize([out], 1.0, {"concurrency": 1})
    assert level["failed"] == 1 and level["output_tokens"] == 0 and level["output_tok_s"] == 0


def test_a_usage_of_zero_tokens_for_an_empty_answer_and_an_absent_count_are_taken():
    """0 tokens with no content streamed is an empty answer, not a contradiction; a usage without
    completion_tokens says nothing of the output: the content chunks count."""
    from decodekit.serve.load import read_stream

    out = RequestTiming()
    read_stream(stream_lines({"choices": [], "usage": {"completion_tokens": 0}}, "[DONE]"), out, time.perf_counter(), 60)
    assert out.error is None and out.tokens == 0
    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    out = RequestTiming()
    read_stream(stream_lines(content, {"choices": [], "usage": {"prompt_tokens": 3}}, "[DONE]"), out, time.perf_counter(), 60)
    assert out.error is None and out.tokens == 1


@pytest.mark.parametrize("url, problem", [
    ("http://127.0.0.1:abc/v1", "Port could not be cast to integer value as 'abc'"),
    ("http://[::1/v1", "Invalid IPv6 URL"),
    ("http://127.0.0.1:99999/v1", "Port out of range 0-65535"),
    ("http://user:secret@127.0.0.1/v1", "nonnumeric port: 'secret@127.0.0.1'"),  # http.client's reading of the host
])
@pytest.mark.parametrize("model", [[], ["--model", "m"]], ids=["model_listed", "model_given"])
def test_a_malformed_url_is_refused_in_one_line_when_the_arguments_are_read(tmp_path, url, problem, model):
    """A --url whose port or host cannot be read is refused before anything is sent, --model given or not
    (it was an exception from the first connection: a traceback)."""
    with pytest.raises(InvalidParameter) as err:
        run(parse("--url", url, *model, "--limit", "1", "--out", str(tmp_path / "out")))
    assert str(err.value) == f"--url {url!r} is not a URL this client can send to ({problem})"
    assert not (tmp_path / "out").exists()
