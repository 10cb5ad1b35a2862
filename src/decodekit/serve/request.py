"""A completion request's body read and checked field by field, in decodekit's terms
(:func:`parse_request`); every fault is an :class:`.errors.ApiError` naming its field."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..engine.api import chat_role, make_sampler, split_params
from ..engine.registry import build_decoder, method_spec, search_widths, sequences_at_once
from ..engine.stops import stop_strings
from ..errors import DecodeKitError, InvalidParameter
from ..models import LoadedModel
from ..options import finite
from ..samplers.constraint import KINDS, constraint_processor
from ..samplers.params import SEED_LIMIT
from ..samplers.sampler import truncation_asked
from .errors import SERVER_FAULTS, ApiError, ClientGone, internal_error, shutting_down

MAX_N = 16
MAX_TOKENS = 2**31 - 1  # far past any context; a larger one is said by its size, not in its digits
MAX_BODY_BYTES = 16 << 20  # a context's worth of text or token ids is well under a megabyte
MAX_TOP_LOGPROBS = 20
#: vLLM's fields for structured output, beside OpenAI's response_format
GUIDED = tuple("guided_" + kind for kind in KINDS if kind != "json_schema")
#: Request fields the server reads itself (here, or ``model`` in app.py): never passed on to the method as its options.
READ_HERE = {"model", "stream", "stream_options", "messages", "prompt", "n", "max_tokens", "max_completion_tokens",
             "stop", "logprobs", "top_logprobs", "temperature", "top_p", "seed", "presence_penalty",
             "frequency_penalty", "method", "ignore_eos", "response_format", "method_options", *GUIDED}
#: OpenAI fields that mean nothing for a local model and change no answer: accepted and ignored.
IGNORED = {"user", "safety_identifier", "store", "metadata", "prompt_cache_key", "prompt_cache_retention",
           "parallel_tool_calls", "service_tier"}
NOT_OPTIONS = READ_HERE | IGNORED
# OpenAI fields that would change the answer and are not implemented: refused, never ignored
UNSUPPORTED = {"tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
               "function_call": "function calls", "logit_bias": "logit_bias", "suffix": "suffix",
               "echo": "echo", "best_of": "best_of", "audio": "audio output", "modalities": "modalities",
               "prediction": "predicted outputs", "reasoning_effort": "reasoning effort", "verbosity": "verbosity",
               "web_search_options": "web search"}


#: How often a body still being read asks whether the server is shutting down.
BODY_WAIT_S = 0.25


async def read_body(request: Request, stopping: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """The request's JSON object; a body past :data:`MAX_BODY_BYTES` is a 413 as soon as it is
    declared or read that far (no prompt that fits the context comes near it). A body still coming
    when the server is ``stopping()`` is a 503 then: its client is answered, not cut off when the
    shutdown's grace ends."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(declared)} bytes, more than the {MAX_BODY_BYTES} this server reads")
    reading = asyncio.ensure_future(body_bytes(request))
    reading.add_done_callback(lambda task: task.cancelled() or task.exception())  # (retrieved, whoever waits for it)
    try:
        while not (await asyncio.wait({reading}, timeout=BODY_WAIT_S))[0]:
            if stopping():
                raise shutting_down()
        raw = reading.result()
    finally:
        reading.cancel()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def body_bytes(request: Request) -> bytes:
    """The body's bytes, up to :data:`MAX_BODY_BYTES` (a 413 past it)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is more than the {MAX_BODY_BYTES} bytes this server reads")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


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


def decoding_error(err: Exception, body: dict[str, Any], chat: bool) -> ApiError:
    """The answer to an error raised while a request decoded: a 400 naming the request's field at
    fault, or a 500 where the fault is the server's (or unexpected)."""
    if isinstance(err, DecodeKitError) and not isinstance(err, SERVER_FAULTS):
        return ApiError(400, str(err), param=field_named(err, body, chat))
    return ApiError(500, str(err) if isinstance(err, DecodeKitError) else internal_error(err), "server_error")


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


