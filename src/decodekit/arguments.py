"""Command-line pieces shared by every subcommand (``decodekit``, ``bench``, ``eval``): the
parser class, the model flags, the check of an ``--out`` folder and the writing of the files there. Below the features so that bench and eval need not import the
top-level CLI; the ``--opt key=value`` parser is :func:`decodekit.options.parse_option`."""

from __future__ import annotations

import argparse
import os
import re
import secrets
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import InvalidParameter
from .options import check_int


def user_path(spec: str | os.PathLike) -> Path:
    """A path the user gave, a leading ``~`` or ``~user`` read as that home folder; ``~nouser/x`` stays
    as it is, as a shell leaves it (pathlib's ``expanduser`` raises RuntimeError on it)."""
    return Path(os.path.expanduser(spec))


#: A negative number in any notation a float takes: argparse before Python 3.13 reads only -1 and -1.5
#: as numbers, and takes -3e38 or -inf for a flag ("expected one argument").
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise InvalidParameter, so that they reach the user as the same
    one line (``decodekit: error: ...``, exit code 2) as every other bad input; a negative number
    in any notation is a value (:data:`NEGATIVE_NUMBER`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InvalidParameter(f"{message} (see {self.prog} --help)")


def flags_given(args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None],
                positional: Sequence[str] = ()) -> list[str]:
    """The names of ``args``' flags that differ from their defaults under ``add_arguments`` (a
    flag left at its default counts as not given), for refusing flags where they would be ignored.
    ``positional``: the command's positional arguments, which its defaults need."""
    parser = ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args(list(positional)))
    return [name for name, default in defaults.items() if getattr(args, name, default) != default]


def check_argv(argv: list[str]) -> None:
    """Arguments must be text: bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            try:
                shown = repr(os.fsencode(arg))  # the bytes as given
            except UnicodeEncodeError:
                shown = ascii(arg)
            raise InvalidParameter(f"argument {shown} is not valid UTF-8") from None


def named(value: str) -> str:
    """An argument that names something (a model, an output folder): not empty."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty")
    return value


#: What a model is loaded with (``models.load_model``'s backend, dtype and numerics): the one list of
#: each, here below the models layer so that the flags need no torch.
#: The embedded model a command runs without --model.
DEFAULT_MODEL = "smollm2-135m"
BACKENDS = ("auto", "native", "hf")
DTYPES = ("float32", "bfloat16")
NUMERICS = ("exact", "fast")


def add_numerics_arguments(parser: argparse.ArgumentParser, numerics: str | None = "exact") -> None:
    """``--dtype`` and ``--numerics``, whose default is ``numerics`` ("exact", or None where the
    command chooses: fast where the model and the CPU allow it, else exact)."""
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and compute dtype")
    exact, fast = ("exact: float32, identical to the dequantised model",
                   "fast: 8-bit inputs and integer dot products on the GGUF blocks")
    help = (f"{exact} (default); {fast}" if numerics == "exact"
            else f"{fast} (default where this model and CPU allow it); {exact} (default otherwise)")
    parser.add_argument("--numerics", default=numerics, choices=NUMERICS, help=help)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, type=named,
                        help=f"embedded model name, HF model folder or .gguf file (default: {DEFAULT_MODEL})")


