"""Human-readable outputs: the terminal table, ``report.md`` and the ``--compare`` diff."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..arguments import DEFAULT_MODEL, replace_text
from .results import OVERALL

Fmt = Callable[[Any], str]


def num(digits: int = 1, suffix: str = "") -> Fmt:
    return lambda v: "-" if v is None else f"{v:.{digits}f}{suffix}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def signed(digits: int = 2, suffix: str = "") -> Fmt:
    return lambda v: "-" if v is None else f"{v:+.{digits}f}{suffix}"


# (header, stats key, formatter) of the per-method tables.
COLUMNS: list[tuple[str, str, Fmt]] = [
    ("tok/s", "decode_tps", num(1)),
    ("e2e tok/s", "e2e_tps", num(1)),
    ("speedup", "speedup", num(2, "x")),
    ("e2e speedup", "e2e_speedup", num(2, "x")),
    ("vs HF", "speedup_vs_hf", num(2, "x")),
    ("accepted/verify", "mean_accepted", num(2)),
    ("passes/token", "passes_per_token", num(2)),
    ("exact", "exact_share", pct),
    ("text match", "text_match_share", pct),
    ("questions", "questions", lambda v: str(v)),
]


def one_line(value: object) -> str:
    """``value`` as text on one line (its line breaks as spaces): a markdown heading or cell."""
    return " ".join(str(value).splitlines())


def cell(value: object) -> str:
    """``value`` as one markdown table cell: its line breaks as spaces and its pipes escaped, since
    either would end the cell early (a category is the question file's, a structured task's gold a schema)."""
    return one_line(value).replace("|", "\\|")


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """A plain aligned table, or a GitHub-flavoured markdown table (first column left, rest right)."""
    if markdown:
        lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])
    headers, rows = [one_line(h) for h in headers], [[one_line(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def method_label(name: str, info: dict[str, Any]) -> str:
    return name if info["kind"] == "decodekit" else f"{name} (baseline)"


def method_table(summary: dict[str, Any], category: str, markdown: bool = False, memory: bool = False) -> str:
    """One row per method for one category (``overall`` adds the peak-RSS column when ``memory``)."""
    headers = ["method", *(h for h, _, _ in COLUMNS)] + (["peak RSS MB"] if memory else [])
    rows = []
    for name, info in summary["methods"].items():
        stats = info["categories"].get(category)
        if stats is None:
            continue
        row = [method_label(name, info), *(f(stats[k]) for _, k, f in COLUMNS)]
        rows.append(row + ([num(0)(info["peak_rss_mb"])] if memory else []))
    return render(headers, rows, markdown)


def matrix(summary: dict[str, Any], key: str, fmt: Fmt, markdown: bool = False, skip_reference: bool = True) -> str:
    """Methods x categories for one statistic."""
    cats = summary["categories"]
    rows = [
        [method_label(name, info), *(fmt(info["categories"].get(c, {}).get(key)) for c in cats)]
        for name, info in summary["methods"].items()
        if not (skip_reference and name == summary["reference"])
    ]
    return render(["method", *cats], rows, markdown)


def terminal_report(results: dict[str, Any]) -> str:
    summary, machine = results["summary"], results["machine"]
    parts = [
        f"{machine['model']}, {machine['dtype']}, {machine.get('numerics', 'exact')} numerics; decodekit "
        f"{machine.get('decodekit', 'unknown')}",
        f"Overall ({summary['reference']} = decodekit plain greedy, the reference):",
        method_table(summary, OVERALL, memory=True),
        "",
        "Decode-only speedup vs decodekit greedy, by category:",
        matrix(summary, "speedup", num(2, "x")),
    ]
    if results.get("notes"):
        parts += ["", *(f"note: {n}" for n in results["notes"])]
    return "\n".join(parts)


def fewer_threads(machine: dict[str, Any]) -> str:
    """What share of decodekit's passes the thread governor ran on fewer threads than the machine's
    count (the machine was busy), said beside that count; nothing where every pass had them all."""
    passes = {int(n): count for n, count in machine.get("passes_by_threads", {}).items()}
    fewer, total = sum(c for n, c in passes.items() if n < machine["torch_threads"]), sum(passes.values())
    return f" ({fewer / total:.0%} of decodekit's passes on fewer: the machine was busy)" if fewer else ""


def machine_lines(machine: dict[str, Any]) -> list[str]:
    return [
        f"- CPU: {machine['cpu']} ({machine['usable_cores']} usable of {machine['logical_cores']} logical cores, "
        f"{machine['memory_gb']} GB RAM)",
        f"- torch {machine['torch']} with {machine['torch_threads']} threads{fewer_threads(machine)}; "
        f"transformers {machine['transformers']}; "
        f"llama-cpp-python {machine['llama_cpp'] or 'not installed'}",
        f"- model {machine['model']}, dtype {machine['dtype']}, {machine.get('numerics', 'exact')} numerics; {machine['platform']}, Python {machine['python']}",
        f"- decodekit {machine.get('decodekit', 'unknown')} (the code that ran)",
    ]


def worker_lines(machines: list[dict[str, Any]] | None) -> list[str]:
    """A run on a Ray cluster: one line per worker (the Machine section describes the first)."""
    if not machines:
        return []
    rows = [f"- {m['host']} pid {m['pid']}: {m['machine']['cpu']}, {m['threads']} thread(s), {m['units']} question runs"
            + (" (lost mid-run; the question it was running ran again elsewhere)" if m["lost"] else "") for m in machines]
    return ["## Workers (Ray)", "", "Every question's contestants ran side by side on one worker: ratios are per worker.",
            "", *rows, ""]


def settings_lines(config: dict[str, Any]) -> list[str]:
    return [
        f"- questions: `{config['questions']}` (limit {config['limit'] or 'none'} per category; categories: "
        f"{', '.join(config['categories']) if config['categories'] else 'all'}; "
        f"{'all turns' if config['all_turns'] else 'first turn only'})",
        f"- max new tokens {config['max_new_tokens']}, repeats {config['repeats']} (medians), greedy decoding; "
        "every contestant stops at EOS and is measured on the tokens it produced",
        f"- methods: {', '.join(config['methods'])}; baselines: {', '.join(config['baselines']) or 'none'}",
    ]


def markdown_report(results: dict[str, Any], image: str | None = "speedup.png") -> str:
    summary, config = results["summary"], results["config"]
    out = [
        "# decodekit bench", "",
        f"Produced by `{results['command']}` on {results['created']}.", "",
        "## Machine", "", *machine_lines(results["machine"]), "", *worker_lines(results.get("machines")),
        "## Settings", "", *settings_lines(config), "",
        "## Overall", "", method_table(summary, OVERALL, markdown=True, memory=True), "",
        "## Decode-only speedup vs decodekit greedy", "", matrix(summary, "speedup", num(2, "x"), markdown=True), "",
    ]
    if image:
        out += [f"![Decode-only speedup by category]({image})", ""]
    out += ["## End-to-end speedup vs decodekit greedy (prefill included)", "",
            matrix(summary, "e2e_speedup", num(2, "x"), markdown=True), ""]
    out += ["## Per category", ""]
    for cat in summary["categories"]:
        if cat != OVERALL:
            n = summary["methods"][summary["reference"]]["categories"][cat]["questions"]
            out += [f"### {one_line(cat)} ({n} question{'s' if n != 1 else ''})", "", method_table(summary, cat, markdown=True), ""]
    out += ["## How to read this", "", *(f"- {line}" for line in explanations(summary)), ""]
    if results.get("notes"):
        out += ["## Notes", "", *(f"- {n}" for n in results["notes"]), ""]
    return "\n".join(out)


def explanations(summary: dict[str, Any]) -> list[str]:
    return [
        "tok/s: decode-only throughput, new tokens / decode seconds; e2e tok/s: new tokens / (prefill + decode) seconds.",
        f"Aggregates: {summary['aggregate']}.",
        "vs HF: decode-only throughput relative to transformers `generate()` greedy on the same weights and prompts.",
        "accepted/verify: tokens accepted per verification pass as the method reports it (mean over questions); "
        "passes/token: decode forward passes per new token (plain decoding: about 1).",
        "exact: share of outputs token-identical to decodekit greedy (lossless methods in greedy mode should be 100%); "
        "text match: identical text, the only comparison made for llama.cpp (quantised kernels, so near-ties can differ).",
        "peak RSS: the process's resident-memory high-water mark right after each contestant's first (warm-up) run. "
        "All contestants share one process, so it is cumulative in run order, not a per-method footprint.",
    ]


def write_report(results: dict[str, Any], path: Path, image: str | None = "speedup.png") -> Path:
    return replace_text(path, markdown_report(results, image))


#: The settings two runs must share for their figures and outputs to compare question by question,
#: and for their "overall" rows to be over the same questions.
COMPARED_SETTINGS = ("questions", "limit", "categories", "all_turns", "max_new_tokens", "repeats", "dtype", "numerics",
                     "model", "options")


def setting(config: dict[str, Any], key: str) -> Any:
    """A run's setting as it took effect (``model`` None: the default model)."""
    value = config.get(key)
    return DEFAULT_MODEL if key == "model" and value is None else value


