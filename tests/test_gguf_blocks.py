"""Decoding from GGUF blocks: the same float32 results as the dequantised weights, bit for bit."""

import ctypes

import pytest
import torch

from decodekit.models import kernels
from decodekit.models.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, BLOCKS_FILE, BlockMatrix, matching_blocks, read_block_matrices
from decodekit.models.llama_weights import TIED_HEAD, rope_row_order
from decodekit.models.native import NativeLlama
from decodekit.models.tiny import tiny_hf_config, tiny_state_dict
from tests.marks import needs_fast_numerics

KINDS = ["q4_1", "q8_0"]
needs_kernel = pytest.mark.skipif(
    kernels.block_matmul("q4_1") is None or kernels.few_rows_matmul(torch.float32) is None,
    reason="no C compiler or no AVX2 on this machine",
)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_then_dequantize_stays_close_and_is_stable(kind):
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    blocks = BlockMatrix.quantize(weight, kind)
    assert blocks.data.dtype == torch.uint8 and blocks.shape == (8, 64)
    assert blocks.data.shape[1] == 2 * {"q4_1": 20, "q8_0": 34}[kind]
    approx = blocks.dequantize()
    step = (weight.amax() - weight.amin()) / (15 if kind == "q4_1" else 254)
    assert (approx - weight).abs().max() <= step  # within one quantisation step
    assert torch.equal(BlockMatrix.quantize(approx, kind).dequantize(), approx)  # a fixed point


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9, 16, 33])
def test_block_kernel_is_bit_identical_to_the_float32_kernel(kind, rows):
    """The block kernel rebuilds each weight exactly and sums in the float32 kernel's order, whether
    it rebuilds them for every four inputs or once a pass (rows as stored: from 9 inputs on, 16 and
    33 here; rows interleaved in fours: from 5 on, the test below)."""
    gen = torch.Generator().manual_seed(rows)
    blocks = BlockMatrix.quantize(torch.randn(37, 96, generator=gen), kind)  # 37: a ragged last row block
    x = torch.randn(rows, 96, generator=gen)
    got = kernels.block_matmul(kind)(blocks.data, x, blocks.n_in)
    assert torch.equal(got, kernels.few_rows_matmul(torch.float32)(blocks.dequantize(), x))
    assert torch.equal(got[rows - 1], kernels.block_matmul(kind)(blocks.data, x[rows - 1 :], blocks.n_in)[0])


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 9, 16])
def test_interleaved_block_kernel_is_bit_identical(kind, rows):
    """Rows interleaved in fours give the same bits as the row-major blocks, for any pass size.
    Three blocks a row: with four, interleaving four rows would be a transpose, its own inverse."""
    gen = torch.Generator().manual_seed(10 + rows)
    blocks = BlockMatrix.quantize(torch.randn(40, 96, generator=gen), kind)
    x = torch.randn(rows, 96, generator=gen)
    got = kernels.block_matmul(kind, interleaved=True)(blocks.interleaved(), x, blocks.n_in)
    assert torch.equal(got, kernels.block_matmul(kind)(blocks.data, x, blocks.n_in))
    with pytest.raises(ValueError, match="divisible by 4"):
        BlockMatrix.quantize(torch.randn(6, 32, generator=gen), kind).interleaved()


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_block_pass_of_no_rows_reads_and_writes_nothing(kind, interleaved):
    """A pass of no inputs (the C function called with M = 0) leaves the output alone: no path for
    one or two inputs may take it for one of them."""
    gen = torch.Generator().manual_seed(3)
    blocks = BlockMatrix.quantize(torch.randn(40, 96, generator=gen), kind)
    data = blocks.interleaved() if interleaved else blocks.data
    address = kernels.block_matmul(kind, interleaved=interleaved).address
    call = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 4)(address)
    x, out = torch.randn(2, 96, generator=gen), torch.full((2, 40), float("nan"))
    call(data.data_ptr(), x.data_ptr(), out.data_ptr(), 0, 40, 96, 2)
    assert out.isnan().all()


FILE_KINDS = ["q5_0", "q4_k", "q5_k", "q6_k"]  # read from files as they are (no quantize() for them)


@needs_kernel
@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11])
def test_file_block_kernels_are_bit_identical_to_the_gguf_package_dequantisation(kind, rows):
    """Random blocks (every bit pattern counts: scales, minima, high bits); the reference is the
    ``gguf`` package's own dequantisation, which is what the float32 weights are."""
    gen = torch.Generator().manual_seed(rows)
    blocks = BlockMatrix.random(13, 512, kind, gen)  # two super-blocks a row
    from gguf import GGMLQuantizationType, dequantize

    reference = torch.from_numpy(dequantize(blocks.data.numpy(), GGMLQuantizationType[kind.upper()])).reshape(13, 512)
    assert torch.equal(blocks.dequantize(), reference)
    x = torch.randn(rows, 512, generator=gen)
    got = kernels.block_matmul(kind)(blocks.data, x, blocks.n_in)
    assert torch.equal(got, kernels.few_rows_matmul(torch.float32)(reference, x))
    assert torch.equal(got[-1], kernels.block_matmul(kind)(blocks.data, x[-1:], blocks.n_in)[0])
    four = BlockMatrix(kind, blocks.data[:12].contiguous(), 512)  # rows interleaved in fours, block by block
    interleaved = kernels.block_matmul(kind, interleaved=True)(four.interleaved(), x, 512)
    assert torch.equal(interleaved, got[:, :12])
    rows_back = BlockMatrix.from_interleaved(kind, four.interleaved(), torch.tensor([0, 5, 11]), 512)
    assert torch.equal(rows_back.data, four.data[[0, 5, 11]])