def add_model_arguments(parser: argparse.ArgumentParser, numerics: str | None = "exact") -> None:
    """``--model``, ``--backend``, ``--dtype``, ``--numerics`` (see :func:`add_numerics_arguments`)
    and ``--kv-cache``."""
    add_model_argument(parser)
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="model backend (default: native for Llama-family)")
    add_numerics_arguments(parser, numerics)
    parser.add_argument(
        "--kv-cache", default="full", metavar="POLICY",
        help="which keys and values to keep: full (default), int8, int4 and int2 (KIVI), sink:S,window:W (StreamingLLM), h2o:budget=B,window=W, "
             "snapkv:budget=B,window=O (see decodekit methods)",
    )


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]`` and ``--workers``: run the units of a sweep on a Ray cluster (:mod:`decodekit.cluster`)."""
    parser.add_argument(
        "--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="run on a Ray cluster: alone, a local instance on this machine's cores; 'auto', the cluster this machine "
             "joined with 'ray start'; or the cluster's address (needs: pip install 'decodekit[ray]')",
    )
    parser.add_argument("--workers", type=int, default=None,
                        help="with --ray: worker processes, each loading the model once (default: the cluster's CPUs / threads per worker)")


def check_ray_arguments(ray: str | None, workers: int | None) -> None:
    """``--workers`` a positive count and only with ``--ray``; with ``--ray``, Ray installed (its
    one-line install hint otherwise): checked before anything loads."""
    if workers is not None:
        check_int("--workers", workers)
    if workers is not None and ray is None:
        raise InvalidParameter("--workers needs --ray")
    if ray is not None:
        from .cluster import import_ray

        import_ray()


def existing_file(path: Path, what: str, missing: str = "not found", param: str | None = None) -> Path:
    """``path`` if it is a file; else one line naming ``what`` it should be: a folder given for it is
    said to be one (not "not found"), anything else gets ``missing``. ``param``: the option it
    came in, for the error (a server request's field)."""
    if path.is_dir():
        raise InvalidParameter(f"{what} {str(path)!r} is a folder: give a file", param=param)
    if not path.is_file():
        raise InvalidParameter(f"{what} {str(path)!r} {missing}", param=param)
    return path


def check_writable(out: Path, files: Sequence[str] = (), given: Path | None = None) -> None:
    """``--out`` must be a folder this process can write, or one it can create: checked before
    the model loads, leaving nothing behind. A folder is made and removed where the first part of
    the path that exists is: permissions alone do not tell (root may write anywhere, but not in
    ``/proc``). ``files``: what the command writes there; none of them may already be a folder.
    ``given``: the path the user gave, where ``out`` is derived from it (a file's folder)."""
    shown = str(given if given is not None else out)
    taken = next((name for name in files if (out / name).exists() and not (out / name).is_file()), None)
    if taken is not None:
        raise InvalidParameter(f"--out {shown!r}: {out / taken} is in the way of the file this command writes there "
                               "(it is not a file)")
    existing = out.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InvalidParameter(f"--out {shown!r} is not a writable folder ({existing} is not a folder)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".decodekit-out-", dir=existing))
    except OSError as err:
        raise InvalidParameter(f"--out {shown!r} is not a writable folder (no folder can be made in {existing}: "
                               f"{err.strerror or err})") from None


def replace_file(path: Path, fill: Callable[[Path], object]) -> Path:
    """Write ``path`` whole or not at all: ``fill`` writes a temporary file beside it (hidden, with
    ``path``'s suffix, which a plot's writer reads its format from), and one rename puts it in
    ``path``'s place. A run stopped while writing (Ctrl-C, a full disk, a writer's error) leaves the
    previous file, or none, never half of one; the temporary is removed, except after a kill that
    gives no chance (then it is a ``.<name>.<random>.tmp<suffix>`` file beside ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _new_file_beside(path)
    try:
        fill(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def replace_text(path: Path, text: str) -> Path:
    """:func:`replace_file` with ``text`` in UTF-8 (a report, a results file)."""
    return replace_file(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def save_figure(fig, path: Path, **savefig) -> Path:
    """Write a matplotlib figure to ``path`` whole (:func:`replace_file`) and close it, written or
    not (pyplot keeps every open figure). ``savefig``: the options of ``Figure.savefig``."""
    import matplotlib.pyplot as plt  # (the caller made the figure: matplotlib is loaded already)

    try:
        return replace_file(path, lambda temporary: fig.savefig(temporary, **savefig))
    finally:
        plt.close(fig)


def _new_file_beside(path: Path) -> Path:
    """An empty, new, hidden file in ``path``'s folder, made with the permissions the user's umask
    gives a new file (``tempfile.mkstemp`` makes it private, and the rename would keep that)."""
    while True:  # (a name already taken is tried again under another: 2^-32 a try)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp{path.suffix}")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return temporary
        except FileExistsError:
            continue
