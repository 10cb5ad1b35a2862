"""The OpenAI-compatible HTTP API (Starlette, through FastAPI) over a :class:`.scheduler.Scheduler`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET
/health`` (503 until the model is loaded), ``GET /metrics`` (Prometheus). Request bodies follow
OpenAI's; what decodekit adds comes as extra fields, as vLLM does: ``method`` (any registered
decoding method) and any sampler parameter or method option by its decodekit name (``top_k``,
``min_p``, ``repetition_penalty``, ``budget``, ``max_ngram``, ...). Every error is an OpenAI
error object with its status: 400 for a bad parameter or a prompt that does not fit, 404 for
another model or route, 503 when the server is loading or full (with ``Retry-After``).

Defaults as OpenAI's: ``temperature`` 1 (sampling, method ``sample``) unless a request says
otherwise; ``temperature`` 0 decodes greedily (a search method that chooses among samples draws
them at its ``sample_temperature`` then, as everywhere). With ``seed``, choice ``i`` of ``n`` samples with
``seed + i`` (a search method's with ``seed + i * 2**32``, since its own samples take ``seed``,
``seed + 1``, ...) and its tokens are those ``decodekit generate --seed`` gives, alone or in a batch.
``logprobs`` are the model's own (before temperature and truncation), from a teacher-forced pass
over the answer.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine.api import make_sampler, prompt_token_ids, split_params
from ..engine.core import check_fits
from ..engine.registry import build_decoder, method_spec
from ..engine.stops import shown_tokens
from ..errors import CacheError, ClusterError, DecodeKitError, InvalidModel, InvalidParameter, ModelNotFound, PromptTooLong
from ..samplers.constraint import KINDS, constraint_processor
from ..samplers.params import SEED_LIMIT
from ..models import LoadedModel
from ..models.tokenizer import Tokenizer
from ..options import finite
from . import MAX_BATCH, MAX_QUEUE, RETRY_AFTER_S, STREAM_INTERVAL_S
from .metrics import ServerMetrics
from .scheduler import Job, Outcome, Overloaded, Scheduler

MAX_N = 16
MAX_BODY_BYTES = 16 << 20  # a context's worth of text or token ids is well under a megabyte
ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20
#: vLLM's fields for structured output, beside OpenAI's response_format
GUIDED = tuple("guided_" + kind for kind in KINDS if kind != "json_schema")
#: Request fields this module reads itself: never passed on to the method as its options.
READ_HERE = {"model", "stream", "stream_options", "messages", "prompt", "n", "max_tokens", "max_completion_tokens",
             "stop", "logprobs", "top_logprobs", "temperature", "top_p", "seed", "presence_penalty",
             "frequency_penalty", "method", "ignore_eos", "response_format", "method_options", *GUIDED}
#: OpenAI fields that mean nothing for a local model and change no answer: accepted and ignored.
IGNORED = {"user", "safety_identifier", "store", "metadata", "prompt_cache_key", "prompt_cache_retention",
           "parallel_tool_calls", "service_tier"}
NOT_OPTIONS = READ_HERE | IGNORED
#: Seeds between two choices of a search method (its samples are seeded seed, seed + 1, ...).
SEARCH_CHOICE_SPACING = 2**32
# OpenAI fields that would change the answer and are not implemented: refused, never ignored
UNSUPPORTED = {"tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
               "function_call": "function calls", "logit_bias": "logit_bias", "suffix": "suffix",
               "echo": "echo", "best_of": "best_of", "audio": "audio output", "modalities": "modalities",
               "prediction": "predicted outputs", "reasoning_effort": "reasoning effort", "verbosity": "verbosity",
               "web_search_options": "web search"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


#: Errors raised while a request decodes that are the server's fault, not the request's: a model or
#: a cache found damaged (a 500, where the request's own faults are 400s).
SERVER_FAULTS = (InvalidModel, CacheError, ModelNotFound, ClusterError)


def decoding_error(err: Exception, body: dict[str, Any], chat: bool) -> ApiError:
    """The answer to an error raised while a request decoded: a 400 naming the request's field at
    fault, or a 500 where the fault is the server's (or unexpected)."""
    if isinstance(err, DecodeKitError) and not isinstance(err, SERVER_FAULTS):
        return ApiError(400, str(err), param=field_named(err, body, chat))
    return ApiError(500, str(err) if isinstance(err, DecodeKitError) else internal_error(err), "server_error")


