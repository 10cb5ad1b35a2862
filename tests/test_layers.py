"""The layers of src/decodekit/ (docs/ARCHITECTURE.md): every import points down."""

from __future__ import annotations

import ast
from pathlib import Path

import decodekit

ROOT = Path(decodekit.__file__).parent
#: Bottom to top. A module may import its own layer and the layers before it, never one after.
LAYERS = ("exports", "errors", "machine", "options", "cluster", "arguments", "data", "models", "samplers", "engine", "speculative",
          "search", "bench", "eval", "serve", "interfaces")
#: Modules that must not import each other although they share a layer.
APART = {
    "models.kernels": {"models.loading"},
    "search.batch": {"search.uncertainty"},
}


def module_imports(path: Path, root: Path = ROOT) -> tuple[str, set[str]]:
    """The module's dotted name inside decodekit, and every decodekit module it imports (for
    ``from X import name``, both X and X.name: the name may be a module)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
            elif node.module == "decodekit" or (node.module or "").startswith("decodekit."):
                base = []
            else:
                continue
            target = [*base, *(node.module.split(".") if node.module else [])]
            if not node.level:
                target = target[1:]  # decodekit itself
            if target:
                found.add(".".join(target))
            found.update(".".join([*target, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("decodekit.") for a in node.names if a.name.startswith("decodekit."))
    return ".".join(parts), found


def test_the_import_reader_sees_every_spelling(tmp_path):
    (tmp_path / "engine").mkdir()
    module = tmp_path / "engine" / "x.py"
    module.write_text("from .. import search\nfrom decodekit import serve\nfrom decodekit.bench.runner import run\n"
                      "import decodekit.eval.tasks\nfrom .core import Request\nfrom ..models import kernels\n")
    name, found = module_imports(module, tmp_path)
    assert name == "engine.x"
    assert {"search", "serve", "bench.runner", "eval.tasks", "engine.core", "models.kernels"} <= found
    assert not any(t == "" or t.startswith(".") for t in found)


def all_modules() -> dict[str, set[str]]:
    return dict(module_imports(p) for p in sorted(ROOT.rglob("*.py")))


def test_every_import_points_down():
    upward = []
    for module, imports in all_modules().items():
        own = module.split(".")[0]
        if own not in LAYERS:
            continue  # the package's __init__ and __main__ assemble everything
        for target in imports:
            layer = target.split(".")[0]
            if layer in LAYERS and LAYERS.index(layer) > LAYERS.index(own):
                upward.append(f"{module} imports {target}")
    assert not upward, upward


def test_modules_kept_apart_do_not_import_each_other():
    modules = all_modules()
    crossing = [f"{name} imports {t}" for m, banned in APART.items() for name, imports in modules.items()
                if name == m or name.startswith(m + ".") for t in imports if any(t == b or t.startswith(b + ".") for b in banned)]
    assert not crossing, crossing


def test_the_engine_names_no_layer_above_it_even_as_a_string():
    above = LAYERS[LAYERS.index("engine") + 1 :]
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        named = [layer for layer in above if f'"decodekit.{layer}' in text or f"'decodekit.{layer}" in text]
        assert not named, f"{path.name} names {named}"


def test_the_architecture_document_draws_and_lists_this_order():
    doc = (ROOT.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    diagram = doc.split("```\n", 2)[1]
    drawn = [line.split()[0].rstrip("/").removesuffix(".py") for line in diagram.splitlines() if line[:1].strip()]
    assert drawn == list(reversed(LAYERS))
    sentence = doc.split("holds the order, bottom to top: ", 1)[1].split(")", 1)[0]
    assert [name.strip() for name in " ".join(sentence.split()).split(",")] == list(LAYERS)
