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

from ..arguments import user_path
from ..errors import CacheError, InvalidParameter

DIGEST = "crc32/16MiB"  # recorded in each manifest: a manifest made with another digest fails the check
CHUNK = 16 << 20
MANIFEST = "manifest.json"
SOURCE = "source.txt"  # in a folder entry built from a file that may change (a GGUF file): what it was built from

Build = Callable[[Path], None]  # writes an entry's content at the (temporary) path it is given


class CacheRefused(InvalidParameter):
    """A cache path that holds something decodekit did not write, outside its cache folder."""


def cache_root() -> Path:
    """``$DECODEKIT_CACHE`` (a leading ``~`` is the home folder), default ``~/.cache/decodekit`` (also
    where it is set but empty: an empty path would be the current folder)."""
    return user_path(os.environ.get("DECODEKIT_CACHE") or Path.home() / ".cache" / "decodekit")


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
    """The stamps a manifest holds, or None when it is missing, unreadable or of another digest
    (or damaged: a size of ``Infinity``, which JSON reads as a float no int holds, or lists nested
    past the parser's recursion limit, are none either)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved["digest"] != DIGEST:
            return None
        return {str(name): Stamp(int(f["size"]), str(f["digest"])) for name, f in saved["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
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


def wait_for_lock(handle: Any, mode: int, path: Path) -> None:
    """Take the lock of entry ``path`` (``fcntl.LOCK_EX`` or ``LOCK_SH``), saying in one line when
    another process holds it (building the entry, most likely) and this one waits: a wait with no
    word looks like a hang."""
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"decodekit: waiting for another process to release the cache entry {path}", file=sys.stderr)
        fcntl.flock(handle, mode)


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
        if problem is None and self.source is not None and (
                SOURCE not in stamps or (self.path / SOURCE).read_text(encoding="utf-8") != self.source):
            return "built from another version of its source"
        return problem

    @property
    def lock(self) -> Path:
        return self.path.with_name(f".{self.path.name}.lock")

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this entry's lock (released on exit, or by the system if the process dies)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock, "a") as handle:
            wait_for_lock(handle, fcntl.LOCK_EX, self.path)
            yield

    @contextmanager
    def _lock_file(self) -> Iterator[Any]:
        """This entry's lock file, open, or None where it cannot be opened (a read-only cache)."""
        try:
            handle = open(self.lock, "a")
        except OSError:
            yield None
            return
        with handle:
            yield handle

    @contextmanager
    def locked_if_free(self) -> Iterator[bool]:
        """Hold this entry's lock where no one else holds it (a builder, a reader: see
        :func:`reading`); yields whether it was taken, never waiting. A lock that cannot be opened
        (a read-only cache) counts as taken."""
        with self._lock_file() as handle:
            if handle is None:
                yield False
                return
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
                    (tmp / SOURCE).write_text(self.source, encoding="utf-8")
                names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
                (tmp / MANIFEST).write_text(manifest_text({n: Stamp.of(tmp / n) for n in names}), encoding="utf-8")
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
            tmp.write_text(text, encoding="utf-8")
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
        entry.build(lambda tmp: tmp.write_text(text, encoding="utf-8"))


# What the cache holds, and removing what has gone unused ---------------------------------------

#: Folders of the cache whose files are not entries (no manifest: written by a command, or by a
#: package's own code) but still decodekit's: trained drafters and their data, assembled model files.
DRAFTERS, MODELS = "drafters", "models"
#: How deep under the cache's root decodekit writes (``kernels/<library>``): nothing deeper is looked at,
#: so a cache variable pointed at a big folder (the home folder) is not walked whole.
DEPTH = 2


@dataclass(frozen=True)
class CachedItem:
    """One thing under :func:`cache_root`: an entry (it has a manifest decodekit wrote, and is built
    again when needed), a builder's temporary left by a crash, or another file of decodekit's
    (:data:`DRAFTERS`, :data:`MODELS`), which pruning never removes."""

    path: Path
    size: int  # bytes, the manifest's included
    used: float  # when it was last used (an entry) or written (the others), seconds since the epoch
    entry: bool  # removable: an entry or an orphan temporary
    unfinished: bool = False  # a temporary whose builder is gone


def _is_bookkeeping(name: str) -> bool:
    """A lock, a builder's temporary or a file entry's manifest: part of an entry, never one."""
    return (name.startswith(".") and (name.endswith(".lock") or name.endswith(".tmp"))) or name.endswith(".manifest.json")


