"""One option system: OptionSpec tables for the sampler, every method and drafter; one value and
bool parser; one ``parse_option`` used by the CLI, bench and eval; ``decodekit methods`` lists them."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

import decodekit
from decodekit import options as options_module
from decodekit.bench import cli as bench_cli
from decodekit.engine import (
    available_methods,
    build_decoder,
    make_sampler,
    method_spec,
    register_method,
    registry,
    split_params,
)
from decodekit.errors import DecodeKitError, InvalidParameter
from decodekit.eval import cli as eval_cli
from decodekit.interfaces import cli
from decodekit.options import (OptionSpec, check_int, check_real, parse_bool, parse_option, parse_option_items,
                               parse_options, shown)
from decodekit.samplers import SAMPLER_OPTIONS, SAMPLER_PARAMS, Sampler
from decodekit.speculative.drafters import DRAFTER_SPECS

SRC = Path(decodekit.__file__).parent


def decoder_for(*argv: str):
    """The decoder the CLI would build for ``decodekit generate hi ARGV`` (no model is loaded)."""
    args = cli.build_parser().parse_args(["generate", "hi", *argv])
    cli.validate_decoding(args)
    _, method_options = decodekit.engine.split_params(cli.decoding_params(args))
    return build_decoder(args.method, **method_options)


# One value parser, one bool parser ------------------------------------------------------------------


@pytest.mark.parametrize("word, value", [("yes", True), ("no", False), ("true", True), ("False", False),
                                         ("1", True), ("0", False), (True, True), (False, False),
                                         (" yes ", True), ("True\n", True), (" 0", False)])
def test_one_bool_parser(word, value):
    assert parse_bool("flag", word) is value
    assert OptionSpec("flag", bool, False).parse(word) is value


@pytest.mark.parametrize("bad", ["maybe", "", 1, 0, None, 2.0])
def test_bool_parser_refuses_other_values_naming_the_option(bad):
    with pytest.raises(InvalidParameter, match="^flag must be true or false"):
        OptionSpec("flag", bool, False).parse(bad)


def test_corpus_and_adapt_take_the_same_words_on_the_command_line():
    # Today's bug: corpus=yes worked for suffix, adapt=yes was refused for layerskip.
    for word, value in (("yes", True), ("no", False), ("1", True), ("false", False)):
        assert decoder_for("--method", "suffix", "--opt", f"corpus={word}").method.drafter.use_corpus is value
        assert decoder_for("--method", "layerskip", "--opt", f"adapt={word}").method.drafter.adapt is value
    for method, option in (("suffix", "corpus"), ("layerskip", "adapt"), ("layerskip", "stochastic"), ("cot", "aggregate")):
        with pytest.raises(InvalidParameter, match=f"^{option} must be true or false"):
            decoder_for("--method", method, "--opt", f"{option}=maybe")


def test_text_values_are_parsed_by_the_spec_type():
    assert OptionSpec("n", int, 1, lo=1).parse("3") == 3
    assert OptionSpec("x", float, 1.0).parse("0.5") == 0.5
    assert OptionSpec("s", str, "a").parse("3") == "3"  # a string option keeps its text
    with pytest.raises(InvalidParameter, match=r"^n must be an integer >= 1, got '3.5'"):
        OptionSpec("n", int, 1, lo=1).parse("3.5")
    with pytest.raises(InvalidParameter, match=r"^x must be a finite number, got nan"):
        OptionSpec("x", float, 1.0).parse("nan")
    with pytest.raises(InvalidParameter, match="^mode must be one of a, b"):
        OptionSpec("mode", str, "a", choices=("a", "b")).parse("c")


def test_a_range_holds_its_ends_unless_one_is_declared_open():
    """lo and hi are in the range; an open end is not, and the listing says which."""
    k = OptionSpec("k", int, 4, lo=1, hi=16)
    assert k.parse("16") == 16 and k.parse(1) == 1
    with pytest.raises(InvalidParameter, match=r"^k must be an integer in \[1, 16\], got 17"):
        k.parse(17)
    x = OptionSpec("x", float, 1.0, lo=0.0, lo_open=True)
    with pytest.raises(InvalidParameter, match=r"^x must be a finite number > 0, got 0"):
        x.parse("0")
    assert x.describe() == "x (float > 0, default 1.0)"
    assert OptionSpec("y", float, 1.0, lo=0.0).describe() == "y (float >= 0, default 1.0)"


def test_an_open_high_end_is_listed_as_open_too():
    """describe() says which ends are in the range: an open high end is "<", a closed one "<="."""
    assert OptionSpec("r", float, 0.5, hi=1.0, hi_open=True).describe() == "r (float < 1, default 0.5)"
    assert OptionSpec("r", float, 0.5, hi=1.0).describe() == "r (float <= 1, default 0.5)"
    assert OptionSpec("r", float, 0.5, lo=0.0, hi=1.0, hi_open=True).describe() == "r (float in [0, 1), default 0.5)"


def test_a_range_with_one_end_names_that_end_and_whether_it_is_open_in_its_message():
    """The error for a number with only a high end says "<" for an open end and "<=" for a closed
    one (as describe() does); an integer option with only a high end says "<= hi"."""
    with pytest.raises(InvalidParameter, match=r"^r must be a finite number < 1, got 1.0$"):
        OptionSpec("r", float, 0.5, hi=1.0, hi_open=True).parse("1")
    with pytest.raises(InvalidParameter, match=r"^r must be a finite number <= 1, got 1.5$"):
        OptionSpec("r", float, 0.5, hi=1.0).parse("1.5")
    assert OptionSpec("r", float, 0.5, hi=1.0).parse("1") == 1.0
    with pytest.raises(InvalidParameter, match=r"^n must be an integer <= 5, got 9$"):
        OptionSpec("n", int, 1, hi=5).parse("9")
    assert OptionSpec("n", int, 1, hi=5).parse("-3") == -3


def test_describe_shows_every_default_choice_and_open_end_as_declared():
    """A falsy default (0, False, "") is a default, not "off"; a spec that takes a callable says so;
    an open low end of a two-ended range is "("; a text default is shown quoted."""
    assert OptionSpec("flag", bool, False, "a flag").describe() == "flag (bool, default False): a flag"
    assert OptionSpec("n", int, 0, lo=0).describe() == "n (int >= 0, default 0)"
    assert OptionSpec("n", int, None, lo=1).describe() == "n (int >= 1, off by default)"
    assert (OptionSpec("scorer", str, "loglik", choices=("loglik", "prob"), allow_callable=True).describe()
            == "scorer (loglik | prob | callable, default 'loglik')")
    assert OptionSpec("mode", str, "a", choices=("a", "b")).describe() == "mode (a | b, default 'a')"
    assert OptionSpec("p", float, 0.9, lo=0.0, hi=1.0, lo_open=True).describe() == "p (float in (0, 1], default 0.9)"
    assert OptionSpec("p", float, 0.5, lo=0.0, hi=1.0, lo_open=True, hi_open=True).describe() == "p (float in (0, 1), default 0.5)"
    assert SAMPLER_OPTIONS["top_p"].describe().startswith("top_p (float in (0, 1], off by default)")


def test_a_callable_is_taken_only_by_an_option_that_allows_one():
    """allow_callable: a Python callable passes the check; any other option refuses one (a callable
    is no choice of a str option, no number)."""
    allows = OptionSpec("scorer", str, "a", choices=("a", "b"), allow_callable=True)
    assert allows.check(len) is len and allows.parse("b") == "b"
    with pytest.raises(InvalidParameter, match="^mode must be one of a, b, got <built-in function len>$"):
        OptionSpec("mode", str, "a", choices=("a", "b")).check(len)
    with pytest.raises(InvalidParameter, match="^s must be a non-empty string"):
        OptionSpec("s", str, "a").parse(len)
    with pytest.raises(InvalidParameter, match="^x must be a finite number"):
        OptionSpec("x", float, 1.0).parse(len)
    with pytest.raises(InvalidParameter, match="^delimiter must be a non-empty string"):
        build_decoder("step-beam", delimiter=str.upper)


def test_the_samplers_signature_shows_each_options_default():
    """Sampler.from_params's signature (keyword_signature over the table) carries every option's
    default, for help() and inspect; an option off by default is annotated as optional."""
    params = inspect.signature(Sampler.from_params).parameters
    for name, spec in SAMPLER_OPTIONS.items():
        assert params[name].default == spec.default, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].annotation == (spec.type if spec.default is not None else spec.type | None), name
    signature = options_module.keyword_signature({"n": OptionSpec("n", int, 4)}, "self")
    assert str(signature) == "(self, *, n: int = 4)"


def test_a_bool_is_no_number_for_a_float_option():
    """check_real refuses bools (True is no temperature), as check_int does, naming the option."""
    with pytest.raises(InvalidParameter, match="^x must be a finite number, got True"):
        OptionSpec("x", float, 1.0).parse(True)
    with pytest.raises(InvalidParameter, match="^temperature must be"):
        Sampler.from_params(temperature=True)


def test_a_string_option_refuses_an_empty_string_and_a_path_option_takes_a_path():
    """A str option must be a non-empty string; a Path option takes a path as text or as a Path."""
    with pytest.raises(InvalidParameter, match="^s must be a non-empty string, got ''"):
        OptionSpec("s", str, "a").parse("")
    assert OptionSpec("f", Path, None).parse(Path("some/file.bin")) == "some/file.bin"
    assert OptionSpec("f", Path, None).parse("some/file.bin") == "some/file.bin"
    for bad, shown in (("", "''"), (5, "5")):  # a path option is as strict as a string one
        with pytest.raises(InvalidParameter, match=f"^f must be a non-empty string, got {shown}$"):
            OptionSpec("f", Path, None).parse(bad)


def test_typed_values_are_not_parsed_from_text_when_text_is_off():
    """parse_options(text=False) (the sampler's, for Python callers) checks values as they are:
    the string "3" is no integer there, while the command line's parse turns it into one."""
    specs = {"n": OptionSpec("n", int, 4, lo=1)}
    assert parse_options("method 'm'", specs, {"n": "3"}) == {"n": 3}
    with pytest.raises(InvalidParameter, match="^n must be an integer >= 1, got '3'"):
        parse_options("method 'm'", specs, {"n": "3"}, text=False)
    with pytest.raises(InvalidParameter, match="^top_k must be"):
        Sampler.from_params(top_k="3")


def test_none_turns_off_only_an_option_that_is_off_by_default():
    """None is the value of an option whose default is None (off); any other option must get a value."""
    specs = {"n": OptionSpec("n", int, 4, lo=1), "budget": OptionSpec("budget", int, None, lo=1)}
    assert parse_options("method 'm'", specs, {"budget": None}) == {"n": 4, "budget": None}
    with pytest.raises(InvalidParameter, match="^n must be an integer >= 1, got None"):
        parse_options("method 'm'", specs, {"n": None})


def test_parse_option_uses_the_key_spec_and_guesses_otherwise():
    specs = method_spec("beam").options
    assert parse_option("n=3", specs) == ("n", 3)
    assert parse_option("x=3") == ("x", 3) and parse_option("x=yes") == ("x", "yes")
    assert parse_option("x=True") == ("x", True) and parse_option("x=FALSE") == ("x", False)  # in any case
    assert parse_option("delimiter=3", method_spec("step-beam").options) == ("delimiter", "3")
    with pytest.raises(InvalidParameter, match="key=value"):
        parse_option("novalue")
    with pytest.raises(InvalidParameter, match="key=value"):
        parse_option("=3")  # no key


def test_a_guessed_value_is_an_int_before_a_float():
    """literal(): true/false, then int, then float, else the text: "3" is the integer 3, not 3.0."""
    assert [type(parse_option(f"x={raw}")[1]) for raw in ("3", "-2", "0.5", "1e3", "abc")] == [int, int, float, float, str]


def test_unknown_options_and_bad_values_name_the_option():
    with pytest.raises(InvalidParameter, match=r"method 'pld' has no option 'bogus'; valid options: .*max_ngram"):
        build_decoder("pld", bogus=1)
    with pytest.raises(InvalidParameter, match=r"method 'greedy' takes no options, got: bogus"):
        build_decoder("greedy", bogus=1)
    with pytest.raises(InvalidParameter, match="^max_draft must be an integer >= 1"):
        build_decoder("layerskip", max_draft=0)
    with pytest.raises(InvalidParameter, match="^budget must be an integer >= 0"):
        build_decoder("suffix", budget="-1")
    with pytest.raises(InvalidParameter, match="^cost_table must be a mapping"):
        build_decoder("pld", cost_table="fast")
    with pytest.raises(InvalidParameter, match=r"^k must be an integer in \[1, 16\]"):
        build_decoder("recycling", k=100)
    with pytest.raises(InvalidParameter, match="the sampler has no option 'top_q'"):
        Sampler.from_params(top_q=0.5)
    with pytest.raises(InvalidParameter, match=r"^window must be an integer in \[1, 64\]"):  # what one pass holds
        build_decoder("lookahead", window=10**9)


def test_a_cost_table_comes_as_json_on_the_command_line_and_is_checked_entry_by_entry():
    decoder_for("--method", "pld", "--opt", 'cost_table={"1": 0.004, "8": 0.006}')  # JSON's keys are strings
    for table, message in (({1: 1.0, -4: 2.0}, "keys must be token counts >= 1, got -4"),
                           ({1: 1.0, 2.5: 1.0}, "keys must be token counts >= 1, got 2.5"),
                           ({0: 0.5, 1: 1.0}, "keys must be token counts >= 1, got 0"),
                           ({"0": 0.5, "1": 1.0}, "keys must be token counts >= 1, got '0'"),
                           ({"1": 1.0, None: 2}, "keys must be token counts >= 1, got None"),
                           ({1: float("inf")}, "values must be seconds from 1e-9 to 3600, got inf"),
                           ({1: 1e-300, 64: 1e300}, "values must be seconds from 1e-9 to 3600"),
                           ({1: True}, "values must be seconds"), ({1: 1.0, "1": 2.0}, "the cost of 1 tokens twice"),
                           ({8: 1.0}, "needs at least the cost of 1 token")):
        with pytest.raises(InvalidParameter, match=message) as err:
            build_decoder("pld", cost_table=table)  # its controller reads the table as it is built
        assert err.value.param == "cost_table"


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "epsilon", "repetition_penalty", "presence_penalty"])
def test_an_integer_too_large_for_a_float_is_a_bad_value_not_a_crash(name):
    with pytest.raises(InvalidParameter, match=f"^{name} must be"):
        Sampler.from_params(**{"temperature": 0.7, name: 10**400})