def test_a_gguf_file_with_k_quants_is_read_as_its_blocks(tmp_path):
    """A file written by the ``gguf`` package: each tensor comes back as blocks of its own type."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    gen = torch.Generator().manual_seed(0)
    names = {"blk.0.attn_q.weight": "q5_0", "blk.0.attn_output.weight": "q4_k", "blk.0.ffn_down.weight": "q6_k",
             "blk.0.ffn_up.weight": "q5_k", "output.weight": "q8_0"}
    written = {name: BlockMatrix.random(8, 256, kind, gen) for name, kind in names.items()}
    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    for name, blocks in written.items():
        writer.add_tensor(name, blocks.data.numpy(), raw_dtype=GGMLQuantizationType[blocks.kind.upper()])
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))  # a float: not blocks
    q2_k = torch.randint(0, 256, (8, 84), dtype=torch.uint8, generator=gen).numpy()  # one 256-weight block a row
    writer.add_tensor("blk.0.ffn_gate.weight", q2_k, raw_dtype=GGMLQuantizationType.Q2_K)  # no kernel reads Q2_K
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = read_block_matrices(tmp_path / "tiny.gguf", num_layers=1)
    assert "model.embed_tokens.weight" not in read and "model.layers.0.mlp.gate_proj.weight" not in read
    assert read.unread == {"model.layers.0.mlp.gate_proj.weight": ("q2_k", 8 * 256)}
    for name, blocks in written.items():
        hf_name = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
                   "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
                   "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
                   "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight", "output.weight": "lm_head.weight"}[name]
        got = read[hf_name]
        assert (got.kind, got.shape) == (blocks.kind, (8, 256)) and torch.equal(got.data, blocks.data)


def test_weights_no_kernel_reads_are_named_in_one_line_or_refused_when_they_do_not_fit(monkeypatch, capsys, tmp_path):
    from decodekit.errors import InvalidModel
    from decodekit.models import loading

    unread = {"model.layers.0.mlp.gate_proj.weight": ("q2_k", 1 << 20), "model.layers.0.mlp.up_proj.weight": ("iq4_xs", 1 << 20)}
    loading.check_unread_weights(tmp_path / "m.gguf", {})
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(loading, "available_memory", lambda: 64 << 20)
    loading.check_unread_weights(tmp_path / "m.gguf", unread)  # 8 MiB of float32: it fits
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "IQ4_XS, Q2_K" in err and "float32" in err
    monkeypatch.setattr(loading, "available_memory", lambda: 4 << 20)
    with pytest.raises(InvalidModel, match=r"IQ4_XS, Q2_K.*exceed the memory available.*--backend hf"):
        loading.check_unread_weights(tmp_path / "m.gguf", unread)


def tied_model_on_blocks(seed: int):
    """A tiny Llama with tied embeddings whose float32 weights are its blocks dequantised (the
    embedding table in Q8_0, the other matrices in Q4_1): its config, float32 state and blocks."""
    from decodekit.models.llama_weights import LlamaConfig

    config = {**tiny_hf_config(hidden_size=64), "tie_word_embeddings": True}
    state = tiny_state_dict(config, seed=seed)
    state.pop("lm_head.weight")
    blocks = {}
    for name, weight in list(state.items()):
        if weight.dim() == 2:
            blocks[name] = BlockMatrix.quantize(weight, "q8_0" if "embed" in name else "q4_1")
            state[name] = blocks[name].dequantize()
    return LlamaConfig.from_hf(config), state, blocks


@needs_kernel
def test_a_tied_head_on_blocks_replaces_the_float32_embedding_bit_for_bit():
    """Tied embeddings with blocks: no float32 table is kept; lookups read the head's blocks (in
    the layout its kernel streams) and give the same logits, bit for bit, as the float32 table."""
    llama, state, blocks = tied_model_on_blocks(seed=5)
    plain, on_blocks = NativeLlama(llama, state), NativeLlama(llama, state, gguf_blocks=blocks)
    assert plain.weights.embed is not None and on_blocks.weights.embed is None
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(plain.append(ids).logits, on_blocks.append(ids).logits)
    for token in (3, 7, 11):
        step = torch.tensor([[token]])
        assert torch.equal(plain.append(step).logits, on_blocks.append(step).logits)
    with pytest.raises(IndexError, match="out of range"):  # never a row read from outside the table
        on_blocks.weights.embedding(torch.tensor([[96]]))


@pytest.mark.parametrize("numerics", ["exact", pytest.param("fast", marks=needs_fast_numerics)])
def test_a_build_from_recorded_matches_compares_nothing_and_decodes_the_same(numerics, monkeypatch):
    """What one build finds of the blocks (the tied head's and each projection's match) is what a
    later build takes without dequantising; a head recorded as not matching keeps float32."""
    llama, state, blocks = tied_model_on_blocks(seed=7)
    matches: dict = {}
    checked = NativeLlama(llama, state, gguf_blocks=blocks, numerics=numerics, block_matches=matches)
    assert matches[TIED_HEAD] is True and matches["model.layers.0.mlp.gate_proj.weight"] == [0, 0]
    assert len(matches) == 1 + 4 * llama.num_layers
    with monkeypatch.context() as patched:
        patched.setattr(BlockMatrix, "dequantize", lambda self: pytest.fail("a recorded match was checked again"))
        taken = NativeLlama(llama, state, gguf_blocks=blocks, numerics=numerics, block_matches=dict(matches))
    refused = NativeLlama(llama, state, gguf_blocks=blocks, numerics=numerics, block_matches={**matches, TIED_HEAD: False})
    assert taken.weights.embed is None and refused.weights.embed is not None  # the float32 table kept
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    expected = checked.append(ids).logits
    assert torch.equal(taken.append(ids).logits, expected) and torch.equal(refused.append(ids).logits, expected)


def test_matching_blocks_finds_the_row_order_or_declines():
    gen = torch.Generator().manual_seed(1)
    q = BlockMatrix.quantize(torch.randn(32, 64, generator=gen), "q4_1")
    v = BlockMatrix.quantize(torch.randn(16, 64, generator=gen), "q4_1")
    order = rope_row_order(32, 16)
    fused = torch.cat([q.dequantize()[order], v.dequantize()])  # q rotary-interleaved, v as is
    orders = [lambda n: rope_row_order(n, 16)]
    found = matching_blocks([q, v], fused, orders)
    assert found is not None and torch.equal(BlockMatrix.stack(found[0]).dequantize(), fused)
    assert found[1] == [1, 0]  # q reordered, v as stored
    assert BlockMatrix.stack([v, BlockMatrix.quantize(torch.randn(4, 32, generator=gen), "q4_1")]) is None  # another width
    assert matching_blocks([q, v], fused, []) is None  # q's rows need the reordering
    assert matching_blocks([q, None], fused, orders) is None  # a missing part
    assert matching_blocks([q], fused, orders) is None  # parts that are not the whole matrix (q alone matches its rows)
    assert matching_blocks([q], fused, orders, known=[1]) is None
    assert matching_blocks([q, v], fused + 1e-3, orders) is None  # not the same weights
    # choices found earlier are taken as they are (nothing compared); any that are not choices are checked afresh
    taken = matching_blocks([q, v], fused + 1e-3, orders, known=[1, 0])
    assert taken is not None and torch.equal(BlockMatrix.stack(taken[0]).dequantize(), fused) and taken[1] == [1, 0]
    for unusable in ([2, 0], [1], [True, 0], "1,0", None):
        assert matching_blocks([q, v], fused, orders, known=unusable)[1] == [1, 0]
        assert matching_blocks([q, v], fused + 1e-3, orders, known=unusable) is None


def _tiny_gguf_model(dtype=torch.float32, kind="q4_1"):
    """A tiny Llama whose float weights are exactly the dequantised blocks (as after GGUF loading)."""
    from decodekit.models.llama_weights import LlamaConfig

    config = tiny_hf_config(hidden_size=64)
    llama = LlamaConfig.from_hf(config)
    state = tiny_state_dict(config, seed=3)
    blocks = {}
    for name, weight in list(state.items()):
        if weight.dim() == 2:
            blocks[name] = BlockMatrix.quantize(weight, kind)
            state[name] = blocks[name].dequantize()
    return llama, state, blocks


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_a_model_on_blocks_decodes_exactly_as_on_float32(kind):
    llama, state, blocks = _tiny_gguf_model(kind=kind)
    plain = NativeLlama(llama, state)
    on_blocks = NativeLlama(llama, state, gguf_blocks=blocks)
    assert "gguf-blocks" in on_blocks.info.architecture and "gguf-blocks" not in plain.info.architecture
    assert all(p.on_blocks for p in on_blocks.weights.projections)
    context = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    for backend in (plain, on_blocks):
        backend.reset()
        backend.append(context)
    for _ in range(8):  # decode steps and a small tree: identical logits
        a, b = plain.append(context[:, -1:]).logits, on_blocks.append(context[:, -1:]).logits
        assert torch.equal(a, b)
    tokens, parents = torch.tensor([3, 5, 7, 9]), [-1, 0, 0, 1]
    assert torch.equal(plain.verify_tree(tokens, parents).logits, on_blocks.verify_tree(tokens, parents).logits)


def test_blocks_are_ignored_for_bfloat16():
    llama, state, blocks = _tiny_gguf_model()
    backend = NativeLlama(llama, state, dtype=torch.bfloat16, gguf_blocks=blocks)
    assert "gguf-blocks" not in backend.info.architecture


def test_the_embedded_ggufs_blocks_are_read_saved_beside_the_weights_and_read_back_the_same(real_model, tmp_path):
    from decodekit.models.gguf_blocks import cached_block_matrices
    from decodekit.models.loading import embedded_gguf

    backend = real_model.backend
    if kernels.block_matmul("q4_1") is not None:
        # every fused projection of the loaded model matched its blocks exactly
        assert all(p.on_blocks for p in backend.weights.projections)
        assert "gguf-blocks" in backend.info.architecture
    gguf = embedded_gguf("smollm2-135m")
    first = cached_block_matrices(gguf, tmp_path, backend.info.num_layers)  # read from the file, then saved
    assert first["model.embed_tokens.weight"].kind == "q8_0"
    assert first["model.layers.0.mlp.down_proj.weight"].kind == "q4_1"
    assert (tmp_path / BLOCKS_FILE).is_file()
    again = cached_block_matrices(gguf, tmp_path, backend.info.num_layers)
    assert first.keys() == again.keys()
    for name, blocks in first.items():
        saved = again[name]
        assert (saved.kind, saved.n_in) == (blocks.kind, blocks.n_in) and torch.equal(saved.data, blocks.data)


# The integer kernel of the `fast` numerics -------------------------------------------------------

def integer_product(kind: str, blocks: BlockMatrix, x: torch.Tensor) -> torch.Tensor:
    packed = kernels.pack_integer_blocks(kind, blocks.data, blocks.n_in)
    return kernels.integer_block_matmul(kind)(packed, x, blocks.n_in)


def integer_products_of_every_build(kind: str, blocks: BlockMatrix, x: torch.Tensor) -> list[torch.Tensor]:
    """:func:`integer_product` by the build in use, and on an AVX-512 CPU by the AVX2 build as well."""
    products = [integer_product(kind, blocks, x)]
    if kernels.build.level() == "avx512":
        lib = kernels.build._library_at("gemm_q8", "avx2")
        fn = getattr(lib, f"decodekit_q8_{kind}")
        fn.argtypes, fn.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4, None
        packed = kernels.pack_integer_blocks(kind, blocks.data, blocks.n_in)
        out = torch.empty(x.shape[0], blocks.shape[0])
        fn(packed.data_ptr(), x.contiguous().data_ptr(), out.data_ptr(), x.shape[0], blocks.shape[0], blocks.n_in, 2)
        products.append(out)
    return products


def integer_product_on_threads(threads: int, kind: str, blocks: BlockMatrix, x: torch.Tensor) -> torch.Tensor:
    """:func:`integer_product` with torch's (and so the kernel's) thread count set to ``threads``."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return integer_product(kind, blocks, x)
    finally:
        torch.set_num_threads(before)


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 100])
def test_integer_kernel_is_its_scalar_reference_bit_for_bit_and_close_to_float32(kind, rows):
    """Inputs quantised to 8 bits per block of 32, integer dot products: the vector kernel does the
    reference's arithmetic in the reference's order; against float32 it is off by the inputs'
    quantisation error (well under 1% here), and each row's result is the same whatever else is in
    the pass (alone, or in a tile of eight at another position)."""
    gen = torch.Generator().manual_seed(rows)
    blocks = BlockMatrix.quantize(torch.randn(48, 192, generator=gen), kind)
    x = torch.randn(rows, 192, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    got = integer_product(kind, blocks, x)
    assert torch.equal(got, kernels.integer_block_matmul_reference(kind, blocks.data, x, blocks.n_in))
    exact = x @ blocks.dequantize().T
    assert ((got - exact).norm() / exact.norm()).item() < 0.01
    assert torch.equal(got[rows - 1], integer_product(kind, blocks, x[rows - 1 :].contiguous())[0])
    assert torch.equal(got[0], integer_product(kind, blocks, torch.cat([x[rows - 1 :], x[:1]]))[1])


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS)
def test_a_block_of_values_too_small_to_invert_its_scale_is_quantised_to_zeros(kind):
    """Below ~3.7e-37 a block's 1 / scale is infinite: its values (an exact zero among them: 0 *
    inf is NaN, which the vector and scalar code converted differently) are quantised to zeros,
    in the kernel as in its reference, within a tiny absolute error of float32."""
    gen = torch.Generator().manual_seed(0)
    blocks = BlockMatrix.quantize(torch.randn(16, 64, generator=gen), kind)
    x = torch.randn(2, 64, generator=gen) * 1e-37
    x[0, 3] = 0.0
    x[1, 32:] = torch.randn(32, generator=gen)  # a normal block beside a tiny one, in the same row
    got = integer_product(kind, blocks, x)
    assert torch.equal(got, kernels.integer_block_matmul_reference(kind, blocks.data, x, blocks.n_in))
    assert torch.equal(got[0], torch.zeros(16))
    normal = x[1:].clone()
    normal[0, :32] = 0.0
    assert torch.equal(got[1], integer_product(kind, blocks, normal)[0])


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS + ["q6_k"])
@pytest.mark.parametrize("rows", [21, 22, 40])
def test_two_threads_quantising_a_pass_together_give_the_reference_bit_for_bit(kind, rows):
    """From 128 input blocks of 32 values on, the threads quantise a pass's inputs between them
    before they split the output rows (21 rows of 192 inputs stay below, 22 and 40 rows, and 21
    rows of 256, are above): still the scalar reference bit for bit, and each row what it is alone
    on one thread. A row with a value that is not finite comes out NaN, whichever thread
    quantised it."""
    gen = torch.Generator().manual_seed(rows)
    blocks = (BlockMatrix.quantize(torch.randn(48, 192, generator=gen), kind) if kind in KINDS
              else BlockMatrix.random(48, 256, kind, gen))
    n_in = blocks.n_in
    x = torch.randn(rows, n_in, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[rows - 2, 5] = float("inf")  # a block of the second thread's share
    got = integer_product_on_threads(2, kind, blocks, x)
    want = kernels.integer_block_matmul_reference(kind, blocks.data, x, n_in)
    assert torch.equal(got.isnan(), want.isnan()) and got[rows - 2].isnan().all() and not got[: rows - 2].isnan().any()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got[0], integer_product(kind, blocks, x[:1].contiguous())[0])


