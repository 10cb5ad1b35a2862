"""`decodekit profile`: pass costs, prefill speed and the machine's limits, on the tiny model."""

from __future__ import annotations

import argparse
import copy
import json
import types

import pytest

from decodekit.bench import profile
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
    assert set(result["machine"]) == {"copy_gb_s", "fma_gflop_s", "vnni_gop_s"}
    assert result["machine"]["copy_gb_s"] > 0 and result["machine"]["fma_gflop_s"] > 0
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


MACHINE = {"copy_gb_s": 20.0, "fma_gflop_s": 100.0, "vnni_gop_s": 400.0}
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
    rate a share of the matrix-product rate (exact) or the VNNI loop's (fast); the "x one token"
    line is each pass's time over a one-token pass's."""
    stub_measurements(monkeypatch)
    result = profile.profile({n: stub_model(n) for n in ("exact", "fast")})
    exact, fast = result["numerics"]["exact"], result["numerics"]["fast"]
    assert exact["bandwidth_share_at_1"] == 0.25 and exact["fma_share_at_32"] == 0.3  # 5 / 20, 30 / 100
    assert fast["bandwidth_share_at_1"] == 0.4 and fast["vnni_share_at_32"] == 0.25  # 8 / 20, 100 / 400
    assert "vnni_share_at_32" not in exact and "fma_share_at_32" not in fast
    lines = profile.describe(result).splitlines()
    assert "  x one token: 1:1.00  2:1.20  4:1.50  32:4.00" in lines  # exact: 12 / 10, 15 / 10, 40 / 10
    assert "  x one token: 1:1.00  2:1.25  4:1.50  32:5.00" in lines  # fast: 5 / 4, 6 / 4, 20 / 4
    assert "  one-token pass reads weights at 5.0 GB/s (25% of the copy bandwidth)" in lines
    assert "  32-token pass computes 30.0 G operations/s (two a multiply-add) (30% of the matrix-product rate)" in lines
    assert "  32-token pass computes 100.0 G operations/s (two a multiply-add) (25% of the VNNI loop rate)" in lines


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