def test_one_value_is_never_set_twice_on_the_command_line():
    """A flag and an --opt (or two --opt) naming the same parameter: refused, not the last one kept."""
    for argv, message in ((["--method", "sample", "--seed", "4", "--opt", "seed=3"], "--seed and --opt seed=... both set seed"),
                          (["--method", "sample", "--temperature", "0.8", "--opt", "temperature=5"],
                           "--temperature and --opt temperature=... both set temperature"),
                          (["--method", "pld", "--opt", "max_ngram=2", "--opt", "max_ngram=3"],
                           "--opt max_ngram=... is given twice"),
                          (["--method", "sample", "--opt", "seed=2", "--opt", "seed=2"], "--opt seed=... is given twice")):
        with pytest.raises(InvalidParameter, match=f"^{re.escape(message)}; give one$"):
            decoder_for(*argv)


# Tables -------------------------------------------------------------------------------------------


def test_every_registered_method_declares_its_options():
    for name, spec in available_methods().items():
        assert spec.options is not None, name
        for option_name, option in spec.options.items():
            assert isinstance(option, OptionSpec) and option.name == option_name and option.help, (name, option_name)
            if option.default is not None:  # every default passes its own check
                assert parse_options(name, spec.options, {option_name: option.default})[option_name] == option.default
    assert {"max_draft", "budget", "cost_table", "max_ngram"} <= set(method_spec("pld").options)


