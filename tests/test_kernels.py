"""The compiled weight-streaming kernel: same results as torch, row by row identical."""

import ctypes
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from decodekit.models import kernels
from decodekit.models.llama_weights import Projection
from decodekit.models.tiny import tiny_llama

matmul = kernels.few_rows_matmul(torch.float32)
needs_kernel = pytest.mark.skipif(matmul is None, reason="no C compiler or no AVX2 on this machine")
needs_bf16_kernel = pytest.mark.skipif(kernels.few_rows_matmul(torch.bfloat16) is None,
                                       reason="no bfloat16 kernel on this machine (it needs AVX512-BF16)")
# (at the AVX2 level the race is always built: a test that needs it then runs, and fails without it)
needs_race_kernel = pytest.mark.skipif(kernels.sampling._race_function() is None and kernels.build.level() != "avx2",
                                       reason="no race kernel on this machine (it needs AVX2, or AVX-512 with AVX512DQ)")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 16])
@pytest.mark.parametrize("shape", [(96, 64), (101, 37), (3, 20), (8, 576)])
def test_kernel_matches_torch(rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(*shape, generator=gen), torch.randn(rows, shape[1], generator=gen)
    # torch sums in another order (oneDNN's, which depends on the CPU): sums of up to 576 unit
    # products round differently by up to ~1e-5 each way
    torch.testing.assert_close(matmul(weight, x), F.linear(x, weight), rtol=1e-5, atol=5e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """What makes a k-token verification pass agree bit for bit with one-token steps."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(130, 77, generator=gen), torch.randn(7, 77, generator=gen)
    together = matmul(weight, x)
    for i in range(7):
        assert torch.equal(together[i], matmul(weight, x[i : i + 1].contiguous())[0])


@needs_kernel
def test_every_thread_of_a_team_flushes_subnormals_whenever_the_team_was_made():
    """Flushing subnormals to zero (torch.set_flush_denormal) is a per-thread setting: a team of
    threads made before it was set keeps computing with subnormals, so a row's bits would depend
    on which thread computed it. Every thread sets it at the start of every parallel region."""
    import threading

    weight, x = torch.full((64, 16), 1e-20), torch.full((1, 16), 1e-20)  # every product 1e-40: subnormal
    out = {}

    def on_a_fresh_thread() -> None:  # (its own team, made by its first kernel call)
        torch.set_flush_denormal(False)
        matmul(weight, x)  # the team made while this thread computes with subnormals
        torch.set_flush_denormal(True)  # this thread's setting, not its team's other threads'
        out["y"] = matmul(weight, x)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=on_a_fresh_thread)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    assert torch.count_nonzero(out["y"]) == 0  # every row flushed, the team's other thread's too


@needs_kernel
def test_a_strided_input_is_multiplied_as_its_values():
    """Rows taken as a view (a transpose, every other column) are made contiguous before the C
    code reads them as packed rows: the product of the values, as for a contiguous copy."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 24, generator=gen)
    for x in (torch.randn(24, 3, generator=gen).t(), torch.randn(3, 48, generator=gen)[:, ::2]):
        assert not x.is_contiguous()
        assert torch.equal(matmul(weight, x), matmul(weight, x.contiguous()))


@needs_kernel
def test_projection_uses_the_kernel_for_few_rows_and_keeps_shapes_and_bias():
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    proj = Projection(weight, bias)
    assert proj.few_rows is not None
    for shape in [(1, 1, 24), (2, 3, 24), (1, 17, 24), (1, kernels.MAX_ROWS + 1, 24)]:  # the last past MAX_ROWS: torch's path
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(proj(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert Projection(weight.double()).few_rows is None  # float32 and bfloat16 only


@needs_bf16_kernel
def test_bfloat16_weights_multiply_exactly_and_sum_in_float32():
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(64, 48, generator=gen).bfloat16(), torch.randn(3, 48, generator=gen).bfloat16()
    out = kernels.few_rows_matmul(torch.bfloat16)(weight, x)
    assert out.dtype == torch.bfloat16
    exact = (x.double() @ weight.double().t()).bfloat16()  # products of bf16 values are exact
    assert (out.float() - exact.float()).abs().max() <= 2 ** -6 * exact.float().abs().max()
    assert torch.equal(out[1], kernels.few_rows_matmul(torch.bfloat16)(weight, x[1:2])[0])


@needs_bf16_kernel
def test_bfloat16_outputs_round_a_tie_to_the_even_neighbour():
    """A float32 sum exactly halfway between two bfloat16 values goes to the even one (torch's
    round-to-nearest-even conversion): 1 + 2^-8 -> 1, and 1 + 3 * 2^-8 -> 1 + 2^-6."""
    weight, x = torch.zeros(2, 32), torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.0, 2.0**-8])
    weight[0, :2] = torch.tensor([1.0, 1.0])  # 1 + 2^-8: halfway between 1 and 1 + 2^-7
    weight[1, :2] = torch.tensor([1.0 + 2.0**-7, 1.0])  # 1 + 3 * 2^-8: halfway between 1 + 2^-7 and 1 + 2^-6
    out = kernels.few_rows_matmul(torch.bfloat16)(weight.bfloat16(), x.bfloat16())
    assert out.float().tolist() == [[1.0, 1.0 + 2.0**-6]]


@needs_bf16_kernel
def test_bfloat16_outputs_keep_infinities_and_nans():
    """Rounding to bfloat16 is torch's conversion: a float32 sum of +-inf stays +-inf (only a NaN,
    whose mantissa is non-zero, is made a quiet NaN), and a NaN stays a NaN."""
    bf16 = kernels.few_rows_matmul(torch.bfloat16)
    if bf16 is None:
        pytest.skip("no AVX512-BF16 on this machine")
    weight, x = torch.zeros(2, 32), torch.zeros(2, 32)
    x[0, :2], x[1, 0] = torch.tensor([float("inf"), 1.0]), float("nan")
    weight[0, :2], weight[1, :2] = torch.tensor([1.0, 0.0]), torch.tensor([-2.0, 3.0])
    out = bf16(weight.bfloat16(), x.bfloat16()).float()
    assert out[0].tolist() == [float("inf"), float("-inf")]  # inf * 1 + 1 * 0, inf * -2 + 1 * 3
    assert bool(out[1].isnan().all())


def test_the_bfloat16_kernel_is_not_offered_where_the_cpu_lacks_avx512bf16(monkeypatch):
    """The bfloat16 kernel's dot products are AVX512-BF16 instructions: on a CPU without them (the
    library says so) there is no bfloat16 kernel (torch runs), while float32's is still offered."""
    from types import SimpleNamespace

    from decodekit.models.kernels import matmul as matmul_module

    fake = SimpleNamespace(decodekit_gemm_f32=SimpleNamespace(), decodekit_gemm_bf16=SimpleNamespace(),
                           decodekit_has_avx512bf16=lambda: 0)
    monkeypatch.setattr(matmul_module, "_library", lambda name: fake)
    monkeypatch.setattr(matmul_module, "_address", lambda fn: 0)
    assert matmul_module.few_rows_matmul.__wrapped__(torch.bfloat16) is None
    assert matmul_module.few_rows_matmul.__wrapped__(torch.float32) is not None


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("DECODEKIT_KERNELS", "0")
    assert not kernels.build._supported()


def test_a_failed_build_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.build.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert kernels.build._build(Path(kernels.__file__).with_name("gemm.c")) is None


@pytest.mark.parametrize("at", ["avx512", "avx2"])
@pytest.mark.parametrize("source", sorted(p.name for p in Path(kernels.__file__).parent.glob("*.c")))
def test_every_kernel_source_builds_wherever_the_kernels_run(source, at):
    """A kernel that fails to compile is silently replaced by torch (and its tests skip): so every
    source, with its own extra instructions (VNNI, AVX512DQ), must build wherever gemm.c does, at
    both levels (an AVX-512 CPU may load either; compiling runs nothing, so any CPU checks both)."""
    if kernels.build._library("gemm") is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    assert kernels.build._build(Path(kernels.__file__).with_name(source), at) is not None


def test_the_integer_kernel_runs_wherever_the_float32_kernels_do():
    """The `fast` numerics is not limited to VNNI CPUs: where the kernels run at all (AVX2 or
    AVX-512), the integer kernel loads and says it runs here; its tests must never skip there."""
    if kernels.build.level() is None or kernels.few_rows_matmul(torch.float32) is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    assert kernels.integer_block_matmul("q4_1") is not None
    assert kernels.integer_peak_loop() is not None


class FakeLibrary:
    """A stand-in for a build of gemm_q8.c or race.c that says whether it runs on this CPU."""

    def __init__(self, runs: bool):
        self.runs = runs

    def decodekit_q8_runs_here(self) -> int:
        return int(self.runs)

    def decodekit_race_runs(self) -> int:
        return int(self.runs)

    def __getattr__(self, name):  # the entry points, which only get their ctypes declarations here
        entry = types.SimpleNamespace()
        setattr(self, name, entry)
        return entry


@pytest.mark.parametrize("wide", ["runs", "lacks-an-extension", "not-built"])
@pytest.mark.parametrize("name, runs_here", [("gemm_q8", "decodekit_q8_runs_here"), ("race", "decodekit_race_runs")])
def test_an_avx512_cpu_without_an_extension_runs_the_avx2_build(monkeypatch, wide, name, runs_here):
    """Skylake-X has AVX-512 but no VNNI: the AVX-512 build of gemm_q8.c (or race.c's, which needs
    AVX512DQ) cannot run there, or did not build, so its AVX2 build serves; on an AVX2 CPU a build
    that cannot run gives no kernel at all. The integer kernel's library is found this way."""
    build = kernels.build
    builds = {"avx512": {"runs": FakeLibrary(True), "lacks-an-extension": FakeLibrary(False), "not-built": None}[wide],
              "avx2": FakeLibrary(True)}
    monkeypatch.setattr(build, "level", lambda: "avx512")
    monkeypatch.setattr(build, "_library", lambda n: builds["avx512"])
    monkeypatch.setattr(build, "_library_at", lambda n, at: builds[at])
    want = builds["avx2" if wide != "runs" else "avx512"]
    assert build._library_that_runs(name, runs_here) is want
    if name == "gemm_q8":
        assert kernels.matmul._integer_library.__wrapped__() is want
    monkeypatch.setattr(build, "level", lambda: "avx2")
    monkeypatch.setattr(build, "_library", lambda n: FakeLibrary(False))
    assert build._library_that_runs(name, runs_here) is None


def test_a_librarys_own_extra_flags_reach_its_compiler(monkeypatch, tmp_path):
    """EXTRA_FLAGS is keyed by the library's name (gemm_q8, race), and those flags are given at the
    AVX-512 level only. (Without them gemm_q8.c still builds: its AVX2 section, slower on a VNNI CPU.)"""
    if kernels.build._build(Path(kernels.__file__).with_name("topk.c")) is None:
        pytest.skip("no C compiler that builds the kernels")
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "flagged.c"
    source.write_text("#ifndef ANSWER\n#define ANSWER 0\n#endif\nint probe(void) { return ANSWER; }\n")
    monkeypatch.setitem(kernels.build.EXTRA_FLAGS, "flagged", ["-DANSWER=42"])
    wide, narrow = kernels.build._build(source, "avx512"), kernels.build._build(source, "avx2")
    assert ctypes.CDLL(str(wide)).probe() == 42  # (compiled for AVX-512, but the probe has no such instruction)
    assert ctypes.CDLL(str(narrow)).probe() == 0


def test_a_library_is_rebuilt_when_its_headers_or_flags_change(monkeypatch, tmp_path):
    """The compiled library is found by a digest of its source, the headers beside it and its
    flags: a change to any of them builds a new one (an old library is never loaded for new code);
    the kernels' digest for the cost table covers the headers too."""
    if kernels.build._build(Path(kernels.__file__).with_name("topk.c")) is None:
        pytest.skip("no C compiler that builds the kernels")
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    source, header = tmp_path / "probe.c", tmp_path / "probe.h"
    header.write_text("#define ANSWER 41\n")
    source.write_text('#include "probe.h"\nint probe(void) { return ANSWER; }\n')
    first = kernels.build._build(source, "avx512")  # (compiled, never run: the probe has no AVX-512 instruction)
    header.write_text("#define ANSWER 42\n")
    second = kernels.build._build(source, "avx512")
    monkeypatch.setitem(kernels.build.EXTRA_FLAGS, "probe", ["-DUNUSED"])
    third = kernels.build._build(source, "avx512")
    fourth = kernels.build._build(source, "avx2")  # another level, other flags
    assert None not in (first, second, third, fourth) and len({first, second, third, fourth}) == 4
    assert ctypes.CDLL(str(fourth)).probe() == 42

    for name in ("probe.c", "probe.h"):
        (tmp_path / "kernels_dir").mkdir(exist_ok=True)
        shutil.copy(tmp_path / name, tmp_path / "kernels_dir" / name)
    monkeypatch.setattr(kernels.build, "__file__", str(tmp_path / "kernels_dir" / "build.py"))
    try:
        kernels.build._sources_digest.cache_clear()
        before = kernels.build.sources_digest()
        (tmp_path / "kernels_dir" / "probe.h").write_text("#define ANSWER 43\n")
        kernels.build._sources_digest.cache_clear()
        assert kernels.build.sources_digest() != before
    finally:
        kernels.build._sources_digest.cache_clear()  # (the real sources' digest on the next call)


def test_a_library_that_cannot_be_loaded_falls_back_to_torch(monkeypatch, tmp_path):
    """A built file that the loader refuses (not a shared library) means no kernel, never an error."""
    if not kernels.build._supported():
        pytest.skip("compiled kernels are off or unsupported here")
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not a shared library")
    monkeypatch.setattr(kernels.build, "_build", lambda source, at: junk)
    assert kernels.build._library_at.__wrapped__("gemm", kernels.build.level()) is None


# Layout-independent attention ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128])  # one head a job (general size); a group's three heads a job; two and one
def test_attention_kernel_matches_sdpa(dtype, dim):
    attend = kernels.layout_independent_attention(dtype, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, cap, start, n = 6, 2, 64, 40, 5
    k = torch.randn(kv_heads, cap, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, cap, dim, generator=gen).to(dtype)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    visible = torch.rand(n, start + n, generator=gen) < 0.7
    visible[:, 0] = True  # every query sees at least one key
    got = attend(q, k[:, : start + n], v[:, : start + n], visible, dim**-0.5)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[None, :, : start + n].float(), v[None, :, : start + n].float(),
        attn_mask=visible, enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 48])  # a group's heads in one job (the model's size); one head a job
def test_a_masked_query_gets_the_bits_of_its_visible_keys_alone(dtype, dim):
    """The kernel walks a row's mask by runs of visible keys, 64 mask bytes at a time: runs that
    cross 64-key boundaries, keys seen alone, whole 64-key spans unseen, a run to the last key.
    Each query's result must be bit for bit the one it gets from its visible keys alone, packed
    together with no mask (what a plain step over a contiguous cache computes)."""
    attend = kernels.layout_independent_attention(dtype, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, n_keys = 6, 2, 300
    k = torch.randn(kv_heads, n_keys, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, n_keys, dim, generator=gen).to(dtype)
    q = torch.randn(5, heads, dim, generator=gen).to(dtype)
    visible = torch.zeros(5, n_keys, dtype=torch.bool)
    visible[0] = True  # every key
    visible[1, 3:250] = True  # one run across three 64-key spans, ending inside the fourth
    visible[2, [0, 63, 64, 127, 128, 299]] = True  # keys alone, at the spans' edges and the last key
    visible[3] = torch.rand(n_keys, generator=gen) < 0.5
    visible[4, 200:] = True  # three 64-key spans unseen, then a run to the end
    got = attend(q, k, v, visible, dim**-0.5)
    for row in range(5):
        seen = visible[row].nonzero().flatten()
        alone = attend(q[row : row + 1], k[:, seen].contiguous(), v[:, seen].contiguous(), None, dim**-0.5)
        assert torch.equal(got[row], alone[0]), row


ROWS_OF_A_LONG_PASS = 23


def _rows_of_a_long_pass(n_keys: int, gen: torch.Generator) -> torch.Tensor:
    """Masks of 23 rows (a pass that the kernel cuts into blocks of rows, read a tile of 128 keys at
    a time; a prime count, so that no number of blocks splits the rows evenly): a causal prompt
    chunk, a tree's rows, keys alone at tile and 16-key edges, a row that sees only the last,
    partial block, one that sees nothing past the first key, the last key of every 16, a whole
    tile, every key."""
    visible = torch.zeros(ROWS_OF_A_LONG_PASS, n_keys, dtype=torch.bool)
    for row in range(12):  # the end of a prompt read in a chunk: a prefix, one key longer each row
        visible[row, : n_keys - 20 + row + 1] = True
    visible[12:16] = torch.rand(4, n_keys, generator=gen) < 0.5
    visible[16, [0, 15, 16, 127, 128, 255, 256, n_keys - 1]] = True
    visible[17, n_keys - n_keys % 16 :] = True
    visible[18, 0] = True
    visible[19, 100:260] = True  # a run across two tiles
    visible[20, 15::16] = True
    visible[21, 128:256] = True
    visible[22] = True
    return visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 48, 256])  # a group's heads a job; two; one head a job (general size; the largest, Gemma 3's)
