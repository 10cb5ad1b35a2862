"""Chat templates rendered without transformers (models/chat_template.py) give transformers' text,
in its sandbox."""

from __future__ import annotations

import jinja2
import pytest

from decodekit.models.chat_template import render_chat

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say <b>hi</b> & \"quote\" 'me' ünïcode"},
    {"role": "assistant", "content": "hi", "reasoning": "they asked for hi"},
    {"role": "user", "content": "again"},
    # both names given: reasoning_content is the reasoning, and the message keeps its own thinking
    {"role": "assistant", "content": "ok", "reasoning_content": "standard", "thinking": "its own"},
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

TEMPLATES = {
    "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "whitespace": "{{ bos_token }}\n  {% for m in messages %}\n    {% if m.role == 'user' %}\n[U] {{ m.content }}\n"
                  "    {% endif %}\n  {% endfor %}\n{{ eos_token }}",
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}|"
                     "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}",
    "tojson and dict": "{{ messages[1] | tojson }} {{ messages[1] | tojson(indent=2, sort_keys=true) }} "
                       "{{ dict(a=1, b=[1, 2]) | tojson }} {{ tools is none }} {{ documents is none }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}"
                 "{% endfor %}{{ ns.n }}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}"
                  "{% endgeneration %}{% else %}{{ m.role }}:{{ m.content }}{% endif %};{% endfor %}",
    "reasoning": "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }}/{{ m.reasoning }};{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_text_is_transformers_text(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    for prompt in (True, False):
        theirs, _ = render_jinja_template(conversations=[MESSAGES], chat_template=TEMPLATES[name],
                                          add_generation_prompt=prompt, **SPECIAL)
        assert render_chat(TEMPLATES[name], MESSAGES, add_generation_prompt=prompt, **SPECIAL) == theirs[0]


def test_a_templates_refusal_of_the_messages_is_the_callers_mistake_and_its_other_errors_the_models():
    """A refusal is the caller's (InvalidParameter); a template out of its sandbox, not Jinja or reading
    past the messages is the model's fault (InvalidModel: one line, not jinja2's traceback), its cause kept."""
    from decodekit.errors import InvalidModel, InvalidParameter
    from decodekit.models.chat_template import refusals_as_invalid

    with pytest.raises(InvalidParameter, match="^the model's chat template refuses these messages: no system$") as err:
        with refusals_as_invalid():
            render_chat("{{ raise_exception('no system') }}", MESSAGES)
    assert err.value.param == "prompt"
    for broken in ("{{ messages.__class__.__mro__ }}", "{% for %}", "{{ messages[9].content.upper() }}"):
        with pytest.raises(InvalidModel, match="^the model's chat template is broken") as err:
            with refusals_as_invalid():
                render_chat(broken, MESSAGES)
        assert not isinstance(err.value, InvalidParameter)
        assert isinstance(err.value.__cause__, jinja2.exceptions.TemplateError)


def test_a_template_is_sandboxed_and_its_errors_are_jinjas():
    with pytest.raises(jinja2.exceptions.TemplateError, match="^no system message$"):
        render_chat("{{ raise_exception('no system message') }}", MESSAGES)
    with pytest.raises(jinja2.exceptions.SecurityError):  # CPython's internals are out of reach
        render_chat("{{ messages.__class__.__mro__ }}", MESSAGES)
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox is immutable
        render_chat("{{ messages.append(1) }}", MESSAGES)
    with pytest.raises(jinja2.exceptions.SecurityError, match="_secret"):
        render_chat("{% set ns = namespace(_secret=1) %}", MESSAGES)
    with pytest.raises(jinja2.exceptions.SecurityError, match="_secret"):  # nor set on one afterwards
        render_chat("{% set ns = namespace(n=0) %}{% set ns._secret = 1 %}", MESSAGES)
    assert MESSAGES[2] == {"role": "assistant", "content": "hi", "reasoning": "they asked for hi"}  # not aliased in place


def test_loading_the_embedded_model_does_not_import_transformers(real_model):
    """What the module is for: about a second of every start. Checked in a process of its own."""
    import subprocess
    import sys

    code = ("import sys; from decodekit.models import load_model; m = load_model(); "
            "assert m.tokenizer.chat_prompt([{'role': 'user', 'content': 'hi'}]); "
            "print(any(name.split('.')[0] == 'transformers' for name in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
