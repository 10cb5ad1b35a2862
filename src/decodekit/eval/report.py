"""Write an evaluation's report.md, results.json and plot.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..arguments import replace_text, save_figure
from ..bench.report import cell
from ..search.uncertainty import CONFIDENCE_DIRECTION
from .metrics import reliability_bins

# Signals that are already a probability-like confidence in [0, 1] (after orientation).
CALIBRATION_SIGNALS = {"agreement": lambda v: v, "pc": lambda v: v, "phi_first": lambda v: 1 - v,
                       "margin": lambda v: v, "delta": lambda v: v}


def write_report(result: dict[str, Any], out: Path, header: dict[str, Any]) -> list[Path]:
    result = {**header, **result}
    replace_text(out / "results.json", json.dumps(result, indent=1, ensure_ascii=False))
    replace_text(out / "report.md", markdown(result))
    paths = [out / "report.md", out / "results.json"]
    if result["records"]:
        plot(result, out / "plot.png")
        paths.append(out / "plot.png")
    return paths


LOW_ACCURACY = 0.3  # below this upper confidence bound the report warns that the model is out of its depth


def markdown(r: dict[str, Any]) -> str:
    lo, hi = r["ci95"]
    samples = "" if r["n"] is None else f", n {r['n']}"  # null: the run drew one answer (runner.uses_n)
    lines = [
        f"# decodekit eval: {r['task']} · {r['method']}",
        "",
        f"- command: `{r.get('command', '')}`",
        f"- model: {r.get('model', '')} ({r.get('dtype', '')}), seed {r['seed']}{samples}, options {r['options'] or '{}'}",
        f"- accuracy: **{r['accuracy']:.3f}** ({r['correct']}/{r['items']}), 95% Wilson CI [{lo:.3f}, {hi:.3f}]",
        f"- tokens spent by the method: {r['tokens_spent']} ({r['tokens_spent'] / max(r['items'], 1):.1f} per item);"
        f" by extra signals: {r['signal_tokens']}",
        f"- wall time: {r['time_s']} s ({r['time_s'] / max(r['items'], 1):.2f} s per item)",
        *(["- Ray workers: " + "; ".join(f"{m['host']} pid {m['pid']}, {m['units']} items{' (lost)' if m['lost'] else ''}"
                                            for m in r["machines"])] if r.get("machines") else []),
        "",
        "## Uncertainty signals: AUROC for predicting correctness",
        "",
    ]
    if hi < LOW_ACCURACY:  # (before the table: inside it, the rows after it would not be a table's)
        lines += [f"> Accuracy is low (the 95% upper bound is below {LOW_ACCURACY:.0%}). Small models such as the"
                  " embedded 135M SmolLM2 rarely solve multi-step problems; such a run checks the pipeline end to"
                  " end more than it ranks methods, and AUROCs are n/a when every answer is wrong.", ""]
    lines += ["| signal | direction | AUROC |", "|---|---|---|"]
    for name, value in r["auroc"].items():
        direction = "lower = confident" if CONFIDENCE_DIRECTION.get(name, 1) < 0 else "higher = confident"
        lines.append(f"| {name} | {direction} | {'n/a' if value is None else f'{value:.3f}'} |")
    if r["budget_curve"]:
        lines += ["", f"## Accuracy of a majority vote over the first m {voted(r)}", "", "| m | accuracy |", "|---|---|"]
        lines += [f"| {p['samples']} | {p['accuracy']:.3f} |" for p in r["budget_curve"]]
    lines += ["", "## Items", "", "| id | gold | answer | correct |", "|---|---|---|---|"]
    for rec in r["records"][:100]:
        answer = cell(rec["answer"])[:60]
        lines.append(f"| {cell(rec['id'])} | {cell(rec['gold'])} | {answer} | {'yes' if rec['correct'] else 'no'} |")
    return "\n".join(lines) + "\n"


def voted(r: dict[str, Any]) -> str:
    """What the budget curve votes over: CoT-decoding's candidates are its top-k first-token
    branches, in the order of their first token's rank, not samples."""
    return "decoding paths" if r["method"] == "cot" else "samples"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [rec["correct"] for rec in r["records"]]
    left.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    for name, to_conf in CALIBRATION_SIGNALS.items():
        pairs = [(to_conf(rec["signals"][name]), rec["correct"]) for rec in r["records"]
                 if isinstance(rec["signals"].get(name), (int, float))]
        bins = reliability_bins([p[0] for p in pairs], [p[1] for p in pairs]) if pairs else []
        if bins:
            auc = r["auroc"].get(name)
            tag = f"{name} (AUROC {auc:.2f})" if auc is not None else name
            left.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label=tag)
    left.set(xlim=(0, 1), ylim=(-0.02, 1.02), xlabel="confidence (binned)", ylabel="accuracy",
             title=f"Reliability · {r['task']} · {r['method']} (n={len(labels)})")
    left.legend(fontsize=8)
    if r["budget_curve"]:
        xs = [p["samples"] for p in r["budget_curve"]]
        right.plot(xs, [p["accuracy"] for p in r["budget_curve"]], marker="o")
        right.set(xscale="log", xlabel=f"{voted(r)} voted", ylabel="accuracy", title=f"Accuracy vs {voted(r)} (majority vote)")
        right.set_xticks(xs, [str(x) for x in xs])
        right.minorticks_off()
    else:
        names = [k for k, v in r["auroc"].items() if v is not None]
        right.bar(names, [r["auroc"][k] for k in names])
        right.axhline(0.5, color="grey", linestyle=":")
        right.set(ylim=(0, 1), ylabel="AUROC", title="Signal AUROC for correctness")
        right.tick_params(axis="x", rotation=30)
    lo, hi = r["ci95"]
    fig.suptitle(f"accuracy {r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] · {r['tokens_spent']} tokens · {r['time_s']} s")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