def test_rows_read_a_tile_at_a_time_get_the_bits_of_each_row_alone(dtype, dim):
    """A pass of many rows is cut into blocks of rows that read each tile of keys once and score it
    a block at once (AVX-512: transposed, the keys' sums across registers, not across lanes; AVX2: as
    rows, eight keys' lanes summed by shuffles). Every row's result must be bit
    for bit what the row gets alone, from its visible keys packed together (the one-row path)."""
    attend = kernels.layout_independent_attention(dtype, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, n_keys = 6, 2, 333  # three tiles, the last ending inside a block of 16
    k = torch.randn(kv_heads, n_keys, dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, n_keys, dim, generator=gen).to(dtype)
    q = torch.randn(ROWS_OF_A_LONG_PASS, heads, dim, generator=gen).to(dtype)
    visible = _rows_of_a_long_pass(n_keys, gen)
    got = attend(q, k, v, visible, dim**-0.5)
    for row in range(ROWS_OF_A_LONG_PASS):
        seen = visible[row].nonzero().flatten()
        alone = attend(q[row : row + 1], k[:, seen].contiguous(), v[:, seen].contiguous(), None, dim**-0.5)
        assert torch.equal(got[row], alone[0]), row


def test_a_pass_of_no_rows_or_no_threads_asked_for_returns():
    """No rows: nothing to plan (no blocks of rows, so no division by them); no thread asked for
    (0): one, as before blocks of rows were planned by the thread count."""
    attend = kernels.layout_independent_attention(torch.float32, 64)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    lib = kernels.build._library("attention")
    gen = torch.Generator().manual_seed(14)
    k, v = torch.randn(1, 40, 64, generator=gen), torch.randn(1, 40, 64, generator=gen)
    assert attend(torch.randn(0, 1, 64, generator=gen), k, v, None, 0.125).shape == (0, 1, 64)
    q = torch.randn(20, 1, 64, generator=gen)  # 20 rows: blocks of rows
    out = torch.full_like(q, float("nan"))
    lib.decodekit_attention_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    lib.decodekit_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, out.data_ptr(), 20, 1, 1, 64, 40, 40, 0.125, 0)
    assert torch.equal(out, attend(q, k, v, None, 0.125))


