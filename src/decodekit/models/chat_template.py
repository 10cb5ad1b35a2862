"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, without importing
transformers (a large share of every process start, most of what loading the embedded model took
besides the weights).

A model file's chat template is Jinja code written for transformers, and code from a model file is
untrusted: it runs in jinja2's immutable sandbox. The environment is transformers' own, rebuilt
(``transformers.utils.chat_template_utils``): ``trim_blocks`` and ``lstrip_blocks``, the loop
controls (``break``, ``continue``), a ``tojson`` filter that does not escape HTML, ``raise_exception``,
``strftime_now``, a ``{% generation %}`` block (it marks assistant text for training masks; here it
renders its body), a ``dict`` that builds plain dictionaries and a ``namespace`` that refuses
underscore-prefixed names. A template sees ``messages`` (reasoning fields aliased as transformers
aliases them), ``tools`` and ``documents`` (None), ``add_generation_prompt`` and the tokenizer's
special tokens. Tests render the embedded models' templates here and through transformers and
compare the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any

from ..errors import InvalidModel, InvalidParameter, cause_line

#: the names transformers reads a message's reasoning from; templates read the first
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **variables: Any) -> str:
    """``template`` rendered for ``messages`` (plain dictionaries), as transformers renders it."""
    return compiled(template).render(messages=_aliased(messages), tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **variables)


@contextmanager
def refusals_as_invalid() -> Iterator[None]:
    """A template's own refusal of the messages (its ``raise_exception``, as Gemma's when roles do not
    alternate) as an :class:`InvalidParameter` naming the prompt: the caller's mistake, one line. Its
    other errors (a broken template, or one reaching out of its sandbox) are the model's fault, not
    the caller's: an :class:`InvalidModel`, one line too (a server's 500, the command line's error
    line), with jinja2's error as its cause."""
    import jinja2

    try:
        yield
    except jinja2.exceptions.TemplateError as err:
        if type(err) is not jinja2.exceptions.TemplateError:  # its subclasses: syntax, security, undefined
            raise InvalidModel(f"the model's chat template is broken ({cause_line(err)})") from err
        raise InvalidParameter(f"the model's chat template refuses these messages: {err}", param="prompt") from None


@lru_cache(maxsize=8)
def compiled(template: str):
    """The template compiled in transformers' sandboxed environment (a template error is jinja2's)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body, rendered as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing names that start with an underscore (CPython's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class PlainDict:
        """``dict(...)`` in a template: a plain dictionary, and nothing of the type to reach through."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=PlainDict(), namespace=Namespace)
    return env.from_string(template)


def _aliased(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under every name templates read it by, as transformers gives it."""
    out = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out
