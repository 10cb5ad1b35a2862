"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""


class DecodeKitError(Exception):
    """Base class for every error decodekit raises on purpose."""


class InvalidParameter(DecodeKitError, ValueError):
    """A user-supplied option has a value the algorithm cannot use. ``param``: the option or field
    at fault where the message does not start with its name (a server reports it)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class NumericsUnavailable(InvalidParameter):
    """The numerics asked for cannot run this model here (``fast`` on the HF backend, in bfloat16,
    without the compiled kernels): what ``decodekit serve`` falls back to ``exact`` on, and only that."""


class RollbackRefused(InvalidParameter):
    """A cache asked to roll back past what its policy kept (an evicting or int4 cache holds only the
    last ``recent`` tokens as they were): callers that roll back limit themselves to that reach."""


class UnknownMethod(DecodeKitError, KeyError):
    """A method, drafter, task or baseline name that decodekit does not know. ``param``: the option
    or field that named it (a server reports it)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelNotFound(DecodeKitError, FileNotFoundError):
    """The model path or name does not resolve to loadable weights."""


class InvalidModel(DecodeKitError, ValueError):
    """The model's files are there but cannot be read as a model (damaged or incomplete)."""

    @classmethod
    def because(cls, path: object, problem: str, err: BaseException) -> "InvalidModel":
        """``path: problem (cause)``, the cause being the first line of a loader's own error."""
        return cls(f"{path}: {problem} ({cause_line(err)})")


class CacheError(DecodeKitError, OSError):
    """decodekit's cache folder (``DECODEKIT_CACHE``) cannot be written."""


class PromptTooLong(DecodeKitError, ValueError):
    """The prompt (plus the requested new tokens) does not fit the model's context."""


class ClusterError(DecodeKitError, RuntimeError):
    """A Ray cluster could not be started or joined, or lost more workers than a run tolerates."""


def cause_line(err: BaseException) -> str:
    """Another library's error as one line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