def internal_error(err: Exception) -> str:
    """A 500's message for an error no check foresaw (its type and text, never a traceback)."""
    return f"internal error: {type(err).__name__}: {err}"


class ClientGone(Exception):
    """The client closed the connection before its answer: nobody to answer, nothing to count as an error."""


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object (what goes under ``"error"``, in a reply or in a stream's event)."""
    return {"message": message, "type": kind, "param": param, "code": code}


def error_response(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": error_body(message, kind, param, code)}
    return JSONResponse(body, status_code=status, headers=headers)


class Server:
    """The app and what it serves. ``load`` makes the model (run on a thread at start-up; until
    it returns, ``/health`` and the API answer 503)."""

    def __init__(self, load: Callable[[], LoadedModel], *, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
                 passes_on_caller: bool = False, stream_interval_s: float = STREAM_INTERVAL_S,
                 allowed_origins: Sequence[str] = ()):
        """``stream_interval_s``: how long a stream's text after its first is gathered before it is
        written (:class:`Outbox`). ``allowed_origins``: web pages (``https://host:port``, or ``*``)
        whose scripts may call the API from a browser (CORS); none by default, so that a page the
        user happens to visit cannot use a server on their machine."""
        self.max_batch, self.max_queue, self.passes_on_caller = max_batch, max_queue, passes_on_caller
        self.allowed_origins = frozenset(allowed_origins)
        self.stream_interval_s = stream_interval_s
        self._outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop
        self.scheduler: Scheduler | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: str | None = None
        # redirect_slashes=False: a path with a trailing slash is a 404 error object, not an empty 307
        self.app = FastAPI(title="decodekit", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
        if allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            self.app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST"],
                                    allow_headers=["*"])
        self._load = load
        self._routes()

    def _outbox(self, loop: asyncio.AbstractEventLoop) -> "Outbox":
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes[loop] = Outbox(loop, self.stream_interval_s)
        return outbox

    # start-up ---------------------------------------------------------------------------------

    def load_now(self) -> None:
        try:
            model = self._load()
            from ..speculative import prepare

            prepare(model.backend)  # the cost table speculative methods need, measured once, outside requests
            scheduler = Scheduler(model, max_batch=self.max_batch, max_queue=self.max_queue,
                                  passes_on_caller=self.passes_on_caller)
            self.metrics = ServerMetrics(scheduler)
            self.scheduler = scheduler
        except DecodeKitError as err:
            self.load_error = str(err)
            raise

    @property
    def numerics(self) -> str:
        return getattr(self.scheduler.model.backend, "numerics", "exact") if self.scheduler else ""

    @property
    def model_id(self) -> str:
        return self.scheduler.model.name if self.scheduler else ""

    def ready(self) -> Scheduler:
        if self.scheduler is None:
            reason = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, reason, "server_error", code="model_loading")
        return self.scheduler

    # routes -----------------------------------------------------------------------------------

    def count_error(self, status: int) -> None:
        """One request answered with an error of this HTTP status, in the metrics (once they exist)."""
        if self.metrics:
            self.metrics.errors.labels(str(status)).inc()

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(ApiError)
        async def api_error(request: Request, err: ApiError):
            self.count_error(err.status)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
            return error_response(err.status, str(err), err.kind, err.param, err.code, headers)

        @app.exception_handler(ClientGone)
        async def client_gone(request: Request, err: ClientGone):
            return Response(status_code=499)  # nginx's "client closed request": logged, never sent

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, err: StarletteHTTPException):
            message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
            return error_response(err.status_code, message, "invalid_request_error")

        @app.exception_handler(Exception)
        async def unexpected(request: Request, err: Exception):
            self.count_error(500)
            return error_response(500, internal_error(err), "server_error")

        @app.api_route("/health", methods=["GET", "HEAD"])
        async def health():
            if self.scheduler is None:
                return JSONResponse({"status": "error" if self.load_error else "loading"}, status_code=503)
            return {"status": "ok"}

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        async def metrics():
            self.ready()
            return Response(self.metrics.text(), media_type="text/plain; version=0.0.4")

        @app.api_route("/v1/models", methods=["GET", "HEAD"])
        async def models():
            self.ready()
            return {"object": "list", "data": [self.model_card()]}

        @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
        async def model(model: str):
            self.ready()
            if model != self.model_id:
                raise self.unknown_model(model)
            return self.model_card()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.complete(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.complete(request, chat=False)

    def unknown_model(self, name: Any) -> ApiError:
        return ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r}", param="model",
                        code="model_not_found")

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "decodekit", "numerics": self.numerics,
                "max_model_len": self.scheduler.model.backend.info.max_length}

    def check_origin(self, request: Request) -> None:
        """A browser names the page that sends a request (``Origin``). CORS keeps such a page from
        reading the answer, not from sending the request: a text/plain POST needs no preflight. So a
        request from a page that is not allowed is refused before any decoding."""
        origin = request.headers.get("origin")
        if origin is not None and "*" not in self.allowed_origins and origin not in self.allowed_origins:
            raise ApiError(403, f"requests from the web page {origin} are not allowed (decodekit serve "
                                "--allowed-origins names the pages that may call it)")

    # completions ------------------------------------------------------------------------------

    async def complete(self, request: Request, *, chat: bool) -> Response | dict[str, Any]:
        started = time.perf_counter()  # the request's arrival: its latencies count reading and checking it too
        scheduler = self.ready()
        self.check_origin(request)
        body = await read_body(request)
        if body.get("model") not in (None, self.model_id):
            raise self.unknown_model(body.get("model"))
        spec = parse_request(body, chat=chat)
        try:
            # on a thread: a long prompt takes a while to tokenise, and other clients wait meanwhile otherwise
            prompt_ids = await asyncio.to_thread(prompt_token_ids, scheduler.model, spec.prompt, chat=chat)
            if spec.max_tokens is None:  # to the context's end; past a windowed cache's, as many as the model's context holds
                info = scheduler.model.backend.info
                room = info.max_length - len(prompt_ids)
                spec.max_tokens = max(1, min(room, info.trained_length or room))
            check_fits(scheduler.model.backend, len(prompt_ids), spec.max_tokens)
            check_method(spec, scheduler.model)
        except PromptTooLong as err:
            raise ApiError(400, str(err), param="messages" if chat else "prompt", code="context_length_exceeded") from None
        except DecodeKitError as err:  # a bad parameter, method, option or constraint
            raise ApiError(400, str(err), param=field_named(err, body, chat)) from None
        stream = spec.stream
        deltas = self._outbox(asyncio.get_running_loop()).channel()
        jobs = []
        # choice i seeds seed + i; a search's own samples take seed, seed + 1, ... too, so its choices
        # are spaced far apart, that no two of them share a sample
        spacing = SEARCH_CHOICE_SPACING if method_spec(spec.method).family == "search" else 1
        for i in range(spec.n):
            params = dict(spec.params)
            if "seed" in params:
                params["seed"] = (params["seed"] + i * spacing) % SEED_LIMIT
            on_text = (lambda text, i=i: deltas.post((i, text))) if stream else None
            jobs.append(Job(prompt_ids, spec.method, params, spec.max_tokens, spec.stop, on_text, spec.top_logprobs,
                            spec.ignore_eos, constraint=spec.constraint))
        try:
            futures = scheduler.submit(jobs)
        except Overloaded as err:
            raise ApiError(503, str(err), "server_error", code="overloaded") from None
        except DecodeKitError as err:  # more choices than the server ever holds at once
            raise ApiError(400, str(err), param=field_named(err, body, chat)) from None
        reply = Reply(self, chat, spec, prompt_ids, started, body)
        if stream:
            return StreamingResponse(reply.stream(request, jobs, futures, deltas), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            outcomes = await wait_or_cancel(request, scheduler, jobs, futures)
        except ClientGone:
            reply.record_when_stopped(dict(enumerate(futures)), {})  # cancelled choices count too, as in a stream
            raise
        except DecodeKitError as err:  # found while decoding: an option the checks above cannot judge alone, or a fault
            reply.record_finished(futures, jobs)  # the other choices ran to their end: they count
            raise decoding_error(err, body, chat) from None
        return reply.whole(outcomes, jobs)


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; a body past :data:`MAX_BODY_BYTES` is a 413 as soon as it is
    declared or read that far (no prompt that fits the context comes near it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(declared)} bytes, more than the {MAX_BODY_BYTES} this server reads")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is more than the {MAX_BODY_BYTES} bytes this server reads")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def field_named(err: DecodeKitError, body: dict[str, Any], chat: bool) -> str | None:
    """The request field an error of decodekit's checks is about, for the error object's ``param``:
    the one it names (``InvalidParameter.param``; a chat's prompt is its ``messages``), else the
    one its message begins with, as in "temperature must be a finite number >= 0"."""
    named = getattr(err, "param", None)
    if named == "prompt" and chat:
        return "messages"
    if named == "constraint":  # the field that gave it (structured_output takes one at most)
        return next((f for f in ("response_format", *GUIDED) if body.get(f) is not None), None)
    if named is not None:
        return named
    first = str(err).split(" ", 1)[0].strip(":'")
    named_options = body.get("method_options")
    if isinstance(named_options, dict) and first in named_options:  # (a search's n, not the body's n of choices)
        return "method_options"
    return first if first in body else None