def test_available_methods_is_a_copy_that_cannot_change_the_registry():
    """available_methods() hands out a new dict each call: a caller that edits it (removes one it
    does not offer, adds its own) changes nothing for the next lookup."""
    listed = available_methods()
    listed.pop("greedy")
    listed["mine"] = listed["pld"]
    assert "greedy" in available_methods() and "mine" not in available_methods()
    assert method_spec("greedy").name == "greedy"


def test_search_spec_defaults_reach_the_method():
    assert build_decoder("beam").width == method_spec("beam").options["n"].default
    assert build_decoder("beam", n="3").width == 3


def test_methods_lists_every_option_of_every_method(capsys):
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    blocks: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("      "):
            current = line.split()[0]
            blocks[current] = []
        elif line.startswith("      "):
            blocks[current].append(line.strip())
    assert set(blocks) == set(available_methods())
    for name, spec in available_methods().items():
        assert blocks[name] == [option.describe() for option in spec.options.values()], name
    assert "k (int in [1, 16], default 8): successors kept per token" in blocks["recycling"]


def test_sampler_flags_are_the_sampler_table():
    assert SAMPLER_PARAMS == tuple(SAMPLER_OPTIONS)
    assert tuple(inspect.signature(Sampler.from_params).parameters) == SAMPLER_PARAMS
    parser = cli.build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    group = next(g for g in generate._action_groups if g.title == "sampling")
    flags = {action.dest: action for action in group._group_actions}
    assert set(flags) == set(SAMPLER_OPTIONS) - {"greedy"}
    for name, action in flags.items():
        assert action.option_strings == ["--" + name.replace("_", "-")]
        assert action.type is SAMPLER_OPTIONS[name].type and action.help == SAMPLER_OPTIONS[name].help


