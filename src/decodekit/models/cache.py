"""Where decodekit keeps what it builds once, and how a cached file earns trust again.

Everything decodekit caches is an *entry* under :func:`cache_root`: a folder (a GGUF model
dequantised to float safetensors, with its config and tokenizer files) or a single file (the
saved GGUF blocks, a compiled kernel, the controller's cost table). An entry is:

* **built aside and renamed into place**: written to a temporary path unique to the builder
  (``.<name>.<random>.tmp`` beside the entry), then ``os.replace``-d, so a half-written entry
  is never read;
* **described by a manifest**: each file's size and digest (``manifest.json`` inside a folder
  entry, ``<name>.manifest.json`` beside a file entry);
* **checked before every use**: a missing manifest or file, a size or a digest that differs,
  is reported in one line on stderr and the entry is rebuilt;
* **built by one process at a time**: builders hold ``fcntl.flock`` on ``.<name>.lock`` beside
  the entry and check again once they hold it, so concurrent first loads build it once; the
  lock holder also removes temporaries that a crashed builder left behind.

The digest is CRC-32 over each 16 MiB chunk (chunks hashed on threads: ``zlib.crc32`` releases
the GIL), folded into one value. It catches accidents, which is what a cache meets: a CRC-32
detects every change confined to 32 consecutive bits (any single changed byte) and misses other
changes of a chunk with probability 2^-32. A cryptographic hash would add nothing against
tampering (whoever can write the cache can rewrite its manifest) and costs several times more
at every load of the float weights (measured in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidParameter

DIGEST = "crc32/16MiB"  # recorded in each manifest: a manifest made with another digest fails the check
CHUNK = 16 << 20
MANIFEST = "manifest.json"
SOURCE = "source.txt"  # in a folder entry built from a file that may change (a GGUF file): what it was built from

Build = Callable[[Path], None]  # writes an entry's content at the (temporary) path it is given


class CacheRefused(InvalidParameter):
    """A cache path that holds something decodekit did not write, outside its cache folder."""


def cache_root() -> Path:
    """``$DECODEKIT_CACHE``, default ``~/.cache/decodekit`` (also where it is set but empty: an
    empty path would be the current folder)."""
    return Path(os.environ.get("DECODEKIT_CACHE") or Path.home() / ".cache" / "decodekit")


# Digests ----------------------------------------------------------------------------------------


def save_tensors(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, a failure to write (a full disk among them) raised as the
    OSError any other write gives (safetensors raises its own error type)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        raise OSError(f"{path}: {err}") from err


def file_digest(path: Path) -> str:
    """The digest of a file's bytes (see the module docstring). Read a chunk at a time, the CRCs
    computed on a second thread while the next chunk is read: the memory it takes is a few chunks,
    not the file (a memory map would count the whole file in the process's resident memory)."""
    crcs, pending = [], []
    with open(path, "rb") as handle, ThreadPoolExecutor(2) as pool:  # buffered: read(n) gives n bytes until the end
        while chunk := handle.read(CHUNK):
            pending.append(pool.submit(zlib.crc32, chunk))  # zlib releases the GIL on big buffers
            if len(pending) > 2:
                crcs.append(pending.pop(0).result())
        crcs += [job.result() for job in pending]
    return _fold(crcs)


def _fold(crcs: list[int]) -> str:
    return hashlib.blake2b(b"".join(c.to_bytes(4, "big") for c in crcs), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Stamp:
    """What a manifest records of one file."""

    size: int
    digest: str

    @classmethod
    def of(cls, path: Path) -> "Stamp":
        return cls(path.stat().st_size, file_digest(path))


def manifest_text(stamps: dict[str, Stamp]) -> str:
    files = {name: {"size": s.size, "digest": s.digest} for name, s in sorted(stamps.items())}
    return json.dumps({"digest": DIGEST, "files": files}, indent=1)


def read_manifest(path: Path) -> dict[str, Stamp] | None:
    """The stamps a manifest holds, or None when it is missing, unreadable or of another digest."""
    try:
        saved = json.loads(path.read_text())
        if saved["digest"] != DIGEST:
            return None
        return {str(name): Stamp(int(f["size"]), str(f["digest"])) for name, f in saved["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def problem_with(base: Path, stamps: dict[str, Stamp]) -> str | None:
    """Why the files under ``base`` do not match ``stamps`` (the first difference), or None.
    Sizes are compared before any digest is computed: a truncated file costs a ``stat``."""
    for name, stamp in stamps.items():
        try:
            size = (base / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != stamp.size:
            return f"{name} is {size} bytes, its manifest says {stamp.size}"
    for name, stamp in stamps.items():
        try:
            if file_digest(base / name) != stamp.digest:
                return f"{name} has changed since it was written"
        except OSError as err:
            return f"{name} cannot be read ({err.strerror or err})"
    return None


def report(path: Path, problem: str) -> None:
    """The one line a damaged entry costs the user."""
    print(f"decodekit: cache {path} failed its check ({problem}); rebuilding it", file=sys.stderr)


# Entries ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A cached file or folder at ``path`` with its manifest, lock and temporaries."""

    path: Path
    folder: bool
    source: str | None = None  # a folder's: what it was built from (say, a file's size and time), kept in SOURCE

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST if self.folder else self.path.with_name(self.path.name + ".manifest.json")

    def exists(self) -> bool:
        return self.path.exists() or self.path.is_symlink()

    def check(self) -> str | None:
        """Why this entry cannot be used as it is (missing, damaged), or None."""
        if not self.exists():
            return "missing"
        if self.path.is_dir() != self.folder:
            return "a folder where a file belongs" if self.path.is_dir() else "a file where a folder belongs"
        stamps = read_manifest(self.manifest)
        if stamps is None or (not self.folder and set(stamps) != {self.path.name}):
            return "no valid manifest"
        problem = problem_with(self.path if self.folder else self.path.parent, stamps)
        if problem is None and self.source is not None and (SOURCE not in stamps or
                                                            (self.path / SOURCE).read_text() != self.source):
            return "built from another version of its source"
        return problem

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this entry's lock (released on exit, or by the system if the process dies)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    @contextmanager
    def locked_if_free(self) -> Iterator[bool]:
        """Hold this entry's lock where no one else holds it; yields whether it was taken (a
        builder at work is never waited for, nor disturbed)."""
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True

    def mark_used(self) -> None:
        """Record a use of the entry: its manifest's modification time, which :func:`remove_unused`
        weighs. Best effort: a cache that cannot be written is still read."""
        try:
            os.utime(self.manifest)
        except OSError:
            pass

    def settle(self) -> bool:
        """With the lock held: whether the entry checks out. When it does not, report it (unless
        it was never built: no file, no manifest) and clear it away with any orphan temporaries."""
        problem = self.check()
        if problem is None:
            return True
        if self.exists() and not self.manifest.exists() and not _inside(self.path, cache_root()):
            # a path outside the cache (a variable such as DECODEKIT_COST_TABLE names it) holding
            # something decodekit never wrote: the user's, never cleared away
            raise CacheRefused(f"{self.path} is {'a folder' if self.path.is_dir() else 'a file'} decodekit did not "
                               f"write; give a path of its own (a new file) or remove it")
        if self.exists() or self.manifest.exists():
            report(self.path, problem)
        for path in [self.path, self.manifest, *self._temporaries()]:
            _remove(path)
        return False

    def build(self, build: Build) -> None:
        """With the lock held: build the entry aside with ``build`` and move it into place."""
        tmp = self._new_temporary()
        try:
            build(tmp)
            if self.folder:
                if self.source is not None:
                    (tmp / SOURCE).write_text(self.source)
                names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
                (tmp / MANIFEST).write_text(manifest_text({n: Stamp.of(tmp / n) for n in names}))
                os.replace(tmp, self.path)
            else:
                stamp = Stamp.of(tmp)
                os.replace(tmp, self.path)
                # written second: a reader that sees the new file before its manifest takes the
                # lock, waits for this builder and checks again
                self._write_aside(self.manifest, manifest_text({self.path.name: stamp}))
        finally:
            _remove(tmp)

    def _new_temporary(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prefix, suffix, where = f".{self.path.name}.", ".tmp", self.path.parent
        if self.folder:
            return Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=where))
        handle, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=where)
        os.close(handle)
        return Path(name)

    def _write_aside(self, path: Path, text: str) -> None:
        """Write ``path`` (a file entry's manifest) as the entry itself is written: aside, then renamed."""
        tmp = self._new_temporary()
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            _remove(tmp)

    def _temporaries(self) -> list[Path]:
        """Temporaries of this entry's builders (only ever orphans while the lock is held), and
        the single ``<name>.tmp`` that versions before the lock used."""
        name = self.path.name
        try:
            siblings = list(self.path.parent.iterdir())
        except OSError:
            return []
        return [p for p in siblings if (p.name.startswith(f".{name}.") and p.name.endswith(".tmp")) or p.name == f"{name}.tmp"]


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _ensure(entry: Entry, build: Build) -> Path:
    if entry.check() is None:  # the common case: no lock taken
        entry.mark_used()
        return entry.path
    with entry.locked():
        if not entry.settle():  # checked again: another process may have built it meanwhile
            entry.build(build)
    return entry.path


def cached_folder(path: Path, build: Build, source: str | None = None) -> Path:
    """``path``, a cached folder that checks out: built by ``build(temporary folder)`` when it is
    missing or damaged, or, with ``source``, built from another source (then rebuilt in place, so
    a source file that changes never leaves old folders behind). Raises OSError where the cache
    cannot be written."""
    return _ensure(Entry(path, folder=True, source=source), build)


def cached_file(path: Path, build: Build) -> Path:
    """``path``, a cached file that checks out: built by ``build(temporary path)`` when it is
    missing or damaged. Raises OSError where the cache cannot be written."""
    return _ensure(Entry(path, folder=False), build)


def read_json(path: Path) -> Any | None:
    """The JSON value cached at ``path``, or None when there is none or it is damaged (then
    reported and cleared, so the caller's next :func:`update_json` starts afresh)."""
    entry = Entry(path, folder=False)
    if not entry.exists():
        return None
    try:
        if entry.check() is not None:  # damaged, or its writer is between the file and its manifest
            with entry.locked():
                if not entry.settle():
                    return None
        entry.mark_used()
        return json.loads(path.read_bytes())
    except CacheRefused:
        raise
    except (OSError, ValueError):  # an unwritable cache or an unreadable file: no value
        return None


def update_json(path: Path, update: Callable[[Any | None], Any]) -> None:
    """Replace the JSON value at ``path`` by ``update(current value or None)``, under the entry's
    lock so that concurrent updates from several processes all land. Raises OSError where the
    cache cannot be written."""
    entry = Entry(path, folder=False)
    with entry.locked():
        current = None
        if entry.settle():
            try:
                current = json.loads(path.read_bytes())
            except ValueError:
                current = None
        text = json.dumps(update(current), indent=1, sort_keys=True)
        entry.build(lambda tmp: tmp.write_text(text))


# What the cache holds, and removing what has gone unused ---------------------------------------


@dataclass(frozen=True)
class CachedItem:
    """One thing under :func:`cache_root`: an entry (it has a manifest, and decodekit builds it
    again by itself when it is gone) or another file (a trained drafter, its training data, an
    assembled model file: written by a command, or by a package's own code)."""

    path: Path
    size: int  # bytes, the manifest's included
    used: float  # when it was last used (an entry) or written (another file), seconds since the epoch
    entry: bool


def _is_bookkeeping(name: str) -> bool:
    """A lock, a builder's temporary or a file entry's manifest: part of an entry, never one."""
    return (name.startswith(".") and (name.endswith(".lock") or name.endswith(".tmp"))) or name.endswith(".manifest.json")


def cached_items(root: Path | None = None) -> list[CachedItem]:
    """Everything the cache at ``root`` (default :func:`cache_root`) holds, entries and other files."""
    root = cache_root() if root is None else root
    items = []
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        if here != root and MANIFEST in files:  # a folder entry: itself one item
            subfolders.clear()
            size = sum(_size(Path(inside) / name) for inside, _, names in os.walk(here) for name in names)
            items.append(CachedItem(here, size, _mtime(here / MANIFEST), True))
            continue
        subfolders[:] = [name for name in subfolders if not _is_bookkeeping(name)]
        for name in files:
            path = here / name
            if _is_bookkeeping(name) or path.is_symlink():
                continue
            manifest = Entry(path, folder=False).manifest
            if manifest.exists():
                items.append(CachedItem(path, _size(path) + _size(manifest), _mtime(manifest), True))
            else:
                items.append(CachedItem(path, _size(path), _mtime(path), False))
    return items


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone meanwhile
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def remove_unused(days: float, root: Path | None = None, now: float | None = None) -> list[CachedItem]:
    """Remove the entries of the cache at ``root`` not used for ``days`` days (0: every entry), and
    return them. Only entries go, which decodekit builds again when it needs them; other files stay
    (a trained drafter took minutes to make). An entry whose lock another process holds (a build
    under way) is left, and so is one used since it was listed."""
    cutoff = (time.time() if now is None else now) - days * 86400
    removed = []
    for item in cached_items(root):
        if not item.entry or item.used > cutoff:
            continue
        entry = Entry(item.path, folder=item.path.is_dir())
        with entry.locked_if_free() as held:
            if held and _mtime(entry.manifest) <= cutoff:
                for path in [entry.path, entry.manifest]:
                    _remove(path)
                removed.append(item)
    return removed
