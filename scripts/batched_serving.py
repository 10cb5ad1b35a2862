"""Continuous batching inside one process, without the network's noise: the server's app and
scheduler on the embedded model (fast numerics by default), passes on the main thread as in ``decodekit
serve``, and C concurrent requests of 128 tokens each (``ignore_eos``), short or long prompts.
Prints aggregate tokens/s and what the batcher did: passes, rows per pass, milliseconds a pass
computes, and milliseconds the next pass waits for its requests to come back (their Python work).
An uncounted first round of as many requests as the largest level warms every slot up first.

    .venv/bin/python scripts/batched_serving.py 1 8 16 [--long] [--stream [--stream-interval-ms MS]] [--method pld] [--kv-cache int8] [--numerics exact]
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from decodekit.models import load_model
from decodekit.models.native import NativeLlama
from decodekit.serve.app import Server

SHORT = "Explain how a bicycle works."
LONG = "Summarise this: " + "The quick brown fox jumps over the lazy dog. " * 25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("concurrency", type=int, nargs="+")
    parser.add_argument("--long", action="store_true", help="a prompt of about 270 tokens instead of one sentence")
    parser.add_argument("--method", default="greedy", help="the decoding method each request asks for (e.g. pld)")
    parser.add_argument("--kv-cache", default="full", help="the server's cache policy (as decodekit serve --kv-cache)")
    parser.add_argument("--numerics", default="fast", help="the server's numerics (exact where the CPU has no AVX2)")
    parser.add_argument("--stream", action="store_true", help="streamed requests (server-sent events, read as they come)")
    parser.add_argument("--stream-interval-ms", type=float, default=None, help="as decodekit serve's (default: its default)")
    args = parser.parse_args()
    stats = {"exec": 0.0, "passes": 0, "rows": 0, "gap": 0.0}
    last_end: list[float | None] = [None]
    forward_batch = NativeLlama.forward_batch

    def timed(self, batch):  # what each batched pass costs, and how long it waited for its requests
        start = time.perf_counter()
        if last_end[0] is not None:
            stats["gap"] += start - last_end[0]
        outputs = forward_batch(self, batch)
        last_end[0] = time.perf_counter()
        stats["exec"] += last_end[0] - start
        stats["passes"] += 1
        stats["rows"] += sum(len(p.tokens) for p in batch)
        return outputs

    NativeLlama.forward_batch = timed
    server = Server(lambda: load_model(numerics=args.numerics, kv_cache=args.kv_cache), max_batch=max(args.concurrency), passes_on_caller=True,
                    **({} if args.stream_interval_ms is None else {"stream_interval_s": args.stream_interval_ms / 1000}))
    server.load_now()
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    web = uvicorn.Server(uvicorn.Config(server.app, log_level="error"))
    threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True).start()
    done = threading.Event()

    def ask(_) -> int:
        body = {"messages": [{"role": "user", "content": LONG if args.long else SHORT}], "max_tokens": 128,
                "temperature": 0, "ignore_eos": True, **({} if args.method == "greedy" else {"method": args.method})}
        if args.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            if not args.stream:
                return json.loads(response.read())["usage"]["completion_tokens"]
            usage = None
            for line in response:  # one event a line, read as it comes
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
            return usage["completion_tokens"]

    def drive() -> None:
        time.sleep(0.5)
        # a first round, not counted: every slot then holds the prompt (the server keeps a slot's
        # cache for a next prompt that starts the same way), and start-up work is done, so each
        # level below meets the same conditions (the first level measured used to pay for both)
        with ThreadPoolExecutor(max(args.concurrency)) as pool:
            list(pool.map(ask, range(max(args.concurrency))))
        for c in args.concurrency:
            stats.update(exec=0.0, passes=0, rows=0, gap=0.0)
            last_end[0] = None
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                tokens = sum(pool.map(ask, range(c)))
            wall = time.perf_counter() - t0
            n = max(1, stats["passes"])
            print(f"{c:3d} requests: {tokens / wall:6.1f} tok/s; {stats['passes']} passes, {stats['rows'] / n:.1f} rows a pass, "
                  f"{stats['exec'] * 1e3 / n:.2f} ms computing and {stats['gap'] * 1e3 / n:.2f} ms waiting a pass", flush=True)
        done.set()
        server.scheduler.batcher.stop_waiting()

    threading.Thread(target=drive).start()
    server.scheduler.batcher.serve(done)
    web.should_exit = True


if __name__ == "__main__":
    main()
