"""`decodekit profile`: pass costs, prefill speed and the machine's limits, on the tiny model."""

from __future__ import annotations

import argparse
import copy
import json
import types

import pytest

from decodekit.bench import profile
from decodekit.bench.results import cpu_model
from decodekit.interfaces.cli import main
from decodekit.models import CharTokenizer, LoadedModel, kernels
from decodekit.models.threads import GOVERNOR
from decodekit.models.tiny import tiny_llama


def test_profile_reports_every_pass_size_and_the_rates_they_imply(capsys, monkeypatch):
    monkeypatch.setattr(profile, "COPY_BYTES", 2**20)  # small, for a fast test
    monkeypatch.setattr(profile, "GEMM_SIZE", 64)
    monkeypatch.setattr(profile, "PEAK_ITERATIONS", 1000)
    model = LoadedModel(tiny_llama(seed=0, max_position=1024), CharTokenizer(96), "tiny")
    models = {"exact": model}
    if kernels.integer_block_matmul("q4_1") is not None:
        models["fast"] = LoadedModel(tiny_llama(seed=0, max_position=1024, numerics="fast"), CharTokenizer(96), "tiny")
    args = argparse.Namespace(model=None, backend="auto", dtype="float32", contention=False, json=True)
    assert profile.run(args, models=models) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["numerics"]) == list(models)
    exact = result["numerics"]["exact"]
    assert list(exact["pass_ms"]) == [str(n) for n in profile.PASS_SIZES]
    assert all(ms > 0 for ms in exact["pass_ms"].values()) and exact["prefill_tok_s"] > 0
    weight_bytes, macs = model.backend.weight_traffic()
    assert exact["weight_gb_s_at_1"] == round(weight_bytes / (exact["pass_ms"]["1"] / 1e3) / 1e9, 2)
    assert exact["gflop_s_at_32"] == round(2 * macs * 32 / (exact["pass_ms"]["32"] / 1e3) / 1e9, 1)
    assert set(result["machine"]) == {"cpu", "copy_gb_s", "fma_gflop_s", "vnni_gop_s"}
    assert result["machine"]["cpu"] == cpu_model() and result["machine"]["copy_gb_s"] > 0 and result["machine"]["fma_gflop_s"] > 0
    if "fast" in models:
        fast = result["numerics"]["fast"]
        assert result["machine"]["vnni_gop_s"] > 0 and fast["vnni_share_at_32"] > 0
        # the packed blocks are what a fast one-token pass reads
        assert models["fast"].backend.weight_traffic()[0] < weight_bytes
    assert model.backend.length == 0  # the cache is left empty
    assert GOVERNOR.held is None


