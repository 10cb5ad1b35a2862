"""``decodekit eval``: tasks (gsm8k, capitals, structured), accuracy with Wilson intervals,
uncertainty AUROCs; and ``longctx`` (:mod:`.longctx`), which compares KV-cache policies on long
inputs instead of scoring a method. The names below are imported on first use (:mod:`decodekit.exports`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

_EXPORTS = {
    "auroc": ".metrics", "reliability_bins": ".metrics", "wilson_interval": ".metrics",
    "EvalConfig": ".runner", "evaluate": ".runner",
    "Item": ".tasks", "Task": ".tasks", "load_task": ".tasks", "register_task": ".tasks",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .metrics import auroc, reliability_bins, wilson_interval
    from .runner import EvalConfig, evaluate
    from .tasks import Item, Task, load_task, register_task