def test_processors_check_with_their_table_row(monkeypatch):
    from dataclasses import replace

    from decodekit.samplers import TopP

    monkeypatch.setitem(SAMPLER_OPTIONS, "top_p", replace(SAMPLER_OPTIONS["top_p"], hi=0.5))
    with pytest.raises(InvalidParameter, match=r"top_p must be in \(0, 0.5\]"):
        TopP(0.9)


# One parser for the CLI, bench and eval; imports point down ---------------------------------------


def test_cli_bench_and_eval_share_one_parse_option():
    # --opt items are read by one function everywhere, which refuses a key given twice
    assert cli.parse_option_items is bench_cli.parse_option_items is eval_cli.parse_option_items
    assert eval_cli.parse_option_items is options_module.parse_option_items  # which reads each item with parse_option
    plan_options = bench_cli.parse_method_options(["suffix.corpus=yes", "layerskip.adapt=no", "beam.n=3"],
                                                  ["greedy", "suffix", "layerskip", "beam"])
    assert plan_options == {"suffix": {"corpus": True}, "layerskip": {"adapt": False}, "beam": {"n": 3}}
    with pytest.raises(InvalidParameter, match="has no option 'bogus'"):
        bench_cli.parse_method_options(["pld.bogus=1"], ["greedy", "pld"])