@needs_fast_numerics
def test_an_odd_number_of_blocks_shared_between_two_threads_is_quantised_to_the_last():
    """43 rows of 3 blocks: 129 blocks to quantise (from 128 on the threads share them), which two
    threads cannot split evenly; the one past the halves is quantised too, as the reference does."""
    gen = torch.Generator().manual_seed(43)
    blocks = BlockMatrix.quantize(torch.randn(16, 96, generator=gen), "q4_1")
    x = torch.randn(43, 96, generator=gen)
    got = integer_product_on_threads(2, "q4_1", blocks, x)
    assert torch.equal(got, kernels.integer_block_matmul_reference("q4_1", blocks.data, x, 96))


@needs_fast_numerics
@pytest.mark.parametrize("kind", ["q4_1", "q6_k"])
def test_every_pass_length_computes_every_row_of_every_group(kind):
    """Passes of 1 to 19 rows against three groups of 16 output rows: up to 8 rows the groups one
    by one in tiles of any length (1-8); from 9 on, nibbles (Q4_1) still one by one, tiles of 8 and
    a last one of 1-8, and whole bytes (Q6_K) in pairs, tiles of 4 and a last one of 1-4 rows, the
    odd third group alone with a last tile of any length; every row of every group is the
    reference's, bit for bit."""
    gen = torch.Generator().manual_seed(19)
    blocks = (BlockMatrix.quantize(torch.randn(48, 64, generator=gen), kind) if kind in KINDS
              else BlockMatrix.random(48, 256, kind, gen))
    x = torch.randn(19, blocks.n_in, generator=gen)
    want = kernels.integer_block_matmul_reference(kind, blocks.data, x, blocks.n_in)
    for rows in range(1, 20):
        assert torch.equal(integer_product(kind, blocks, x[:rows]), want[:rows]), rows


