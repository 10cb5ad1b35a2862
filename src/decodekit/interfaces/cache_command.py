"""``decodekit cache``: what decodekit keeps on disk, and removing what has gone unused.

The cache (``$DECODEKIT_CACHE``, default ``~/.cache/decodekit``) grows with use: a dequantised
folder per model file (hundreds of megabytes each), compiled kernels per version of their sources,
the speculative controller's cost table, trained drafters. ``--prune DAYS`` removes the entries not
used for that many days (``--prune 0``: every entry); each one is built again the next time it is
needed. Other files (trained drafters and their data, written by ``train-drafter``) are listed,
never removed here.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from ..errors import InvalidParameter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prune", type=float, metavar="DAYS", default=None,
                   help="remove the entries not used for DAYS days (0: all of them); they are built again when needed")
    p.add_argument("--json", action="store_true", help="print one JSON object: every item, and what was removed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models.cache import cache_root, cached_items, remove_unused

    if args.prune is not None and not args.prune >= 0:  # not NaN either
        raise InvalidParameter(f"--prune takes a number of days >= 0, got {args.prune:g}")
    root = cache_root()
    removed = remove_unused(args.prune, root) if args.prune is not None else []
    items = cached_items(root) if root.is_dir() else []
    now = time.time()
    if args.json:
        def listed(item) -> dict:
            return {"path": str(item.path.relative_to(root)), "bytes": item.size, "days_unused": round((now - item.used) / 86400, 2),
                    "rebuilt_when_needed": item.entry}
        print(json.dumps({"root": str(root), "bytes": sum(i.size for i in items), "items": [listed(i) for i in items],
                          "removed": [listed(i) for i in removed]}, indent=1))
        return 0
    if args.prune is not None:
        print(f"removed {len(removed)} entries not used for {args.prune:g} days: {_size(sum(i.size for i in removed))}")
    print(f"{root}: {_size(sum(i.size for i in items))} in {len(items)} items")
    # one line per item at the top of the cache, one per folder of many (the kernels: one library
    # per version of each source)
    groups: dict[Path, list] = defaultdict(list)
    for item in items:
        top = root / item.path.relative_to(root).parts[0]
        groups[top].append(item)
    for top, members in sorted(groups.items(), key=lambda kv: -sum(i.size for i in kv[1])):
        size, last = sum(i.size for i in members), max(i.used for i in members)
        kept = "" if all(i.entry for i in members) else "  (not removed by --prune)"
        name = top.name + ("/" if top.is_dir() else "")
        count = "" if members[0].path == top else f" ({len(members)} item{'s' if len(members) > 1 else ''})"
        print(f"  {_size(size):>9}  used {_ago(now - last):>12}  {name}{count}{kept}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _ago(seconds: float) -> str:
    days = seconds / 86400
    return "today" if days < 1 else f"{days:.0f} days ago"
