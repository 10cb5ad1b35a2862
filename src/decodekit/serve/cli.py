"""``decodekit serve``: the OpenAI-compatible server (:mod:`.app`) under uvicorn.

The socket is bound first (a taken port is one clear line, exit code 2), then the server starts
answering (``/health`` says 503) while the main thread loads the model; the start-up line names
the model, the numerics and the address once it is ready, and the main thread then runs every
forward pass of every request."""

from __future__ import annotations

import argparse
import socket
import sys
import threading
from collections.abc import Callable

from ..arguments import add_model_arguments
from ..errors import InvalidParameter, NumericsUnavailable
from . import MAX_BATCH, MAX_QUEUE, PROMPT_CACHE_MIB, STREAM_INTERVAL_S


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, numerics=None)  # the server's default: fast where the model and CPU allow it, else exact
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH, help=f"requests decoded together (default {MAX_BATCH})")
    p.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help=f"requests waiting for a slot before 503s (default {MAX_QUEUE})")
    p.add_argument("--prompt-cache-mib", type=float, default=PROMPT_CACHE_MIB, metavar="MIB",
                   help="host memory for the keys and values of earlier prompts, so that a prompt that starts like "
                        f"one of them reads only the rest (default {PROMPT_CACHE_MIB}; 0: only what the slots hold)")
    p.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated web origins (https://host:port, or *) whose pages may call the API from a "
                        "browser (CORS; default none)")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="how long a stream's text after its first token is gathered into one write "
                        f"(default {STREAM_INTERVAL_S * 1000:g}; 0: every token as it is decoded)")
    p.set_defaults(func=run)


def load_for_serving(args: argparse.Namespace):
    """The model in the numerics asked for; without ``--numerics``, ``fast`` if it can run here,
    else ``exact`` (with a note)."""
    from ..models import load_model

    if args.numerics is not None:
        return load_model(args.model, backend=args.backend, dtype=args.dtype, numerics=args.numerics, kv_cache=args.kv_cache)
    try:
        return load_model(args.model, backend=args.backend, dtype=args.dtype, numerics="fast", kv_cache=args.kv_cache)
    except NumericsUnavailable as err:  # (any other error is the model's or the cache's: said once, as it is)
        print(f"decodekit serve: {err}; serving the exact numerics", file=sys.stderr)
        return load_model(args.model, backend=args.backend, dtype=args.dtype, numerics="exact", kv_cache=args.kv_cache)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket: IPv6 for an IPv6 address (``::``, ``::1``), else IPv4."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, reuse_port=False)
    except (OSError, OverflowError) as err:
        raise InvalidParameter(f"cannot listen on {host}:{port} ({getattr(err, 'strerror', None) or err})") from None
    sock.set_inheritable(True)
    return sock