@needs_fast_numerics
@pytest.mark.parametrize("kind", ["q5_0", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 5, 9, 40])
def test_integer_kernel_on_k_quants_is_its_reference_and_close_to_float32(kind, rows):
    """Q5_0's fifth bits and the K-quants' sub-block scales and minima (Q6_K: a scale per 16
    weights, two integer sums a sub-block) in the integer kernel: bit for bit its scalar reference, close to the float32
    product, each row alone as in any pass."""
    gen = torch.Generator().manual_seed(rows)
    blocks = BlockMatrix.random(32, 512, kind, gen)
    x = torch.randn(rows, 512, generator=gen)
    got = integer_product(kind, blocks, x)
    assert torch.equal(got, kernels.integer_block_matmul_reference(kind, blocks.data, x, blocks.n_in))
    exact = x @ blocks.dequantize().T
    assert ((got - exact).norm() / exact.norm()).item() < 0.01
    assert torch.equal(got[-1], integer_product(kind, blocks, x[-1:].contiguous())[0])


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS + FILE_KINDS)
@pytest.mark.parametrize("byte", [0xFF, 0x80, 0x7F])
def test_integer_sums_at_the_ends_of_the_weight_and_input_ranges_are_exact(kind, byte):
    """Every weight byte set to one value (4-, 5- and 6-bit weights at their largest; Q8_0's at -1,
    -128 and 127) against inputs at +-127 after quantisation, of one sign and alternating: the
    largest integer sums a block can have, which AVX2's 16-bit partial sums (vpmaddubsw) must hold
    without saturating. Bit for bit the scalar reference, in every build this CPU runs (an AVX-512
    CPU runs the AVX2 build too)."""
    gen = torch.Generator().manual_seed(byte)
    blocks = BlockMatrix.random(32, 512, kind, gen)
    data = blocks.data.view(32, 512 // BLOCK_WEIGHTS[kind], BLOCK_BYTES[kind])
    scales = data.clone()
    data.fill_(byte)
    at = BLOCK_BYTES[kind] - 2 if kind == "q6_k" else 0  # where random() put d (and dmin after it)
    data[..., at : at + 2] = scales[..., at : at + 2]
    if kind in ("q4_1", "q4_k", "q5_k"):
        data[..., 2:4] = scales[..., 2:4]
    ones = torch.ones(512)
    x = torch.stack([ones, -ones, ones * torch.tensor([1.0, -1.0]).repeat(256)])
    want = kernels.integer_block_matmul_reference(kind, blocks.data, x, blocks.n_in)
    for got in integer_products_of_every_build(kind, blocks, x):
        assert torch.equal(got, want)
    exact = x @ blocks.dequantize().T
    assert ((want - exact).norm() / exact.norm()).item() < 1e-5  # (+-1 quantises without error)


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS + FILE_KINDS)
def test_packed_rows_are_the_dequantised_rows_bit_for_bit(kind):
    """A tied embedding's lookups read the head's packed blocks: each row exactly the file's
    dequantised row (signs of zeros included), and NaN for a row outside the matrix (past its end or
    before its start)."""
    gen = torch.Generator().manual_seed(3)
    blocks = BlockMatrix.random(48, 512, kind, gen)
    packed = kernels.pack_integer_blocks(kind, blocks.data, blocks.n_in)
    rows = torch.tensor([0, 17, 47, 16, 17])
    got = kernels.integer_block_rows(kind, packed, rows, blocks.n_in)
    want = blocks.dequantize()[rows]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert kernels.integer_block_rows(kind, packed, torch.tensor([48, -1]), blocks.n_in).isnan().all()


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS)
def test_integer_kernel_quantises_inputs_as_q8_blocks(kind):
    """An input exactly on a block's 8-bit grid (its largest magnitude maps to 127) loses nothing
    to quantisation: the result is the float32 product with the dequantised weights up to float
    rounding, also with a block of zeros (scale 0) beside it, and with weights of both signs."""
    weight = torch.cat([torch.ones(8, 64), -torch.ones(8, 64)]) * torch.linspace(0.5, 2, 64)
    blocks = BlockMatrix.quantize(weight, kind)
    x = torch.cat([torch.arange(-127, 129, 8, dtype=torch.float32)[:32] / 127 * 3.0, torch.zeros(32)])[None]
    got = integer_product(kind, blocks, x)
    assert torch.allclose(got, x @ blocks.dequantize().T, rtol=1e-6, atol=1e-5)


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS)
def test_an_input_halfway_between_two_steps_rounds_to_the_even_one(kind):
    """The inputs' conversion rounds to nearest even (as nearbyintf and the vector conversion do):
    in a block whose largest magnitude is 127 (scale 1), x.5 goes to the even integer, in the
    kernel as in its scalar reference; with integer Q8_0 weights of scale 1 the product is then
    exactly that of the inputs rounded half to even (torch.round's rule)."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randint(-127, 128, (16, 64), generator=gen).float()
    weight[:, [0, 32]] = 127.0  # every block's largest weight: scale 1, the integers as they are
    blocks = BlockMatrix.quantize(weight, kind)
    halves = torch.arange(-15, 16, dtype=torch.float32) + 0.5  # -14.5 .. 15.5: ties of both parities and signs
    x = torch.cat([torch.tensor([127.0]), halves, torch.tensor([-127.0]), halves.flip(0)])[None]
    got = integer_product(kind, blocks, x)
    assert torch.equal(got, kernels.integer_block_matmul_reference(kind, blocks.data, x, blocks.n_in))
    if kind == "q8_0":
        assert torch.equal(blocks.dequantize(), weight)
        assert torch.equal(got, torch.round(x) @ weight.T)


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS)
def test_block_kernels_read_a_strided_input_as_its_values(kind):
    """An input given as a view (a transpose) is made contiguous before the C code reads it as
    packed rows, in the integer kernel as in the exact block kernel."""
    gen = torch.Generator().manual_seed(8)
    blocks = BlockMatrix.quantize(torch.randn(16, 64, generator=gen), kind)
    x = torch.randn(64, 3, generator=gen).t()
    assert not x.is_contiguous()
    assert torch.equal(integer_product(kind, blocks, x), integer_product(kind, blocks, x.contiguous()))
    exact = kernels.block_matmul(kind)
    assert torch.equal(exact(blocks.data, x, 64), exact(blocks.data, x.contiguous(), 64))


@needs_fast_numerics
def test_integer_kernel_turns_a_non_finite_input_into_nan_and_refuses_bad_shapes():
    blocks = BlockMatrix.quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), "q4_1")
    packed = kernels.pack_integer_blocks("q4_1", blocks.data, 64)
    fast = kernels.integer_block_matmul("q4_1")
    for bad in (float("nan"), float("inf")):
        for column in (40, 56):  # in the first and in the second half of a block (two vectors of 16)
            x = torch.randn(2, 64)
            x[1, column] = bad
            got = fast(packed, x, 64)
            assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all(), (bad, column)
    with pytest.raises(ValueError, match="inputs"):
        fast(packed, torch.randn(3, 60), 60)
    with pytest.raises(ValueError, match="inputs"):  # no row at all: the kernel's pass needs one
        fast(packed, torch.randn(0, 64), 64)
    with pytest.raises(ValueError, match="blocks"):
        fast(packed[:, :20].contiguous(), torch.randn(1, 64), 64)
    with pytest.raises(ValueError, match="blocks"):  # not a whole group of 16 rows
        kernels.pack_integer_blocks("q4_1", blocks.data[:5].contiguous(), 64)


@needs_fast_numerics
def test_a_matrix_packed_slice_by_slice_is_the_matrix_packed_whole():
    """A big head is packed a slice at a time (its file blocks are never all in memory): the same
    bytes as packing it whole; a slice that does not start on a group of 16 rows, that runs past
    the room's rows, or room laid out for another kind or width, is refused."""
    blocks = BlockMatrix.random(64, 256, "q8_0", torch.Generator().manual_seed(4))
    whole = kernels.pack_integer_blocks("q8_0", blocks.data, 256)
    sliced = kernels.empty_packed("q8_0", 64, 256)
    for start, stop in ((0, 16), (16, 48), (48, 64)):
        kernels.pack_integer_blocks("q8_0", blocks.data[start:stop].contiguous(), 256, into=sliced, first_row=start)
    assert torch.equal(sliced, whole)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.pack_integer_blocks("q8_0", blocks.data[:16].contiguous(), 256, into=sliced, first_row=8)
    with pytest.raises(ValueError, match="do not fit"):  # past the room's last row
        kernels.pack_integer_blocks("q8_0", blocks.data[:32].contiguous(), 256, into=sliced, first_row=48)
    for other in (kernels.empty_packed("q8_0", 64, 512), kernels.empty_packed("q4_1", 64, 256)):  # another layout's room
        with pytest.raises(ValueError, match="do not fit"):
            kernels.pack_integer_blocks("q8_0", blocks.data, 256, into=other)
    assert torch.equal(sliced, whole)  # a refused slice writes nothing