LIGHT_COMMAND_LINES = (["--help"], ["generate", "--help"], ["generate", "hi", "--numerics", "quick"], ["bench", "--help"],
                       ["serve", "--help"], ["bench-serve", "--help"], ["profile", "--help"], ["nosuch"])

LIGHT_CHECK = """
import contextlib, io, sys
import decodekit, decodekit.cluster
light = 'torch' not in sys.modules
from decodekit.interfaces.cli import main
codes = []
for argv in %r:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as end:
            codes.append(end.code)
light_cli = 'torch' not in sys.modules
import decodekit.engine as e
m = e.available_methods()
print(light, light_cli, codes, m['pld'].family, m['beam'].family, decodekit.Engine is e.Engine, 'Engine' in dir(decodekit))
""" % (LIGHT_COMMAND_LINES,)


def test_import_decodekit_is_light_and_the_engine_alone_registers_every_family():
    """In a fresh process: ``import decodekit`` (and ``decodekit.cluster``, which a Ray worker imports
    before its payload) does not import torch, nor do the command line's help and its usage errors
    (each feature command's module is imported only when that command is given); importing the
    engine alone, every family's methods are there at its first lookup (that the engine names no
    layer above it is tests/test_layers.py's); the package's names resolve to the engine's."""
    out = subprocess.run([sys.executable, "-c", LIGHT_CHECK], capture_output=True, text=True, timeout=120, check=False)
    codes = "[" + ", ".join("0" if "--help" in argv else "2" for argv in LIGHT_COMMAND_LINES) + "]"
    assert out.stdout.rsplit(maxsplit=4) == [f"True True {codes}", "speculative", "search", "True", "True"], out.stderr
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        decodekit.Nothing  # noqa: B018
    assert decodekit.speculative.drafters.DRAFTER_SPECS is DRAFTER_SPECS  # a subpackage, imported when asked for


def test_an_installed_package_adds_methods_through_the_entry_point(monkeypatch):
    """A package declared under ``decodekit.methods`` is imported at the registry's first lookup, and
    the methods it registers are there beside decodekit's own."""
    class Point:
        def load(self):
            registry.register_method("plugin-greedy", registry.plain_decoder, "a plugin's method", lossless=True,
                                     family="plain", options={}, sampling="never")

    asked = []
    monkeypatch.setattr(registry, "_plugins_imported", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: asked.append(group) or [Point()])
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    methods = registry.available_methods()
    assert asked == ["decodekit.methods"] and methods["plugin-greedy"].description == "a plugin's method"
    assert methods["pld"].family == "speculative" and registry.available_methods() == methods  # imported once


def test_a_package_cannot_take_a_built_in_methods_name(monkeypatch):
    def pld_of_mine():
        return registry.plain_decoder()

    monkeypatch.setattr(registry, "_METHODS", dict(registry.available_methods()))
    with pytest.raises(InvalidParameter, match=r"^method 'pld' is registered already, by decodekit\.speculative\.\S+; "
                                               r"choose another name$"):
        registry.register_method("pld", pld_of_mine, "not pld", lossless=False, family="plain")
    assert registry.available_methods()["pld"].family == "speculative"
    registry.register_method("greedy", registry.plain_decoder, "again", lossless=True, family="plain")  # its own module
    assert registry.available_methods()["greedy"].description == "again"


