"""The answers: OpenAI response bodies and server-sent events made from a request's outcomes
(:class:`Reply`), and the hand-over of streamed text from the decoding requests to the event loop
(:class:`Outbox`)."""

from __future__ import annotations

import asyncio
import codecs
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from fastapi import Request

from ..engine.registry import method_spec
from ..engine.stops import shown_tokens
from ..models.tokenizer import Tokenizer
from .errors import ApiError, error_body
from .request import RequestSpec, decoding_error
from .scheduler import Job, Outcome

if TYPE_CHECKING:
    from .app import Server


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
    """What the decoding requests post for the streams of one event loop, handed to the loop in batches.

    A choice's first text and its end are handed over at once (the time to the first token, and
    the response's end); other text is gathered for ``interval_s`` and handed over together with
    whatever every other stream posted meanwhile: one wake-up of the loop, and one write a stream,
    for several tokens. Each wake-up, generator resumption and socket write takes the interpreter
    and a core that a request's decoding or the next pass needs; a wake-up a token showed as time
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
        try:
            if wanted == "now":
                self.loop.call_soon_threadsafe(self._hand_over)
            else:
                self.loop.call_soon_threadsafe(self.loop.call_later, self.interval_s, self._hand_over)
        except RuntimeError:
            # the loop has closed (the server shut down while this choice decoded): nobody reads it now
            if not self.loop.is_closed():
                raise

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
        """Count each of these choices when its decoding has stopped (a cancelled one with
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

    @staticmethod
    def watch(futures, deltas: Channel) -> None:
        """Post each choice's end to ``deltas`` as it comes: the same way as its text, after it (both
        are posted from its decoding, in order), so that a stream waits for deliveries, never polls."""
        for index, future in enumerate(futures):
            future.add_done_callback(lambda f, i=index: deltas.post((i, FINISHED)))

    async def stream(self, request: Request, jobs: list[Job], futures, deltas: Channel,
                     delivered: list[tuple[int, Any]], delivered_at: float) -> AsyncIterator[str]:
        """Server-sent events: text as it is decoded, each choice's finish reason, the usage when
        asked for, then ``[DONE]``, from the ``delivered`` items on (what :meth:`watch`-ed
        ``deltas`` handed over first, at ``delivered_at``). A client that goes away cancels every
        choice. What the server's :class:`Outbox` hands over together goes out in one write."""
        unrecorded = dict(enumerate(futures))
        first: dict[int, float] = {}
        outcomes: dict[int, Outcome] = {}
        try:
            if self.chat:
                for i in range(len(jobs)):
                    yield self._chunk(i, None, None, role=True)
            while len(outcomes) < len(futures):
                out = []
                if delivered:  # (its texts' time to first token: when they came, not once the response began)
                    items, at, delivered = delivered, delivered_at, []
                else:
                    items, at = await deltas.take(), None
                for index, text in items:
                    if text is not FINISHED:
                        first.setdefault(index, (at or time.perf_counter()) - self.started)
                        out.append(self._chunk(index, text, None))
                        continue
                    outcome = outcomes[index] = futures[index].result()  # an engine error propagates
                    self.server.refuse_if_stopped([outcome])
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
            answer = err if isinstance(err, ApiError) else decoding_error(err, self.body, self.chat)
            self.server.count_error(answer.status)
            yield f"data: {json.dumps({'error': error_body(str(answer), answer.kind, answer.param, answer.code)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.server.scheduler.cancel(jobs)  # a client that went away, or an error: stop decoding for nobody
            self.record_when_stopped(unrecorded, first)  # what was cancelled is counted when it stops