def base_url(sock: socket.socket) -> str:
    """The API's address on ``sock``, an IPv6 host in brackets."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


SHUTDOWN_SIGNALS = ("SIGTERM", "SIGINT")
#: How long a shutdown waits for the requests in progress (uvicorn's graceful timeout); the answers
#: still running a second before its end are stopped, each with an error its client can read.
SHUTDOWN_GRACE_S = 5
#: After a second signal: the answers are stopped at once, and the server exits this much later
#: (time for their error events to go out), or when they have.
STOP_NOW_S = 1


def shut_down_on_signals(web, stop_answers: Callable[[], None], loading: Callable[[], bool]) -> None:
    """SIGTERM and Ctrl-C shut the server down as uvicorn does on its own thread (which installs no
    handlers off the main thread): no new connections, the requests in progress answered in full
    (the passes go on meanwhile) for up to the graceful timeout, less a second in which
    ``stop_answers`` ends those still running with a 503; then the process ends with status 0. A
    second signal stops the answers at once and exits. While the model is ``loading()`` (on the main
    thread, with no answers to finish) a signal stops the load there, as a KeyboardInterrupt. A
    SIGINT the process was started ignoring (a background job of a shell) stays ignored."""
    import signal

    def shut_down(signum: int, frame) -> None:
        # the handler runs on the main thread, which also runs the requests: what it leaves to timer
        # threads (stopping the answers, which takes the scheduler's lock; printing, which a request
        # may be doing) could otherwise meet the same work half done below it
        name = signal.Signals(signum).name
        if web.should_exit:
            later(0, stop_answers)
            later(STOP_NOW_S, lambda: setattr(web, "force_exit", True))
            return
        web.should_exit = True
        if loading():
            raise KeyboardInterrupt(f"{name}, shutting down (the model was loading)")
        later(SHUTDOWN_GRACE_S - 1, stop_answers)
        later(0, lambda: print(f"decodekit serve: {name}, shutting down (the requests in progress have "
                               f"{SHUTDOWN_GRACE_S - 1} s to finish; another signal stops now)", file=sys.stderr, flush=True))

    for name in SHUTDOWN_SIGNALS:
        number = getattr(signal, name)
        if signal.getsignal(number) is not signal.SIG_IGN:
            signal.signal(number, shut_down)


def later(seconds: float, action: Callable[[], object]) -> None:
    """Run ``action`` on a thread of its own after ``seconds`` (a daemon: it never holds the exit up)."""
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


def allowed_origins(text: str) -> list[str]:
    """The comma-separated origins of ``--allowed-origins``. Each is ``*`` or ``scheme://host[:port]``,
    as a browser's Origin header spells it (in lower case, as it is kept): one with a path (a trailing
    slash too) or without a scheme would never match a page, leaving the flag silently without effect,
    so it is refused."""
    import re

    origins = [o.strip().lower() for o in text.split(",") if o.strip()]
    if text.strip() and not origins:  # given, but naming none: the flag would be silently without effect
        raise InvalidParameter(f"--allowed-origins: {text!r} names no origin (scheme://host[:port], or *)")
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+", origin):
            raise InvalidParameter(f"--allowed-origins: {origin!r} is not a web origin (scheme://host[:port] without "
                                   "a path, such as https://app.example:8443, or *)")
    return origins


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..models.loading import resolve_model_folder
    from ..models.kv_policy import parse_kv_cache
    from .app import Server

    for name in ("max_batch", "max_queue"):
        if getattr(args, name) < 1:
            raise InvalidParameter(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.prompt_cache_mib < float("inf"):  # NaN too
        raise InvalidParameter(f"--prompt-cache-mib must be 0 or a finite number of MiB, got {args.prompt_cache_mib}")
    interval_s = STREAM_INTERVAL_S if args.stream_interval_ms is None else args.stream_interval_ms / 1000
    if not 0 <= interval_s <= 1:  # NaN too
        raise InvalidParameter(f"--stream-interval-ms must be between 0 and 1000, got {args.stream_interval_ms}")
    origins = allowed_origins(args.allowed_origins)
    if args.kv_cache is not None:
        parse_kv_cache(args.kv_cache)  # a bad spelling is its own line, not a reason to leave the fast numerics
    resolve_model_folder(args.model)  # a missing model is reported now, before anything listens
    sock = listen(args.host, args.port)
    server = Server(lambda: load_for_serving(args), max_batch=args.max_batch, max_queue=args.max_queue,
                    passes_on_caller=True, stream_interval_s=interval_s,
                    allowed_origins=origins, prompt_cache_mib=args.prompt_cache_mib)
    web = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    # HTTP on a thread, answering 503 while the model loads; the main thread loads the model and
    # then runs every forward pass (see models/batching.py for why the main thread)
    http = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, name="decodekit-http", daemon=True)
    http.start()
    stopped = threading.Event()
    shut_down_on_signals(web, server.stop_answers, loading=lambda: server.scheduler is None)
    try:
        server.load_now()
        print(f"decodekit serve: {server.model_id}, {server.numerics} numerics, {base_url(sock)} "
              f"(max batch {server.scheduler.max_batch}, queue {server.max_queue})", file=sys.stderr, flush=True)
        threading.Thread(target=lambda: (http.join(), stopped.set(), server.scheduler.batcher.stop_waiting()),
                         daemon=True).start()
        server.scheduler.batcher.serve(stopped)
    except KeyboardInterrupt as interrupt:  # a signal while the model loaded
        if interrupt.args:
            print(f"decodekit serve: {interrupt.args[0]}", file=sys.stderr, flush=True)
    finally:
        web.should_exit = True
        http.join(timeout=10)
    return 0