class RequestSpec:
    """A completion request's fields, checked, in decodekit's terms."""

    def __init__(self, prompt: Any, method: str, params: dict[str, Any], max_tokens: int | None, stop: list[str], n: int,
                 top_logprobs: int | None, include_usage: bool, ignore_eos: bool, constraint: dict | None,
                 stream: bool = False):
        self.prompt, self.method, self.params, self.max_tokens, self.stream = prompt, method, params, max_tokens, stream
        self.ignore_eos, self.constraint = ignore_eos, constraint
        self.stop, self.n, self.top_logprobs, self.include_usage = stop, n, top_logprobs, include_usage


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        huge = isinstance(value, int) and value.bit_length() > 256  # its digits would be most of the message
        shown = f"an integer of {value.bit_length()} bits" if huge else repr(value)
        raise ApiError(400, f"{name} must be an integer {bounds}, got {shown}", param=name)
    return value


def _flag(body: dict, name: str, field: str | None = None) -> bool:
    """A boolean field of ``body`` (``field``: its name in the request, where ``body`` is an object inside it)."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):  # never "no" read as true
        field = field or name
        raise ApiError(400, f"{field} must be true or false, got {value!r}", param=field.split(".")[0])
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
        raise ApiError(400, f"{name} must be a finite number, got {value!r:.80}", param=name)
    return float(value)


def asks_for_nothing(name: str, value: Any) -> bool:
    """Whether an unsupported field is absent or at a value that changes nothing (OpenAI's
    defaults: false, empty, ``best_of`` 1, a tool choice of "none" or "auto", which calls no tool
    where no tool is given, and given tools are refused, ``modalities`` ["text"], what this server
    answers in); 0 or "" are not taken for false."""
    if value is None or value is False or (isinstance(value, (list, dict)) and not value):
        return True
    if name in ("tool_choice", "function_call"):
        return value in ("none", "auto")
    if name == "modalities":
        return value == ["text"]
    return name == "best_of" and type(value) is int and value == 1


def parse_request(body: dict[str, Any], *, chat: bool) -> RequestSpec:
    """A request body, checked field by field (an :class:`ApiError` naming the field otherwise)."""
    for name, what in UNSUPPORTED.items():
        if not asks_for_nothing(name, body.get(name)):
            raise ApiError(400, f"{what} ({name}) is not supported by this server", param=name)
    prompt = chat_messages(body.get("messages")) if chat else _completion_prompt(body)
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    # unset: the rest of the context for chat (filled in once the prompt is tokenised), 16 for completions as OpenAI's
    max_tokens = _integer(body, "max_tokens", max_tokens if chat else max_tokens or 16, 1)
    n = _integer(body, "n", 1, 1, MAX_N)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    stream = _flag(body, "stream")
    top_logprobs = _top_logprobs(body, chat, stream)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if options and not stream:  # as OpenAI answers it: options of a stream that is not asked for
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    method = body.get("method", "sample")
    if not isinstance(method, str):
        raise ApiError(400, f"method must be a string, got {method!r}", param="method")
    method, params = _sampling(body, method, _method_options(body))
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    return RequestSpec(prompt, method, params, max_tokens, stop, n, top_logprobs, include_usage,
                       _flag(body, "ignore_eos"), structured_output(body), stream)


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list of them: text, or token ids
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
    return prompt


def _top_logprobs(body: dict[str, Any], chat: bool, stream: bool) -> int | None:
    """How many alternatives each token's log-probability comes with (None: no log-probabilities):
    chat's ``logprobs`` + ``top_logprobs``, the legacy completions' ``logprobs`` count."""
    if chat:
        top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        top_logprobs = top if _flag(body, "logprobs") else None
        if top_logprobs is None and body.get("top_logprobs") is not None:  # as OpenAI answers it
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        top_logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and stream:
        raise ApiError(400, "logprobs with stream is not supported yet; ask without stream", param="logprobs")
    return top_logprobs


def _method_options(body: dict[str, Any]) -> dict[str, Any]:
    """The method's options and sampler parameters: the body's fields that are not OpenAI's, and
    ``method_options``."""
    # (a field set to null is a field not given, as OpenAI reads it)
    params: dict[str, Any] = {k: v for k, v in body.items()
                              if k not in NOT_OPTIONS and k not in UNSUPPORTED and v is not None}
    # a method's options may also come in an object of their own: the only way to give those named
    # like an OpenAI field (a search method's n, which the body's n cannot be)
    named = body.get("method_options") or {}
    if not isinstance(named, dict) or not all(isinstance(k, str) for k in named):
        raise ApiError(400, "method_options must be an object of a method's options", param="method_options")
    # the OpenAI fields are read from the body below: inside method_options they would be lost
    fields = sorted(set(named) & (NOT_OPTIONS - {"n"}))
    if fields:
        raise ApiError(400, f"{fields[0]} is a field of the request body, not a method option: give it there",
                       param="method_options")
    twice = sorted(set(named) & set(params))
    if twice:
        raise ApiError(400, f"{twice[0]} is given both in the body and in method_options", param="method_options")
    params.update(named)
    return params


def _sampling(body: dict[str, Any], method: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The OpenAI sampling fields as decodekit's: temperature 0 is greedy decoding, OpenAI's default
    temperature is 1 (for plain sampling), and a sampling request without a seed gets a random one."""
    temperature = _number(body, "temperature")
    if temperature is None and "method" not in body and not body.get("greedy"):
        temperature = 1.0  # OpenAI's default
    if temperature == 0:
        if method == "sample":
            method = "greedy"
    elif temperature is not None:
        params["temperature"] = temperature
    top_p = _number(body, "top_p")
    if top_p is not None and top_p != 1:
        params["top_p"] = top_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value:
            params[name] = value
    seed = _integer(body, "seed", None, 0, SEED_LIMIT - 1)
    if seed is not None or temperature not in (None, 0):
        params["seed"] = seed if seed is not None else secrets.randbelow(2**31)
    return method, params