@needs_fast_numerics
def test_packing_no_rows_writes_nothing_even_at_the_end_of_the_room():
    """A slice of no rows (a head's last, empty slice) packs nothing: the room is returned as it
    was, also where the slice starts at the room's end, and a matrix of no rows packs to no rows."""
    blocks = BlockMatrix.random(32, 64, "q4_1", torch.Generator().manual_seed(6))
    room = kernels.pack_integer_blocks("q4_1", blocks.data, 64)
    before = room.clone()
    assert kernels.pack_integer_blocks("q4_1", blocks.data[:0], 64, into=room, first_row=32) is room
    assert torch.equal(room, before)
    assert kernels.pack_integer_blocks("q4_1", blocks.data[:0], 64).shape[0] == 0


@needs_fast_numerics
def test_integer_kernel_refuses_blocks_it_cannot_read_as_packed_rows():
    """The C code reads the blocks as packed rows: a view with other strides (the same shape and
    values) is refused, packed or as the file has them, not read in memory order; a kind the integer
    kernel does not read has no kernel (None, as where it is unavailable), not an error."""
    blocks = BlockMatrix.quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(7)), "q4_1")
    packed = kernels.pack_integer_blocks("q4_1", blocks.data, 64)
    fast, x = kernels.integer_block_matmul("q4_1"), torch.randn(2, 64)
    strided_packed, strided_blocks = packed.t().contiguous().t(), blocks.data.t().contiguous().t()
    assert torch.equal(strided_packed, packed) and not strided_packed.is_contiguous()
    with pytest.raises(ValueError, match="blocks"):
        fast(strided_packed, x, 64)
    with pytest.raises(ValueError, match="blocks"):
        kernels.integer_block_matmul_reference("q4_1", strided_blocks, x, 64)
    with pytest.raises(ValueError, match="blocks"):
        kernels.pack_integer_blocks("q4_1", strided_blocks, 64)
    assert kernels.integer_block_matmul("q3_k") is None and kernels.block_matmul("q3_k") is None


def test_tiny_models_on_blocks_hold_projections_in_q4_1_and_the_head_in_q8_0():
    """as_gguf_blocks quantises as the embedded model's GGUF file does: every projection Q4_1, the
    output head Q8_0 (the embedding table, where the head is tied to it), and the state holds each
    quantised weight's dequantised values."""
    from decodekit.models.tiny import as_gguf_blocks

    for tied in (False, True):
        config = {**tiny_hf_config(hidden_size=64), "tie_word_embeddings": tied}
        state = tiny_state_dict(config, seed=2)
        if tied:
            state.pop("lm_head.weight")
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        quantised, blocks = as_gguf_blocks(state)
        want = {name: "q4_1" for name in state if name.endswith("_proj.weight")} | {head: "q8_0"}
        assert {name: b.kind for name, b in blocks.items()} == want
        assert all(torch.equal(quantised[name], b.dequantize()) for name, b in blocks.items())


@needs_fast_numerics
def test_a_fast_head_read_slice_by_slice_from_the_saved_blocks_decodes_as_one_held_whole(tmp_path, monkeypatch):
    """The `fast` tied head reads its blocks from the saved file a slice at a time (16 rows here,
    six slices): the model decodes bit for bit as one built from blocks held in memory, and asking
    whether the file has the head reads none of it."""
    from safetensors.torch import save_file

    from decodekit.models import llama_weights
    from decodekit.models.gguf_blocks import SavedBlocks

    llama, state, blocks = tied_model_on_blocks(seed=6)
    path = tmp_path / BLOCKS_FILE
    save_file({n: b.data for n, b in blocks.items()}, str(path), metadata={n: f"{b.kind}:{b.n_in}" for n, b in blocks.items()})
    saved = SavedBlocks(path)
    monkeypatch.setattr(SavedBlocks, "__getitem__", lambda self, name: pytest.fail(f"{name} read whole"))
    assert "model.embed_tokens.weight" in saved and "nothing" not in saved
    monkeypatch.undo()
    monkeypatch.setattr(llama_weights, "HEAD_SLICE_VALUES", 16 * 64)
    held, read = (NativeLlama(llama, state, gguf_blocks=source, numerics="fast") for source in (blocks, saved))
    assert held.weights.embed is None and read.weights.embed is None
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(held.append(ids).logits, read.append(ids).logits)
    assert torch.equal(held.append(torch.tensor([[5]])).logits, read.append(torch.tensor([[5]])).logits)


