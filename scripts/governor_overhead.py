"""Decode speed with the thread governor's load check and without it, alternating in one process (fast numerics,
200 tokens, 6 rounds): what reading the cores' load costs a quiet machine."""

import time
from decodekit.models import load_model
from decodekit.engine import Engine
from decodekit.models.threads import GOVERNOR
from decodekit.machine import BusyElsewhere
e = Engine(load_model(numerics="fast"))
e.generate("Tell a story.", max_new_tokens=64)
res = {"with load check": [], "without": []}
for r in range(6):
    for label in res:
        GOVERNOR.busy_elsewhere = BusyElsewhere() if label == "with load check" else None
        t = time.perf_counter(); g = e.generate("Tell a long story about a fox.", max_new_tokens=200, ignore_eos=True)
        res[label].append(200 / g.stats.decode_s)
for label, v in res.items():
    v.sort(); print(label, "median tok/s", round(v[3], 1), "all", [round(x) for x in v])