def test_profile_of_a_missing_model_is_one_line(capsys):
    assert main(["profile", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodekit: error:") and err.count("\n") == 1


def test_profile_measures_the_numerics_it_is_asked_for_or_both(capsys, monkeypatch):
    import decodekit.models

    monkeypatch.setattr(profile, "COPY_BYTES", 2**20)
    monkeypatch.setattr(profile, "GEMM_SIZE", 64)
    monkeypatch.setattr(profile, "PEAK_ITERATIONS", 1000)
    loaded = []

    def load_model(*args, numerics="exact", **kwargs):
        loaded.append(numerics)
        return LoadedModel(tiny_llama(seed=0, max_position=1024), CharTokenizer(96), "tiny")

    monkeypatch.setattr(decodekit.models, "load_model", load_model)
    for asked, want in (("exact", ["exact"]), (None, ["exact", "fast"])):
        loaded.clear()
        args = argparse.Namespace(model=None, backend="auto", dtype="float32", kv_cache="full", numerics=asked,
                                  contention=False, json=True)
        assert profile.run(args) == 0
        assert loaded == want and list(json.loads(capsys.readouterr().out)["numerics"]) == want


MACHINE = {"cpu": "a test CPU", "copy_gb_s": 20.0, "fma_gflop_s": 100.0, "vnni_gop_s": 400.0}
COSTS = {  # per numerics, as pass_costs gives them (made-up round figures)
    "exact": {"context": 256, "pass_ms": {"1": 10.0, "2": 12.0, "4": 15.0, "32": 40.0}, "prefill_tok_s": 500.0,
              "weight_gb_s_at_1": 5.0, "gflop_s_at_32": 30.0},
    "fast": {"context": 256, "pass_ms": {"1": 4.0, "2": 5.0, "4": 6.0, "32": 20.0}, "prefill_tok_s": 900.0,
             "weight_gb_s_at_1": 8.0, "gflop_s_at_32": 100.0},
}


def stub_model(numerics: str) -> types.SimpleNamespace:
    """A stand-in for a loaded model: what the stubbed measurements below need of it."""
    return types.SimpleNamespace(name="tiny", numerics=numerics)


def stub_measurements(monkeypatch) -> None:
    """The machine's limits and each numerics' pass costs as the hand-made figures above."""
    monkeypatch.setattr(profile, "machine_limits", lambda: dict(MACHINE))
    monkeypatch.setattr(profile, "pass_costs", lambda model: copy.deepcopy(COSTS[model.numerics]))


def test_profile_sets_bandwidth_against_the_copy_and_operations_against_each_numerics_peak(monkeypatch):
    """The one-token pass's weight bandwidth is a share of the copy bandwidth; the 32-token pass's
    rate a share of the matrix-product rate (exact) or the integer dot-product loop's (fast); the "x one token"
    line is each pass's time over a one-token pass's."""
    stub_measurements(monkeypatch)
    result = profile.profile({n: stub_model(n) for n in ("exact", "fast")})
    exact, fast = result["numerics"]["exact"], result["numerics"]["fast"]
    assert exact["bandwidth_share_at_1"] == 0.25 and exact["fma_share_at_32"] == 0.3  # 5 / 20, 30 / 100
    assert fast["bandwidth_share_at_1"] == 0.4 and fast["vnni_share_at_32"] == 0.25  # 8 / 20, 100 / 400
    assert "vnni_share_at_32" not in exact and "fma_share_at_32" not in fast
    lines = profile.describe(result).splitlines()
    assert lines[1].startswith("machine: a test CPU, copy 20.0 GB/s")
    assert "  x one token: 1:1.00  2:1.20  4:1.50  32:4.00" in lines  # exact: 12 / 10, 15 / 10, 40 / 10
    assert "  x one token: 1:1.00  2:1.25  4:1.50  32:5.00" in lines  # fast: 5 / 4, 6 / 4, 20 / 4
    assert "  one-token pass reads weights at 5.0 GB/s (25% of the copy bandwidth)" in lines
    assert "  32-token pass computes 30.0 G operations/s (two a multiply-add) (30% of the matrix-product rate)" in lines
    assert "  32-token pass computes 100.0 G operations/s (two a multiply-add) (25% of the integer dot-product loop rate)" in lines


def test_profile_reports_fast_unavailable_but_a_missing_exact_is_an_error(capsys, monkeypatch):
    """With no numerics named, a model or machine without ``fast`` is profiled in ``exact`` and
    ``fast`` reported unavailable; without ``exact`` there is nothing left to profile: the error stands."""
    import decodekit.models
    from decodekit.errors import InvalidParameter

    stub_measurements(monkeypatch)
    for missing in ("fast", "exact"):
        def load_model(*args, numerics="exact", **kwargs):
            if numerics == missing:
                raise InvalidParameter(f"no {numerics} numerics here")
            return stub_model(numerics)

        monkeypatch.setattr(decodekit.models, "load_model", load_model)
        args = argparse.Namespace(model=None, backend="auto", dtype="float32", kv_cache="full", numerics=None,
                                  contention=False, json=False)
        if missing == "exact":
            with pytest.raises(InvalidParameter, match="no exact numerics here"):
                profile.run(args)
            continue
        assert profile.run(args) == 0
        out = capsys.readouterr().out.splitlines()
        assert "fast: unavailable (no fast numerics here)" in out
        assert any(line.startswith("exact: pass ms after 256 tokens") for line in out)


def test_machine_limits_count_a_copy_as_read_plus_write_and_a_multiply_add_as_two_operations(monkeypatch):
    """The copy moves COPY_BYTES each way; a GEMM_SIZE matrix product is GEMM_SIZE**3 multiply-adds; the
    integer dot-product loop runs PEAK_ITERATIONS rounds of 12 instructions of 64 byte multiply-adds on every thread."""
    import torch

    monkeypatch.setattr(profile, "COPY_BYTES", 10**6)
    monkeypatch.setattr(profile, "GEMM_SIZE", 100)
    monkeypatch.setattr(profile, "PEAK_ITERATIONS", 1000)
    monkeypatch.setattr(profile, "best_of", lambda fn, rounds=5: 1e-3)  # every measurement takes 1 ms
    monkeypatch.setattr(kernels, "integer_peak_loop", lambda: lambda iterations, threads: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    limits = profile.machine_limits()
    assert limits["copy_gb_s"] == 2.0  # 2 x 1e6 bytes in 1 ms
    assert limits["fma_gflop_s"] == 2.0  # 2 x 100**3 operations in 1 ms
    assert limits["vnni_gop_s"] == 3.1  # 2 x 64 x 12 x 1000 x 2 threads = 3.072e6 operations in 1 ms


def test_best_of_is_the_fastest_timed_call_after_an_untimed_one(monkeypatch):
    """Load from other processes only slows a call down: the fastest of ``rounds``, the first call untimed."""
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # timed calls of 3, 1 and 2 seconds
    monkeypatch.setattr(profile.time, "perf_counter", lambda: next(clock))
    calls = []
    assert profile.best_of(lambda: calls.append(1), rounds=3) == 1.0
    assert len(calls) == 4


def test_contention_ratio_is_the_busy_speed_over_the_quiet_one(monkeypatch):
    """``ratio``: decode speed beside a busy core as a share of the quiet speed (below 1 when it slows)."""
    speeds = iter([10.0, 8.0])  # quiet first, then beside the spinner
    monkeypatch.setattr(profile, "decode_speed", lambda model: next(speeds))

    class Spinner:
        def __init__(self, *args, **kwargs):
            pass

        def kill(self):
            pass

        def wait(self):
            pass

    monkeypatch.setattr(profile.subprocess, "Popen", Spinner)
    assert profile.contention(object()) == {"quiet_tok_s": 10.0, "busy_core_tok_s": 8.0, "ratio": 0.8}


def test_a_machine_without_an_integer_loop_gives_fast_no_share_of_it(monkeypatch):
    """Without an integer dot-product loop (``vnni_gop_s`` None) ``fast`` still gets its bandwidth share, and no operations share."""
    stub_measurements(monkeypatch)
    monkeypatch.setattr(profile, "machine_limits", lambda: {**MACHINE, "vnni_gop_s": None})
    result = profile.profile({n: stub_model(n) for n in ("exact", "fast")})
    fast = result["numerics"]["fast"]
    assert fast["bandwidth_share_at_1"] == 0.4 and "vnni_share_at_32" not in fast
    assert result["numerics"]["exact"]["fma_share_at_32"] == 0.3


def test_prefill_speed_is_the_prompts_tokens_over_its_time(monkeypatch):
    """``prefill_tok_s``: PREFILL_TOKENS over the fastest prefill's seconds."""
    monkeypatch.setattr(profile, "best_of", lambda fn, rounds=5: 0.25)
    model = LoadedModel(tiny_llama(seed=0, max_position=1024), CharTokenizer(96), "tiny")
    assert profile.pass_costs(model)["prefill_tok_s"] == 2048.0  # 512 tokens in a quarter of a second
    # a model of a shorter context reads a prompt of all of it but one token (it failed: "a sequence
    # of 512 tokens exceeds the model's context"), and says so
    short = profile.pass_costs(LoadedModel(tiny_llama(seed=0, max_position=300), CharTokenizer(96), "tiny"))
    assert (short["prefill_tokens"], short["prefill_tok_s"]) == (299, 1196.0)


def test_a_figure_without_its_machine_rate_is_described_without_a_share():
    """A machine whose peak loop could not run (no integer kernel) gives no share of it: the description
    leaves the share out rather than failing."""
    from decodekit.bench import profile

    r = {"context": 256, "pass_ms": {"1": 4.0}, "prefill_tok_s": 1.0, "weight_gb_s_at_1": 8.0, "gflop_s_at_32": 100.0,
         "bandwidth_share_at_1": 0.4}
    text = profile.describe({"model": "m", "machine": {"cpu": "c", "copy_gb_s": 20.0, "fma_gflop_s": 100.0, "vnni_gop_s": None},
                             "numerics": {"fast": r}})
    assert "100.0 G operations/s (two a multiply-add)\n" in text + "\n" and "integer dot-product loop rate" not in text


def test_decode_speed_is_the_median_of_timed_requests_after_an_untimed_one(monkeypatch):
    """One short untimed request first (the thread governor sees the machine as it is now), then the
    median tokens/s of the requests: tokens actually generated (a request may stop early) over decode
    time, the median so that one lucky or unlucky request does not decide."""
    import decodekit.engine

    runs = iter([(16, 9.0), (64, 1.0), (32, 1.0), (64, 2.0), (64, 0.5)])  # (tokens, decode seconds)
    asked = []

    class Engine:
        def __init__(self, model):
            pass

        def generate(self, prompt, max_new_tokens):
            asked.append(max_new_tokens)
            tokens, seconds = next(runs)
            return types.SimpleNamespace(tokens=[0] * tokens, stats=types.SimpleNamespace(decode_s=seconds))

    monkeypatch.setattr(decodekit.engine, "Engine", Engine)
    assert profile.decode_speed(object()) == 48.0  # median of 64, 32, 32 and 128 tokens/s
    assert asked == [16, 64, 64, 64, 64]


def test_contention_stops_its_busy_loop(monkeypatch):
    """The busy loop is another process: it is killed and reaped once the shared speed is measured."""
    monkeypatch.setattr(profile, "decode_speed", lambda model: 10.0)
    spinners = []

    class Spinner:
        def __init__(self, *args, **kwargs):
            self.killed = self.waited = False
            spinners.append(self)

        def kill(self):
            self.killed = True

        def wait(self):
            self.waited = self.killed

    monkeypatch.setattr(profile.subprocess, "Popen", Spinner)
    profile.contention(object())
    assert len(spinners) == 1 and spinners[0].killed and spinners[0].waited


def test_contention_is_measured_for_every_numerics_outside_the_hold(monkeypatch):
    """``--contention`` decodes in each numerics with the governor free (not held on all threads, which
    would measure what it is there to avoid), and the description reports it, quiet speed first."""
    stub_measurements(monkeypatch)
    held = []

    def contention(model):
        held.append((model.numerics, GOVERNOR.held))
        return {"quiet_tok_s": 10.0, "busy_core_tok_s": 8.0, "ratio": 0.8}

    monkeypatch.setattr(profile, "contention", contention)
    result = profile.profile({n: stub_model(n) for n in ("exact", "fast")}, with_contention=True)
    assert held == [("exact", None), ("fast", None)]
    assert list(result["contention"]) == ["exact", "fast"]
    lines = profile.describe(result).splitlines()
    assert "contention, fast: decode 10.0 tok/s quiet, 8.0 beside a busy loop (0.80x)" in lines
    held.clear()
    assert "contention" not in profile.profile({"exact": stub_model("exact")}) and held == []


def test_the_command_line_profiles_both_numerics_with_its_kv_cache_and_contention(capsys, monkeypatch):
    """``decodekit profile`` with no --numerics loads both (the command's own default, not the model
    arguments' ``exact``), each with the --kv-cache asked for, and --contention reaches the profile."""
    import decodekit.models

    stub_measurements(monkeypatch)
    monkeypatch.setattr(profile, "contention", lambda model: {"quiet_tok_s": 10.0, "busy_core_tok_s": 5.0, "ratio": 0.5})
    loaded = []

    def load_model(*args, numerics="exact", kv_cache="full", **kwargs):
        loaded.append((numerics, kv_cache))
        return stub_model(numerics)

    monkeypatch.setattr(decodekit.models, "load_model", load_model)
    assert main(["profile", "--kv-cache", "int8", "--contention", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert loaded == [("exact", "int8"), ("fast", "int8")]
    assert result["contention"]["fast"]["ratio"] == 0.5


def test_a_numerics_asked_for_by_name_that_cannot_load_is_an_error(monkeypatch):
    """``--numerics fast`` on a model or machine without it: the error stands, not an empty profile."""
    import decodekit.models
    from decodekit.errors import InvalidParameter

    stub_measurements(monkeypatch)

    def load_model(*args, numerics="exact", **kwargs):
        raise InvalidParameter(f"no {numerics} numerics here")

    monkeypatch.setattr(decodekit.models, "load_model", load_model)
    args = argparse.Namespace(model=None, backend="auto", dtype="float32", kv_cache="full", numerics="fast",
                              contention=False, json=True)
    with pytest.raises(InvalidParameter, match="no fast numerics here"):
        profile.run(args)


def test_a_machine_without_a_vnni_loop_is_described_without_one():
    """No integer dot-product loop (``vnni_gop_s`` None): the machine line names the copy and matrix-product rates only."""
    text = profile.describe({"model": "m", "machine": {**MACHINE, "vnni_gop_s": None}, "numerics": {}})
    assert text.splitlines()[1] == "machine: a test CPU, copy 20.0 GB/s (read + write), float32 matrix product 100.0 GFLOP/s"