def test_rotary_angles_computed_as_far_as_a_sequence_reaches_are_the_whole_tables():
    """Rotary tables are filled in fixed chunks as passes reach further (a long-context model pays
    only for the positions it uses): every value is the one the whole table has, whatever was asked
    for first, and a pass fills what it needs before it runs."""
    from decodekit.models.llama_weights import ROPE_CHUNK, LlamaConfig, RopeTable

    def whole(theta: float, dim: int, positions: int) -> torch.Tensor:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
        return torch.polar(torch.ones_like(angles), angles)

    for theta, dim, positions, reaches in ((1e6, 256, 5000, (5, 3000, 5000)), (1e4, 64, 2500, (2500,))):
        table = RopeTable(theta, dim, positions)
        for end in reaches:
            table.reach(end)
            assert table.filled >= end
        assert torch.equal(table.angles, whole(theta, dim, positions))
        assert torch.equal(table.pairs, torch.view_as_real(table.angles).reshape(positions, -1))
    config = tiny_hf_config(hidden_size=64, max_position=4 * ROPE_CHUNK)
    model = NativeLlama(LlamaConfig.from_hf(config), tiny_state_dict(config, seed=1))
    assert model._rope.filled == 0
    model.append(torch.zeros(1, ROPE_CHUNK + 3, dtype=torch.long))
    assert model._rope.filled == 2 * ROPE_CHUNK


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_maps_each_blocks_extremes_onto_the_ends_of_its_integer_range(kind):
    """llama.cpp's rules: Q8_0 scales a block by max|w| / 127, so its largest magnitude comes back
    as itself (to float16's rounding of the scale); Q4_1 maps [min, max] onto 0..15, so both ends
    come back."""
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    back = BlockMatrix.quantize(weight, kind).dequantize().view(4, 2, 32)
    w = weight.view(4, 2, 32)
    if kind == "q8_0":
        top = w.abs().argmax(-1, keepdim=True)
        assert torch.allclose(back.gather(-1, top), w.gather(-1, top), rtol=2**-9, atol=0)
    else:
        spread = (w.amax(-1) - w.amin(-1)) / 500
        assert ((back.amax(-1) - w.amax(-1)).abs() <= spread).all()
        assert ((back.amin(-1) - w.amin(-1)).abs() <= spread).all()


@needs_kernel
@pytest.mark.parametrize("values", [16 * 64, 64 * 64, 64], ids=["six-slices", "a-shorter-last-slice", "under-a-group"])
def test_a_tied_head_checked_slice_by_slice_matches_every_slice(monkeypatch, values):
    """The tied head's blocks are checked against the float32 table a slice of rows at a time, each
    slice against its own rows: blocks that match put the head on blocks, whatever the slicing (96
    rows: six slices of 16; a slice of 64 and the last 32; a slice of fewer values than a group of
    16 rows still takes a whole group)."""
    from decodekit.models import llama_weights

    llama, state, blocks = tied_model_on_blocks(seed=5)
    monkeypatch.setattr(llama_weights, "HEAD_SLICE_VALUES", values)
    matches: dict = {}
    sliced = NativeLlama(llama, state, gguf_blocks=blocks, block_matches=matches)
    assert sliced.weights.embed is None and matches[TIED_HEAD] is True
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    assert torch.equal(sliced.append(ids).logits, NativeLlama(llama, state).append(ids).logits)