@pytest.mark.parametrize("change, message", [
    ({"name": 5}, "a method's name must be a non-empty string, got 5"),
    ({"name": " "}, "a method's name must be a non-empty string, got ' '"),
    ({"build": 5}, "method 'mine': build must be callable"),
    ({"description": None}, "method 'mine': description must be a string"),
    ({"lossless": "yes"}, "method 'mine': lossless must be True or False, got 'yes'"),
    ({"family": "bogus"}, "method 'mine': family must be one of plain, speculative, search, got 'bogus'"),
])
def test_a_plugins_bad_registration_is_refused_at_once_and_leaves_the_registry_working(monkeypatch, change, message):
    """A plugin's mistake is one line when it registers, and nothing of it reaches the registry: a
    name that is not a string would break the unknown-method message (sorted names) for everyone."""
    from decodekit.errors import UnknownMethod

    monkeypatch.setattr(registry, "_METHODS", dict(registry.available_methods()))
    given = {"name": "mine", "build": registry.plain_decoder, "description": "a plugin's method", "lossless": True,
             "family": "plain", **change}
    with pytest.raises(InvalidParameter, match=f"^{re.escape(message)}"):
        registry.register_method(given.pop("name"), given.pop("build"), given.pop("description"), **given)
    assert "mine" not in registry.available_methods()
    with pytest.raises(UnknownMethod, match="^unknown method 'pdl'; choose from: "):
        registry.method_spec("pdl")


def test_a_plugin_build_that_returns_no_decoder_is_one_line(monkeypatch):
    """register_method cannot call a builder (its options come with each request): what it returns
    is checked where it is built, before the engine calls a method of it."""
    from decodekit.engine import Engine
    from decodekit.models import CharTokenizer, LoadedModel
    from decodekit.models.tiny import tiny_llama

    def build_nothing(**options):
        return None

    build_nothing.__module__ = "package_a.methods"
    monkeypatch.setattr(registry, "_METHODS", dict(registry.available_methods()))
    registry.register_method("returns-none", build_nothing, "a plugin's mistake", lossless=True, family="plain")
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    with pytest.raises(InvalidParameter, match=r"^method 'returns-none': its build \(package_a\.methods\) returned "
                                               r"NoneType, not a decodekit Decoder$"):
        engine.generate("hi", method="returns-none", max_new_tokens=2, chat=False)
    assert engine.generate("hi", max_new_tokens=2, chat=False).tokens  # the engine goes on


def test_a_partials_method_belongs_to_the_module_of_the_function_inside(monkeypatch):
    """A builder made with functools.partial is the package's whose function it wraps (a partial's
    own module is functools'): one package's partial cannot replace another package's method."""
    import functools

    def build_a(**options):
        return registry.plain_decoder()

    def build_b(**options):
        return registry.plain_decoder()

    build_a.__module__, build_b.__module__ = "package_a.methods", "package_b.methods"
    monkeypatch.setattr(registry, "_METHODS", dict(registry.available_methods()))
    registry.register_method("shared-name", functools.partial(build_a), "a's", lossless=True, family="plain")
    with pytest.raises(InvalidParameter, match=r"^method 'shared-name' is registered already, by package_a\.methods;"):
        registry.register_method("shared-name", functools.partial(build_b), "b's", lossless=True, family="plain")
    registry.register_method("shared-name", functools.partial(build_a), "a's again", lossless=True, family="plain")
    assert registry.available_methods()["shared-name"].description == "a's again"


FIRST_REGISTRATION = """
from decodekit.engine import registry
from decodekit.errors import InvalidParameter
try:
    registry.register_method("pld", lambda: registry.plain_decoder(), "not pld", lossless=False, family="plain")
except InvalidParameter as err:
    print("refused:", err)
methods = registry.available_methods()
print(methods["pld"].family, len(methods) > 20)
"""


