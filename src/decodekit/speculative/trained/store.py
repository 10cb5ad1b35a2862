"""Where trained drafters live, and the check that a drafter belongs to its target.

A drafter file is safetensors (float16 weights) with metadata: its kind, network config, the
fingerprint of the target it was trained on, how it was trained, and a digest of all of these and
the weights (:func:`drafter_digest`): a file whose weights or metadata changed is refused as
damaged. The fingerprint is a hash of the target's weight files' digests (the GGUF file where the
model came from one), or, for a model built in memory, of its output head. A drafter whose fingerprint differs from the target's is
refused in one line: it would still be lossless, but it would draft for another model.

Lookup for ``--method eagle`` / ``medusa`` / ``hydra``: the ``drafter=`` option's file, else the one
``decodekit train-drafter`` saved in ``$DECODEKIT_CACHE/drafters``, else one shipped in the package
(``decodekit/data/drafters``, the embedded model's). A damaged file in the cache is said so in one
line and the shipped drafter is used instead, where there is one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ...arguments import existing_file, user_path
from ...errors import InvalidModel, InvalidParameter
from ...models.backend import Backend
from ...models.cache import cache_root, file_digest, save_tensors
from .networks import NETWORKS, Net, on_kernels

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "drafters"  # decodekit/data/drafters
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what a drafter's weights may be stored in


def target_fingerprint(backend: Backend) -> str:
    """A hash of the target's weights (see the module docstring), computed once per model: once per
    weight file as it stands (its size and modification time), whichever clone of the model asks
    (a server's slots each ask on their first request, on the thread that runs every pass)."""

    def compute() -> str:
        if backend.weights_files:
            stamps = []
            for path in backend.weights_files:
                stat = Path(path).stat()
                stamps.append((str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))
            return _files_fingerprint(tuple(stamps))
        # a model made in memory: its sizes and its output head (two models sharing a head, a
        # truncated one say, differ in their sizes at least)
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(sorted(vars(getattr(backend, "config", backend.info)).items())).encode())
        h.update(backend.head_rows(torch.arange(backend.info.vocab_size)).numpy().tobytes())
        return h.hexdigest()

    return backend.memory("drafter.fingerprint", compute)


