"""Start `decodekit serve` on the embedded model, time a few greedy streams one after another, stop it.

    .venv/bin/python scripts/serve_stream_times.py [--streams 3] [--tokens 48] [-- serve flags...]

For how the server behaves beside another busy process (start one, e.g. `python3 -c "while 1: pass"`,
before this): each line is one stream's chunks and seconds, first request to last chunk."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request

import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("serve", nargs="*", help="more flags for decodekit serve (after --)")
    args = parser.parse_args()
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "decodekit", "serve", "--port", str(port), *args.serve])
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health") as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for _ in range(args.streams):
            start = time.perf_counter()
            chunks = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Tell a long story."}],
                                                    max_tokens=args.tokens, temperature=0, stream=True)
            print(f"{sum(1 for _ in chunks)} chunks in {time.perf_counter() - start:.2f} s", flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
