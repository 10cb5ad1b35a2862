"""scripts/mutations.py's command line (docs/TESTING.md: the mutation check)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutations.py"


@pytest.fixture(scope="module")
def mutations():
    spec = importlib.util.spec_from_file_location("decodekit_mutations_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_a_misspelt_name_is_refused_before_anything_runs(mutations, monkeypatch, capsys):
    """A name that is no mutation's ends the run with status 2 and names it, and none of the others
    runs: skipped silently, the run would report the rest alone, all caught."""
    ran = []
    monkeypatch.setattr(mutations, "run", lambda m: ran.append(m.name) or "caught")
    known = mutations.MUTATIONS[0].name
    monkeypatch.setattr(sys, "argv", ["mutations.py", known, "no-such-mutation"])
    assert mutations.main() == 2
    assert ran == []
    assert "no-such-mutation" in capsys.readouterr().err


def test_every_name_given_runs_after_the_control(mutations, monkeypatch):
    ran = []
    monkeypatch.setattr(mutations, "run", lambda m: ran.append(m.name) or ("SURVIVED" if m.name == "control" else "caught"))
    names = [m.name for m in mutations.MUTATIONS[:2]]
    monkeypatch.setattr(sys, "argv", ["mutations.py", *names])
    assert mutations.main() == 0
    assert ran == ["control", *names]


def test_every_mutation_still_finds_the_one_place_it_changes(mutations):
    """A mutation whose text the code no longer holds once (moved, reworded) changes nothing, or the
    wrong place: the check would report it stale only when it is run. Each is found here, at once."""
    root = SCRIPT.parents[1]
    stale = [m.name for m in mutations.MUTATIONS if (root / m.path).read_text().count(m.old) != 1]
    assert stale == []