def test_quantised_tensors_of_names_the_backend_does_not_read_are_neither_blocks_nor_unread(tmp_path):
    """Only the weight matrices the backend computes with are read (or listed as unread, to run in
    float32): a quantised tensor of another name (a vision tower's, an expert router's) is ignored."""
    from gguf import GGMLQuantizationType, GGUFWriter

    gen = torch.Generator().manual_seed(0)
    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    for name in ("blk.0.attn_v.weight", "blk.0.ffn_gate_inp.weight", "v.blk.0.attn_q.weight"):
        writer.add_tensor(name, BlockMatrix.random(8, 64, "q8_0", gen).data.numpy(), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = read_block_matrices(tmp_path / "tiny.gguf", num_layers=1)
    assert list(read) == ["model.layers.0.self_attn.v_proj.weight"] and read.unread == {}


def test_unread_weights_whose_float32_copies_just_fit_are_run_not_refused(monkeypatch, capsys, tmp_path):
    """Refused only where the float32 copies exceed the memory available: exactly that much fits."""
    from decodekit.models import loading

    unread = {"model.layers.0.mlp.gate_proj.weight": ("q2_k", 1 << 20)}
    monkeypatch.setattr(loading, "available_memory", lambda: 4 << 20)  # 4 bytes a weight
    loading.check_unread_weights(tmp_path / "m.gguf", unread)
    assert "run as float32" in capsys.readouterr().err


@needs_kernel
def test_a_projection_recorded_as_unmatched_keeps_float32_without_a_check(monkeypatch):
    """A record that found a projection's blocks not to match (None) is taken as it is: a later
    build of the same files runs that projection on float32 and dequantises nothing to check again."""
    llama, state, blocks = tied_model_on_blocks(seed=7)
    matches: dict = {}
    NativeLlama(llama, state, gguf_blocks=blocks, block_matches=matches)
    name = "model.layers.0.mlp.gate_proj.weight"
    monkeypatch.setattr(BlockMatrix, "dequantize", lambda self: pytest.fail("a recorded match was checked again"))
    taken = NativeLlama(llama, state, gguf_blocks=blocks, block_matches={**matches, name: None})
    assert not taken.weights.layers[0]["gate_up"].on_blocks
    assert taken.weights.layers[0]["qkv"].on_blocks and taken.weights.layers[1]["gate_up"].on_blocks


@needs_kernel
@pytest.mark.parametrize("reorderings, choice", [(1, 0), (0, 1), (2, 2)])
def test_q_and_k_blocks_are_found_in_either_rotary_row_order(reorderings, choice):
    """The fused q/k weights hold each head's rotary pairs adjacent: blocks whose rows are stored
    that way (llama.cpp's order), in the checkpoint's order, or reordered the other way round are
    each found (their choice recorded), so the projection streams its blocks, bit for bit."""
    llama, state, blocks = _tiny_gguf_model()
    for n in "qk":
        name = f"model.layers.0.self_attn.{n}_proj.weight"
        for _ in range(reorderings):  # the rotary interleaving applied to the checkpoint's rows, once or twice
            blocks[name] = blocks[name].take(rope_row_order(blocks[name].shape[0], llama.head_dim))
    matches: dict = {}
    backend = NativeLlama(llama, state, gguf_blocks=blocks, block_matches=matches)
    assert matches["model.layers.0.self_attn.q_proj.weight"] == [choice, choice, 0]
    assert backend.weights.layers[0]["qkv"].on_blocks
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(backend.append(ids).logits, NativeLlama(llama, state).append(ids).logits)


@needs_kernel
def test_a_negative_token_id_is_refused_by_a_tied_head_on_blocks_as_by_the_float32_table():
    """An embedding lookup reads only rows of the table: a negative id is an IndexError (as
    F.embedding's on the float32 table), never the row counted back from the end."""
    llama, state, blocks = tied_model_on_blocks(seed=5)
    for backend in (NativeLlama(llama, state), NativeLlama(llama, state, gguf_blocks=blocks)):
        with pytest.raises(IndexError):
            backend.weights.embedding(torch.tensor([[5, -1]]))


@needs_kernel
def test_an_empty_lookup_gives_no_rows_on_blocks_as_from_the_float32_table():
    """A lookup of no tokens is no rows, not an error, whether the rows come from the table or from
    the tied head's blocks (interleaved in fours)."""
    llama, state, blocks = tied_model_on_blocks(seed=5)
    for backend in (NativeLlama(llama, state), NativeLlama(llama, state, gguf_blocks=blocks)):
        assert backend.weights.embedding(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 64)


@needs_kernel
def test_a_model_on_blocks_streams_its_blocks_bytes_not_its_float32_weights():
    """What a one-token pass reads (the profile's weight traffic): the blocks where the projections
    run on them (Q4_1 and Q8_0: a few bits a weight), the float32 weights where they do not."""
    llama, state, blocks = tied_model_on_blocks(seed=5)
    plain, on_blocks = NativeLlama(llama, state), NativeLlama(llama, state, gguf_blocks=blocks)
    floats, weights = plain.weight_traffic()
    assert floats == 4 * weights
    assert on_blocks.weight_traffic() == (sum(b.data.nbytes for b in blocks.values()), weights)


def test_the_fast_numerics_says_why_a_projection_cannot_run_it(monkeypatch):
    from decodekit.models import llama_weights
    from decodekit.models.llama_weights import fast_numerics_unavailable

    blocks = BlockMatrix.quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), "q4_1")
    assert "a GGUF model's blocks" in fast_numerics_unavailable(None)
    monkeypatch.setattr(llama_weights, "integer_block_matmul", lambda kind: None)  # no kernel for it here
    monkeypatch.setenv("DECODEKIT_KERNELS", "0")
    assert fast_numerics_unavailable(blocks) == "it needs the compiled kernels, which DECODEKIT_KERNELS=0 turns off"
    monkeypatch.setenv("DECODEKIT_KERNELS", "1")
    assert fast_numerics_unavailable(blocks) == "it needs a CPU with AVX2 and a C compiler"
    monkeypatch.setattr(llama_weights, "integer_block_matmul", lambda kind: object())  # a kernel, whatever the machine
    assert fast_numerics_unavailable(blocks) is None
    assert fast_numerics_unavailable(blocks.take(torch.arange(8))) == "it needs projections of a multiple of 16 rows"


def test_parts_of_different_block_types_are_not_stacked_as_one_matrix():
    """Blocks of two types cannot be read as one matrix of either (Gemma's q, k in Q5_0 and v in
    Q8_0): stack declines them, and stacks parts of one type and width row after row."""
    gen = torch.Generator().manual_seed(2)
    a, b = (BlockMatrix.quantize(torch.randn(8, 64, generator=gen), kind) for kind in ("q4_1", "q8_0"))
    assert BlockMatrix.stack([a, b]) is None and BlockMatrix.stack([b, a]) is None
    c = BlockMatrix.quantize(torch.randn(4, 64, generator=gen), "q4_1")
    both = BlockMatrix.stack([a, c])
    assert both.kind == "q4_1" and torch.equal(both.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))


def test_q4_1_quantize_gives_each_weight_its_nearest_level_even_far_from_zero():
    """Q4_1 rounds each weight to the nearest of its block's 16 levels m + d q (q in 0..15) and
    saturates at the ends: a block far from zero (its float16 minimum rounded well below the true
    one) puts weights past level 15, which must clamp to 15, never spill a 16 into the next nibble."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.cat([torch.randn(2, 64, generator=gen), 100.02 + 0.01 * torch.rand(2, 64, generator=gen)])
    blocks = BlockMatrix.quantize(weight, "q4_1")
    raw = blocks.data.view(4, 2, 20)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    m = raw[..., 2:4].contiguous().view(torch.float16).float()
    levels = m + d * torch.arange(16, dtype=torch.float32)  # [rows, blocks, 16]
    w = weight.view(4, 2, 32)
    nearest = (w.unsqueeze(-1) - levels.unsqueeze(-2)).abs().argmin(-1)
    assert torch.equal(blocks.dequantize().view(4, 2, 32), levels.gather(-1, nearest))
    assert (blocks.dequantize()[2:] > 100).all()  # the far block saturated at its top level, not wrapped to 0


@pytest.mark.parametrize("kind, n_in", [("q4_1", 48), ("q8_0", 16), ("q4_k", 128), ("q6_k", 288)])
def test_blocks_of_a_width_that_is_not_whole_blocks_are_refused(kind, n_in):
    """A matrix whose width is not a whole number of its type's blocks has no block layout: both
    constructors refuse it with a ValueError, never a matrix of missing or garbled blocks."""
    gen = torch.Generator().manual_seed(0)
    if kind in ("q4_1", "q8_0"):
        with pytest.raises(ValueError, match="divisible"):
            BlockMatrix.quantize(torch.randn(4, n_in, generator=gen), kind)
    with pytest.raises(ValueError, match="divisible"):
        BlockMatrix.random(4, n_in, kind, gen)


@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q6_k"])
def test_rows_taken_back_from_the_interleaved_layout_are_the_rows_taken_from_the_matrix(kind):
    """from_interleaved walks the interleaved layout by whole blocks of the type (256 weights for
    the K-quants, not sub-blocks of 32) and, like take, accepts an index of any shape: the rows it
    returns are the matrix's own rows, [len(rows), n_in]."""
    blocks = BlockMatrix.random(8, 512, kind, torch.Generator().manual_seed(9))
    rows = torch.tensor([[7], [0], [5], [2]])
    back = BlockMatrix.from_interleaved(kind, blocks.interleaved(), rows, 512)
    taken = blocks.take(rows)
    assert back.shape == taken.shape == (4, 512) and taken.data.shape == blocks.data[:4].shape
    assert torch.equal(back.data, taken.data) and torch.equal(taken.data, blocks.data[[7, 0, 5, 2]])


def test_blocks_one_ulp_away_from_the_float32_weights_do_not_match():
    """Decoding on blocks is bit-identical only where they dequantise exactly to the float32
    weights: a single weight one ulp off is no match (a tolerance would put the model on weights
    that differ from its float32 ones)."""
    blocks = BlockMatrix.quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(10)), "q4_1")
    weight = blocks.dequantize()
    assert matching_blocks([blocks], weight, []) is not None
    nudged = weight.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(float("inf")))
    assert matching_blocks([blocks], nudged, []) is None