@pytest.mark.parametrize("head_dim", [64, 48])
def test_int8_rows_read_a_tile_at_a_time_get_the_bits_of_each_row_alone(head_dim):
    """The same for the int8 cache, whose transposed tiles carry each key's row scale."""
    from decodekit.models.kernels import int8_cache_kernels, quantise_int8_rows

    int8 = int8_cache_kernels(head_dim)
    if int8 is None:
        pytest.skip("kernels unavailable")
    gen = torch.Generator().manual_seed(13)
    n_keys = 333
    pk = quantise_int8_rows(torch.randn(2, n_keys, head_dim, generator=gen))
    pv = quantise_int8_rows(torch.randn(2, n_keys, head_dim, generator=gen))
    q = torch.randn(ROWS_OF_A_LONG_PASS, 6, head_dim, generator=gen)
    visible = _rows_of_a_long_pass(n_keys, gen)
    got = int8.attention(q, pk, pv, visible, head_dim**-0.5)
    for row in range(ROWS_OF_A_LONG_PASS):
        seen = visible[row].nonzero().flatten()
        alone = int8.attention(q[row : row + 1], pk[:, seen].contiguous(), pv[:, seen].contiguous(), None, head_dim**-0.5)
        assert torch.equal(got[row], alone[0]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_nodes_are_bit_identical_to_one_token_decoding(dtype):
    """With the kernels, verifying a token in a tree gives exactly the logits of plain one-token
    decoding of its path: lossless speculation holds bit for bit, also in bfloat16."""
    backend = tiny_llama(seed=4, dtype=dtype, hidden_size=64)  # head_dim 16: the kernel's path
    if dtype == torch.bfloat16 and kernels.few_rows_matmul(torch.bfloat16) is None:
        pytest.skip("no bfloat16 kernel on this machine (it needs AVX512-BF16)")
    if backend._attend is None or Projection(torch.zeros(4, 4, dtype=dtype)).few_rows is None:
        pytest.skip("kernels unavailable on this machine")
    assert backend._ops is not None  # the element-wise kernels are on the path too
    context = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    parents = [-1, 0, 0, 1, 3, -1, 5, 2]
    nodes = torch.randint(0, 96, (len(parents),), generator=torch.Generator().manual_seed(6))
    backend.reset()
    backend.append(context)
    tree_logits = backend.verify_tree(nodes, parents).logits[0]
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        backend.reset()
        backend.append(context)
        for token in nodes[path[::-1]]:
            logits = backend.append(token.view(1, 1)).logits[0, -1]
        assert torch.equal(tree_logits[node], logits), node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_decoder_layers_match_the_layer_by_layer_path(dtype):
    """forward.c runs the same kernels as the Python layer loop: prefill chunks, steps and tree
    verification give bit-identical logits and caches either way."""
    fused = tiny_llama(seed=4, dtype=dtype, hidden_size=64)
    if dtype == torch.bfloat16 and kernels.few_rows_matmul(torch.bfloat16) is None:
        pytest.skip("no bfloat16 kernel on this machine (it needs AVX512-BF16)")
    if fused._stack is None:
        pytest.skip("kernels unavailable on this machine")
    looped = tiny_llama(seed=4, dtype=dtype, hidden_size=64)
    looped._stack = None
    tokens = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(7))
    parents = [-1, 0, 0, 1, -1]
    nodes = torch.randint(0, 96, (len(parents),), generator=torch.Generator().manual_seed(8))
    outputs = []
    for backend in (fused, looped):
        backend.reset()
        outputs.append([
            backend.append(tokens[:, :7]).logits,  # a multi-token pass: causal mask
            backend.append(tokens[:, 7:8]).logits,  # a plain step: every key visible
            backend.verify_tree(nodes, parents).logits,  # a tree mask
            backend._k[:, :, :, : backend.length].clone(),
        ])
    for got, expected in zip(*outputs):
        assert torch.equal(got, expected)
    for skip in (frozenset({1}), frozenset({0}), frozenset({0, 1})):  # skipped layers (self-speculation drafts): the
        # last, the first (the next layer then adds no MLP output before its norm), all of them
        expected = looped.append(tokens[:, 8:9], skip_layers=skip).logits
        assert torch.equal(fused.append(tokens[:, 8:9], skip_layers=skip).logits, expected)
        assert torch.equal(fused._k[:, :, :, : fused.length], looped._k[:, :, :, : looped.length])


def test_a_truncated_model_ignores_skips_of_layers_it_does_not_have():
    """A truncated copy shares its model's layers and runs as many as its cache has: a skip set
    naming layers past them (a self-speculation draft's) skips nothing there, in forward.c as in
    the layer-by-layer path."""
    fused = tiny_llama(seed=4, hidden_size=64, num_layers=3)
    if fused._stack is None:
        pytest.skip("kernels unavailable on this machine")
    looped = tiny_llama(seed=4, hidden_size=64, num_layers=3)
    looped._stack = None
    tokens = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(9))
    logits = []
    for backend in (fused.truncated(2), looped.truncated(2)):
        backend.append(tokens[:, :3])
        logits.append(backend.append(tokens[:, 3:], skip_layers=frozenset({1, 2})).logits)
    assert torch.equal(*logits)
    plain = fused.truncated(2)
    plain.append(tokens[:, :3])
    assert torch.equal(plain.append(tokens[:, 3:], skip_layers=frozenset({1})).logits, logits[0])


def test_rows_of_one_cache_read_together_get_the_bits_each_row_gets_alone():
    """A search's rows (one cache, several sequences) take forward.c under a causal mask, each on
    its own slice of the cache: a prompt chunk and a step give every row the logits it gets alone,
    bit for bit (the layer loop would attend through torch and round otherwise)."""
    model = tiny_llama(seed=4, hidden_size=64)
    if model._stack is None:
        pytest.skip("kernels unavailable on this machine")
    a, b = (torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    model.reset(2)
    together = [model.append(torch.cat([a[:, :7], b[:, :7]])).logits,  # a causal mask over 7 new tokens
                model.append(torch.cat([a[:, 7:], b[:, 7:]])).logits]
    for row, sequence in enumerate((a, b)):
        alone = model.clone()
        expected = [alone.append(sequence[:, :7]).logits, alone.append(sequence[:, 7:]).logits]
        for got, want in zip(together, expected):
            assert torch.equal(got[row], want[0])


def test_a_pass_of_exactly_the_kernels_row_limit_asking_for_hidden_states_keeps_the_kernels_bits():
    """A pass that asks for hidden states runs layer by layer from Python, through the same kernels
    as forward.c up to MAX_ROWS tokens, that limit included: its logits and features are those of
    the same pass without hidden states, and its hidden states those of the torch-only layer loop."""
    fused = tiny_llama(seed=4, hidden_size=64, num_layers=3)
    if fused._stack is None:
        pytest.skip("kernels unavailable on this machine")
    looped = tiny_llama(seed=4, hidden_size=64, num_layers=3)
    looped._stack = None
    prompt = torch.randint(0, 96, (1, kernels.MAX_ROWS), generator=torch.Generator().manual_seed(8))
    plain = fused.clone().append(prompt)
    outputs = [backend.append(prompt, hidden_layers=(0, 2, 3)) for backend in (fused, looped)]
    for out in outputs:
        assert set(out.hidden) == {0, 2, 3}
        assert torch.equal(out.logits, plain.logits) and torch.equal(out.features, plain.features)
    for layer in (0, 2, 3):
        assert torch.equal(outputs[0].hidden[layer], outputs[1].hidden[layer])


def test_a_prompt_read_in_chunks_has_the_features_of_every_chunk():
    """A prompt longer than MAX_ROWS is read a chunk at a time: its features (what trained drafters
    read, also kept as ``last_features``) cover every token, bit for bit those of reading it one
    token at a time, as its logits do."""
    model = tiny_llama(seed=4, hidden_size=64)
    if model._stack is None:
        pytest.skip("kernels unavailable on this machine")
    prompt = torch.randint(0, 96, (1, 2 * kernels.MAX_ROWS + 22), generator=torch.Generator().manual_seed(3))
    whole = model.append(prompt)
    stepped = model.clone()
    steps = [stepped.append(prompt[:, i : i + 1]) for i in range(prompt.shape[1])]
    assert torch.equal(whole.logits, torch.cat([s.logits for s in steps], dim=1))
    assert torch.equal(whole.features, torch.cat([s.features for s in steps], dim=1))
    assert torch.equal(model.last_features, whole.features)
    last = model.clone().append(prompt, last_only=True)  # (a prompt read for its next token only)
    assert torch.equal(last.logits, whole.logits[:, -1:]) and torch.equal(last.features, whole.features)


def test_decoder_layers_read_strided_or_int32_positions_and_strided_masks_as_their_values():
    """forward.c reads positions as contiguous int64 and masks as contiguous bools: positions
    given strided or as int32, and a strided mask, give the bits of their contiguous copies (x,
    the pending MLP output and the keys and values written)."""
    model = tiny_llama(seed=4, hidden_size=64)
    if model._stack is None:
        pytest.skip("kernels unavailable on this machine")
    model.append(torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1)))
    x = model._embed(torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(9)))[0].contiguous()
    visible = torch.ones(4, 10, dtype=torch.bool).tril(diagonal=6)
    positions = torch.arange(6, 10)
    strided_positions = torch.stack([positions, positions], dim=1).view(-1)[::2]
    strided_visible = visible.T.contiguous().T
    assert not strided_positions.is_contiguous() and not strided_visible.is_contiguous()
    results = []
    for pos, vis in ((positions, visible), (strided_positions, strided_visible), (positions.to(torch.int32), visible)):
        k, v, rows = model._k[:, 0].clone(), model._v[:, 0].clone(), x.clone()
        pending = torch.empty_like(rows)
        assert model._stack.run(rows, pending, model._freqs_pairs, pos, vis, k, v, 6)
        results.append((rows, pending, k, v))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert torch.equal(got, want)


def test_a_batch_whose_parts_do_not_add_up_to_its_rows_is_refused():
    """forward.c reads each part's rows from the stacked input: parts that do not cover exactly
    the rows given would have it read past them or leave rows unrun."""
    backend = tiny_llama(seed=4, hidden_size=64)
    if backend._stack is None:
        pytest.skip("kernels unavailable on this machine")
    k_cache, v_cache = backend._k[:, 0], backend._v[:, 0]
    part = kernels.SequencePart(2, 0, torch.arange(2), None, k_cache, v_cache)
    x = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="add up"):
        backend._stack.run_batch(x, torch.empty_like(x), backend._freqs_pairs, [part])


def test_a_batch_with_a_cache_deeper_than_the_model_or_parts_of_other_depths_is_refused():
    """forward.c runs as many layers as the first part's cache has, over every part's cache: a
    cache of more layers than the model, or parts whose caches differ in depth, are refused (C
    would read past the model's layers or the shallower cache)."""
    backend = tiny_llama(seed=4, hidden_size=64)  # two layers
    if backend._stack is None:
        pytest.skip("kernels unavailable on this machine")
    k_cache, v_cache = backend._k[:, 0], backend._v[:, 0]

    def part(k, v):
        return kernels.SequencePart(1, 0, torch.arange(1), None, k, v)

    deeper = [torch.zeros(3, *k_cache.shape[1:], dtype=k_cache.dtype) for _ in range(4)]
    shallow = k_cache[:1].contiguous(), v_cache[:1].contiguous()
    x = torch.zeros(2, 64)
    for parts in ([part(deeper[0], deeper[1]), part(deeper[2], deeper[3])], [part(k_cache, v_cache), part(*shallow)]):
        with pytest.raises(ValueError, match="layers"):
            backend._stack.run_batch(x, torch.empty_like(x), backend._freqs_pairs, parts)


SEGMENT_KEYS = 256  # attention.c's: visible keys a segment


