"""``decodekit eval``: tasks (gsm8k, capitals), accuracy with Wilson intervals, uncertainty AUROCs."""

from .metrics import auroc, reliability_bins, wilson_interval
from .runner import EvalConfig, evaluate
from .tasks import Item, Task, load_task, register_task

__all__ = ["EvalConfig", "Item", "Task", "auroc", "evaluate", "load_task", "register_task", "reliability_bins", "wilson_interval"]