def structured_output(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's constraint: OpenAI's ``response_format`` (``json_object``, ``json_schema``) or
    vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ApiError(400, f"response_format must be an object such as {{\"type\": \"json_object\"}}, got {fmt!r:.80}",
                           param="response_format")
        kind = fmt.get("type")
        if kind == "json_object":
            found.append({"json": None})
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs json_schema.schema, an object", param="response_format")
            found.append({"json_schema": schema})
        elif kind != "text":
            raise ApiError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")
    for field in GUIDED:
        if body.get(field) is not None:
            kind = field.removeprefix("guided_")
            found.append({"json_schema" if kind == "json" else kind: body[field]})
    if len(found) > 1:
        raise ApiError(400, "give at most one of response_format and the guided_* fields", param="response_format")
    return found[0] if found else None


def token_texts(tokenizer: Tokenizer, tokens: list[int], length: int | None = None) -> tuple[list[str], list[int]]:
    """Each token's text and where it starts in the text (a completion's ``tokens`` and
    ``text_offset``): the characters the token completes, as an incremental detokeniser gives them.
    A character split over byte tokens is the last one's and the ones before it hold "", so the
    texts join to the output's text and the offsets index it. ``length``: the text's, where a stop
    string cut it inside the last token (its text is then cut there too)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pieces = [decoder.decode(tokenizer.token_bytes(t)) for t in tokens]
    if pieces:
        pieces[-1] += decoder.decode(b"", final=True)
    offsets, at = [], 0
    for i, piece in enumerate(pieces):
        offsets.append(at)
        if length is not None:
            pieces[i] = piece = piece[: max(length - at, 0)]
        at += len(piece)
    return pieces, offsets


def top_key(tokenizer: Tokenizer, token: int) -> str:
    """A legacy completion's ``top_logprobs`` key for ``token``: its text, or, for a token holding
    part of a character, its bytes spelled ``bytes:\\xNN...`` as OpenAI spells them (its text would
    be U+FFFD, the same for every such token, and one would hide another)."""
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages as decodekit's ``{"role", "content"}`` strings (content parts of type
    text are joined; a developer message is a system message)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a content, got {message!r:.80}",
                           param="messages")
        if message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role, one of {', '.join(ROLES)}; "
                                f"got {message.get('role')!r}", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        # OpenAI's developer messages are its newer name for system ones: chat templates know "system"
        out.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    return out


def check_method(spec: RequestSpec, model: LoadedModel) -> None:
    """Every parameter, option and constraint checked before the request is queued (the same
    checks the engine makes, so a bad one is a 400 now, not an error after waiting)."""
    declared = method_spec(spec.method).options or {}
    sampler_params, options = split_params(spec.params)
    for name, value in options.items():
        local = getattr(declared.get(name), "local", None)
        if local is not None and local(value):
            raise ApiError(400, f"{name} names a file, a model or an object of the server's machine, which a request "
                                f"cannot choose", param=name)
    build_decoder(spec.method, **options)
    make_sampler(spec.method, sampler_params)
    if spec.constraint is not None:
        try:
            constraint_processor(spec.constraint, model.tokenizer)
        except InvalidParameter as err:  # the error object names the request's field (field_named)
            raise InvalidParameter(str(err), param=err.param or "constraint") from None


async def wait_or_cancel(request: Request, scheduler: Scheduler, jobs: list[Job], futures) -> list[Outcome]:
    """The outcomes, cancelling every choice if the client goes away meanwhile."""
    waiting = [asyncio.wrap_future(f) for f in futures]
    try:
        while True:
            done, pending = await asyncio.wait(waiting, timeout=0.25)
            if not pending:
                return [await f for f in waiting]
            if await request.is_disconnected():
                raise ClientGone
    except BaseException:
        scheduler.cancel(jobs)
        raise


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
FINISHED = object()  # posted to a stream's channel: the choice has ended (its outcome is in its future)


class Channel:
    """One streamed response's side of an :class:`Outbox`: what was handed over for it, read on the
    event loop."""

    def __init__(self, outbox: "Outbox"):
        self.outbox, self.items, self.ready = outbox, [], asyncio.Event()
        self.begun: set[int] = set()  # choices whose first text has been posted (under the outbox's lock)

    def post(self, item: tuple[int, Any]) -> None:
        """From any thread: a choice's text, or its end (:data:`FINISHED`); a choice's items keep their order."""
        self.outbox.post(self, item)

    async def take(self) -> list[tuple[int, Any]]:
        """Everything handed over so far, once there is something."""
        await self.ready.wait()
        items, self.items = self.items, []
        self.ready.clear()
        return items


class Outbox:
    """What the request threads post for the streams of one event loop, handed to the loop in batches.

    A choice's first text and its end are handed over at once (the time to the first token, and
    the response's end); other text is gathered for ``interval_s`` and handed over together with
    whatever every other stream posted meanwhile: one wake-up of the loop, and one write a stream,
    for several tokens. Each wake-up, generator resumption and socket write takes the interpreter
    and a core that a request thread or the next pass needs; a wake-up a token showed as time
    between passes (docs/BENCHMARKS.md, "Streaming"). ``interval_s`` 0: every token at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float):
        self.loop, self.interval_s = loop, interval_s
        self._lock = threading.Lock()
        self._posted: list[tuple[Channel, tuple[int, Any]]] = []
        self._due: str | None = None  # what the loop has been asked for: None, "later" or "now"

    def channel(self) -> Channel:
        return Channel(self)

    def post(self, channel: Channel, item: tuple[int, Any]) -> None:
        with self._lock:
            self._posted.append((channel, item))
            index, text = item
            at_once = text is FINISHED or index not in channel.begun or self.interval_s <= 0
            channel.begun.add(index)
            wanted = "now" if at_once else "later"
            if self._due == "now" or self._due == wanted:
                return  # the loop has been asked already, soon enough
            self._due = wanted
        if wanted == "now":
            self.loop.call_soon_threadsafe(self._hand_over)
        else:
            self.loop.call_soon_threadsafe(self.loop.call_later, self.interval_s, self._hand_over)

    def _hand_over(self) -> None:
        """On the loop: every posted item to its channel. (A timer that finds nothing is harmless.)"""
        with self._lock:
            posted, self._posted, self._due = self._posted, [], None
        for channel, item in posted:
            channel.items.append(item)
            channel.ready.set()