def test_saved_blocks_list_the_unread_weights_on_the_first_read_and_every_later_one(tmp_path):
    """The weights no kernel reads (name -> (type, number of weights)) are what the loader runs in
    float32 or refuses: reported the same when the blocks are first read from the GGUF and saved,
    and when they are read back from the saved file (whose metadata key for them is no matrix); the
    saved file's name lists every type read."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from decodekit.models.gguf_blocks import BLOCK_BYTES, UNREAD_KEY, cached_block_matrices

    assert all(kind.replace("_", "") in BLOCKS_FILE for kind in BLOCK_BYTES)
    gen = torch.Generator().manual_seed(11)
    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    v = BlockMatrix.random(8, 256, "q8_0", gen)
    writer.add_tensor("blk.0.attn_v.weight", v.data.numpy(), raw_dtype=GGMLQuantizationType.Q8_0)
    q2_k = torch.randint(0, 256, (8, 84), dtype=torch.uint8, generator=gen).numpy()
    writer.add_tensor("blk.0.ffn_gate.weight", q2_k, raw_dtype=GGMLQuantizationType.Q2_K)  # no kernel reads Q2_K
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = {"model.layers.0.mlp.gate_proj.weight": ("q2_k", 8 * 256)}
    first = cached_block_matrices(tmp_path / "tiny.gguf", tmp_path, num_layers=1)
    again = cached_block_matrices(tmp_path / "tiny.gguf", tmp_path, num_layers=1)
    assert first.unread == expected and again.unread == expected
    assert list(again) == ["model.layers.0.self_attn.v_proj.weight"] and UNREAD_KEY not in again
    assert torch.equal(again["model.layers.0.self_attn.v_proj.weight"].data, v.data)


@pytest.mark.parametrize("kind", KINDS)
def test_integer_operands_the_c_code_would_misread_are_refused(kind):
    """What gemm_q8.c relies on, checked in Python (no kernel needed): inputs exactly n_in wide and
    uint8 blocks exactly n_in / block weights * block bytes wide; other inputs or blocks of another
    dtype (the same shape, other bytes) are refused, never read past their ends."""
    from decodekit.models.kernels.matmul import _check_integer_operands

    blocks = BlockMatrix.random(16, 64, kind, torch.Generator().manual_seed(12)).data
    _check_integer_operands(kind, blocks, torch.zeros(2, 64), 64)  # as the C code reads them
    with pytest.raises(ValueError, match="inputs"):
        _check_integer_operands(kind, blocks, torch.zeros(2, 32), 64)  # inputs narrower than n_in
    with pytest.raises(ValueError, match="blocks"):
        _check_integer_operands(kind, blocks.to(torch.int8), torch.zeros(2, 64), 64)
    with pytest.raises(ValueError, match="blocks"):
        _check_integer_operands(kind, blocks.float(), torch.zeros(2, 64), 64)


@needs_fast_numerics
def test_packing_into_room_the_c_code_cannot_write_as_packed_bytes_is_refused():
    """The C code writes packed bytes row after row from the room's first byte: room of the right
    shape but another dtype (other row lengths in bytes) or other strides is refused, and left as
    it was, never written in memory order."""
    blocks = BlockMatrix.random(32, 256, "q8_0", torch.Generator().manual_seed(13))
    whole = kernels.pack_integer_blocks("q8_0", blocks.data, 256)
    for room in (torch.zeros(whole.shape, dtype=torch.int8), torch.zeros(whole.shape, dtype=torch.float32),
                 torch.zeros(whole.shape[1], whole.shape[0], dtype=torch.uint8).t()):
        before = room.clone()
        with pytest.raises(ValueError, match="do not fit"):
            kernels.pack_integer_blocks("q8_0", blocks.data, 256, into=room)
        assert torch.equal(room, before)


@needs_fast_numerics
@pytest.mark.parametrize("kind", KINDS)
def test_the_integer_reference_reads_inputs_of_any_float_dtype_as_their_values(kind):
    """Both the kernel and its scalar reference take inputs as float32 values (converted first, as
    the kernel does): bfloat16 or float64 inputs give the float32 inputs' results bit for bit, never
    their bytes read as float32."""
    blocks = BlockMatrix.random(16, 64, kind, torch.Generator().manual_seed(14))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(15)).bfloat16().float()
    expected = kernels.integer_block_matmul_reference(kind, blocks.data, x, 64)
    for other in (x.bfloat16(), x.double()):
        assert torch.equal(kernels.integer_block_matmul_reference(kind, blocks.data, other, 64), expected)
        assert torch.equal(integer_product(kind, blocks, other), integer_product(kind, blocks, x))


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_out", [6, 37])
def test_a_projection_on_blocks_of_rows_not_in_fours_multiplies_as_its_float32_weights(kind, n_out):
    """Rows interleaved in fours need a row count divisible by 4: a projection of another height
    (a vocabulary of 37 tokens) streams the blocks as stored, bit for bit its float32 weights'
    product, and its rows read back as the dequantised rows."""
    from decodekit.models.llama_weights import Projection

    gen = torch.Generator().manual_seed(n_out)
    blocks = BlockMatrix.quantize(torch.randn(n_out, 64, generator=gen), kind)
    weight = blocks.dequantize()
    on_blocks, plain = Projection(weight, None, blocks), Projection(weight)
    assert on_blocks.on_blocks
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(on_blocks(x), plain(x))
    rows = torch.tensor([n_out - 1, 0, 2])
    assert torch.equal(on_blocks.weight_rows(rows), weight[rows])


@needs_kernel
def test_a_qwen2_whose_q_k_and_v_blocks_differ_in_type_keeps_their_biases():
    """A Qwen2 GGUF file may hold v in Q8_0 beside q and k in Q4_1 (as llama.cpp's mixed
    quantisations do): the three run as separate projections, each adding its own rows of the
    q/k/v bias, giving the float32 model's logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from decodekit.models.llama_weights import LlamaConfig, SplitProjection
    from decodekit.models.tiny import as_gguf_blocks

    config = tiny_hf_config(hidden_size=64) | {"model_type": "qwen2"}
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "model_type"}))
    state = {name: t + 0.2 * torch.randn_like(t) if name.endswith("bias") else t for name, t in hf.state_dict().items()}
    state, blocks = as_gguf_blocks(state)
    for name in [n for n in state if n.endswith("v_proj.weight")]:
        blocks[name] = BlockMatrix.quantize(state[name], "q8_0")
        state[name] = blocks[name].dequantize()
    llama = LlamaConfig.from_hf(config)
    plain, on_blocks = NativeLlama(llama, state), NativeLlama(llama, state, gguf_blocks=blocks)
    assert all(isinstance(layer["qkv"], SplitProjection) for layer in on_blocks.weights.layers)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    want = plain.append(ids).logits
    assert torch.allclose(on_blocks.append(ids).logits, want, atol=1e-4)
    for i in range(3):  # decode steps: few-row passes on the blocks
        step = torch.tensor([[i + 7]])
        assert torch.allclose(on_blocks.append(step).logits, plain.append(step).logits, atol=1e-4)
