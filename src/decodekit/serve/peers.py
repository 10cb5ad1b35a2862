"""The servers ``decodekit bench-serve --start`` runs itself, one after another, on one GGUF file.

* ``decodekit``: ``decodekit serve``, continuous batching over as many slots as the highest level;
* ``llama-cpp-python``: llama-cpp-python's own server (``llama_cpp.server``, the ``llamacpp`` extra),
  which answers one request at a time;
* ``llama-server``: llama.cpp's native server with continuous batching (``-np N -cb``), built by
  ``scripts/build_llama_server.sh`` into ``.llama.cpp/bin`` (or named by ``DECODEKIT_LLAMA_SERVER``,
  or on the ``PATH``).

A server that is not installed is skipped with a note. Each one gets a free loopback port, is
measured once it answers ``GET /v1/models``, and is stopped (SIGINT, then SIGKILL after a grace
period) before the next starts, also when the run fails or is interrupted: two servers never share
the machine's cores, and none outlives the run.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidParameter
from ..machine import usable_cores

STOP_GRACE_S = 15.0  # decodekit serve finishes its requests within 4 s of SIGINT; llama-server at once
POLL_S = 0.25
REPOSITORY = Path(__file__).resolve().parents[3]  # (where an editable install's scripts/ build into)


def decodekit_command(gguf: Path, port: int, slots: int) -> list[str] | None:
    return [sys.executable, "-m", "decodekit", "serve", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--max-batch", str(slots)]


LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")  # llama-cpp-python[server]


def llama_cpp_python_command(gguf: Path, port: int, slots: int) -> list[str] | None:
    if any(importlib.util.find_spec(module) is None for module in LLAMA_CPP_SERVER_MODULES):
        return None
    # Its default thread count is half the cores; the context fits a question and its answer. It answers
    # one request at a time, and by default a new request cuts the one being streamed short
    # (--interrupt_requests): off, so that each request waits its turn and gets its whole answer.
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(usable_cores()), "--n_ctx", "4096", "--interrupt_requests", "False"]


def llama_server_binary() -> str | None:
    named = os.environ.get("DECODEKIT_LLAMA_SERVER")
    if named:
        return named
    built = REPOSITORY / ".llama.cpp" / "bin" / "llama-server"
    return str(built) if built.is_file() else shutil.which("llama-server")


def llama_server_command(gguf: Path, port: int, slots: int) -> list[str] | None:
    binary = llama_server_binary()
    if binary is None:
        return None
    # a slot per request in flight, each with room for a question and its answer
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-cb",
            "-c", str(2048 * slots), "-t", str(usable_cores())]


@dataclass(frozen=True)
class Peer:
    name: str
    command: Callable[[Path, int, int], list[str] | None]  # (GGUF file, port, slots) -> argv; None: not installed
    missing: str  # how to install it


PEERS = {peer.name: peer for peer in (
    Peer("decodekit", decodekit_command, "decodekit is always there"),
    Peer("llama-cpp-python", llama_cpp_python_command,
         "not installed with its server: pip install -e '.[llamacpp]' (builds llama.cpp from source, about 10 minutes)"),
    Peer("llama-server", llama_server_command,
         "not built: bash scripts/build_llama_server.sh (about 10 minutes), or set DECODEKIT_LLAMA_SERVER"),
)}


def parse_servers(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    unknown = [name for name in names if name not in PEERS]
    if unknown or len(set(names)) != len(names):
        raise InvalidParameter(f"--start takes comma-separated servers, each once, of {', '.join(PEERS)}; got {text!r}")
    return names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1].strip() if lines else "(nothing written)"


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/models", timeout=5) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):  # refused while starting; 503 while it loads the model
        return False


def stop(process: subprocess.Popen) -> None:
    """SIGINT (each server's graceful shutdown), SIGKILL after STOP_GRACE_S; waits for it to end."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def started(name: str, argv: list[str], port: int, log: Path, timeout: float) -> Iterator[str]:
    """Run ``argv`` (its output into ``log``) until it answers on ``port``; yield its base URL; stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as output:
        try:
            # a session of its own: a Ctrl-C at the terminal reaches this process, which stops it
            process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        except OSError as err:
            raise InvalidParameter(f"cannot start {name} ({argv[0]}): {err.strerror or err}") from None
        try:
            url, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + timeout
            while not answers(url):
                if process.poll() is not None:
                    raise InvalidParameter(f"{name} exited with status {process.returncode} before it answered: "
                                           f"{last_line(log)} (all of its output: {log})")
                if time.monotonic() > deadline:
                    raise InvalidParameter(f"{name} did not answer within {timeout:g} s (--timeout; its output: {log})")
                time.sleep(POLL_S)
            yield url
        finally:
            stop(process)