def only_in_one(a: Iterable[str], b: Iterable[str], what: str) -> list[str]:
    """Notes on the ``what`` (methods, categories) one run has and the other lacks."""
    a, b = list(a), list(b)
    return [f"note: {what} only in {side}: {', '.join(names)}"
            for side, names in (("A", [n for n in a if n not in b]), ("B", [n for n in b if n not in a])) if names]


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Per method x category change from run A to run B: tokens/s (%) and speedup vs greedy."""
    sa, sb = a["summary"], b["summary"]
    rows = []
    for name, info in sb["methods"].items():
        if name not in sa["methods"]:
            continue
        for cat in sb["categories"]:
            old, new = sa["methods"][name]["categories"].get(cat), info["categories"].get(cat)
            if old is None or new is None:
                continue
            rows.append([name, cat, *change(old["decode_tps"], new["decode_tps"]), *speedups(old, new)])
    headers = ["method", "category", "tok/s A", "tok/s B", "change", "speedup A", "speedup B", "change"]
    lines = [f"A: {a['command']} ({a['created']})", f"B: {b['command']} ({b['created']})"]
    if a["machine"].get("cpu") != b["machine"].get("cpu"):
        lines.append(f"note: different CPUs ({a['machine'].get('cpu')} vs {b['machine'].get('cpu')})")
    differ = [key for key in COMPARED_SETTINGS if setting(a["config"], key) != setting(b["config"], key)]
    if differ:  # the same question ids may then be other questions, and outputs differ for that alone
        lines.append("note: different settings (" + "; ".join(
            f"{key} {setting(a['config'], key)!r:.60} vs {setting(b['config'], key)!r:.60}" for key in differ) + ")")
    lines += only_in_one(sa["methods"], sb["methods"], "methods")
    lines += only_in_one(sa["categories"], sb["categories"], "categories")
    lines.append(same_outputs(a["records"], b["records"]))
    if not rows:
        return "\n".join(lines + ["no method and category in common"])
    return "\n".join(lines + ["", render(headers, rows)])


def same_outputs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str:
    """How many runs both files have (method, question, repeat) produced the same tokens in both."""
    def tokens(records):
        return {(r["method"], r["question_id"], r["repeat"]): r["tokens"] for r in records if r["error"] is None}

    ta, tb = tokens(a), tokens(b)
    common = [k for k in ta if k in tb]
    differ = sorted({k[0] for k in common if ta[k] != tb[k]})
    return (f"outputs: {sum(ta[k] == tb[k] for k in common)} of {len(common)} runs in both files are token-identical"
            + (f" (differ: {', '.join(differ)})" if differ else ""))


def change(old: float | None, new: float | None) -> list[str]:
    rel = (new / old - 1) if old and new is not None else None
    return [num(1)(old), num(1)(new), signed(1, "%")(None if rel is None else 100 * rel)]


def speedups(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = old["speedup"], new["speedup"]
    return [num(2, "x")(a), num(2, "x")(b), signed(2)(b - a if a is not None and b is not None else None)]