#: OpenAI's ranges for its sampling fields (its API refuses values outside them, and so does this server)
RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    lo, hi = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value) or not lo <= value <= hi:
        raise ApiError(400, f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r:.80}", param=name)
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
    max_tokens = _integer(body, "max_tokens", None, 1, MAX_TOKENS)
    # max_completion_tokens, OpenAI's newer name, wins where both are given (as in vLLM); neither: the rest
    # of the context for chat (filled in once the prompt is tokenised), 16 for completions as OpenAI's
    max_tokens = _integer(body, "max_completion_tokens", max_tokens if chat else max_tokens or 16, 1, MAX_TOKENS)
    n = _integer(body, "n", 1, 1, MAX_N)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop  # (0 or false is no list either)
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    try:  # the engine's own check (an empty string, a lone surrogate), before a stream starts
        stop_strings(stop)
    except InvalidParameter as err:
        raise ApiError(400, str(err), param="stop") from None
    stream = _flag(body, "stream")
    top_logprobs = _top_logprobs(body, chat, stream)
    options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if options and not stream:  # as OpenAI answers it: options of a stream that is not asked for
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:  # as an unknown field of the body is: not silently ignored
        raise ApiError(400, f"unknown field {unknown[0]!r:.80} in stream_options: it takes include_usage",
                       param="stream_options")
    method = "sample" if body.get("method") is None else body["method"]  # (null: not given, as every field)
    if not isinstance(method, str):
        raise ApiError(400, f"method must be a string, got {method!r}", param="method")
    method, params = _sampling(body, method, _method_options(body))
    if body.get("method") is None:  # every other field is one of OpenAI's or a sampler parameter
        unknown = sorted(split_params(params)[1])
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}: not a field of this API or a sampler parameter (a "
                                f"method's options need the method named in 'method')", param=unknown[0])
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    return RequestSpec(prompt, method, params, max_tokens, stop, n, top_logprobs, include_usage,
                       _flag(body, "ignore_eos"), structured_output(body), stream)


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list of them: text, or token ids
    token_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not isinstance(prompt, str) and not token_ids:  # (true and false are JSON's, not token ids)
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
    named = {} if body.get("method_options") is None else body["method_options"]
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
    if temperature is None and body.get("method") is None and not body.get("greedy"):
        temperature = 1.0  # OpenAI's default
    top_p = _number(body, "top_p")
    plain_greedy = temperature == 0 and method == "sample"
    if top_p is not None and top_p != 1 and not plain_greedy:  # (plain greedy decoding: whatever top_p says)
        params["top_p"] = top_p
    if plain_greedy and not truncation_asked(params):
        method = "greedy"  # the same tokens, decoded by plain greedy decoding
    elif temperature is not None:
        # as the engine reads it, 0 included: greedy decoding where a truncation option such as top_k is
        # given beside it (refused without a temperature), a search's samples at its sample_temperature
        params["temperature"] = temperature
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
            schema = fmt["json_schema"].get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, (dict, bool)):  # a boolean schema is one too, as guided_json takes it
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
        try:
            role = chat_role(message.get("role"), f"messages[{i}]")
        except InvalidParameter as err:
            raise ApiError(400, str(err), param="messages") from None
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": role, "content": content})
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
    widths = search_widths(spec.method, options)  # the candidates a search scores at each step
    if math.prod(widths.values()) > MAX_N:
        shown = " x ".join(f"{name} {value!r:.20}" for name, value in widths.items())  # (not a 4,000-digit n)
        raise ApiError(400, f"a search on this server takes at most {MAX_N} candidates at once, got {shown}",
                       param="method_options")
    policy = getattr(model.backend, "kv_policy", None)
    if policy is not None:
        try:
            policy.check_sequences(sequences_at_once(spec.method, options))
        except InvalidParameter as err:
            raise ApiError(400, str(err), param="method") from None
    make_sampler(spec.method, sampler_params)
    if spec.constraint is not None:
        try:
            constraint_processor(spec.constraint, model.tokenizer)
        except InvalidParameter as err:  # the error object names the request's field (field_named)
            raise InvalidParameter(str(err), param=err.param or "constraint") from None
