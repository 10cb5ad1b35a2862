"""Benchmark results: the summary statistics, the machine description and ``results.json``.

``results.json`` schema (``"schema": "decodekit-bench/1"``)::

    {
      "schema": "decodekit-bench/1",
      "created": "2025-01-01T12:00:00",          # local time, ISO 8601
      "command": "decodekit bench --quick",      # the command line that produced the file
      "config": {questions, methods, baselines, max_new_tokens, limit, categories, dtype, numerics, model,
                 repeats, all_turns, options},
      "machine": {cpu, logical_cores, usable_cores, memory_gb, platform, python, torch, torch_threads,
                  passes_by_threads {count: passes}, transformers, llama_cpp, dtype, numerics, model},
      "machines": [{host, pid, threads, units, questions [[repeat, question_id]], lost, machine}],
                                                  # only in a run on a Ray cluster: one per worker
      "notes": [str, ...],                        # skipped methods/baselines, failures, caveats
      "records": [                               # one per contestant x question x repeat
        {method, kind ("decodekit"|"baseline"), family, lossless (bool|null),
         question_id, category, group (category, MT-Bench ones as "mt_bench"), repeat, position
         (0-based place in that question's rotated order), turns, prompt_tokens, new_tokens,
         prefill_s, decode_s, forward_passes (int|null: decode passes, prefill excluded),
         decode_tps (new_tokens/decode_s), e2e_tps (new_tokens/(prefill_s+decode_s)),
         mean_accepted (float|null: tokens per verification), verifications (int|null: how many),
         finish_reason, identical_to_reference (bool|null: token-identical
         to decodekit greedy; null where not comparable, e.g. llama.cpp), text_match (bool|null),
         text_prefix_share (float|null: share of greedy's text reproduced from the start),
         texts [str per turn], tokens [[int] per turn], extra {method figures}, error (str|null)}
      ],
      "summary": {
        "reference": "greedy", "hf_reference": "hf"|null, "aggregate": str, "categories": [..., "overall"],
        "methods": {name: {kind, family, lossless, token_exact, peak_rss_mb,
                           "categories": {category: STATS}}}
      }
    }

STATS (per method and category; figures over repeats are per-question medians first):
``questions, new_tokens, prefill_s, decode_s, decode_tps, e2e_tps, speedup, e2e_speedup,
speedup_vs_hf, e2e_speedup_vs_hf, mean_accepted, passes_per_token, exact_share,
text_match_share, text_prefix_share, errors``. Speedups are ratios of aggregate throughputs
(summed tokens / summed seconds) over the questions both sides completed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from ..arguments import existing_file, replace_text
from ..errors import InvalidParameter
from ..machine import usable_cores
from .questions import OVERALL
from .runner import RECORD_FIELDS, per_verification

SCHEMA = "decodekit-bench/1"
AGGREGATE = ("throughput = summed new tokens / summed seconds over a category's questions (per-question "
             "medians over repeats); speedup = method throughput / reference throughput on the same questions")
STAT_KEYS = (
    "questions", "new_tokens", "prefill_s", "decode_s", "decode_tps", "e2e_tps", "speedup", "e2e_speedup",
    "speedup_vs_hf", "e2e_speedup_vs_hf", "mean_accepted", "passes_per_token", "exact_share",
    "text_match_share", "text_prefix_share", "errors",
)


def _median(values: list[float | None], low: bool = False) -> float | None:
    """Median of the values present; None when there are none, or when ``low`` (counts) and one is missing."""
    present = [v for v in values if v is not None]
    if not present or (low and len(present) < len(values)):
        return None
    return statistics.median_low(present) if low else statistics.median(present)


def per_question(records: Iterable[dict[str, Any]]) -> dict[str, dict[Any, dict[str, Any]]]:
    """method -> question_id -> medians over the successful repeats (with the record's group)."""
    grouped: dict[str, dict[Any, list[dict[str, Any]]]] = {}
    for rec in records:
        if rec["error"] is None:
            grouped.setdefault(rec["method"], {}).setdefault(rec["question_id"], []).append(rec)
    out: dict[str, dict[Any, dict[str, Any]]] = {}
    for method, questions in grouped.items():
        out[method] = {}
        for qid, recs in questions.items():
            row = {"group": recs[0]["group"]}
            row |= {key: _median([r[key] for r in recs]) for key in ("prefill_s", "decode_s")}
            # Counts stay integers: the lower median is one of the observed values.
            row |= {key: _median([r[key] for r in recs], low=True) for key in ("new_tokens", "forward_passes")}
            # accepted tokens pooled over the repeats' verifications, as over the questions' (a median of
            # each apart paired one repeat's acceptance with another's count, which could be 0)
            row["mean_accepted"], row["verifications"] = per_verification(
                [(r["mean_accepted"], r.get("verifications")) for r in recs])
            out[method][qid] = row
    return out


def _throughput(rows: dict[Any, dict[str, Any]], qids: Iterable[Any]) -> tuple[float | None, float | None]:
    """(decode-only, end-to-end) tokens/s over the given questions."""
    qids = list(qids)
    tokens = sum(rows[q]["new_tokens"] for q in qids)
    decode = sum(rows[q]["decode_s"] for q in qids)
    total = decode + sum(rows[q]["prefill_s"] for q in qids)
    return (tokens / decode if decode > 0 else None, tokens / total if total > 0 else None)


def _ratio(rows: dict, other: dict | None, qids: list) -> tuple[float | None, float | None]:
    """Throughput ratios rows/other on the questions both completed."""
    if other is None:
        return None, None
    common = [q for q in qids if q in other]
    if not common:
        return None, None
    mine, theirs = _throughput(rows, common), _throughput(other, common)
    return tuple(a / b if a is not None and b else None for a, b in zip(mine, theirs))  # type: ignore[return-value]


def _share(values: list[Any]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return sum(present) / len(present) if present else None


def category_stats(rows: dict[Any, dict[str, Any]], records: list[dict[str, Any]], ref: dict | None, hf: dict | None) -> dict[str, Any]:
    """STATS for one method on one category (rows: that method's per-question medians there)."""
    qids = list(rows)
    tokens = sum(r["new_tokens"] for r in rows.values())
    passes = [r["forward_passes"] for r in rows.values()]
    decode_tps, e2e_tps = _throughput(rows, qids) if qids else (None, None)
    speedup, e2e_speedup = _ratio(rows, ref, qids)
    vs_hf, e2e_vs_hf = _ratio(rows, hf, qids)
    ok = [r for r in records if r["error"] is None]
    return {
        "questions": len(qids), "new_tokens": tokens,
        "prefill_s": sum(r["prefill_s"] for r in rows.values()), "decode_s": sum(r["decode_s"] for r in rows.values()),
        "decode_tps": decode_tps, "e2e_tps": e2e_tps, "speedup": speedup, "e2e_speedup": e2e_speedup,
        "speedup_vs_hf": vs_hf, "e2e_speedup_vs_hf": e2e_vs_hf,
        "mean_accepted": per_verification([(r["mean_accepted"], r.get("verifications")) for r in rows.values()])[0],
        "passes_per_token": sum(passes) / tokens if qids and tokens and None not in passes else None,
        "exact_share": _share([r["identical_to_reference"] for r in ok]),
        "text_match_share": _share([r["text_match"] for r in ok]),
        "text_prefix_share": _share([r["text_prefix_share"] for r in ok]),
        "errors": len(records) - len(ok),
    }


def _rows_in(medians: dict[str, dict], method: str | None, group: str) -> dict | None:
    """A method's per-question medians restricted to a group (None when the method has none)."""
    if method is None or method not in medians:
        return None
    return {q: r for q, r in medians[method].items() if group in (OVERALL, r["group"])}


def summarize(records: Sequence[dict[str, Any]], contestants: Sequence[dict[str, Any]], peak_rss: dict[str, float],
              *, reference: str = "greedy", hf_reference: str = "hf") -> dict[str, Any]:
    """The ``summary`` block of results.json (see the module docstring)."""
    medians = per_question(records)
    groups = list(dict.fromkeys(r["group"] for r in records))
    hf_name = hf_reference if any(c["name"] == hf_reference for c in contestants) else None
    methods: dict[str, Any] = {}
    for c in contestants:
        name = c["name"]
        per_cat = {}
        for group in [*groups, OVERALL]:
            recs = [r for r in records if r["method"] == name and group in (OVERALL, r["group"])]
            rows = _rows_in(medians, name, group) or {}
            per_cat[group] = category_stats(rows, recs, _rows_in(medians, reference, group), _rows_in(medians, hf_name, group))
        methods[name] = {**{k: c[k] for k in ("kind", "family", "lossless", "token_exact")},
                         "peak_rss_mb": peak_rss.get(name), "categories": per_cat}
    return {"reference": reference, "hf_reference": hf_name, "aggregate": AGGREGATE,
            "categories": [*groups, OVERALL], "methods": methods}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except (OSError, ValueError):
        pass
    return None


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


@cache
def code_version() -> str:
    """decodekit's version plus a hash of its source files: two runs with the same value ran the
    same code, whether or not it was committed. Computed once per process (first call: before a
    run starts), so editing the sources during a run does not relabel it."""
    import hashlib

    import decodekit

    root = Path(decodekit.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return f"{decodekit.__version__}+{digest.hexdigest()[:12]}"


def machine_info(*, model: str, dtype: str, numerics: str = "exact", passes: Mapping[int, int] | None = None) -> dict[str, Any]:
    """This machine and process; ``passes``: the run's passes by thread count (default: the process's)."""
    import torch

    from ..models.threads import GOVERNOR

    passes = GOVERNOR.passes if passes is None else passes

    return {
        "cpu": cpu_model(), "logical_cores": os.cpu_count(), "usable_cores": usable_cores(), "memory_gb": memory_gb(),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        # the count passes run on when the machine is quiet (torch's count now is the governor's
        # last choice), and how many passes the governor ran on each count: fewer when it was busy
        "torch_threads": GOVERNOR.full_count(),
        "passes_by_threads": {str(n): count for n, count in sorted(passes.items())},
        "transformers": _version("transformers"),
        "llama_cpp": _version("llama-cpp-python"), "dtype": dtype, "numerics": numerics, "model": model,
        "decodekit": code_version(),
    }


def exactness_notes(summary: dict[str, Any]) -> list[str]:
    """Flag greedy-lossless contestants whose outputs are not all token-identical to the reference."""
    notes = []
    for name, info in summary["methods"].items():
        share = info["categories"][OVERALL]["exact_share"]
        if info["lossless"] and share is not None and share < 1.0:
            notes.append(f"{name} is lossless but matched {summary['reference']} on {100 * share:.0f}% of outputs: a bug, "
                         "or a floating-point near-tie resolved differently by a multi-token pass than by one-token steps")
    return notes


def merged_notes(*groups: Iterable[str]) -> list[str]:
    """The notes of a run, each once, in order: the plan's, the contestants', and a resumed run's
    from its checkpoint (which holds the notes of the run it continues, which this one may make again)."""
    return list(dict.fromkeys(note for group in groups for note in group))


def build_results(run, *, command: str, config: dict[str, Any], machine: dict[str, Any], notes: Sequence[str] = (),
                  machines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole results.json document for a :class:`~decodekit.bench.runner.BenchRun`;
    ``machines``: the workers of a run on a cluster, one entry each."""
    summary = summarize(run.records, run.contestants, run.peak_rss_mb, reference=config.get("reference", "greedy"))
    results = {
        "schema": SCHEMA, "created": datetime.now().isoformat(timespec="seconds"), "command": command,
        "config": config, "machine": machine, "notes": merged_notes(notes, run.notes, exactness_notes(summary)),
        "records": run.records, "summary": summary,
    }
    if machines is not None:
        results["machines"] = machines
    return results


_NUMBER = {"type": ["number", "null"], "minimum": 0}  # (every figure a count, a time, a rate or a ratio)
_STATS = {"type": "object", "required": list(STAT_KEYS), "properties": {k: _NUMBER for k in STAT_KEYS}}
#: results.json as JSON Schema (the module docstring in prose); checked by :func:`validate_results`.
RESULTS_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema", "created", "command", "config", "machine", "notes", "records", "summary"],
    "properties": {
        "schema": {"const": SCHEMA}, "created": {"type": "string"}, "command": {"type": "string"},
        "config": {"type": "object", "required": ["questions", "methods", "baselines", "max_new_tokens", "dtype",
                                                  "numerics", "repeats", "options", "reference"]},
        "machine": {"type": "object", "required": ["cpu", "logical_cores", "usable_cores", "torch_threads", "model",
                                                   "dtype", "numerics", "decodekit"]},
        "machines": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["host", "pid", "threads", "units", "questions", "lost", "machine"]}},
        "notes": {"type": "array", "items": {"type": "string"}},
        "records": {"type": "array", "items": {
            "type": "object", "required": sorted(RECORD_FIELDS),
            "properties": {
                "method": {"type": "string"}, "kind": {"enum": ["decodekit", "baseline"]},
                "question_id": {"type": ["integer", "string"]}, "repeat": {"type": "integer", "minimum": 0},
                "position": {"type": "integer", "minimum": 0}, "new_tokens": {"type": "integer", "minimum": 0},
                "verifications": {"type": ["integer", "null"], "minimum": 0},
                "texts": {"type": "array", "items": {"type": "string"}},
                "tokens": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                "identical_to_reference": {"type": ["boolean", "null"]}, "error": {"type": ["string", "null"]},
            }}},
        "summary": {"type": "object", "required": ["reference", "hf_reference", "aggregate", "categories", "methods"],
                    "properties": {"categories": {"type": "array", "items": {"type": "string"}},
                                   "methods": {"type": "object", "additionalProperties": {
                        "type": "object", "required": ["kind", "family", "lossless", "token_exact", "peak_rss_mb", "categories"],
                        "properties": {"categories": {"type": "object", "additionalProperties": _STATS}}}}}},
    },
}


def validate_results(results: dict[str, Any]) -> None:
    """Raise InvalidParameter (one line: where and what) if ``results`` does not follow the schema."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(RESULTS_JSON_SCHEMA).iter_errors(results))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise InvalidParameter(f"results.json does not follow {SCHEMA} at {where}: {error.message}")
    where = _not_finite(results.get("summary"), "summary")
    if where is not None:  # (NaN passes a schema's bounds: every comparison with it is false)
        raise InvalidParameter(f"results.json does not follow {SCHEMA} at {where}: a figure that is not a finite number")


def _not_finite(value: Any, at: str) -> str | None:
    """Where in ``value`` a float is NaN or infinite, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((found for key, inner in items if (found := _not_finite(inner, f"{at}/{key}")) is not None), None)


def write_results(results: dict[str, Any], path: Path) -> Path:
    return replace_text(path, json.dumps(results, indent=1, ensure_ascii=False))


def read_document(path: Path, schema: str, what: str, *, prefix: str = "", required: Sequence[str] = ()) -> dict[str, Any]:
    """A JSON object with ``"schema": schema`` (and the ``required`` keys) from an existing file;
    anything else is a one-line error naming ``what`` the file should have been."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidParameter(f"{prefix}{path}: not a JSON file ({err})") from None
    except RecursionError:  # json's reader recurses: [[[[... thousands deep
        raise InvalidParameter(f"{prefix}{path}: not a {what} (JSON nested too deeply)") from None
    if not isinstance(data, dict) or data.get("schema") != schema or any(key not in data for key in required):
        raise InvalidParameter(f"{prefix}{path}: not a {what}")
    return data


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results.json; a missing or foreign file is a one-line error."""
    path = existing_file(Path(path), "results file")
    results = read_document(path, SCHEMA, f"decodekit bench results file (schema {SCHEMA})", required=("summary",))
    try:
        validate_results(results)
    except InvalidParameter as err:  # a damaged or edited file: said, not trusted
        raise InvalidParameter(f"{path}: {err}") from None
    return results
