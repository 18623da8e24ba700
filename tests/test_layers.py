"""Every import under harness/ points down the layers (README, "Layout of the repository"), so
that a module can be read, tested and replaced with only what lies below it in mind."""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "harness"

# Lowest first. A module may import its own package and any lower layer; packages on the same
# layer do not import each other.
LAYERS = [
    ["harness.errors", "harness.resources"],  # user mistakes; the data files shipped
    ["harness.files"],  # outputs written whole; a user's YAML read strictly
    ["harness.parallel_dims"],  # the degrees, their order and their ranks
    ["harness.model.config_families"],  # what each LLaMA-family model_type's config.json adds
    ["harness.model.config_json"],  # config.json read as a Shape
    ["harness.model.presets"],  # shape facts the spec checks against
    ["harness.model.flops"],
    ["harness.registry"],  # engine name -> adapter; EngineFacts
    ["harness.spec", "harness.store", "harness.measure", "harness.progress"],
    ["harness.data", "harness.model", "harness.runtime"],  # tokens, the plain model, process setup
    ["harness.engine"],
    ["harness.frameworks"],
    ["harness.profiling"],  # profiled steps: annotations, trace, breakdown
    ["harness.gather"],  # every rank's results, gathered for the record
    ["harness.run", "harness.launch"],
    ["harness.compare", "harness.sweep", "harness.report", "harness.planner"],
    ["harness.memtrace"],  # runs the engine on fake tensors; reads the planner
    ["harness.interop"],  # other frameworks' launch configurations, in and out; reads the planner's layout
    ["harness.commands"],
    ["harness.cli", "harness.__main__"],
]
TESTING = "harness.testing"  # test helpers: may use the product; nothing in the product uses them


def unit_of(module: str) -> tuple[int, str]:
    """(layer, unit): the longest listed prefix of `module`."""
    best = None
    for layer, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    if best is None:
        raise KeyError(module)
    return best


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            out += [
                (node.lineno, f"{node.module}.{a.name}") if node.module == "harness" else (node.lineno, node.module)
                for a in node.names
            ]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("harness")]
    return out


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        if me == "harness":
            continue
        for line, target in imports(path):
            if target == "harness":
                continue
            if target.startswith(TESTING):
                if not me.startswith(TESTING):
                    bad.append(f"{me}:{line} imports the test helpers {target}")
                continue
            if me.startswith(TESTING):
                if unit_of(target)[0] >= unit_of("harness.commands")[0]:
                    bad.append(f"{me}:{line} imports {target} (test helpers stay below the commands)")
                continue
            (mine, my_unit), (theirs, their_unit) = unit_of(me), unit_of(target)
            if my_unit == their_unit:
                continue
            if theirs >= mine:
                bad.append(
                    f"{me}:{line} imports {target} (layer {theirs} {their_unit} is not below layer {mine} {my_unit})"
                )
    return bad


def test_every_import_points_down():
    assert violations() == []


def import_graph() -> dict[str, set[str]]:
    """Module -> the harness modules it imports, at module level or inside a function
    (`from harness.a import b` is module harness.a.b where that is a module, else harness.a)."""
    modules = {module_name(p) for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        me, targets = module_name(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
                targets |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("harness")}
        graph[me] = {t for t in targets if t in modules and t != me}
    return graph


def test_no_import_cycle():
    """No two modules import each other, directly or round a loop, not even inside a function: a loop
    hidden in a function-level import is still two modules that cannot be read apart."""
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_a_cycle_would_be_caught():
    graph = import_graph()
    graph["harness.planner.rates"] = graph["harness.planner.rates"] | {"harness.planner.timing"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def test_every_module_has_a_layer():
    for path in ROOT.rglob("*.py"):
        name = module_name(path)
        if name not in ("harness",) and not name.startswith(TESTING):
            unit_of(name)


@pytest.mark.parametrize(
    "module,target",
    [
        ("harness.engine.engine", "harness.frameworks.single.facts"),
        ("harness.spec", "harness.planner.layout"),
        ("harness.report.compare", "harness.compare.parity"),
    ],
)
def test_an_upward_import_would_be_caught(module, target):
    assert unit_of(target)[0] >= unit_of(module)[0]


def test_commands_hold_every_subcommand_and_the_top_stays_small():
    from harness.cli import COMMANDS

    assert all(mod == f"harness.commands.{name}" for name, (mod, _) in COMMANDS.items())
    loose = [p.name for p in ROOT.glob("*.py")]
    assert len(loose) <= 13, loose
    for folder in (p for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{folder.name}/__init__.py docstring"
