"""How long a short request waits while a search runs on the same server: a `beam` request of
200 tokens is sent, and 3 seconds later a greedy request of 10 tokens; both times are printed.

    .venv/bin/decodekit serve --port 8791 --numerics fast &     # wait for /health to answer 200
    .venv/bin/python scripts/search_beside_a_request.py --port 8791
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request


def post(port: int, body: dict) -> float:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        json.loads(reply.read())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    base = {"model": args.model, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    times: dict[str, float] = {}
    search = threading.Thread(target=lambda: times.update(beam=post(args.port, {**base, "method": "beam", "max_tokens": 200})))
    search.start()
    time.sleep(3)
    times["short"] = post(args.port, {**base, "max_tokens": 10})
    search.join()
    print(f"short request (10 tokens, sent 3 s after the beam): {times['short']:.2f} s; beam (200 tokens): {times['beam']:.2f} s")


if __name__ == "__main__":
    main()
