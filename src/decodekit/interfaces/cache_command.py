"""``decodekit cache``: what decodekit keeps on disk, and removing what has gone unused.

The cache (``$DECODEKIT_CACHE``, default ``~/.cache/decodekit``) grows with use: a dequantised
folder per model file (hundreds of megabytes each), compiled kernels per version of their sources,
the speculative controller's cost table, trained drafters. ``--prune DAYS`` removes the entries not
used for that many days (``--prune 0``: every entry no process is using); each one is built again
the next time it is needed. Only what decodekit wrote is ever listed or removed (an entry is known
by its manifest); trained drafters and their data (written by ``train-drafter``) are listed, never
removed here.
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

    days = args.prune
    if days is not None:
        if not days >= 0:  # not NaN either
            raise InvalidParameter(f"--prune takes a number of days >= 0, got {days:g}")
        days += 0.0  # -0 reads as 0
    root = cache_root()
    if root.exists() and not root.is_dir():  # (no cache could ever be built there: not "nothing built yet")
        raise InvalidParameter(f"the cache {str(root)!r} (DECODEKIT_CACHE) is not a folder")
    if not root.is_dir():
        print(json.dumps({"root": str(root), "bytes": 0, "items": [], "removed": []}) if args.json
              else f"{root}: no cache there (nothing built yet)")
        return 0
    try:  # an unreadable cache is said so, not listed as empty
        next(root.iterdir(), None)
    except OSError as err:
        raise InvalidParameter(f"cannot read the cache {str(root)!r} (DECODEKIT_CACHE): {err.strerror or err}") from None
    pruned = remove_unused(days, root) if days is not None else None
    items = cached_items(root)
    now = time.time()
    if args.json:
        def listed(item) -> dict:
            return {"path": str(item.path.relative_to(root)), "bytes": item.size, "days_unused": round((now - item.used) / 86400, 2),
                    "rebuilt_when_needed": item.entry, "unfinished": item.unfinished}
        report = {"root": str(root), "bytes": sum(i.size for i in items), "items": [listed(i) for i in items]}
        if pruned is not None:
            report.update(removed=[listed(i) for i in pruned.removed], left_in_use=pruned.left)
        print(json.dumps(report, indent=1))
        return 0
    if pruned is not None:
        print(f"removed {_count(len(pruned.removed), 'item')} not used for {days:g} days: "
              f"{_size(sum(i.size for i in pruned.removed))}"
              + (f"; {_count(pruned.left, 'item')} in use by another process, or not removable, left" if pruned.left else ""))
    print(f"{root}: {_size(sum(i.size for i in items))} in {_count(len(items), 'item')}")
    # one line per item at the top of the cache, one per folder of several (the kernels: one library
    # per version of each source)
    groups: dict[Path, list] = defaultdict(list)
    for item in items:
        groups[root / item.path.relative_to(root).parts[0]].append(item)
    for top, members in sorted(groups.items(), key=lambda kv: -sum(i.size for i in kv[1])):
        size, last = sum(i.size for i in members), max(i.used for i in members)
        notes = ("  (an unfinished build)" if all(i.unfinished for i in members) else
                 "" if all(i.entry for i in members) else "  (not removed by --prune)")
        name = top.name + ("/" if top.is_dir() else "")
        count = "" if members[0].path == top else f" ({_count(len(members), 'item')})"
        print(f"  {_size(size):>9}  used {_ago(now - last):>12}  {name}{count}{notes}")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _ago(seconds: float) -> str:
    days = seconds / 86400
    return "today" if days < 1 else "1 day ago" if round(days) == 1 else f"{days:.0f} days ago"