def test_a_built_in_methods_name_cannot_be_taken_before_the_registry_is_first_read():
    """Registering first (nothing has looked a method up yet) must not take ``pld`` and leave the
    built-in packages half imported: they are imported before another package's method."""
    out = subprocess.run([sys.executable, "-c", FIRST_REGISTRATION], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.stdout.splitlines()[-2:] == [
        "refused: method 'pld' is registered already, by decodekit.speculative.loop; choose another name",
        "speculative True"], out.stdout + out.stderr


CONCURRENT_FIRST_LOOKUPS = """
import threading
from decodekit.engine import registry
names, found, together = ["beam", "pld", "suffix", "best-of-n", "medusa", "mbr"], [], threading.Barrier(6)

def look(name):
    together.wait()
    try:
        found.append(registry.method_spec(name).name)
    except Exception as err:
        found.append(f"{type(err).__name__}: {err}")

threads = [threading.Thread(target=look, args=(n,)) for n in names]
[t.start() for t in threads]
[t.join() for t in threads]
print(sorted(found) == sorted(names), found)
"""


def test_threads_looking_methods_up_first_all_wait_for_the_whole_registry():
    """The first lookups of several threads at once: they saw the registry half filled (the first
    thread marked it imported before its imports) and failed with UnknownMethod."""
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", CONCURRENT_FIRST_LOOKUPS], capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.stdout.startswith("True"), out.stdout + out.stderr


def test_a_package_whose_methods_cannot_be_imported_is_one_line_every_time(monkeypatch):
    class Broken:
        name, value = "theirs", "theirpackage.decoding"

        def load(self):
            raise ModuleNotFoundError("No module named 'somedependency'\nmore detail")

    monkeypatch.setattr(registry, "_plugins_imported", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [Broken()])
    for _ in range(2):  # not a partial registry at the second lookup either
        with pytest.raises(DecodeKitError, match=r"^the methods of 'theirpackage.decoding' \(decodekit.methods entry point "
                                                 r"'theirs'\) could not be imported: ModuleNotFoundError: No module named "
                                                 r"'somedependency'$"):
            registry.method_spec("greedy")


# Sampling behaviour is a field of the method's spec -------------------------------------------------


def test_make_sampler_reads_the_sampling_field(monkeypatch):
    monkeypatch.setitem(registry._METHODS, "fake", registry.MethodSpec(
        "fake", registry.plain_decoder, "test", lossless=True, family="plain", options={}, sampling="always"))
    assert not make_sampler("fake", {}).is_greedy  # samples with no temperature, like `sample`
    assert [method_spec(m).sampling for m in ("greedy", "sample", "pld", "beam")] == [
        "never", "always", "when-temperature", "when-temperature"]
    assert make_sampler("pld", {}).is_greedy and not make_sampler("pld", {"temperature": 0.7}).is_greedy
    with pytest.raises(InvalidParameter, match="sampling must be"):
        register_method("bad", registry.plain_decoder, "test", lossless=True, family="plain", sampling="sometimes")


def test_a_method_without_an_option_table_gets_its_options_as_given(monkeypatch):
    """options=None: not declared, so the builder checks what it is given, all of it, unparsed."""
    got = {}
    monkeypatch.setitem(registry._METHODS, "fake", registry.MethodSpec(
        "fake", lambda **kw: got.update(kw) or registry.plain_decoder(), "test", lossless=True, family="plain"))
    build_decoder("fake", window="3", k=2)
    assert got == {"window": "3", "k": 2}


def test_no_method_option_shares_a_name_with_a_sampler_parameter(monkeypatch):
    """A keyword named like a sampler parameter always goes to the sampler (``split_params``): an
    option of that name could never be set, and setting it would change sampling instead (the
    trained drafters' candidates per position were once ``top_k``). Registering one is refused."""
    own = set(inspect.signature(decodekit.generate).parameters) | set(inspect.signature(decodekit.Engine.generate).parameters)
    for name, spec in available_methods().items():
        assert not set(spec.options or ()) & set(SAMPLER_OPTIONS), name
        # nor one of generate()'s own keywords (kvdraft's draft cache was once kv_cache, the model's policy there)
        assert not set(spec.options or ()) & (own - {"kwargs", "params"}), name
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    with pytest.raises(InvalidParameter, match="top_k share a name with the sampler's parameters"):
        registry.register_method("clashing", registry.plain_decoder, "", lossless=True, family="plain",
                                 options={"top_k": OptionSpec("top_k", int, 4, "")})
    sampler, options = split_params({"top_k": 8, "candidates": 3})
    assert sampler == {"top_k": 8} and options == {"candidates": 3}
    assert set(available_methods()["eagle"].options) >= {"candidates"}


def test_every_methods_constructor_defaults_are_its_option_tables():
    """A drafter's or a search method's defaults are written twice, in its option table (what
    `decodekit methods` prints and a request is checked against) and in its constructor's signature
    (what Python calls get): the two must say the same, and the table must cover the signature."""
    from decodekit.search import METHODS

    def defaults(cls: type) -> dict:
        found = {}
        for klass in cls.__mro__:  # a subclass passing **kwargs on: its bases' defaults count
            init = klass.__dict__.get("__init__")
            for p in inspect.signature(init).parameters.values() if init else ():
                if p.default is not inspect.Parameter.empty:
                    found.setdefault(p.name, p.default)
        return found

    methods = [(n, s.factory, s.options) for n, s in DRAFTER_SPECS.items()] + [(n, c, o) for n, (c, o, _) in METHODS.items()]
    assert len(methods) > 20
    for name, factory, options in methods:
        given = defaults(factory)
        for option, spec in options.items():
            assert option in given and given[option] == spec.default, (name, option, given.get(option), spec.default)


def test_a_value_is_shown_whole_up_to_the_width_and_cut_to_the_width_past_it():
    exact = "a" * 58  # repr: 60 characters, the width
    assert shown(exact) == repr(exact)
    longer = "a" * 59
    assert shown(longer) == repr(longer)[:57] + "..."
    assert len(shown(longer)) == 60
    assert shown(12345, width=5) == "12345"
    assert shown(123456, width=5) == "12..."


def test_a_float_option_hands_back_a_python_float_whatever_real_number_it_was_given():
    spec = OptionSpec("temperature", float, lo=0)
    for value in (2, Fraction(1, 2), np.float32(0.5), np.int64(3), spec.parse("1e3")):
        out = spec.check(value)
        assert type(out) is float and out == float(value)
    assert type(check_real("temperature", 1)) is float
    assert json.dumps(parse_options("t", {"t": spec}, {"t": Fraction(1, 4)})) == '{"t": 0.25}'


def test_an_int_option_hands_back_a_python_int_which_a_results_file_can_hold():
    spec = OptionSpec("n", int, lo=1)
    out = spec.check(np.int64(3))
    assert type(out) is int and out == 3
    assert type(check_int("n", np.int32(2))) is int
    # a numpy integer would make the options unwritable as JSON
    assert json.dumps(parse_options("method 'x'", {"n": spec}, {"n": np.int64(4)})) == '{"n": 4}'


def test_an_opt_value_may_hold_an_equals_sign_the_key_ends_at_the_first():
    from decodekit.options import parse_option, parse_option_items

    assert parse_option("stop=a=b") == ("stop", "a=b")
    assert parse_option("x==") == ("x", "=")
    spec = {"pattern": OptionSpec("pattern", str)}
    assert parse_option("pattern=k=v", spec) == ("pattern", "k=v")
    assert parse_option_items(["pattern=a=1", "n=2"], spec) == {"pattern": "a=1", "n": 2}


def test_a_choice_option_that_takes_a_callable_too_says_so_when_refusing():
    takes = OptionSpec("scorer", str, choices=("a", "b"), allow_callable=True)
    with pytest.raises(InvalidParameter, match=r"^scorer must be one of a, b or a callable, got 'c'$"):
        takes.check("c")
    plain = OptionSpec("scorer", str, choices=("a", "b"))
    with pytest.raises(InvalidParameter, match=r"^scorer must be one of a, b, got 'c'$"):
        plain.check("c")


def test_unknown_options_are_named_in_order_and_the_first_is_the_param_and_valid_ones_are_sorted():
    specs = {"zeta": OptionSpec("zeta", int), "alpha": OptionSpec("alpha", int), "mid": OptionSpec("mid", int)}
    with pytest.raises(InvalidParameter) as err:
        parse_options("method 'x'", specs, {"yy": 1, "bb": 2})
    assert str(err.value) == "method 'x' has no option 'bb', 'yy'; valid options: alpha, mid, zeta"
    assert err.value.param == "bb"


def test_an_unknown_method_lists_the_methods_in_alphabetical_order():
    from decodekit.engine import available_methods, method_spec
    from decodekit.errors import UnknownMethod

    with pytest.raises(UnknownMethod) as err:
        method_spec("nosuch")
    listed = str(err.value).split("choose from: ")[1].split(", ")
    assert listed == sorted(available_methods()) and len(listed) > 2
    assert err.value.param == "method"


def test_a_two_ended_range_message_shows_an_open_high_end():
    with pytest.raises(InvalidParameter, match=r"^p must be in \[0, 1\), got 2\.0$"):
        check_real("p", 2.0, 0, 1, hi_open=True)


def test_a_mapping_option_takes_any_mapping_and_names_text_that_is_no_json_object():
    spec = OptionSpec("cost_table", dict)
    table = MappingProxyType({"1": 0.004})
    assert spec.check(table) is table
    with pytest.raises(InvalidParameter, match=r"^cost_table must be a mapping, got '\[1\]'$"):
        spec.parse("[1]")


def test_an_opt_given_twice_is_named_with_its_prefix():
    with pytest.raises(InvalidParameter, match=r"^--opt pld\.n=\.\.\. is given twice; give one$"):
        parse_option_items(["n=1", "n=2"], prefix="pld.")


def test_an_option_given_to_a_method_without_options_is_the_param():
    with pytest.raises(InvalidParameter, match="takes no options, got: x") as err:
        parse_options("method 'greedy'", {}, {"x": 1})
    assert err.value.param == "x"
