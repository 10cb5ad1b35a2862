"""`decodekit profile`: pass costs, prefill speed and the machine's limits, on the tiny model."""

from __future__ import annotations

import argparse
import json

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