@functools.lru_cache(maxsize=8)
def _files_fingerprint(stamps: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for path, _, _ in stamps:
        h.update(file_digest(Path(path)).encode())
    return h.hexdigest()


def cache_path(backend: Backend, kind: str) -> Path:
    """Where ``train-drafter`` saves a drafter of ``kind`` for this target."""
    return cache_root() / "drafters" / f"{target_fingerprint(backend)}-{kind}.safetensors"


def check_drafter_path(path: Path, given: str | Path | None = None) -> Path:
    """``path`` must name a drafter's file: not a folder (a name ending in ``/`` included), and not
    something else that exists there (a device such as ``/dev/null``, a pipe), which saving it, a
    new file renamed over the name, would replace. ``given``: the path as the user wrote it."""
    shown = str(given if given is not None else path)
    if not path.name or shown.endswith(("/", "\\")) or path.is_dir():
        raise InvalidParameter(f"--out {shown!r} must name the drafter's file, not a folder")
    if path.exists() and not path.is_file():
        raise InvalidParameter(f"--out {shown!r} is not a regular file (a device or a pipe): give a file's path")
    return path


def save(net: Net, kind: str, backend: Backend, path: Path, trained: dict[str, Any]) -> Path:
    """Write ``net`` (float16, without the target's head rows) with its metadata to ``path``."""
    check_drafter_path(path)
    state = {name: (t.half() if t.is_floating_point() else t).contiguous() for name, t in net.state_dict().items()}
    meta = {"kind": kind, "config": json.dumps(net.config.__dict__), "target": target_fingerprint(backend),
            "target_name": backend.info.name, "trained": json.dumps(trained)}
    meta["digest"] = drafter_digest(state, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    try:
        save_tensors(state, temporary, metadata=meta)
        temporary.replace(path)  # never a half-written drafter under the real name
    finally:
        temporary.unlink(missing_ok=True)  # nothing left behind where it failed
    return path


def drafter_digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """The digest a drafter file is saved with: a hash of every metadata entry but the digest itself
    (the kind, the config that shapes the network, the target record, how it was trained) as
    canonical JSON, and of the tensors' names, shapes and bytes. A damaged body, or an edited header
    that would build another network from the same weights, is detected, not trusted."""
    described = {key: value for key, value in meta.items() if key != "digest"}
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(described, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # (a scalar too)
    return h.hexdigest()


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A drafter file's tensors and metadata; a damaged or foreign file is one line."""
    from safetensors import safe_open

    existing_file(path, "drafter", param="drafter")  # (safetensors would say "No such device" of a folder)
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except FileNotFoundError:
        raise InvalidParameter(f"drafter file {path} not found") from None
    except Exception as err:  # safetensors raises several types for a damaged header or body
        raise InvalidModel.because(path, "cannot be read as a drafter file", err) from err
    if meta.get("kind") not in NETWORKS or "config" not in meta or "target" not in meta:
        raise InvalidModel(f"{path}: not a decodekit drafter (its metadata has no kind, config and target)")
    if meta.get("digest") != drafter_digest(tensors, meta):
        raise InvalidModel(f"{path}: damaged (its weights or metadata do not match the digest it was saved with)")
    return tensors, meta


def _target_of(path: Path) -> str | None:
    """The target fingerprint a drafter file's header names (its weights are not read), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("target")
    except Exception:  # not a readable drafter file: not this target's
        return None


def build(path: Path, kind: str, backend: Backend) -> Net:
    """The drafter in ``path``, checked against ``kind`` and the target, attached to its head rows."""
    tensors, meta = read(path)
    if meta["kind"] != kind:
        raise InvalidParameter(f"{path} holds a {meta['kind']} drafter, not a {kind} drafter")
    if meta["target"] != target_fingerprint(backend):
        raise InvalidParameter(
            f"{path}: this {kind} drafter was trained for another model ({meta.get('target_name', '?')}), "
            f"not {backend.info.name}; train one with: decodekit train-drafter --kind {kind} --model MODEL")
    for name, t in tensors.items():  # float weights as save() writes them, and finite; integer token ids
        floating = name != "head.vocab"
        if floating and (t.dtype not in WEIGHT_DTYPES or not bool(torch.isfinite(t).all())):
            raise InvalidModel(f"{path}: does not hold a valid {kind} drafter ({name} must hold finite float16, "
                               f"bfloat16 or float32 values)")
        if not floating and t.dtype not in (torch.int32, torch.int64):  # (a bool or a byte is no token id)
            raise InvalidModel(f"{path}: does not hold a valid {kind} drafter (its head.vocab is not a list of token ids)")
    net_class, config_class = NETWORKS[kind]
    try:
        config = config_class(**json.loads(meta["config"]))
        with torch.device("meta"):  # the config's sizes, nothing allocated: a damaged one could ask for terabytes
            wanted = sum(t.numel() for t in net_class(config, tensors["head.vocab"]).parameters())
        if wanted > sum(t.numel() for t in tensors.values()):
            raise InvalidModel(f"{path}: does not hold a valid {kind} drafter (its config asks for {wanted} weights, "
                               f"more than the file holds)")
        net = net_class(config, tensors["head.vocab"])
        net.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in tensors.items()})
    except InvalidModel:  # (a ValueError too) said already
        raise
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):  # the details are below it
            raise InvalidModel(f"{path}: does not hold a valid {kind} drafter ({lines[1]})") from err
        raise InvalidModel.because(path, f"does not hold a valid {kind} drafter", err) from err
    vocab = net.head.vocab
    # the draft head's token ids, each once (a repeated id would be proposed twice among siblings)
    if vocab.dim() != 1 or not vocab.numel() or int(vocab.min()) < 0 or vocab.unique().numel() != vocab.numel():
        raise InvalidModel(f"{path}: does not hold a valid {kind} drafter (its head.vocab is not a list of distinct "
                           "token ids)")
    if config.hidden != backend.info.hidden_size or int(vocab.max()) >= backend.info.vocab_size:
        raise InvalidParameter(f"{path}: the {kind} drafter does not fit {backend.info.name}'s sizes")
    net.head.attach(backend.head_rows(net.head.vocab))
    return on_kernels(net.eval().requires_grad_(False), backend.matrix)


def shipped(backend: Backend, kind: str) -> Path | None:
    """The drafter of ``kind`` the package ships for this target, if any (its header read only)."""
    fingerprint = target_fingerprint(backend)
    for path in sorted(SHIPPED.glob(f"*-{kind}.safetensors")):
        if _target_of(path) == fingerprint:
            return path  # read in full, and its digest checked, when it is built
    return None


def load(backend: Backend, kind: str, given: str | Path | None = None) -> Net:
    """The target's drafter of ``kind`` (see the module docstring), loaded once per model (kept in
    the backend's memory), or one line saying how to make one. A damaged drafter in the cache, or
    one trained for another model, is said so in one line and the shipped one is used, where there is one."""
    def as_it_stands(path: Path) -> tuple:
        # one entry per file however it is spelt and as it stands (a drafter trained again in this
        # process, or by another, is read again)
        stat = path.stat() if path.exists() else None
        return str(path.resolve()), None if stat is None else (stat.st_size, stat.st_mtime_ns)

    def built(path: Path) -> Net:  # (a few files at most: requests may name others)
        return backend.memory(("drafter.net", kind, *as_it_stands(path)), lambda: build(path, kind, backend), keep=4)

    if given is not None:
        return built(user_path(given))
    saved = cache_path(backend, kind)
    problem, new_problem = None, False
    if saved.exists():
        # a damaged file is read, and said, once as it stands: not at every request (a server's)
        damaged: dict[tuple, str] = backend.memory(("drafter.damaged", kind), dict)
        stamp = as_it_stands(saved)
        if stamp not in damaged:
            try:
                return built(saved)
            except (InvalidModel, InvalidParameter) as err:  # damaged, or another model's (its file replaced since)
                damaged[stamp], new_problem = str(err), True
        problem = damaged[stamp]
    fallback = shipped(backend, kind)
    if problem is not None and fallback is None:
        raise InvalidModel(problem)
    if new_problem:
        print(f"decodekit: {problem}; using the drafter shipped with decodekit instead", file=sys.stderr)
    if fallback is not None:
        return built(fallback)
    raise InvalidParameter(
        f"no {kind} drafter for {backend.info.name}; train one with: decodekit train-drafter --kind {kind} "
        f"--model MODEL (or give drafter=PATH)")