class Reply:
    """Turns outcomes into OpenAI response bodies and stream chunks."""

    def __init__(self, server: Server, chat: bool, spec: RequestSpec, prompt_ids: list[int], started: float,
                 body: dict[str, Any]):
        self.server, self.chat, self.spec, self.prompt_ids, self.started = server, chat, spec, prompt_ids, started
        self.body = body  # the request as sent: what an error's param names
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tokenizer = server.scheduler.model.tokenizer

    def _envelope(self, chunk: bool = False) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.chat else ""), "created": self.created,
                "model": self.server.model_id, "system_fingerprint": f"decodekit-{self.server.numerics}"}

    def usage(self, outcomes: list[Outcome]) -> dict[str, int]:
        completion = sum(o.generation.generated for o in outcomes)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_ids) + completion}

    def record_when_stopped(self, futures: dict[int, Any], first: dict[int, float]) -> None:
        """Count each of these choices when its request thread has stopped (a cancelled one with
        what it generated before; one that failed is counted as an error where it is answered)."""
        for index, future in futures.items():
            # (a future the scheduler's close cancelled has nothing to count)
            future.add_done_callback(lambda f, i=index: f.cancelled() or f.exception() or self.record(f.result(), first.get(i)))

    def record_finished(self, futures: list[Future[Outcome]], jobs: list[Job]) -> None:
        """Count the choices of a reply that is not streamed that finished, when another failed."""
        for future, job in zip(futures, jobs):
            if future.done() and not future.cancelled() and future.exception() is None:
                self.record(future.result(), self.first_token_s(future.result(), job))

    def record(self, outcome: Outcome, first_token_s: float | None) -> None:
        if self.server.metrics:
            self.server.metrics.finished(prompt_tokens=len(self.prompt_ids), generation=outcome.generation,
                                         queued_s=outcome.queued_s, ttft_s=first_token_s,
                                         e2e_s=time.perf_counter() - self.started)

    def first_token_s(self, outcome: Outcome, job: Job) -> float | None:
        """When a reply that is not streamed had its first token, from the request's arrival: after
        its reading and tokenising, its wait and its prompt's reading where the method decodes token
        by token; at the end for a search, which settles its answer last. None where no token was
        generated."""
        g = outcome.generation
        if not g.generated:
            return None
        if method_spec(self.spec.method).family == "search":
            return time.perf_counter() - self.started
        return (job.submitted - self.started) + outcome.queued_s + g.stats.prefill_s

    def _logprobs(self, outcome: Outcome) -> dict[str, Any] | None:
        """Each token's log-probability: the tokens the text shows, a last one cut inside by a stop
        string included, with its text (and bytes) as far as the text goes."""
        if outcome.logprobs is None:
            return None
        g = outcome.generation
        tokens = shown_tokens(self.tokenizer, g.text, g.tokens, g.cut_off)
        pieces, offsets = token_texts(self.tokenizer, tokens, len(g.text))
        if self.chat:
            def entry(token: int, value: float) -> dict[str, Any]:
                text = self.tokenizer.decode([token])
                return {"token": text, "logprob": value, "bytes": list(self.tokenizer.token_bytes(token))}
            content = [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                       for t, (lp, top) in zip(tokens, outcome.logprobs)]
            for i in range(len(g.tokens), len(tokens)):  # cut off, partly shown: what of each the text shows
                content[i]["token"] = pieces[i]
                content[i]["bytes"] = list(pieces[i].encode("utf-8", "surrogatepass"))
            return {"content": content}
        return {"tokens": pieces, "token_logprobs": [lp for lp, _ in outcome.logprobs],
                "top_logprobs": [{top_key(self.tokenizer, a): v for a, v in top} for _, top in outcome.logprobs],
                "text_offset": offsets}

    def whole(self, outcomes: list[Outcome], jobs: list[Job]) -> dict[str, Any]:
        choices = []
        for i, (outcome, job) in enumerate(zip(outcomes, jobs)):
            g = outcome.generation
            self.record(outcome, self.first_token_s(outcome, job))
            choice: dict[str, Any] = {"index": i, "finish_reason": FINISH[g.finish_reason],
                                      "logprobs": self._logprobs(outcome)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": g.text}
            else:
                choice["text"] = g.text
            choices.append(choice)
        return {**self._envelope(), "choices": choices, "usage": self.usage(outcomes)}

    def _chunk(self, index: int, text: str | None, finish: str | None, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
        body = {**self._envelope(chunk=True), "choices": [choice]}
        if self.spec.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, request: Request, jobs: list[Job], futures, deltas: Channel) -> AsyncIterator[str]:
        """Server-sent events: text as it is decoded, each choice's finish reason, the usage when
        asked for, then ``[DONE]``. A client that goes away cancels every choice. What the
        server's :class:`Outbox` hands over together goes out in one write."""
        unrecorded = dict(enumerate(futures))
        first: dict[int, float] = {}
        outcomes: dict[int, Outcome] = {}
        for index, future in enumerate(futures):
            # a choice's end comes the same way as its text, after it (both are posted from its
            # request thread, in order): the stream waits for deliveries, never polls
            future.add_done_callback(lambda f, i=index: deltas.post((i, FINISHED)))
        try:
            if self.chat:
                for i in range(len(jobs)):
                    yield self._chunk(i, None, None, role=True)
            while len(outcomes) < len(futures):
                out = []
                for index, text in await deltas.take():
                    if text is not FINISHED:
                        first.setdefault(index, time.perf_counter() - self.started)
                        out.append(self._chunk(index, text, None))
                        continue
                    outcome = outcomes[index] = futures[index].result()  # an engine error propagates
                    del unrecorded[index]
                    self.record(outcome, first.get(index))
                    out.append(self._chunk(index, None, FINISH[outcome.generation.finish_reason]))
                if out:
                    yield "".join(out)
            if self.spec.include_usage:
                body = {**self._envelope(chunk=True), "choices": [], "usage": self.usage(list(outcomes.values()))}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as err:  # the stream has started: the error goes in it, as OpenAI does, then [DONE]
            answer = decoding_error(err, self.body, self.chat)
            self.server.count_error(answer.status)
            yield f"data: {json.dumps({'error': error_body(str(answer), answer.kind, answer.param, answer.code)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.server.scheduler.cancel(jobs)  # a client that went away, or an error: stop decoding for nobody
            self.record_when_stopped(unrecorded, first)  # what was cancelled is counted when it stops