def _attend_on(threads: int, attend, *args) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return attend(*args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (64, 4, 1), (48, 6, 2), (128, 4, 2)])
def test_a_decode_steps_segments_split_between_threads_give_the_bits_of_one_thread(dtype, dim, heads, kv_heads):
    """A one-row pass that sees every key (a decode step) cuts each head's segments of 256 keys into
    pieces, a job each, so that threads share every head (Flash-Decoding) and fold the pieces after.
    On any number of threads, for every key count (one key past a segment; segments and a part of
    one; whole segments), the row gets the bits of one thread, which takes whole heads, and of
    the same row in a pass of several rows under a mask (a verification), which never cuts. The
    same over the int8 cache (its rows' scales)."""
    if dtype == "int8":
        int8 = kernels.int8_cache_kernels(dim)
        attend, cache = (None, None) if int8 is None else (int8.attention, kernels.quantise_int8_rows)
    else:
        attend, cache = kernels.layout_independent_attention(dtype, dim), lambda x: x.to(dtype)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(15)
    for n_keys in (SEGMENT_KEYS + 1, 3 * SEGMENT_KEYS + 77, 4 * SEGMENT_KEYS, 5 * SEGMENT_KEYS + 255):
        k = cache(torch.randn(kv_heads, n_keys + 3, dim, generator=gen))
        v = cache(torch.randn(kv_heads, n_keys + 3, dim, generator=gen))
        q = torch.randn(3, heads, dim, generator=gen)
        alone = _attend_on(1, attend, q[:1], k[:, :n_keys], v[:, :n_keys], None, dim**-0.5)
        for threads in (2, 3, 4):
            assert torch.equal(_attend_on(threads, attend, q[:1], k[:, :n_keys], v[:, :n_keys], None, dim**-0.5), alone), (n_keys, threads)
        visible = torch.zeros(3, n_keys + 3, dtype=torch.bool)
        visible[0, :n_keys] = True  # the row's keys, among others it does not see
        visible[1:, :-1] = True
        in_a_pass = _attend_on(2, attend, q, k, v, visible, dim**-0.5)
        assert torch.equal(in_a_pass[0], alone[0]), n_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 5, 8, 20])
def test_a_verifications_rows_cut_into_pieces_get_the_bits_of_each_row_alone(dtype, rows):
    """A pass whose rows all see a prefix (a verification's tree, a prompt's chunk) is cut into
    pieces at the segments of that prefix, with all its rows in a piece (one reading of the keys
    for them all), the last piece taking the rows' own keys. On any number of threads each row
    gets the bits it gets alone, from its visible keys packed together on one thread: a prefix
    shorter than a segment (no pieces), ending two keys before a segment's end (the last piece
    starts at that segment), past 4,096 keys (blocks of rows read a tile at a time), and one that
    a row does not see whole (no piece may start past the key it does not see)."""
    attend = kernels.layout_independent_attention(dtype, 64)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(17)
    for start, hole in ((SEGMENT_KEYS - 3, None), (3 * SEGMENT_KEYS - 2, None), (4200, None), (3 * SEGMENT_KEYS - 2, 10)):
        n_keys = start + rows
        k = torch.randn(3, n_keys, 64, generator=gen).to(dtype)
        v = torch.randn(3, n_keys, 64, generator=gen).to(dtype)
        q = torch.randn(rows, 9, 64, generator=gen)
        visible = torch.zeros(rows, n_keys, dtype=torch.bool)
        visible[:, :start] = True
        for row in range(rows):  # a tree: each row sees itself and its parent's path
            parent = int(torch.randint(-1, row, (1,), generator=gen)) if row else -1
            if parent >= 0:
                visible[row, start:] = visible[parent, start:]
            visible[row, start + row] = True
        if hole is not None:
            visible[rows // 2, hole] = False
        got = {threads: _attend_on(threads, attend, q, k, v, visible, 0.125) for threads in (1, 2, 3, 4)}
        for threads in (2, 3, 4):
            assert torch.equal(got[threads], got[1]), (start, threads)
        for row in range(rows):
            seen = visible[row].nonzero().flatten()
            alone = _attend_on(1, attend, q[row : row + 1], k[:, seen].contiguous(), v[:, seen].contiguous(), None, 0.125)
            assert torch.equal(got[2][row], alone[0]), (start, row)


def test_a_pass_is_cut_into_pieces_only_where_they_share_the_work_out_evenly():
    """Pieces end at segment starts. A decode step over 6,000 keys and three key/value heads is cut
    into pieces (each of two threads half of every head, not two heads and one). 16 rows over 272
    keys would make pieces of 256 and 16 keys (528 : 288 keys a row between two threads), so their
    rows are cut into two blocks of 8 instead, dealt evenly; their bits are one thread's either way."""
    attend = kernels.layout_independent_attention(torch.float32, 64)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    from decodekit.models.kernels.attention import attention_plan

    step = attention_plan(1, 9, 3, 64, 6000, None, 2)
    assert step["pieces"] == 2 and step["jobs"] == 6
    # pieces of 12 segments (3,072 keys) and the other 2,928; a thread takes three, of 3 queries each
    assert step["heaviest"] == 3 * (2 * 3072 + 2928)
    assert attention_plan(1, 9, 3, 64, 6000, None, 1)["pieces"] == 1  # one thread: whole heads
    rows, n_keys = 16, 272
    visible = torch.ones(rows, n_keys, dtype=torch.bool).tril(n_keys - rows)  # a prefix, then causal
    plan = attention_plan(rows, 9, 3, 64, n_keys, visible, 2)
    assert plan["pieces"] == 1 and plan["blocks"] == 2 and plan["jobs"] == 6
    assert plan["heaviest"] == rows * 9 * n_keys // 2
    gen = torch.Generator().manual_seed(18)
    q = torch.randn(rows, 9, 64, generator=gen)
    k, v = torch.randn(3, n_keys, 64, generator=gen), torch.randn(3, n_keys, 64, generator=gen)
    assert torch.equal(_attend_on(2, attend, q, k, v, visible, 0.125), _attend_on(1, attend, q, k, v, visible, 0.125))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [64, 48])  # a group's heads a job; one head a job