def _ours(manifest: Path, names: set[str] | None = None) -> bool:
    """Whether ``manifest`` is a manifest decodekit wrote (its digest named, every file's stamp),
    listing exactly ``names`` where given: a user's ``manifest.json`` is never taken for one."""
    stamps = read_manifest(manifest)
    return stamps is not None and (names is None or set(stamps) == names)


def _temporary_of(path: Path) -> Entry | None:
    """The entry whose builder wrote temporary ``path`` (``.<name>.<random>.tmp``), or None."""
    name = path.name
    if not (name.startswith(".") and name.endswith(".tmp")) or name.count(".") < 3:
        return None
    return Entry(path.with_name(name[1:].rsplit(".", 2)[0]), folder=path.is_dir())


def cached_items(root: Path | None = None) -> list[CachedItem]:
    """What the cache at ``root`` (default :func:`cache_root`) holds: its entries, the temporaries
    crashed builders left (those whose entry's lock no one holds) and the files of :data:`DRAFTERS`
    and :data:`MODELS`. Nothing else is listed, whatever else the folder holds."""
    root = cache_root() if root is None else root
    items: list[CachedItem] = []

    def visit(folder: Path, depth: int) -> None:
        try:
            children = sorted(folder.iterdir())
        except OSError:  # not a folder, or unreadable
            return
        for path in children:
            if path.is_symlink():
                continue
            temporary = _temporary_of(path)
            if temporary is not None:
                if not temporary.lock.exists():  # decodekit's builders lock before they write: not one of theirs
                    continue
                with temporary.locked_if_free() as free:
                    if free:  # its builder is gone
                        items.append(CachedItem(path, _tree_size(path), _mtime(path), True, unfinished=True))
            elif path.is_dir():
                if _ours(path / MANIFEST):
                    items.append(CachedItem(path, _tree_size(path), _mtime(path / MANIFEST), True))
                elif depth < DEPTH:
                    visit(path, depth + 1)
            elif not _is_bookkeeping(path.name):
                manifest = Entry(path, folder=False).manifest
                if _ours(manifest, {path.name}):
                    items.append(CachedItem(path, _size(path) + _size(manifest), _mtime(manifest), True))
                elif depth == 2 and folder.name in (DRAFTERS, MODELS):
                    items.append(CachedItem(path, _size(path), _mtime(path), False))

    visit(root, 1)
    return items


def _tree_size(path: Path) -> int:
    if not path.is_dir():
        return _size(path)
    return sum(_size(Path(inside) / name) for inside, _, names in os.walk(path) for name in names)


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


class EntryRemoved(CacheError):
    """A cached entry was pruned between its check and its reading."""


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Hold a shared lock on cached entry ``path`` while its files are read, after its check passed:
    pruning, which takes the lock alone and never waits, leaves the entry in place meanwhile (a
    builder of the same entry waits). A cache that cannot be written takes no lock: nothing prunes it.
    An entry a prune removed between its check and this lock raises :class:`EntryRemoved` (the
    caller checks it again, which builds it again)."""
    with Entry(path, folder=path.is_dir())._lock_file() as handle:
        if handle is not None:
            wait_for_lock(handle, fcntl.LOCK_SH, path)
        if not path.exists():
            raise EntryRemoved(f"{path}: removed from the cache while it was being opened")
        yield


@dataclass(frozen=True)
class Pruned:
    removed: list[CachedItem]
    left: int  # unused long enough, but in use by another process or not removable (a read-only cache)


def remove_unused(days: float, root: Path | None = None, now: float | None = None) -> Pruned:
    """Remove what the cache at ``root`` holds of decodekit's that has not been used for ``days``
    days (0: all of it): entries, which are built again when needed, and temporaries that crashed
    builders left. Other files stay (a trained drafter took minutes to make), and so does an entry
    another process is building or reading (it holds the entry's lock) or used since this call began."""
    cutoff = (time.time() if now is None else now) - days * 86400
    removed, left = [], 0
    for item in cached_items(root):
        if not item.entry or item.used > cutoff:
            continue
        entry = _temporary_of(item.path) if item.unfinished else Entry(item.path, folder=item.path.is_dir())
        assert entry is not None
        with entry.locked_if_free() as free:
            if free and (item.unfinished or _mtime(entry.manifest) <= cutoff):
                paths = [item.path] if item.unfinished else [entry.path, entry.manifest]
                for path in paths:
                    _remove(path)
                if not any(path.exists() for path in paths):
                    removed.append(item)
                    continue
            left += 1
    return Pruned(removed, left)
