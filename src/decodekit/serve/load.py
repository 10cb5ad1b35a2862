"""``decodekit bench-serve``: load any OpenAI-compatible server with Spec-Bench questions.

Each level sends the first turn of every selected Spec-Bench question as a streamed chat
completion (``POST {url}/chat/completions``), in one of two ways:

* ``--concurrency c`` (closed loop): c workers, each taking the next question as soon as its
  previous answer has finished, so c requests are in flight until the questions run out;
* ``--request-rate r`` (open loop, as vLLM's ``benchmark_serving.py``): requests arrive as a
  Poisson process of r a second (exponential gaps drawn from ``--seed``; ``inf``: all at once), each
  sent at its arrival whatever is still in flight, so a server slower than the rate builds a queue.

Before the first level, ``--warmup`` requests (default 1) are sent and not counted: a server's
first request pays for what it sets up once. Per request: time to first token (TTFT: up to the
first chunk with content), end-to-end latency, output tokens (the server's ``usage`` when it sends
one, else the content chunks) and time per output token after the first (TPOT; none for a one-token
answer). Per level: requests ok and failed, output tokens/s and requests/s (of the requests that
succeeded, over the level's wall time), the most requests that were in flight at once, and the
50th, 90th and 99th percentiles of TTFT, TPOT and latency.

Writes DIR/results.json and DIR/throughput.png and prints a Markdown table. ``--compare`` puts
several results files (decodekit serve, llama-server, vLLM, ...) on one chart and one table,
sending nothing. ``--start decodekit,llama-cpp-python,llama-server`` starts those servers itself on
one GGUF file, one after another (:mod:`.peers`), measures each (DIR/<server>/results.json) and
compares them. HTTP is the standard library's, so that the client is the same for every server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import shlex
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..arguments import check_writable, named, replace_text, save_figure
from ..bench.questions import load_questions, resolve_question_file
from ..errors import InvalidParameter
from . import peers

SCHEMA = "decodekit-bench-serve/1"
DEFAULT_URL = "http://127.0.0.1:8000/v1"
QUANTILES = (50, 90, 99)
MAX_ERRORS = 5  # error messages kept per level: enough to see what went wrong, not a log
MAX_TIMEOUT_S = 86400.0  # a day: a larger value overflows the socket's timer (and no request takes that long)
#: The slowest --request-rate, a request a day: far slower, the arrival times overflow the sleep's timer.
MIN_RATE = 1 / MAX_TIMEOUT_S
DEFAULT_CONCURRENCY = "1,2,4,8,16"
RATE_SLOTS = 16  # the batch a server started for --request-rate levels gets (--start); more requests wait in its queue
LOADS = {"concurrency": "concurrency", "request_rate": "request rate /s"}  # a level's load: results key -> heading
COMPARE_ROWS = (("output tok/s", "output_tok_s", None), ("requests/s", "request_s", None), ("TTFT p50 ms", "ttft_ms", "p50"),
                ("TTFT p99 ms", "ttft_ms", "p99"), ("TPOT p50 ms", "tpot_ms", "p50"), ("latency p50 ms", "e2e_ms", "p50"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Send Spec-Bench questions as streamed chat completions to an OpenAI-compatible server, c at a "
                     "time for each concurrency level c (or arriving at each request rate r). Writes DIR/results.json "
                     "and DIR/throughput.png and prints a Markdown table.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server's base URL, up to /v1 (default {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model id to send (default: the first id of GET URL/models)")
    p.add_argument("--concurrency", default=None,
                   help=f"comma-separated requests in flight, a level each (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--request-rate", default=None, metavar="RATES",
                   help="comma-separated requests a second, a level each, instead of --concurrency: requests arrive "
                        "as a Poisson process at that rate, whatever is in flight ('inf': all at once)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --request-rate arrival times (default 0)")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent before the first level and not counted (default 1)")
    p.add_argument("--limit", type=int, default=2, help="questions per category (default 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--method", default=None, help="decodekit decoding method, sent as the extra body field 'method'")
    p.add_argument("--out", default="bench-serve-out", type=named, metavar="DIR", help="output folder (default bench-serve-out)")
    p.add_argument("--label", default=None, help="the server's name in reports (default: host:port of --url)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    p.add_argument("--compare", nargs="+", metavar="RESULTS.json",
                   help="draw these results files on one DIR/throughput.png and print them side by side; sends nothing")
    p.add_argument("--start", metavar="SERVERS",
                   help=f"start these servers one after another on --serve-model and measure each, instead of --url "
                        f"(comma-separated: {', '.join(peers.PEERS)}; one not installed is skipped with a note)")
    p.add_argument("--serve-model", default=None, metavar="MODEL",
                   help="with --start: the embedded model's name or a .gguf file every server runs (default smollm2-135m)")
    p.set_defaults(func=run)


@dataclass
class RequestTiming:
    """One request; times in seconds from just before it was sent. ``error`` is None when it succeeded."""

    e2e_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    error: str | None = None
    sent_at: float = 0.0  # time.perf_counter() when it was sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: the decode rate one user sees. None for an answer
        of one token (as vLLM's benchmark_serving.py has it): no token follows the first, and the
        time after it is the stream's end, not a token's."""
        return None if self.ttft_s is None or self.tokens < 2 else (self.e2e_s - self.ttft_s) / (self.tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between the two nearest ranks:
    the sorted values sit at ranks 0 .. n-1 and the percentile is read at rank (n - 1) * q / 100
    (numpy's default). So the 50th of [1, 2, 3, 4] is 2.5, q = 0 is the minimum, q = 100 the
    maximum. None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def quantiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": None if (v := percentile(values, q)) is None else round(v * 1e3, 2) for q in QUANTILES}


def most_in_flight(outcomes: Sequence[RequestTiming]) -> int:
    """The most requests open at one time (from each one's send to its end): what a request rate
    made of the server's load. A request that ends at the moment another is sent is not counted
    beside it."""
    events = sorted(e for o in outcomes for e in ((o.sent_at, 1), (o.sent_at + o.e2e_s, -1)))  # ends first at a tie
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def summarize(outcomes: Sequence[RequestTiming], wall_s: float, load: dict[str, float | str]) -> dict[str, Any]:
    """One level of results.json; ``load``: its ``{"concurrency": c}`` or ``{"request_rate": r}``.
    Latencies are those of the requests that succeeded."""
    ok = [o for o in outcomes if o.error is None]
    tokens = sum(o.tokens for o in ok)
    per_s = lambda n: round(n / wall_s, 2) if wall_s > 0 else 0.0  # noqa: E731
    return {
        **load, "ok": len(ok), "failed": len(outcomes) - len(ok), "most_in_flight": most_in_flight(outcomes),
        "output_tokens": tokens, "wall_s": round(wall_s, 4), "output_tok_s": per_s(tokens), "request_s": per_s(len(ok)),
        "ttft_ms": quantiles_ms([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_ms": quantiles_ms([o.tpot_s for o in ok if o.tpot_s is not None]),
        "e2e_ms": quantiles_ms([o.e2e_s for o in ok]),
        "errors": [o.error for o in outcomes if o.error is not None][:MAX_ERRORS],
    }


def connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A fresh connection to the server and the path prefix of its API (``/v1``)."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.netloc, timeout=timeout), parts.path.rstrip("/")


def error_message(body: bytes) -> str:
    """The server's ``error.message`` (OpenAI's error object), else the start of what it said."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip()
        return text.splitlines()[0][:200] if text else "(empty body)"


def first_model(url: str, timeout: float) -> str:
    """The first model id the server lists (``GET {url}/models``)."""
    conn, base = connect(url, timeout)
    try:
        conn.request("GET", base + "/models")
        response = conn.getresponse()
        status, body = response.status, response.read()
    except (OSError, http.client.HTTPException) as err:
        raise InvalidParameter(f"cannot fetch the model list from {url}/models ({type(err).__name__}: {err}); "
                               "is the server running? Check --url, or give --model") from None
    finally:
        conn.close()
    if status != 200:
        raise InvalidParameter(f"GET {url}/models answered HTTP {status}: {error_message(body)}; give --model")
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise InvalidParameter(f"{url}/models lists no model; give --model") from None


def output_tokens(usage: Any, chunks: int) -> int:
    """The answer's output tokens: the server's ``usage.completion_tokens`` (the last one sent), else
    the ``chunks`` of content streamed. A usage is the server's word, checked before it is counted: one
    that is not a count (a negative number, ``true``, a string) or that says 0 while content was
    streamed raises ValueError, so that the request fails with the reason rather than turn into a
    negative or erased tok/s. None (no usage, or one without the count) says nothing: the chunks count."""
    if usage is None:
        return chunks
    if isinstance(usage, bool) or not isinstance(usage, int) or usage < 0:
        raise ValueError(f"usage.completion_tokens {json.dumps(usage)} is not a count of tokens")
    if usage == 0 and chunks:
        raise ValueError(f"usage.completion_tokens is 0, yet {chunks} chunks of content were streamed")
    return usage


def read_stream(response: http.client.HTTPResponse, out: RequestTiming, start: float, timeout: float) -> None:
    """Read server-sent events (``data: {...}`` lines up to ``data: [DONE]``) into ``out``. A stream
    that is not one (not JSON, chunks that are not objects, a usage that is no count) raises ValueError."""
    chunks, usage = 0, None
    for raw in response:
        line = raw.decode("utf-8").strip()
        data = line[len("data:"):].strip() if line.startswith("data:") else None  # else a separator, comment, event name
        if data == "[DONE]":
            out.tokens = output_tokens(usage, chunks)
            return
        # the socket timeout only bounds each read: checked on every line, as a server may send
        # keep-alive comments for as long as a request waits
        if time.perf_counter() - start > timeout:
            out.error = timed_out(timeout)
            return
        if data is None:
            continue
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"a stream chunk that is not a JSON object: {data[:80]}")
        if chunk.get("error"):  # a server that fails mid-stream says so in a chunk
            out.error = f"error in stream: {error_message(data.encode())}"
            return
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"].get("completion_tokens")
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("content"):
            chunks += 1
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
    out.error = "the stream ended before data: [DONE]"


def timed_out(timeout: float) -> str:
    """The error of a request that ran past --timeout."""
    return f"timed out after {timeout:g} s"


def shut(sock: socket.socket) -> None:
    """Shut ``sock`` down, from any thread: a read waiting on it returns at once. The plain socket's
    shutdown, also for https: an SSL socket's own unwraps it under the thread reading it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class Watchdog:
    """Cuts a request's socket at its deadline. The socket's timeout bounds each read, not the
    request: a server that trickles bytes (a header or a data line that never ends) has every read
    return something, and no line ends for :func:`read_stream` to check the clock at, so without
    this --timeout would never fire. ``fired``: it cut the request before :meth:`stop`."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._lock, self._stopped, self.fired = sock, threading.Lock(), False, False
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True  # never holds the program open
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:  # a request that has ended is not cut, nor said to be (stop() waits for a cut under way)
            if self._stopped:
                return
            self.fired = True
            shut(self._sock)

    def stop(self) -> None:
        """The request has ended: from now on the watchdog does nothing."""
        with self._lock:
            self._stopped = True
        self._timer.cancel()


class InFlight:
    """The sockets of a level's requests in flight. An interrupted run (Ctrl-C) cuts them
    (:meth:`cut`), and none starts after: else the interrupt would wait for every answer in flight,
    up to --timeout each, before the program could end (the pool's threads are joined at exit).
    Sockets, not connections: a response that ends with the connection's close takes the socket
    from its connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False

    def add(self, sock: socket.socket) -> bool:
        """Note a connected socket; False (and it is not noted) once the level has been cut."""
        with self._lock:
            if not self._cut:
                self._open.add(sock)
            return not self._cut

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    def cut(self) -> None:
        """Shut every noted socket down: a read waiting on one returns at once (from any thread)."""
        with self._lock:
            self._cut = True
            for sock in self._open:
                shut(sock)


def send(url: str, body: dict[str, Any], timeout: float, in_flight: InFlight | None = None) -> RequestTiming:
    """One streamed chat completion. Every failure becomes the outcome's error, never an exception:
    a load test must go on when the server refuses or drops a request. ``in_flight``: where the
    connection is noted while it is open, for an interrupt to cut; a :class:`Watchdog` cuts it at
    ``timeout`` seconds from its start, whatever the server is sending."""
    out = RequestTiming()
    start = out.sent_at = time.perf_counter()
    conn, base = connect(url, timeout)
    sock = watchdog = None
    try:
        conn.connect()
        sock = conn.sock
        if in_flight is not None and not in_flight.add(sock):
            out.error = "interrupted"
            return out
        watchdog = Watchdog(sock, start + timeout - time.perf_counter())
        conn.request("POST", base + "/chat/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status == 200:
            read_stream(response, out, start, timeout)
        else:
            out.error = f"HTTP {response.status}: {error_message(response.read())}"
    except (OSError, http.client.HTTPException, ValueError) as err:  # ValueError: bad JSON or UTF-8
        out.error = f"{type(err).__name__}: {err}"
    finally:
        if watchdog is not None:
            watchdog.stop()
        if in_flight is not None and sock is not None:
            in_flight.discard(sock)
        conn.close()
    if watchdog is not None and watchdog.fired and out.error is not None:  # the cut's effect (a short read, a bad line)
        out.error = timed_out(timeout)
    out.e2e_s = time.perf_counter() - start
    return out


def run_level(url: str, bodies: Sequence[dict[str, Any]], concurrency: int, timeout: float) -> dict[str, Any]:
    """Send every body with ``concurrency`` requests in flight; the level's summary."""
    start = time.perf_counter()
    in_flight = InFlight()
    # The pool's queue is the shared iterator: a worker takes the next question when its answer is done.
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        try:
            outcomes = list(pool.map(lambda body: send(url, body, timeout, in_flight), bodies))
        except BaseException:  # Ctrl-C: the questions not sent are dropped (by map); those in flight end now
            in_flight.cut()
            raise
    return summarize(outcomes, time.perf_counter() - start, {"concurrency": concurrency})


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from a level's start at which each of ``n`` requests is sent: a Poisson process of
    ``rate`` requests a second, so the gaps are exponential with mean 1 / rate (vLLM's
    benchmark_serving.py at burstiness 1). The first request goes at 0; all do for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng, offsets, t = random.Random(seed), [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def run_rate_level(url: str, bodies: Sequence[dict[str, Any]], rate: float, seed: int, timeout: float) -> dict[str, Any]:
    """Send each body at its arrival time (:func:`arrival_offsets`), whatever is still in flight; the level's summary."""
    start = time.perf_counter()
    in_flight = InFlight()
    pool = ThreadPoolExecutor(max_workers=max(1, len(bodies)))  # a thread a request: none waits for another
    try:
        futures = []
        for body, offset in zip(bodies, arrival_offsets(len(bodies), rate, seed)):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            futures.append(pool.submit(send, url, body, timeout, in_flight))
        outcomes = [f.result() for f in futures]
    except BaseException:  # Ctrl-C: no request is sent after it, and those in flight end now
        in_flight.cut()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    # an infinite rate as the string "inf": JSON has no infinity (float() reads it back)
    return summarize(outcomes, time.perf_counter() - start, {"request_rate": "inf" if math.isinf(rate) else rate})


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise InvalidParameter(f"--concurrency must be comma-separated positive integers, got {text!r}") from None
    if any(c < 1 for c in levels):
        raise InvalidParameter(f"--concurrency levels must be positive, got {text!r}")
    return distinct(levels, "--concurrency", text)


def distinct(levels: list, flag: str, text: str) -> list:
    """``levels`` if none is named twice (a level measured twice would be reported under one key)."""
    if len(set(levels)) < len(levels):
        raise InvalidParameter(f"{flag} names a level twice: {text!r}")
    return levels


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise InvalidParameter(f"--request-rate must be comma-separated requests a second (or inf), got {text!r}") from None
    if not all(r >= MIN_RATE for r in rates):  # NaN fails too
        raise InvalidParameter(f"--request-rate levels must be positive, at least one a day ({MIN_RATE:.2g}/s), "
                               f"or inf, got {text!r}")
    return distinct(rates, "--request-rate", text)


def parse_levels(args: argparse.Namespace) -> tuple[str, list[float]]:
    """The levels' load (a key of LOADS) and their values, from --concurrency or --request-rate."""
    if args.request_rate is not None:
        if args.concurrency is not None:
            raise InvalidParameter("--concurrency and --request-rate are two ways to load the server: give one")
        return "request_rate", parse_rates(args.request_rate)
    return "concurrency", parse_concurrency(DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency)


def check_url(url: str) -> None:
    """--url must be an http(s) URL whose host and port this client can read, checked when the
    arguments are read: a port that is not a number in 0..65535, a broken IPv6 host or what
    http.client cannot take as host:port (user info) would otherwise be an exception at the first request."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # read for its ValueError: a port that is not a number in 0..65535
        connect(url, 1.0)  # http.client's own reading of host:port (InvalidURL); connects to nothing
    except (ValueError, http.client.InvalidURL) as err:
        raise InvalidParameter(f"--url {url!r} is not a URL this client can send to ({err})") from None
    if (parts.scheme not in ("http", "https") or not parts.netloc):  # (no host: nothing to send to)
        raise InvalidParameter(f"--url must be an http:// or https:// URL such as {DEFAULT_URL}, got {url!r}")


def check_options(args: argparse.Namespace) -> None:
    if args.start is None:
        check_url(args.url)
    if args.max_tokens <= 0:
        raise InvalidParameter(f"--max-tokens must be positive, got {args.max_tokens}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise InvalidParameter(f"--timeout must be in (0, {MAX_TIMEOUT_S}] seconds, got {args.timeout}")
    if not 0 <= args.temperature < math.inf:
        raise InvalidParameter(f"--temperature must be 0 (greedy) or a finite positive number, got {args.temperature}")
    if args.warmup < 0:
        raise InvalidParameter(f"--warmup must be 0 or more requests, got {args.warmup}")
    if args.seed < 0:  # random.Random(-s) is random.Random(s): two seeds that looked apart would not be
        raise InvalidParameter(f"--seed must be 0 or more, got {args.seed}")


def command_line(args: argparse.Namespace, target: Sequence[str]) -> str:
    """An explicit command that reproduces the run (every default spelled out): ``target`` names the
    server (``--url``, ``--model`` and ``--label``, or ``--start`` and ``--serve-model``)."""
    load = (["--request-rate", args.request_rate, "--seed", str(args.seed)] if args.request_rate is not None
            else ["--concurrency", args.concurrency or DEFAULT_CONCURRENCY])
    parts = ["decodekit", "bench-serve", *target, *load, "--warmup", str(args.warmup),
             "--limit", str(args.limit), "--max-tokens", str(args.max_tokens), "--temperature", f"{args.temperature:g}",
             "--out", str(args.out), "--timeout", f"{args.timeout:g}"]
    return shlex.join(parts + (["--method", args.method] if args.method else []))


_COUNT = {"type": "integer", "minimum": 0}
_PER_S = {"type": "number", "minimum": 0}
_MS = {"type": "object", "required": [f"p{q}" for q in QUANTILES],
       "properties": {f"p{q}": {"type": ["number", "null"], "minimum": 0} for q in QUANTILES}}
#: A level's load in results.json, by its key in LOADS: an infinite request rate is "inf" (JSON has no infinity).
LOAD_VALUES = {"concurrency": {"type": "integer", "minimum": 1},
               "request_rate": {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": "inf"}]}}


def results_schema(key: str) -> dict[str, Any]:
    """results.json as JSON Schema, for levels of the load ``key``: what --compare reads of a file
    (its label, each level's load and measures), so that a damaged or edited file is refused in one
    line instead of failing halfway through the table. Keys it does not read are not required
    (files written before some of them existed still compare)."""
    level = {"type": "object", "required": [key, "ok", "failed", "output_tok_s", "ttft_ms", "tpot_ms", "e2e_ms"],
             "properties": {key: LOAD_VALUES[key], "ok": _COUNT, "failed": _COUNT, "most_in_flight": _COUNT,
                            "output_tok_s": _PER_S, "request_s": _PER_S, "ttft_ms": _MS, "tpot_ms": _MS, "e2e_ms": _MS}}
    return {"type": "object", "required": ["schema", "label", "levels"],
            "properties": {"schema": {"const": SCHEMA}, "label": {"type": "string"}, "model": {"type": "string"},
                           "levels": {"type": "array", "minItems": 1, "items": level}}}  # a run writes after a level


def check_results(data: dict[str, Any], path: Path) -> None:
    """Raise InvalidParameter (one line: the file, where and what) if ``data`` does not follow
    :func:`results_schema` or names one level twice (the table would show one of the two)."""
    import jsonschema

    key = load_of(data)
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(results_schema(key)).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise InvalidParameter(f"{path} does not follow {SCHEMA} at {where}: {error.message}")
    values = [level_load(lv, key) for lv in data["levels"]]
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise InvalidParameter(f"{path} lists {LOADS[key].removesuffix(' /s')} {fmt_load(twice)} twice")


def load_results(path: Path) -> dict[str, Any]:
    """A bench-serve results file, checked (:func:`check_results`); anything else is one line."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise InvalidParameter(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError:
        raise InvalidParameter(f"{path} is not a JSON file") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("levels"), list):
        raise InvalidParameter(f"{path} is not a bench-serve results file (schema {SCHEMA})")
    if data.get("load", "concurrency") not in tuple(LOADS):  # (a tuple: an edited load may be a list, unhashable)
        raise InvalidParameter(f"{path} has levels of an unknown load {data['load']!r} (known: {', '.join(LOADS)})")
    check_results(data, path)
    return data


def load_of(result: dict[str, Any]) -> str:
    """The key its levels are told apart by (results files before --request-rate had concurrency levels only)."""
    return result.get("load", "concurrency")


def level_load(level: dict[str, Any], key: str) -> float:
    """A level's concurrency or request rate (an infinite rate is stored as "inf")."""
    return float(level[key])


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def fmt_load(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:g}"


def markdown_table(result: dict[str, Any]) -> str:
    """One row per level; latencies as p50 / p90 / p99."""
    spread = lambda q: " / ".join(fmt(q[f"p{n}"]) for n in QUANTILES)  # noqa: E731
    key = load_of(result)
    lines = [f"{result['label']} · {result['model']}", "",
             f"| {LOADS[key]} | ok | failed | most in flight | output tok/s | requests/s | TTFT ms p50 / p90 / p99 | "
             "TPOT ms p50 / p90 / p99 | latency ms p50 / p90 / p99 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in result["levels"]:
        lines.append(f"| {fmt_load(level_load(lv, key))} | {lv['ok']} | {lv['failed']} | {lv.get('most_in_flight', '–')} | "
                     f"{fmt(lv['output_tok_s'])} | {fmt(lv.get('request_s'))} | "
                     f"{spread(lv['ttft_ms'])} | {spread(lv['tpot_ms'])} | {spread(lv['e2e_ms'])} |")
    return "\n".join(lines)


def compare_table(results: Sequence[dict[str, Any]]) -> str:
    """One column per results file; a row per level and measure (– where a run lacks the level or
    the measure). The files' levels must be of one load."""
    loads = {load_of(r) for r in results}
    if len(loads) > 1:
        raise InvalidParameter("these results files load their servers in different ways (concurrency levels and request "
                               "rates): compare files of one kind")
    key = loads.pop()
    levels = [{level_load(lv, key): lv for lv in r["levels"]} for r in results]
    lines = [f"| {LOADS[key]} | measure | " + " | ".join(r["label"] for r in results) + " |",
             "|---:|---|" + "---:|" * len(results)]
    for c in sorted({c for by_c in levels for c in by_c}):
        for name, key, sub in (*COMPARE_ROWS, ("failed / sent", None, None)):
            cells = []
            for by_c in levels:
                lv = by_c.get(c)
                if lv is None:
                    cells.append("–")
                elif key is None:
                    cells.append(f"{lv['failed']} / {lv['ok'] + lv['failed']}")
                else:
                    cells.append(fmt(lv.get(key) if sub is None else lv[key][sub]))
            lines.append(f"| {fmt_load(c)} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """Output tokens/s and p50 TTFT against the levels' load, a line per results file (one load:
    :func:`compare_table` refuses a mix). An infinite request rate is drawn at twice the highest finite one."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    key = load_of(results[0])
    values = {level_load(lv, key) for r in results for lv in r["levels"]}
    finite = [v for v in values if not math.isinf(v)]
    x = lambda v: 2 * max(finite, default=1) if math.isinf(v) else v  # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.2), dpi=130)
    for r in results:
        lvs = sorted(r["levels"], key=lambda lv: level_load(lv, key))  # a line joins the levels left to right
        axes[0].plot([x(level_load(lv, key)) for lv in lvs], [lv["output_tok_s"] for lv in lvs], marker="o", label=r["label"])
        ttft = [(x(level_load(lv, key)), lv["ttft_ms"]["p50"]) for lv in lvs if lv["ttft_ms"]["p50"] is not None]
        axes[1].plot([c for c, _ in ttft], [t for _, t in ttft], marker="o", label=r["label"])
    ticks = sorted(values)
    for ax, ylabel in zip(axes, ("output tokens/s (all requests)", "p50 time to first token (ms)")):
        ax.set_xscale("log", base=2)  # levels usually double
        ax.set_xticks([x(v) for v in ticks], [fmt_load(v) for v in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests" if key == "concurrency" else "requests a second (arrival rate)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].legend(fontsize=8, frameon=False)
    models = ", ".join(dict.fromkeys(str(r.get("model")) for r in results))
    fig.suptitle(f"Throughput and time to first token vs {LOADS[key].removesuffix(' /s')} ({models})", fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def run_compare(args: argparse.Namespace) -> int:
    check_writable(Path(args.out), ("throughput.png",))  # before the table is printed: a refused run prints nothing
    results = [load_results(Path(p)) for p in args.compare]
    seen: set[str] = set()
    for path, r in zip(args.compare, results):  # two runs of one URL share a default label: add their folder
        if r["label"] in seen:
            r["label"] = f"{r['label']} ({Path(path).resolve().parent.name})"
        seen.add(r["label"])
    print(compare_table(results))
    print(f"wrote {plot(results, Path(args.out) / 'throughput.png')}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.compare:
        return run_compare(args)
    if args.start is not None:
        return run_started(args)
    if args.serve_model is not None:
        raise InvalidParameter("--serve-model applies with --start (with --url, the server runs its own model)")
    levels = parse_levels(args)
    check_options(args)
    questions = load_questions(resolve_question_file(None), limit=args.limit)
    model = args.model or first_model(args.url, args.timeout)
    out = Path(args.out)  # made once the warm-up has answered: a refused run leaves no folder behind
    check_writable(out, ("results.json", "throughput.png"))
    label = args.label or urllib.parse.urlsplit(args.url).netloc
    result = measure(args, args.url, model, label, questions, levels, out,
                     command_line(args, ["--url", args.url, "--model", model, "--label", label]))
    print(markdown_table(result))
    print(f"wrote {out / 'results.json'} and {plot([result], out / 'throughput.png')}", file=sys.stderr)
    return 0


def make_folder(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidParameter(f"cannot create the --out folder {out}: {err.strerror or err}") from None
    return out


def warm_up(url: str, bodies: Sequence[dict[str, Any]], n: int, timeout: float, who: str) -> None:
    """Send ``n`` requests one after another (the first questions), not counted; the first that
    fails ends the run in one line, before any level (a bad --method, --model or --max-tokens)."""
    for i in range(n):
        outcome = send(url, bodies[i % len(bodies)], timeout)
        if outcome.error is not None:
            raise InvalidParameter(f"{who}the warm-up request failed: {outcome.error}")


def measure(args: argparse.Namespace, url: str, model: str, label: str, questions: Sequence[Any],
            levels: tuple[str, Sequence[float]], out: Path, command: str, server_command: str | None = None) -> dict[str, Any]:
    """Every level (:func:`parse_levels`) against ``url``; the results, also written to ``out``/results.json.
    ``command`` reproduces the run; ``server_command``: how the server was started, where this run did."""
    extra = {"method": args.method} if args.method else {}
    bodies = [{"model": model, "messages": [{"role": "user", "content": q.turns[0]}], "stream": True,
               "stream_options": {"include_usage": True}, "max_tokens": args.max_tokens,
               "temperature": args.temperature, **extra} for q in questions]
    key, values = levels
    result = {"schema": SCHEMA, "label": label, "url": url, "model": model, "load": key,
              "command": command, "warmup": args.warmup, "levels": []}
    if key == "request_rate":
        result["seed"] = args.seed
    if server_command is not None:
        result["server_command"] = server_command
    who = "" if server_command is None else f"{label}: "  # (several servers in one run)
    warm_up(url, bodies, args.warmup, args.timeout, who)
    make_folder(out)
    for value in values:
        if key == "concurrency":
            note = f" (so at most {len(bodies)} in flight, not {value}: raise --limit)" if value > len(bodies) else ""
            print(f"{who}concurrency {value}: {len(bodies)} requests{note}", file=sys.stderr, flush=True)
            level = run_level(url, bodies, int(value), args.timeout)
        else:
            print(f"{who}request rate {fmt_load(value)}/s: {len(bodies)} requests", file=sys.stderr, flush=True)
            level = run_rate_level(url, bodies, value, args.seed, args.timeout)
        result["levels"].append(level)
        # after every level, so that an interrupted run keeps the levels it finished
        replace_text(out / "results.json", json.dumps(result, indent=2) + "\n")
        if level["ok"] == 0:  # every request refused: no figure to report
            raise InvalidParameter(f"{who}every request at {LOADS[key].removesuffix(' /s')} {fmt_load(value)} failed, "
                                   f"the first with: {level['errors'][0]}")
    return result


def run_started(args: argparse.Namespace) -> int:
    """``--start``: each server in turn on the same GGUF file, measured alone, then stopped; one table and chart."""
    from ..models.loading import model_gguf

    names = peers.parse_servers(args.start)
    levels = parse_levels(args)
    check_options(args)
    for flag, given in (("--url", args.url != DEFAULT_URL), ("--model", args.model is not None),
                        ("--label", args.label is not None)):
        if given:  # each started server has its own address, model id and name
            raise InvalidParameter(f"{flag} names the server at --url; with --start, the servers are started on "
                                   "--serve-model and named after themselves")
    gguf = model_gguf(args.serve_model)
    if gguf is None or not gguf.is_file():
        raise InvalidParameter(f"--serve-model must be an embedded model or a .gguf file every server can read, "
                               f"got {args.serve_model!r}")
    questions = load_questions(resolve_question_file(None), limit=args.limit)
    out, results = make_folder(Path(args.out)), []
    for name in names:
        port = peers.free_port()
        slots = int(max(levels[1])) if levels[0] == "concurrency" else RATE_SLOTS
        argv = peers.PEERS[name].command(gguf, port, slots)
        if argv is None:
            print(f"{name}: skipped, {peers.PEERS[name].missing}", file=sys.stderr, flush=True)
            continue
        print(f"{name}: starting {shlex.join(argv)}", file=sys.stderr, flush=True)
        folder = make_folder(out / name)
        with peers.started(name, argv, port, folder / "server.log", args.timeout) as url:
            model = first_model(url, args.timeout)
            command = command_line(args, ["--start", name, "--serve-model", str(gguf)])
            results.append(measure(args, url, model, name, questions, levels, folder, command, shlex.join(argv)))
        print(markdown_table(results[-1]), flush=True)
    if not results:
        raise InvalidParameter(f"none of the servers in --start {args.start!r} is installed")
    if len(results) > 1:
        print(compare_table(results))
    print(f"wrote {out}/<server>/results.json and {plot(results, out / 'throughput.png')}", file=sys.stderr)
    return 0