def test_segments_folded_match_sdpa_where_each_segment_has_its_own_largest_score(threads, dim):
    """Over many segments, each with its own largest score (far apart, so a weight exp(m_k - m)
    taken the wrong way round, a sum not restarted at a segment, or a segment's sum left out is
    far off), the fold gives softmax attention, whether one thread takes whole heads or pieces."""
    attend = kernels.layout_independent_attention(torch.float32, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(16)
    n_keys = 5 * SEGMENT_KEYS + 100
    k = torch.randn(3, n_keys, dim, generator=gen)
    # keys scaled from 0.2 to 1.5 along the cache, rolled so that the largest end up mid-way through the first segment
    k *= torch.linspace(0.2, 1.5, n_keys).roll(SEGMENT_KEYS // 2)[None, :, None]
    v = torch.randn(3, n_keys, dim, generator=gen)
    q = 2 * torch.randn(2, 9, dim, generator=gen)
    visible = torch.ones(2, n_keys, dtype=torch.bool)
    visible[1, ::3] = False
    got = torch.cat([_attend_on(threads, attend, q[:1], k, v, None, dim**-0.5),
                     _attend_on(threads, attend, q[1:], k, v, visible[1:], dim**-0.5)])
    ref = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k[None].double(), v[None].double(),
                                         attn_mask=visible, enable_gqa=True, scale=dim**-0.5)[0].transpose(0, 1)
    torch.testing.assert_close(got, ref.float(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dim", [16, 64])  # one query a job; a group's heads in one job
def test_attention_scores_hundreds_apart_give_the_best_keys_value(dim):
    """Softmax subtracts the largest score before exponentiating: with scores 320 apart (exp far
    past float32's range) the result is the best key's value, not inf / inf. The best key is the
    16th, the last lane of the 16 the largest score is looked for in."""
    attend = kernels.layout_independent_attention(torch.float32, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    n_keys = 20
    weights = torch.zeros(n_keys)
    weights[3], weights[15] = 1.0, 2.0  # scores 0, 10 * dim * 1 and 10 * dim * 2
    k = (weights[:, None] * torch.ones(n_keys, dim))[None].repeat(2, 1, 1).contiguous()
    v = torch.randn(2, n_keys, dim, generator=torch.Generator().manual_seed(12))
    q = torch.full((1, 6, dim), 10.0)
    got = attend(q, k, v, None, 1.0)
    want = v[:, 15].repeat_interleave(3, dim=0)[None]  # heads 0-2 read key/value head 0, heads 3-5 head 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dim", [16, 64])  # one query a job; a group's heads in one job
def test_a_query_that_sees_no_key_gets_zeros_not_nan(dim):
    """The kernel's rule for a row with no visible key (a softmax sum of 0 is inverted as 0):
    zeros, not the NaN of 0 * inf, and the other rows of the pass are untouched by it."""
    attend = kernels.layout_independent_attention(torch.float32, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(13)
    k, v, q = torch.randn(2, 20, dim, generator=gen), torch.randn(2, 20, dim, generator=gen), torch.randn(2, 6, dim, generator=gen)
    visible = torch.ones(2, 20, dtype=torch.bool)
    visible[0] = False
    got = attend(q, k, v, visible, dim**-0.5)
    assert torch.equal(got[0], torch.zeros(6, dim))
    assert torch.equal(got[1], attend(q[1:], k, v, None, dim**-0.5)[0])


@pytest.mark.parametrize("dim", [16, 64])  # one query a job; a group's heads in one job
def test_a_query_that_sees_one_key_gets_that_keys_value_exactly(dim):
    """Softmax over a single score is 1 (exp(s - s) = 1, a sum of 1): a query that sees one key (a
    prompt's first token, a lone key in a mask) gets that key's value row, bit for bit, whatever
    its score, and the others of the pass are untouched by it."""
    attend = kernels.layout_independent_attention(torch.float32, dim)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(14)
    k, v, q = torch.randn(2, 20, dim, generator=gen), torch.randn(2, 20, dim, generator=gen), torch.randn(3, 6, dim, generator=gen)
    visible = torch.zeros(3, 20, dtype=torch.bool)
    visible[0, 0], visible[1, 17], visible[2] = True, True, True
    got = attend(q, k, v, visible, dim**-0.5)
    for row, key in ((0, 0), (1, 17)):
        assert torch.equal(got[row], v[:, key].repeat_interleave(3, dim=0)), row  # heads 0-2: kv head 0, 3-5: 1
    assert torch.equal(got[2], attend(q[2:], k, v, None, dim**-0.5)[0])
    first = attend(q[:1], k[:, :1], v[:, :1], None, dim**-0.5)  # one key in the cache, no mask
    assert torch.equal(first[0], v[:, 0].repeat_interleave(3, dim=0))


def test_attention_reads_strided_queries_and_masks_as_their_values():
    """The kernel reads q and the mask as packed rows: a transposed view of either (same values,
    other strides) must give the bits of its contiguous copy, not the bytes in memory order."""
    attend = kernels.layout_independent_attention(torch.float32, 32)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(21)
    k, v = torch.randn(2, 40, 32, generator=gen), torch.randn(2, 40, 32, generator=gen)
    q = torch.randn(6, 5, 32, generator=gen).transpose(0, 1)  # [5 queries, 6 heads, 32], strided
    visible = (torch.rand(40, 5, generator=gen) < 0.6).t()  # [5, 40], strided
    visible[:, 0] = True
    assert not q.is_contiguous() and not visible.is_contiguous()
    want = attend(q.contiguous(), k, v, visible.contiguous(), 32**-0.5)
    assert torch.equal(attend(q, k, v, visible, 32**-0.5), want)


def test_attention_refuses_keys_and_values_whose_rows_it_cannot_walk():
    """The kernel walks k and v with one stride, head_dim elements a key: a key row that is a
    slice of a wider row, or values laid out unlike the keys, are refused, not read wrongly."""
    attend = kernels.layout_independent_attention(torch.float32, 32)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(22)
    q, cache = torch.randn(1, 2, 32, generator=gen), torch.randn(2, 64, 32, generator=gen)
    wide = torch.randn(2, 20, 64, generator=gen)[:, :, :32]  # rows 64 apart
    with pytest.raises(ValueError, match="contiguous k, v rows"):
        attend(q, wide, wide, None, 1.0)
    with pytest.raises(ValueError, match="contiguous k, v rows"):
        attend(q, cache[:, :20], cache[:, :20].contiguous(), None, 1.0)  # keys 64 a head, values 20
    sliced = attend(q, cache[:, :20], cache[:, :20], None, 1.0)  # the same stride: read as sliced
    assert torch.equal(sliced, attend(q, cache[:, :20].contiguous(), cache[:, :20].contiguous(), None, 1.0))


def test_attention_refuses_queries_of_another_head_size():
    """The kernel reads head_dim values a query, as it was built for: queries of another size
    would be read past their rows (or short of them), so they are refused."""
    attend = kernels.layout_independent_attention(torch.float32, 32)
    if attend is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(23)
    k, v = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)
    with pytest.raises(ValueError, match="head_dim 32"):
        attend(torch.randn(1, 2, 16, generator=gen), k, v, None, 1.0)


def test_attention_refuses_heads_that_do_not_group_and_masks_of_another_width():
    """A key/value head serves H / H_kv query heads: with H not a multiple of H_kv the last heads
    were never computed (their output was whatever memory held), and a mask narrower than the keys
    was read past its end. Both are refused, over the float and the int8 caches."""
    attend = kernels.layout_independent_attention(torch.float32, 32)
    int8 = kernels.int8_cache_kernels(32)
    if attend is None or int8 is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    gen = torch.Generator().manual_seed(24)
    k, v = torch.randn(2, 40, 32, generator=gen), torch.randn(2, 40, 32, generator=gen)
    k8, v8 = kernels.quantise_int8_rows(k), kernels.quantise_int8_rows(v)
    q = torch.randn(3, 4, 32, generator=gen)
    for run, keys, values in ((attend, k, v), (int8.attention, k8, v8)):
        with pytest.raises(ValueError, match="multiple of the cache's 2 key/value heads"):
            run(torch.randn(3, 5, 32, generator=gen), keys, values, None, 1.0)
        for mask in (torch.ones(3, 8, dtype=torch.bool), torch.ones(2, 40, dtype=torch.bool)):
            with pytest.raises(ValueError, match=r"a mask \[3, 40\]"):
                run(q, keys, values, mask, 1.0)
        full = run(q, keys, values, torch.ones(3, 40, dtype=torch.bool), 1.0)  # the right width: read as given
        assert torch.equal(full, run(q, keys, values, None, 1.0))


def test_attention_kernel_declines_head_dims_it_cannot_run():
    assert kernels.layout_independent_attention(torch.float32, 8) is None  # not a multiple of 16
    assert kernels.layout_independent_attention(torch.float32, 512) is None  # over 256
    assert kernels.layout_independent_attention(torch.float16, 64) is None  # float32 and bfloat16 only


@needs_kernel
def test_attention_kernel_takes_head_dims_up_to_256():
    """Its documented range: head_dim a multiple of 16, at most 256 (Gemma's 256 included)."""
    attend = kernels.layout_independent_attention(torch.float32, 256)
    assert attend is not None
    gen = torch.Generator().manual_seed(12)
    q, k, v = torch.randn(2, 2, 256, generator=gen), torch.randn(1, 9, 256, generator=gen), torch.randn(1, 9, 256, generator=gen)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(attend(q, k, v, None, 256**-0.5), ref, rtol=1e-5, atol=1e-5)


# Element-wise layer ops -----------------------------------------------------------------------------


def _ops(dtype):
    ops = kernels.layer_ops(dtype, 64, 96)
    if ops is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch_and_updates_the_residual_in_place(dtype):
    from decodekit.models.llama_weights import rms_norm

    gen = torch.Generator().manual_seed(7)
    x, delta = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(3, 64, generator=gen).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype)
    expected_x = x + delta
    expected_h = rms_norm(expected_x, weight, 1e-5)
    got_x = x.clone()
    got_h = _ops(dtype).add_rms_norm(got_x, delta, weight, 1e-5)
    assert torch.equal(got_x, expected_x)  # the add rounds exactly as torch's
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_h, expected_h, rtol=tolerance, atol=tolerance)
    plain = _ops(dtype).add_rms_norm(expected_x.clone(), None, weight, 1e-5)  # no delta: x untouched
    assert torch.equal(plain, got_h)


def test_rms_norm_adds_epsilon_to_the_mean_square_under_the_root():
    """RMSNorm is x / sqrt(mean(x^2) + eps): a row whose mean square equals eps is scaled by
    1 / sqrt(2 eps), which matters for rows as small as eps (eps outside the root would not)."""
    x = torch.full((2, 64), 1e-3)  # mean square 1e-6
    x[1] = -x[1]
    h = _ops(torch.float32).add_rms_norm(x, None, torch.ones(64), 1e-6)
    want = torch.full((2, 64), 2**-0.5)
    want[1] = -want[1]
    torch.testing.assert_close(h, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(8)
    gate_up = (4 * torch.randn(2, 3, 192, generator=gen)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(_ops(dtype).silu_mul(gate_up), F.silu(gate) * up, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_mul_and_rope_store_read_strided_inputs_as_their_values(dtype):
    """A gate/up or qkv row given as a transposed view gives its contiguous copy's bits: the copy
    the C code reads must outlive the call (``fn(t.contiguous().data_ptr())`` frees it first)."""
    gen = torch.Generator().manual_seed(23)
    ops, weight = _ops(dtype), torch.randn(64, generator=gen).to(dtype)
    x, delta = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(64, 3, generator=gen).to(dtype).t()
    got_x, want_x = x.clone(), x.clone()
    got = ops.add_rms_norm(got_x, delta, weight, 1e-5)
    assert torch.equal(got, ops.add_rms_norm(want_x, delta.contiguous(), weight, 1e-5)) and torch.equal(got_x, want_x)
    gate_up = torch.randn(192, 3, generator=gen).to(dtype).t()
    assert torch.equal(ops.silu_mul(gate_up), ops.silu_mul(gate_up.contiguous()))
    assert torch.equal(ops.gelu_mul(gate_up), ops.gelu_mul(gate_up.contiguous()))
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn((heads + 2 * kv_heads) * dim, 3, generator=gen).to(dtype).t()
    freqs = torch.view_as_real(torch.polar(torch.ones(20, dim // 2), torch.rand(20, dim // 2, generator=gen))).reshape(20, -1)
    results = []
    for rows in (qkv, qkv.contiguous()):
        k_cache, v_cache = torch.zeros(kv_heads, 8, dim, dtype=dtype), torch.zeros(kv_heads, 8, dim, dtype=dtype)
        results.append((ops.rope_store(rows, freqs, torch.tensor([3, 4, 5]), k_cache, v_cache, 2, heads), k_cache, v_cache))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_like_torch_and_fills_the_cache(dtype):
    from decodekit.models.llama_weights import apply_rope

    gen = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, cap, start = 4, 2, 16, 12, 5
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.outer(torch.arange(20, dtype=torch.float32), torch.rand(dim // 2, generator=gen))
    freqs = torch.polar(torch.ones_like(angles), angles)
    positions = torch.tensor([7, 9, 8])
    k_cache, v_cache = torch.zeros(kv_heads, cap, dim, dtype=dtype), torch.zeros(kv_heads, cap, dim, dtype=dtype)
    q = _ops(dtype).rope_store(qkv, torch.view_as_real(freqs).reshape(20, -1), positions, k_cache, v_cache, start, heads)
    rotated = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(3, heads + kv_heads, dim)[None], freqs[positions].view(1, 3, 1, -1))[0]
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q, rotated[:, :heads].float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(k_cache[:, start : start + 3], rotated[:, heads:].transpose(0, 1), rtol=tolerance, atol=tolerance)
    assert torch.equal(v_cache[:, start : start + 3], qkv[:, (heads + kv_heads) * dim :].view(3, kv_heads, dim).transpose(0, 1))
    assert not k_cache[:, :start].any() and not k_cache[:, start + 3 :].any()  # other slots untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_reads_a_strided_delta_as_its_values(dtype):
    """add_rms_norm adds delta's values: a delta given as a transposed view (the C code reads
    packed rows) updates x and gives h bit for bit as its contiguous copy does."""
    gen = torch.Generator().manual_seed(23)
    ops, weight = _ops(dtype), torch.randn(64, generator=gen).to(dtype)
    x, delta = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(64, 3, generator=gen).to(dtype).t()
    assert not delta.is_contiguous()
    got_x, want_x = x.clone(), x.clone()
    got = ops.add_rms_norm(got_x, delta, weight, 1e-5)
    assert torch.equal(got, ops.add_rms_norm(want_x, delta.contiguous(), weight, 1e-5)) and torch.equal(got_x, want_x)


def test_rope_store_refuses_a_value_cache_it_cannot_write_as_rows():
    """rope_store writes both caches as packed [H_kv, cap, D] rows: a value cache that is a strided
    view (a transpose) is refused like a key cache would be, not written in memory order; a head
    narrower than the kernel's 16-value rows is refused too."""
    ops = _ops(torch.float32)
    qkv, freqs = torch.randn(1, 8 * 16), torch.tensor([1.0, 0.0] * 8).repeat(4, 1)
    k_cache, v_cache = torch.zeros(2, 4, 16), torch.zeros(2, 16, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous caches"):
        ops.rope_store(qkv, freqs, torch.tensor([0]), k_cache, v_cache, 0, 4)
    with pytest.raises(ValueError, match="contiguous caches"):
        ops.rope_store(qkv, freqs, torch.tensor([0]), v_cache, k_cache, 0, 4)
    narrow = torch.zeros(2, 4, 8)  # head_dim 8: the kernel's rows are 16 values wide
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        ops.rope_store(torch.randn(1, 8 * 8), freqs[:, :8], torch.tensor([0]), narrow, narrow.clone(), 0, 4)


def test_rope_store_refuses_slots_and_shapes_outside_its_tensors():
    """The C code trusts its sizes: a start at the cache's end wrote past it (the heap broke and the
    process aborted); qkv rows of another width, or a position missing, read past their tensors."""
    ops = _ops(torch.float32)
    qkv, freqs = torch.randn(2, 8 * 16), torch.tensor([1.0, 0.0] * 8).repeat(4, 1)
    k_cache, v_cache, positions = torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), torch.tensor([0, 1])
    for start in (3, 4, -1):  # two rows from slot 3 need slot 4 of 4
        with pytest.raises(ValueError, match="within the cache's 4"):
            ops.rope_store(qkv, freqs, positions, k_cache, v_cache, start, 4)
    with pytest.raises(ValueError, match="as many positions"):
        ops.rope_store(qkv, freqs, positions[:1], k_cache, v_cache, 0, 4)
    with pytest.raises(ValueError, match="qkv rows of 128"):
        ops.rope_store(qkv[:, :100], freqs, positions, k_cache, v_cache, 0, 4)
    ops.rope_store(qkv, freqs, positions, k_cache, v_cache, 2, 4)  # the last two slots: fine
    assert k_cache[:, 2:].abs().sum() > 0


def test_matmuls_refuse_inputs_whose_width_is_not_the_weights():
    """A row of x narrower than the weight's rows was read past its end (garbage out, where F.linear
    raises); the block kernels' operands are held to their shapes likewise."""
    from decodekit.models.gguf_blocks import BlockMatrix

    weight = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"inputs \[rows, 64\]"):
        matmul(weight, torch.randn(2, 16))
    blocks = BlockMatrix.quantize(weight, "q8_0")
    exact = kernels.block_matmul("q8_0")
    with pytest.raises(ValueError, match="inputs"):
        exact(blocks.data, torch.randn(2, 32), 64)
    with pytest.raises(ValueError, match="blocks"):
        exact(blocks.data[:, :10].contiguous(), torch.randn(2, 64), 64)
    assert torch.equal(exact(blocks.data, torch.ones(1, 64), 64), matmul(blocks.dequantize(), torch.ones(1, 64)))


def test_layer_ops_decline_sizes_they_cannot_run():
    assert kernels.layer_ops(torch.float32, 40, 64) is None  # hidden size not a multiple of 16
    assert kernels.layer_ops(torch.float32, 64, 40) is None  # intermediate size not a multiple of 16
    assert kernels.layer_ops(torch.float16, 64, 64) is None


@needs_kernel
@pytest.mark.parametrize("k", [1, 8, 16])
def test_top_k_indices_match_torch_topk(k):
    x = torch.randn(3, 49152 + 5, generator=torch.Generator().manual_seed(k))  # a tail past the last 16
    assert torch.equal(kernels.top_k_indices(x, k), torch.topk(x, k, dim=-1).indices.to(torch.int32))


@needs_kernel
def test_top_k_indices_order_ties_by_index_and_skip_minus_infinity():
    x = torch.full((2, 40), float("-inf"))
    x[0, [3, 17, 30, 35]] = torch.tensor([1.0, 2.0, 2.0, 1.0])
    x[1, 5] = 0.0
    assert kernels.top_k_indices(x, 3).tolist() == [[17, 30, 3], [5, -1, -1]]
    full = kernels.top_k_indices(x, kernels.TOPK_MAX)  # the largest k the kernel takes
    assert full.tolist() == [[17, 30, 3, 35] + [-1] * (kernels.TOPK_MAX - 4), [5] + [-1] * (kernels.TOPK_MAX - 1)]


@needs_kernel
def test_top_k_indices_when_the_bar_rises_inside_a_block_and_the_best_is_the_last_value():
    """The k-th best so far rises while one block of 16 is scanned: a later value of that block
    that beat the old bar but not the new one stays out (a descending row keeps its first k). And
    the tail past the last 16 is read up to its last value."""
    descending = torch.arange(40, 0, -1, dtype=torch.float32)[None]
    assert kernels.top_k_indices(descending, 3).tolist() == [[0, 1, 2]]
    assert kernels.top_k_indices(descending, 1).tolist() == [[0]]
    for n in (17, 40, 49157):
        x = torch.randn(1, n, generator=torch.Generator().manual_seed(n))
        x[0, -1] = 100.0
        assert kernels.top_k_indices(x, 4).tolist() == torch.topk(x, 4, dim=-1).indices.tolist()


@needs_kernel
def test_argmax_is_torch_argmax_on_ties_infinities_nans_and_short_rows():
    """The first index of the largest value, as torch answers: equal values in other lanes and in
    the tail past the last 16, rows of -inf only, +inf, a NaN anywhere (torch: the NaN's index)."""
    assert kernels.sampling._argmax_function() is not None
    generator = torch.Generator().manual_seed(0)
    cases = 0
    for n in (1, 2, 15, 16, 17, 31, 33, 49152 + 5):
        for trial in range(60):
            x = torch.randint(-3, 3, (n,), generator=generator).float()  # many ties
            if trial % 5 == 1:
                x[torch.randint(0, n, (1,), generator=generator)] = float("nan")
            if trial % 7 == 2:
                x.fill_(float("-inf"))
            if trial % 11 == 3:
                x[torch.randint(0, n, (1,), generator=generator)] = float("inf")
            assert kernels.argmax(x) == int(x.argmax()), (n, trial)
            cases += 1
    x = torch.randn(5, 49152 + 7, generator=generator)
    x[2, [40, 9000]] = 99.0  # a tie across lanes: the lower index
    x[3, [49152 + 6, 49152 + 1]] = 99.0  # a tie in the tail
    assert kernels.argmax_rows(x) == x.argmax(dim=-1).tolist() and kernels.argmax_rows(x)[2:4] == [40, 49153]
    assert cases == 8 * 60



@needs_kernel
def test_top_k_indices_of_rows_shorter_than_a_block_match_torch_topk():
    """A row under 16 entries is read by the scalar tail alone: once k entries are in, the bar
    must rise to the k-th best there too, or a later smaller value displaces the k-th."""
    generator = torch.Generator().manual_seed(26)
    descending = torch.arange(10, 0, -1, dtype=torch.float32)[None]
    assert kernels.top_k_indices(descending, 2).tolist() == [[0, 1]]
    for n in range(1, 16):
        x = torch.randn(4, n, generator=generator)
        for k in range(1, n + 1):
            assert torch.equal(kernels.top_k_indices(x, k), torch.topk(x, k, dim=-1).indices.to(torch.int32)), (n, k)


def test_argmax_of_an_empty_row_fails_as_torch_argmax_does():
    """argmax is int(x.argmax()): an empty row has no largest entry, so it raises as torch does
    (the kernels take rows of at least one entry; theirs would answer index 0)."""
    import numpy as np

    with pytest.raises(IndexError):
        torch.empty(0).argmax()
    with pytest.raises(IndexError):
        kernels.argmax(torch.empty(0))
    with pytest.raises(IndexError):
        kernels.masked_argmax(torch.empty(0), np.zeros(2, dtype=np.uint8))

@needs_kernel
def test_top_k_indices_and_argmax_read_strided_rows_as_their_values():
    """The kernels read packed float32 rows: a transposed matrix or a column (a strided view)
    gives torch's answer on its values, not on the bytes in memory order."""
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(300, 3, generator=gen).t()  # [3, 300], strided
    assert torch.equal(kernels.top_k_indices(x, 5), torch.topk(x, 5, dim=-1).indices.to(torch.int32))
    for column in range(3):
        row = x[column]
        assert not row.is_contiguous()
        assert kernels.argmax(row) == int(row.argmax())


def test_a_token_bitmask_on_a_strided_or_non_float32_row_masks_its_values():
    """mask_logits' promise holds for any row it is given: a column of a matrix (strided) is masked
    in place, its neighbours untouched; float64 and bfloat16 rows are masked as their values."""
    import numpy as np

    bits = np.array([0b10100101, 0b00001111, 0xFF, 0x00] * 2, dtype=np.uint8)  # 64 tokens
    allowed = torch.tensor([bool(bits[t // 8] >> (t % 8) & 1) for t in range(64)])
    matrix = torch.randn(64, 3, generator=torch.Generator().manual_seed(25))
    before = matrix.clone()
    kernels.mask_logits(matrix[:, 1], bits)
    assert torch.equal(matrix[:, 1], torch.where(allowed, before[:, 1], float("-inf")))
    assert torch.equal(matrix[:, [0, 2]], before[:, [0, 2]])
    for dtype in (torch.float64, torch.bfloat16):
        row = before[:, 0].to(dtype)
        got = row.clone()
        kernels.mask_logits(got, bits)
        assert torch.equal(got, torch.where(allowed, row, float("-inf")).to(dtype)), dtype


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("vocab, bitmask_tokens", [(49152, 49152), (49157, 49152), (100, 128), (49152, 49184), (37, 32)])
def test_a_token_bitmask_sets_exactly_the_refused_logits_to_minus_infinity(vocab, bitmask_tokens, kernel, monkeypatch):
    """The kernel (and the fallback without it) against the bits unpacked one by one: refused
    tokens, and tokens past the bitmask, get -inf; the rest keep their value."""
    import numpy as np

    rng = np.random.default_rng(vocab)
    bits = rng.integers(0, 256, bitmask_tokens // 8, dtype=np.uint8)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab))
    allowed = [t < bitmask_tokens and bool(bits[t // 8] >> (t % 8) & 1) for t in range(vocab)]
    want = torch.where(torch.tensor(allowed), logits, float("-inf"))
    if not kernel:
        monkeypatch.setattr(kernels.sampling, "_mask_function", lambda: None)
    got = logits.clone()
    kernels.mask_logits(got, bits)  # in place
    assert torch.equal(got, want)
    got = torch.full_like(logits, 7.0)
    kernels.mask_logits(got, bits, source=logits)  # from another row, which is left as it was
    assert torch.equal(got, want) and not torch.isinf(logits).any()


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("vocab, bitmask_tokens", [(49152, 49152), (49157, 49152), (100, 128), (49152, 49184), (37, 32), (10, 16)])
def test_the_best_allowed_token_is_the_argmax_of_the_masked_row(vocab, bitmask_tokens, kernel, monkeypatch):
    """masked_argmax against torch.argmax of the row with the refused tokens at -inf (unpacked bit
    by bit): many ties (the first allowed one), sparse and empty masks, rows of -inf only (0, as
    torch answers), NaN among the allowed tokens (its index) and among the refused (ignored)."""
    import numpy as np

    if not kernel:
        monkeypatch.setattr(kernels.sampling, "_masked_argmax_function", lambda: None)
    rng = np.random.default_rng(vocab + bitmask_tokens)
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(120):
        logits = torch.randint(-3, 3, (vocab,), generator=generator).float()
        bits = rng.integers(0, 256, bitmask_tokens // 8, dtype=np.uint8)
        if trial % 4 == 0:  # about one token in eight allowed
            bits &= rng.integers(0, 256, bits.size, dtype=np.uint8) & rng.integers(0, 256, bits.size, dtype=np.uint8)
        if trial % 9 == 0:
            bits[:] = 0
        if trial % 5 == 1:
            logits[torch.randint(0, vocab, (2,), generator=generator)] = float("nan")
        if trial % 7 == 2:
            logits.fill_(float("-inf"))
        allowed = torch.zeros(vocab, dtype=torch.bool)  # bit t % 8 of byte t // 8, none past the mask
        known = min(vocab, bitmask_tokens)
        allowed[:known] = torch.from_numpy(((bits[np.arange(known) // 8] >> (np.arange(known) % 8)) & 1).astype(bool))
        masked = torch.where(allowed, logits, float("-inf"))
        assert kernels.masked_argmax(logits, bits) == int(masked.argmax()), trial


def race_by_brute_force(p: torch.Tensor, key: int) -> int:
    """argmax_v p(v) / -log U(v) over every token, libm's log, the first index among equals."""
    import math

    u = kernels.race_uniforms(key, p.numel())
    best, best_at = -1.0, -1
    for v, pv in enumerate(p.tolist()):
        if pv > 0:
            r = pv / -math.log(u[v])
            if r > best:
                best, best_at = r, v
    return best_at


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_race_kernel), False], ids=["kernel", "fallback"])
def test_the_exponential_race_is_the_argmax_over_every_token(kernel, monkeypatch):
    """The race's filter (a logarithm only for tokens that can still win) against the ratio of
    every token: peaked and flat rows, rows with zeros, unnormalised ones, lengths around the
    4- and 8-lane blocks, a 49152-token row; and one clear error for a row that is not a distribution."""
    if kernel:
        assert kernels.sampling._race_function() is not None
    else:
        monkeypatch.setattr(kernels.sampling, "_race_function", lambda: None)
    generator = torch.Generator().manual_seed(5)
    for n in (1, 3, 7, 8, 9, 16, 23, 200):
        for trial in range(150):
            p = torch.rand(n, generator=generator) ** (1 + trial % 8)  # from flat to peaked
            if trial % 3 == 0:
                p[torch.rand(n, generator=generator) < 0.6] = 0.0
            if not p.any():
                p[-1] = 0.5
            p *= 10 ** float(torch.randint(-3, 4, (1,), generator=generator))  # unnormalised
            key = int(torch.randint(0, 2**62, (1,), generator=generator))
            assert kernels.exponential_race(p, key) == race_by_brute_force(p, key), (n, trial)
    for temperature in (0.5, 1.0, 3.0):
        p = torch.softmax(torch.randn(49152, generator=generator) * 4 / temperature, dim=-1)
        for key in range(3):
            assert kernels.exponential_race(p, key) == race_by_brute_force(p, key)
    for bad in ([0.5, -0.1, 0.6], [0.0] * 20, [0.1] * 9 + [float("nan")], [float("inf")] + [0.1] * 12):
        with pytest.raises(ValueError, match="finite, non-negative"):
            kernels.exponential_race(torch.tensor(bad), 7)



@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_race_kernel), False], ids=["kernel", "fallback"])
def test_the_exponential_race_refuses_a_nan_or_infinity_anywhere_in_the_row(kernel, monkeypatch):
    """Sampling needs finite, non-negative probabilities: a NaN (or inf, or a negative entry) is
    refused wherever it stands, in the 4- or 8-token blocks as in the tail past them."""
    if not kernel:
        monkeypatch.setattr(kernels.sampling, "_race_function", lambda: None)
    for n in (8, 13, 24):
        for at in range(n):
            for bad in (float("nan"), float("inf"), -0.25):
                p = torch.full((n,), 0.1)
                p[at] = bad
                with pytest.raises(ValueError, match="finite, non-negative"):
                    kernels.exponential_race(p, 11)


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_race_kernel), False], ids=["kernel", "fallback"])
def test_the_exponential_race_reads_a_strided_row_as_its_values(kernel, monkeypatch):
    """A draw depends only on the key and the distribution: a column of a matrix (a strided view)
    gives the draw of the same values packed, not of the bytes in memory order."""
    if not kernel:
        monkeypatch.setattr(kernels.sampling, "_race_function", lambda: None)
    generator = torch.Generator().manual_seed(27)
    matrix = torch.softmax(torch.randn(200, 3, generator=generator) * 3, dim=0)
    matrix[:, 0] = 0.0  # the neighbours in memory: a reader of the wrong bytes sees zeros and others
    for column in (1, 2):
        row = matrix[:, column]
        assert not row.is_contiguous()
        for key in range(20):
            assert kernels.exponential_race(row, key) == race_by_brute_force(row.contiguous(), key), (column, key)

@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False], ids=["kernel", "fallback"])
def test_a_race_key_is_a_64_bit_unsigned_integer(kernel, monkeypatch):
    """Keys outside 0 .. 2^64 - 1 are refused (C would wrap 2^64 to key 0: another draw, silently);
    both ends of the range are keys."""
    if not kernel:
        monkeypatch.setattr(kernels.sampling, "_race_function", lambda: None)
    p = torch.tensor([0.2, 0.3, 0.5])
    for key in (0, 2**64 - 1):
        assert kernels.exponential_race(p, key) == race_by_brute_force(p, key)
    for key in (-1, 2**64):
        with pytest.raises(ValueError, match="64-bit"):
            kernels.exponential_race(p, key)


def key_giving(v: int, h: int) -> int:
    """The race key for which token v's SplitMix64 output is h (the finaliser inverted)."""
    mask = 2**64 - 1

    def unshift(y: int, s: int) -> int:  # inverts y = x ^ (x >> s)
        x = y
        for _ in range(64 // s + 1):
            x = y ^ (x >> s)
        return x & mask

    z = unshift(h, 31) * pow(0x94D049BB133111EB, -1, 2**64) & mask
    z = unshift(z, 27) * pow(0xBF58476D1CE4E5B9, -1, 2**64) & mask
    return (unshift(z, 30) - (v + 1) * 0x9E3779B97F4A7C15) & mask


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("n, v", [(16, 8), (9, 8), (24, 17)])
def test_a_token_at_the_top_cell_of_the_uniforms_wins_by_a_hair(n, v, kernel, monkeypatch):
    """The filter's edge: U(v) = 1 - 2^-53 (E about 1.1e-16), and p(v) one float32 step above or
    below what ties token 0. Rounding 1 - p / best lands on U itself there: the bar must let U
    through (>=), or the winner is lost (the bar compared with >, found in review)."""
    import math

    if not kernel:
        monkeypatch.setattr(kernels.sampling, "_race_function", lambda: None)
    key = key_giving(v, 2**64 - 1)
    u = kernels.race_uniforms(key, n)
    assert u[v] == 1 - 2**-53
    lead = 1.0 / -math.log(u[0])  # token 0's ratio with p(0) = 1
    tie = torch.tensor(lead * -math.log(u[v]), dtype=torch.float32)
    for p_v, winner in ((torch.nextafter(tie, torch.tensor(1.0)), v), (torch.nextafter(tie, torch.tensor(0.0)), 0)):
        p = torch.zeros(n)
        p[0], p[v] = 1.0, p_v
        assert race_by_brute_force(p, key) == winner
        assert kernels.exponential_race(p, key) == winner


def test_the_race_uniforms_are_uniform_and_keyed():
    """U(v) in (0, 1), a different stream for a different key, and its first moments those of a
    uniform (a mean off by 0.01 would fail: the standard error here is 0.0006)."""
    u = kernels.race_uniforms(12345, 200_000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002
    assert (kernels.race_uniforms(12346, 100) != u[:100]).all()


def c_defines(source: str) -> dict[str, str]:
    """The ``#define NAME value`` lines of a kernel source, value as written (comments dropped)."""
    import re

    text = (Path(kernels.__file__).parent / source).read_text()
    return {m[1]: m[2].split("/*")[0].strip() for m in re.finditer(r"^#define (\w+) (.+)$", text, re.M)}


def test_the_tables_python_shares_with_the_c_kernels_agree():
    """What both sides need (block sizes, the packed group, the top-k limit, the race's margin,
    the integer kinds' numbers) is written in each language: here they are held together."""
    import re

    from decodekit.models.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

    gguf = c_defines("gguf.h")
    assert {kind: int(gguf[f"{kind.upper()}_BYTES"]) for kind in BLOCK_BYTES} == BLOCK_BYTES
    weights = {kind: int(gguf["K_BLOCK_WEIGHTS" if kind.endswith("_k") else "SMALL_BLOCK_WEIGHTS"]) for kind in BLOCK_WEIGHTS}
    assert weights == BLOCK_WEIGHTS
    assert int(c_defines("decodekit.h")["DECODEKIT_Q8_GROUP"]) == kernels.INTEGER_GROUP
    assert int(c_defines("topk.c")["TOPK_MAX"]) == kernels.TOPK_MAX
    assert eval(c_defines("race.c")["MARGIN"]) == kernels.sampling._RACE_MARGIN
    enum = re.search(r"enum \{ (KIND_\w+(?:, KIND_\w+)*), KINDS \};", (Path(kernels.__file__).parent / "decodekit.h").read_text())
    order = [name.removeprefix("KIND_").lower() for name in enum[1].split(", ")]
    assert {kind: i for i, kind in enumerate(order)} == kernels.INTEGER_KINDS


def test_the_kernels_level_follows_the_cpu_unless_switched_off(monkeypatch):
    """A CPU torch reports as AVX512 or AMX (Sapphire Rapids and later: AVX-512 too) runs the
    AVX-512 kernels, one it reports as AVX2 the same sources on AVX2 (DECODEKIT_KERNELS=avx2 asks for
    those on an AVX-512 CPU too), an older one none. DECODEKIT_KERNELS=0 switches them all off."""
    monkeypatch.delenv("DECODEKIT_KERNELS", raising=False)
    for capability, level in (("AVX512", "avx512"), ("AMX", "avx512"), ("AVX2", "avx2"), ("DEFAULT", None)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert kernels.build.level() == level
        assert kernels.build._supported() is (level is not None)
    monkeypatch.setattr(kernels.build, "_build", lambda source, at: pytest.fail(f"{source.name} built at {at}"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("DECODEKIT_KERNELS", "avx2")
    assert kernels.build.level() == "avx2"
    monkeypatch.setenv("DECODEKIT_KERNELS", "0")
    assert kernels.build.level() is None
    assert kernels.build._library_at.__wrapped__("gemm", kernels.build.level()) is None


def test_a_missing_cc_falls_back_to_gcc(monkeypatch, tmp_path):
    """CC (or ``cc``) names the compiler; where it is not found, gcc builds the library."""
    gcc = shutil.which("gcc")
    if gcc is None or kernels.build._build(Path(kernels.__file__).with_name("topk.c")) is None:
        pytest.skip("no gcc that builds the kernels")
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.build.shutil, "which", lambda name: gcc if name == "gcc" else None)
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 7; }\n")
    built = kernels.build._build(source)
    assert built is not None and ctypes.CDLL(str(built)).probe() == 7


def test_the_kernels_digest_changes_when_source_text_moves_to_another_file(monkeypatch, tmp_path):
    """The cost table's key covers which file holds which text: one source split in two (the same
    bytes in the same order, now two libraries) or renamed is other kernels, another digest."""
    folder = tmp_path / "kernels_dir"
    folder.mkdir()
    monkeypatch.setattr(kernels.build, "__file__", str(folder / "build.py"))
    digests = []
    try:
        for files in ({"one.c": "int a;\nint b;\n"}, {"one.c": "int a;\n", "two.c": "int b;\n"},
                      {"two.c": "int a;\nint b;\n"}):
            for old in folder.glob("*.c"):
                old.unlink()
            for name, text in files.items():
                (folder / name).write_text(text)
            kernels.build._sources_digest.cache_clear()
            digests.append(kernels.build.sources_digest())
    finally:
        kernels.build._sources_digest.cache_clear()
    assert len(set(digests)) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_reads_int32_positions_as_their_values(dtype):
    """Positions given as int32 rotate and fill the cache bit for bit as the same positions in
    int64 (the C code reads int64: an int32 tensor handed over raw would be read two at a time)."""
    gen = torch.Generator().manual_seed(31)
    ops, heads, kv_heads, dim = _ops(dtype), 4, 2, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    freqs = torch.view_as_real(torch.polar(torch.ones(40, dim // 2), torch.rand(40, dim // 2, generator=gen))).reshape(40, -1)
    results = []
    for positions in (torch.tensor([17, 9, 30]), torch.tensor([17, 9, 30], dtype=torch.int32)):
        k_cache, v_cache = torch.zeros(kv_heads, 8, dim, dtype=dtype), torch.zeros(kv_heads, 8, dim, dtype=dtype)
        results.append((ops.rope_store(qkv, freqs, positions, k_cache, v_cache, 2, heads), k_cache, v_cache))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_decoder_layers_refuse_a_forward_c_whose_structures_their_mirrors_do_not_match(monkeypatch):
    """A ctypes mirror of decodekit.h's structures that no longer matches the C sizes (a field
    added on one side only) is refused when the layers are built, before C reads the wrong memory."""
    from decodekit.models.kernels import layers

    backend = tiny_llama(seed=0, hidden_size=64)
    if backend._stack is None:
        pytest.skip("kernels unavailable on this machine")

    class _LongerSequence(ctypes.Structure):
        _fields_ = layers._Sequence._fields_ + [("extra", ctypes.c_void_p)]

    monkeypatch.setattr(layers, "MIRRORED_STRUCTS", layers.MIRRORED_STRUCTS[:-1] + (_LongerSequence,))
    with pytest.raises(RuntimeError, match="Sequence is .* bytes in decodekit.h"):
        backend._decoder_layers()


def test_decoder_layers_refuse_a_sliding_window_over_the_int8_cache():
    """forward.c's window offset counts rows of head_dim model-dtype values, which the int8 cache's
    rows (codes and a scale) are not: a window over it is refused, not read at the wrong slots."""
    from decodekit.models.kernels import int8_cache_kernels

    backend = tiny_llama(seed=0, hidden_size=64)
    int8 = int8_cache_kernels(backend.config.head_dim)
    if backend._stack is None or int8 is None:
        pytest.skip("kernels unavailable on this machine")
    c, names = backend.config, ("qkv", "o", "gate_up", "down")
    layers = [{"attn_norm": layer["attn_norm"], "mlp_norm": layer["mlp_norm"], **{n: layer[n].kernel for n in names}}
              for layer in backend.weights.layers]
    sizes = dict(hidden=c.hidden_size, inter=c.intermediate_size, n_heads=c.num_heads, n_kv_heads=c.num_kv_heads,
                 head_dim=c.head_dim, eps=c.rms_norm_eps, layers=layers, int8_cache=int8)
    assert kernels.decoder_layers(torch.float32, backend._ops, backend._attend, **sizes) is not None
    with pytest.raises(ValueError, match="int8 cache"):
        kernels.decoder_layers(torch.float32, backend._ops, backend._attend, window=8, **sizes)


@needs_kernel
def test_a_sum_of_sixteen_lanes_is_added_in_gccs_pairing_at_every_level():
    """_mm512_reduce_add_ps adds lanes 8 apart, then 4, then 2, then 1 (GCC's pairing), and the AVX2
    level's emulation must add in that order too, or its sums are other bits than the AVX-512
    level's: one 16-lane product, summed, against numpy's float32 arithmetic in that order, over
    values of many magnitudes (where the order shows). Both levels compile with -ffp-contract=off,
    so no product is fused into a sum the source keeps apart."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(200):
        w = torch.randn(1, 16, generator=gen) * 10.0 ** torch.randint(-4, 5, (1, 16), generator=gen)
        x = torch.randn(1, 16, generator=gen) * 10.0 ** torch.randint(-4, 5, (1, 16), generator=gen)
        p = (w * x)[0].numpy().astype(np.float32)  # each product rounded once, as the kernel's first fused multiply-add
        eight = p[8:] + p[:8]
        four = eight[4:] + eight[:4]
        two = four[:2] + four[2:]
        expected = np.float32(two[0] + two[1])
        assert matmul(w, x)[0, 0].item() == expected, trial
    assert "-ffp-contract=off" in kernels.build.FLAGS and "-ffp-contract=off" in kernels.build.AVX2_FLAGS


def test_rope_store_refuses_angle_tables_of_another_width():
    """rope_store reads head_dim (cos, sin) values a position from its table: a table narrower than
    that (or not a table) was read past its rows."""
    ops = kernels.layer_ops(torch.float32, 64, 96)
    if ops is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    qkv = torch.randn(2, 8 * 16)
    k_cache, v_cache, positions = torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), torch.tensor([0, 1])
    for freqs in (torch.tensor([1.0, 0.0] * 4).repeat(4, 1),  # 8 values a row, not 16
                  torch.tensor([1.0, 0.0] * 8)):  # one row, not a table
        with pytest.raises(ValueError, match="angles of 16"):
            ops.rope_store(qkv, freqs, positions, k_cache, v_cache, 0, 4)
    ops.rope_store(qkv, torch.tensor([1.0, 0.0] * 8).repeat(4, 1), positions, k_cache, v_cache, 0, 4)


def test_rope_store_refuses_positions_outside_its_rotary_table():
    """The C code reads row ``position`` of the (cos, sin) table unchecked: a position past the
    table's rows read memory past it (or crashed), and a negative one before it."""
    ops = kernels.layer_ops(torch.float32, 64, 96)
    if ops is None:
        pytest.skip("no C compiler or no AVX2 on this machine")
    freqs = torch.tensor([1.0, 0.0] * 8).repeat(4, 1)  # the angles of positions 0 .. 3
    for position in (4, 100_000_000, -1):
        with pytest.raises(ValueError, match="outside the rotary table's 4"):
            ops.rope_store(torch.randn(1, 128), freqs, torch.tensor([position]), torch.zeros(2, 4, 16),
                           torch.zeros(2, 4, 16), 0, 4)
    ops.rope_store(torch.randn(1, 128), freqs, torch.tensor([3]), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), 0, 4)


def test_attention_refuses_queries_that_are_not_rows_of_heads():
    """Queries are [n_q, H, D]: a tensor of more axes is refused, not read as its first n_q * H * D values."""
    attend = kernels.layout_independent_attention(torch.float32, 16)
    if attend is None:
        pytest.skip("kernels unavailable")
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    q = torch.randn(1, 4, 16, 2, generator=g)
    with pytest.raises(ValueError, match=r"queries \[n_q, H, D\]"):
        attend(q, k, v, None, 0.25)
    assert attend(q[..., 0], k, v, None, 0.25).shape == (1, 4, 16)


def test_the_decoder_layers_kernel_refuses_a_pass_past_its_cache_or_its_tables():
    """forward.c writes a pass's keys to slots start .. start + rows and reads each position's
    rotary angles unchecked: a slot past the cache's end corrupted the heap, so the wrapper refuses
    it, a position outside the table, a position count that is not the row count, a mask of
    another shape and a values' cache unlike the keys', before any layer runs."""
    backend = tiny_llama(seed=0, hidden_size=64)
    backend.prefill([1, 2, 3])
    stack = getattr(backend, "_stack", None)
    if stack is None:
        pytest.skip("no decoder-layers kernel on this machine")
    cap, table = backend._k.shape[3], backend._freqs_pairs
    x = backend._embed(torch.tensor([[5]]))[0]
    k, v = backend._k[:, 0], backend._v[:, 0]
    before = k.clone()
    bad = [(torch.tensor([3]), None, cap, "slots"), (torch.tensor([3, 4]), None, 3, "positions"),
           (torch.tensor([table.shape[0]]), None, 3, "rotary table"),
           (torch.tensor([3]), torch.ones(1, 3, dtype=torch.bool), 3, "mask")]
    for positions, visible, start, what in bad:
        with pytest.raises(ValueError, match=what):
            stack.run(x.clone(), torch.empty_like(x), table, positions, visible, k, v, start)
    with pytest.raises(ValueError, match="unlike the keys'"):
        stack.run(x.clone(), torch.empty_like(x), table, torch.tensor([3]), None, k, v[:, :, :-1], 3)
    assert torch.equal(k, before)
    assert stack.run(x.clone(), torch.empty_like(x), table, torch.tensor([3]), None, k, v, 3)
