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
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.api import prompt_token_ids
from ..engine.core import check_fits
from ..engine.registry import method_spec
from ..errors import DecodeKitError, PromptTooLong
from ..models import LoadedModel
from ..samplers.params import SEED_LIMIT
from . import MAX_BATCH, MAX_QUEUE, PROMPT_CACHE_MIB, RETRY_AFTER_S, STREAM_INTERVAL_S
from .errors import ApiError, ClientGone, error_response, internal_error, shutting_down
from .metrics import ServerMetrics
from .reply import FINISHED, Outbox, Reply
from .request import check_method, decoding_error, field_named, parse_request, read_body
from .scheduler import Job, Outcome, Overloaded, Scheduler, ShuttingDown

#: Seeds between two choices of a search method (its samples are seeded seed, seed + 1, ...).
SEARCH_CHOICE_SPACING = 2**32


class Server:
    """The app and what it serves. ``load`` makes the model (run on a thread at start-up; until
    it returns, ``/health`` and the API answer 503)."""

    def __init__(self, load: Callable[[], LoadedModel], *, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
                 passes_on_caller: bool = False, stream_interval_s: float = STREAM_INTERVAL_S,
                 allowed_origins: Sequence[str] = (), prompt_cache_mib: float = PROMPT_CACHE_MIB):
        """``prompt_cache_mib``: the scheduler's prompt cache (0: none). ``stream_interval_s``: how long a stream's text after its first is gathered before it is
        written (:class:`Outbox`). ``allowed_origins``: web pages (``https://host:port``, or ``*``)
        whose scripts may call the API from a browser (CORS); none by default, so that a page the
        user happens to visit cannot use a server on their machine."""
        self.max_batch, self.max_queue, self.passes_on_caller = max_batch, max_queue, passes_on_caller
        self.prompt_cache_mib = prompt_cache_mib
        self.allowed_origins = frozenset(allowed_origins)
        self.stream_interval_s = stream_interval_s
        self._outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop
        self.scheduler: Scheduler | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: str | None = None
        self.stopping = False  # stop_answers() was called: the server is shutting down
        # redirect_slashes=False: a path with a trailing slash is a 404 error object, not an empty 307
        self.app = FastAPI(title="decodekit", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
        if allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            self.app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST"],
                                    allow_headers=["*"])
        self._load = load
        self._routes()

    def _outbox(self, loop: asyncio.AbstractEventLoop) -> Outbox:
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
                                  passes_on_caller=self.passes_on_caller, prompt_cache_mib=self.prompt_cache_mib)
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

    def stop_answers(self) -> None:
        """End every answer in progress now, each with a 503 (in its stream if it has one): the server
        is shutting down and its grace is nearly over, so the answers end as errors a client can read,
        never as connections cut in the middle of a text."""
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.cancel_all()

    def refuse_if_stopped(self, outcomes: list[Outcome]) -> None:
        """A 503 for answers that :meth:`stop_answers` cut short (cancelled while stopping)."""
        if self.stopping and any(o.generation.finish_reason == "cancelled" for o in outcomes):
            raise shutting_down()

    def ready(self) -> Scheduler:
        if self.stopping:
            raise shutting_down()
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
            self.count_error(err.status_code)
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
        body = await read_body(request, stopping=lambda: self.stopping)
        model = body.get("model")
        if model is not None and not isinstance(model, str):  # a malformed field, not a model this server lacks
            raise ApiError(400, f"model must be a string, got {model!r:.80}", param="model")
        if model not in (None, self.model_id):
            raise self.unknown_model(model)
        spec = parse_request(body, chat=chat)
        try:
            # on a thread, which the tokenizer lets go of the interpreter's lock (FileTokenizer.encode): a long
            # prompt takes a while to tokenise, and other clients would wait meanwhile (one surely past the
            # context is refused at once, LoadedModel.prompt_ids)
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
        except ShuttingDown:
            raise shutting_down() from None
        except DecodeKitError as err:  # more choices than the server ever holds at once
            raise ApiError(400, str(err), param=field_named(err, body, chat)) from None
        reply = Reply(self, chat, spec, prompt_ids, started, body)
        if stream:
            first, at = await first_delivery(request, scheduler, jobs, futures, deltas, reply)
            return StreamingResponse(reply.stream(request, jobs, futures, deltas, first, at),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            outcomes = await wait_or_cancel(request, scheduler, jobs, futures)
        except ClientGone:
            reply.record_when_stopped(dict(enumerate(futures)), {})  # cancelled choices count too, as in a stream
            raise
        except DecodeKitError as err:  # found while decoding: an option the checks above cannot judge alone, or a fault
            reply.record_finished(futures, jobs)  # the other choices ran to their end: they count
            raise decoding_error(err, body, chat) from None
        self.refuse_if_stopped(outcomes)
        return reply.whole(outcomes, jobs)


DISCONNECT_POLL_S = 0.25  # how often a request waiting for its decoding asks whether its client is still there


async def until_done(request: Request, waiting: Sequence[asyncio.Future]) -> None:
    """Wait for every one of ``waiting``; :class:`ClientGone` if the client goes away meanwhile."""
    while (await asyncio.wait(waiting, timeout=DISCONNECT_POLL_S))[1]:
        if await request.is_disconnected():
            raise ClientGone


async def wait_or_cancel(request: Request, scheduler: Scheduler, jobs: list[Job], futures) -> list[Outcome]:
    """The outcomes, cancelling every choice if the client goes away meanwhile."""
    waiting = [asyncio.wrap_future(f) for f in futures]
    try:
        await until_done(request, waiting)
        return [await f for f in waiting]
    except BaseException:
        scheduler.cancel(jobs)
        raise


async def first_delivery(request: Request, scheduler: Scheduler, jobs: list[Job], futures, deltas,
                         reply: Reply) -> tuple[list, float]:
    """A stream's first delivery (a choice's text, or its end) and when it came, waited for before its
    response starts: an error found before any text (a method this model has no drafter for, say; a
    shutdown) is then the request's status, a 400 or a 503 as without ``stream``, not an event in a
    stream that answered 200; one after some text, in the same delivery or later, is an event in the
    stream. A client that goes away meanwhile cancels every choice, as one that goes away later."""
    reply.watch(futures, deltas)
    take = asyncio.ensure_future(deltas.take())
    try:
        await until_done(request, [take])
        at = time.perf_counter()
        for index, text in take.result():
            if text is not FINISHED:
                break  # text came first: the stream starts, and says what follows in it
            ended = futures[index]
            if ended.cancelled():
                continue
            if ended.exception() is not None:
                raise decoding_error(ended.exception(), reply.body, reply.chat)
            reply.server.refuse_if_stopped([ended.result()])
        return take.result(), at
    except BaseException:
        take.cancel()
        scheduler.cancel(jobs)
        reply.record_when_stopped(dict(enumerate(futures)), {})  # the choices that did not fail count
        raise
