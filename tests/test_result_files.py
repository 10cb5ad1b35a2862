"""Result files are replaced whole: a run stopped while writing one (a full disk, Ctrl-C, a writer's
error) leaves the previous file, never half of one, and no temporary beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from decodekit.arguments import replace_file, replace_text

PREVIOUS = '{"previous": "run"}'


def cut_short(monkeypatch) -> None:
    """Every ``Path.write_text`` writes half of its text, then fails as a full disk does."""
    write_text = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)


def test_a_writer_that_fails_midway_leaves_the_previous_file_and_nothing_beside_it(tmp_path: Path):
    target = tmp_path / "results.json"
    target.write_text(PREVIOUS)

    def half_then_error(temporary: Path) -> None:
        temporary.write_text('{"new": "ru')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_file(target, half_then_error)
    assert target.read_text() == PREVIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_new_file_is_made_whole_with_the_umasks_permissions(tmp_path: Path):
    """The folder is made if needed, the text is UTF-8 whatever the locale, and the file is readable by
    others as any file the user makes (a private temporary, renamed, would keep mode 600)."""
    target = tmp_path / "out" / "report.md"
    old_mask = os.umask(0o022)
    try:
        assert replace_text(target, "déjà vu 東京\n") == target
    finally:
        os.umask(old_mask)
    assert target.read_bytes() == "déjà vu 東京\n".encode()
    assert target.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["report.md"]
    replace_text(target, "second")
    assert target.read_text() == "second" and len(list(target.parent.iterdir())) == 1


def test_the_temporary_keeps_the_suffix_a_plot_is_written_by(tmp_path: Path):
    """matplotlib reads the format from the file name's suffix: the temporary must end like the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots(figsize=(1, 1))
    try:
        replace_file(tmp_path / "plot.png", fig.savefig)
        replace_file(tmp_path / "plot.svg", fig.savefig)
    finally:
        plt.close(fig)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "plot.svg").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "plot.svg"]


def bench_results(out: Path) -> Path:
    from decodekit.bench.results import write_results

    return write_results({"schema": "new"}, out / "results.json")


def bench_report(out: Path) -> Path:
    from decodekit.bench.report import write_report

    return write_report({}, out / "report.md")


def eval_report(out: Path) -> Path:
    from decodekit.eval.report import write_report

    write_report({"records": []}, out, {"task": "capitals"})
    return out / "results.json"


def longctx_report(out: Path) -> Path:
    from decodekit.eval import longctx

    longctx.write({"rows": []}, out)
    return out / "results.json"


@pytest.mark.parametrize("write", [bench_results, bench_report, eval_report, longctx_report])


def test_each_report_writer_leaves_the_previous_file_when_the_disk_fills(write, tmp_path: Path, monkeypatch):
    from decodekit.bench import report
    from decodekit.eval import longctx
    from decodekit.eval import report as eval_report_module

    for module in (report, eval_report_module, longctx):  # (the text itself is not what is tested)
        monkeypatch.setattr(module, "markdown" if module is not report else "markdown_report", lambda *a: "# new\n")
    monkeypatch.setattr(longctx, "plot", lambda result, path: None)
    target = {bench_results: "results.json", bench_report: "report.md"}.get(write, "results.json")
    (tmp_path / target).write_text(PREVIOUS)
    cut_short(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        write(tmp_path)
    assert (tmp_path / target).read_text() == PREVIOUS
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_plot_that_fails_midway_leaves_the_previous_image(tmp_path: Path, monkeypatch):
    from matplotlib.figure import Figure

    from decodekit.bench.plot import plot_speedup

    image = tmp_path / "speedup.png"
    image.write_bytes(b"previous image")
    savefig = Figure.savefig

    def half_then_full(self, path, *args, **kwargs):
        savefig(self, path, *args, **kwargs)
        with open(path, "r+b") as file:
            file.truncate(10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_then_full)
    summary = {"categories": ["qa"], "reference": "greedy",
               "methods": {name: {"kind": "decodekit", "categories": {"qa": {"speedup": 1.0}}} for name in ("greedy", "pld")}}
    with pytest.raises(OSError, match="No space left"):
        plot_speedup(summary, image)
    assert image.read_bytes() == b"previous image"
    assert [p.name for p in tmp_path.iterdir()] == ["speedup.png"]


def test_a_result_file_is_written_into_folders_still_to_make(tmp_path):
    path = tmp_path / "a" / "b" / "results.json"
    assert replace_text(path, "{}\n") == path
    assert path.read_text() == "{}\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


def test_the_temporary_result_file_is_hidden(tmp_path):
    seen = []

    def fill(temporary):
        seen.append(temporary.name)
        temporary.write_text("x")

    replace_file(tmp_path / "r.json", fill)
    assert seen[0].startswith(".r.json.") and seen[0].endswith(".json")
