"""The design's dependency rules, read from every module's imports (relative and lazy ones included) with ast.

apps -> loading -> pipeline -> accel, models, tokenizers; apps -> train -> models, tokenizers. A
decoding method sees only the written interfaces (visar.models.base, visar.tokenizers.base) and the
two model helpers a method needs (the MAR diffusion step, ZipAR's window check), never a concrete
model file, the loader, eval or apps; the pipeline knows no training data, nor how a model loads
(families, the Hub, checkpoints: visar.loading); training code imports no decoding method, loader,
eval or app, and nothing below it imports training; models and tokenizers import nothing above them;
and no module imports itself back through others. The arrows block at the top of
docs/ARCHITECTURE.md is read too, and must say what the imports do. (Importing a subpackage and
looking at sys.modules would not do: visar/__init__.py imports the loader and the pipeline, which
import nearly everything.) And the tests keep their shared helpers in helper modules (tests/laws.py,
conftest.py, ...): no test module imports another.
"""

import ast
from pathlib import Path

import pytest

import visar

PACKAGE = Path(visar.__file__).parent
TESTS = Path(__file__).resolve().parent


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def imports_of(module: str) -> set[str]:
    """Every visar module `module` imports, at the top or inside functions."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = (
                node.module if node.level == 0 else resolve(module, path.name == "__init__.py", node.level, node.module)
            )
            for alias in node.names:  # `from . import x` imports the submodule x when there is one
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in MODULES else source)
    return {name for name in found if name == "visar" or name.startswith("visar.")}


GRAPH = {module: imports_of(module) for module in MODULES}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# What a decoding method may read of models and tokenizers: the interfaces, and beside them the diffusion
# transition that MAR's sampling and cspd's verification share and ZipAR's window check (check_lag).
INTERFACES = {"visar.models.base", "visar.tokenizers.base", "visar.models.diffusion", "visar.models.lag_mask"}
# (who, what it must not import); a module matches a rule when it is the name or lies inside it.
RULES = [
    ("visar.accel", "visar.pipeline"),
    ("visar.accel", "visar.loading"),
    ("visar.accel", "visar.registry"),
    ("visar.accel", "visar.families"),
    ("visar.accel", "visar.checkpoints"),
    ("visar.accel", "visar.eval"),
    ("visar.accel", "visar.apps"),
    ("visar.accel", "visar.data"),
    ("visar.accel", "visar.models"),  # but for INTERFACES
    ("visar.accel", "visar.tokenizers"),  # but for INTERFACES
    ("visar.pipeline", "visar.data"),
    ("visar.pipeline", "visar.eval"),
    ("visar.pipeline", "visar.apps"),
    *[
        ("visar.pipeline", loader)
        for loader in ("visar.loading", "visar.families", "visar.registry", "visar.hub", "visar.checkpoints")
    ],
    *[("visar.train", high) for high in ("visar.accel", "visar.pipeline", "visar.loading", "visar.eval", "visar.apps")],
    *[
        (low, "visar.train")
        for low in (
            "visar.models",
            "visar.tokenizers",
            "visar.families",
            "visar.accel",
            "visar.loading",
            "visar.pipeline",
            "visar.eval",
        )
    ],
    *[
        (low, high)
        for low in ("visar.models", "visar.tokenizers", "visar.families")
        for high in ("visar.accel", "visar.eval", "visar.apps", "visar.loading", "visar.pipeline", "visar.data")
    ],
    *[(low, high) for low in ("visar.models", "visar.tokenizers") for high in ("visar.registry", "visar.families")],
]


def forbids(who: str, forbidden: str, name: str) -> bool:
    """Does the rule (who, forbidden) forbid importing `name`?"""
    return within(name, forbidden) and not (who == "visar.accel" and name in INTERFACES)


def violations() -> list[str]:
    found = []
    for module, imported in GRAPH.items():
        for who, forbidden in RULES:
            if not within(module, who):
                continue
            for name in imported:
                if forbids(who, forbidden, name):
                    found.append(f"{module} imports {name} (rule: {who} must not import {forbidden})")
    return found


def read_arrows(text: str) -> dict[str, set[str]]:
    """The arrows block (the first fenced block of docs/ARCHITECTURE.md): part -> what it may import.
    `visar/apps  words  -> pipeline, models/base.py` gives visar.apps -> {visar.pipeline, visar.models.base}."""
    arrows = {}
    for line in text.split("```")[1].strip().splitlines():
        name, _, targets = line.partition("->")
        part = "visar." + name.split()[0].removeprefix("visar/")
        targets = [t.strip().removesuffix(" only").removesuffix(".py") for t in targets.split(",") if t.strip()]
        arrows[part] = {"visar." + t.replace("/", ".") for t in targets}
    return arrows


ARROWS = read_arrows((PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text())
LEAVES = {"visar.errors", "visar.progress"}  # what every part may import
TOP = {"visar", "visar.__main__"}  # the package's re-exports and `python -m visar`: no part of the design


def part_of(module: str) -> str | None:
    return next((part for part in ARROWS if within(module, part)), None)


def imports_through_the_top(module: str) -> set[str]:
    """`module`'s imports, `import visar` counted as what the package re-exports (visar/__init__.py)."""
    return set().union(*(GRAPH["visar"] if name == "visar" else {name} for name in GRAPH[module]))


def off_the_arrows() -> list[str]:
    """Imports that follow no arrow of their part (nor stay inside it, nor go to a leaf)."""
    found = []
    for module in GRAPH:
        part = part_of(module)
        if part is None:
            continue
        for name in sorted(imports_through_the_top(module)):
            if not (within(name, part) or name in LEAVES or any(within(name, target) for target in ARROWS[part])):
                found.append(f"{module} imports {name}: docs/ARCHITECTURE.md has no arrow {part} -> {part_of(name)}")
    return found


def stale_arrows() -> list[str]:
    """Arrows that no import follows: the block must not claim a dependency the code does not have."""
    followed = {
        (part_of(module), target)
        for module in GRAPH
        for name in imports_through_the_top(module)
        for target in ARROWS.get(part_of(module), ())
        if within(name, target)
    }
    return [
        f"{part} -> {target}"
        for part, targets in ARROWS.items()
        for target in targets
        if (part, target) not in followed
    ]


def arrows_against_rules() -> list[str]:
    """Arrows that a rule forbids (a rule on the part, or on a module inside it)."""
    return [
        f"{part} -> {target} (rule: {who} must not import {forbidden})"
        for part, targets in ARROWS.items()
        for target in targets
        for who, forbidden in RULES
        if (within(part, who) or within(who, part)) and forbids(who, forbidden, target)
    ]


def cycles() -> list[list[str]]:
    """Import cycles among modules (a package importing its own submodules, and a submodule its
    package's __init__ back, counts)."""
    found, state = [], {}

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for name in sorted(GRAPH.get(module, ())):
            if name == module or name not in GRAPH or name == "visar":
                continue  # the top package only re-exports (visar/__init__.py)
            if state.get(name) == "open":
                found.append(stack[stack.index(name) :] + [name])
            elif name not in state:
                visit(name, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])
    return found


def test_the_import_reader_sees_relative_and_lazy_imports():
    """The reader must see what the rules talk about, or every rule passes vacuously."""
    assert "visar.accel.core.scoring" in GRAPH["visar.accel.raster.chain"]  # from .scoring import ...
    assert "visar.models.base" in GRAPH["visar.accel.raster.static_tree"]  # from ...models.base import ...
    assert "visar.accel.raster.static_tree" in GRAPH["visar.accel.raster.methods.relaxed"]  # imported inside lantern_pp
    assert "visar.registry" in GRAPH["visar.loading"]  # from . import hub, registry
    assert {"visar.accel.raster.methods.jacobi", "visar.accel.raster.zipar"} <= GRAPH[
        "visar.accel"
    ]  # from .raster.methods import jacobi, ...


def test_dependency_rules():
    assert violations() == []


def test_the_arrows_block_is_read():
    assert ARROWS["visar.accel"] == {
        "visar.models.base",
        "visar.models.diffusion",
        "visar.models.lag_mask",
        "visar.tokenizers.base",
    }
    assert {"visar.loading", "visar.train", "visar.models.base"} <= ARROWS["visar.apps"]
    assert ARROWS["visar.models"] == ARROWS["visar.tokenizers"] == {"visar.configs"}
    assert ARROWS["visar.configs"] == set() and "visar.hub" in ARROWS


def test_every_module_lies_in_a_part_of_the_arrows_block():
    assert [module for module in MODULES if part_of(module) is None and module not in TOP | LEAVES] == []


def test_imports_follow_the_arrows_block():
    assert off_the_arrows() == []


def test_every_arrow_is_followed_by_an_import():
    assert stale_arrows() == []


def test_the_arrows_allow_nothing_the_rules_forbid():
    assert arrows_against_rules() == []


def test_each_arrows_check_catches_its_violation(monkeypatch):
    """Negative controls: an import off the arrows, an arrow no import follows, an arrow a rule forbids."""
    monkeypatch.setitem(GRAPH, "visar.train.loop", GRAPH["visar.train.loop"] | {"visar.families"})
    assert any("visar.train.loop imports visar.families" in line for line in off_the_arrows())
    monkeypatch.setitem(ARROWS, "visar.data", {"visar.hub"})
    assert stale_arrows() == ["visar.data -> visar.hub"]
    monkeypatch.setitem(ARROWS, "visar.train", ARROWS["visar.train"] | {"visar.pipeline"})
    assert any(line.startswith("visar.train -> visar.pipeline") for line in arrows_against_rules())


def test_no_import_cycles():
    assert cycles() == []


@pytest.mark.parametrize(
    "module, extra, expected",
    [
        ("visar.accel.raster.chain", "visar.pipeline", "visar.accel.raster.chain imports visar.pipeline"),
        ("visar.accel.raster.zipar", "visar.models.llamagen", "rule: visar.accel must not import visar.models"),
        ("visar.accel.raster.chain", "visar.models.kv_cache", "rule: visar.accel must not import visar.models"),
        ("visar.accel.masked.loop", "visar.models.outputs", "rule: visar.accel must not import visar.models"),
        ("visar.pipeline", "visar.data.shapes", "visar.pipeline imports visar.data.shapes"),
        ("visar.pipeline", "visar.families", "visar.pipeline imports visar.families"),
        ("visar.accel.raster.chain", "visar.loading", "visar.accel.raster.chain imports visar.loading"),
        ("visar.train.raster", "visar.accel.raster.zipar", "visar.train.raster imports visar.accel.raster.zipar"),
        ("visar.train.continuous", "visar.pipeline", "rule: visar.train must not import visar.pipeline"),
        ("visar.eval.fid", "visar.train.loop", "rule: visar.eval must not import visar.train"),
        ("visar.models.llamagen", "visar.eval.bench", "visar.models.llamagen imports visar.eval.bench"),
    ],
)
def test_each_rule_catches_its_violation(monkeypatch, module, extra, expected):
    """Negative control: one forbidden import added to the graph is reported."""
    monkeypatch.setitem(GRAPH, module, GRAPH[module] | {extra})
    assert any(expected in line for line in violations())


def test_a_cycle_is_caught(monkeypatch):
    monkeypatch.setitem(GRAPH, "visar.eval.sweep", GRAPH["visar.eval.sweep"] | {"visar.eval.fid"})
    monkeypatch.setitem(GRAPH, "visar.eval.fid", GRAPH["visar.eval.fid"] | {"visar.eval.sweep"})
    assert any({"visar.eval.sweep", "visar.eval.fid"} <= set(cycle) for cycle in cycles())


def imported_test_modules(source: str) -> set[str]:
    """The test modules (test_*) a file's source imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return {name for name in found if name.startswith("test_")}


def test_no_test_module_imports_another():
    """A test module imported by another runs twice under two names and ties the files together:
    what tests share lives in a helper module (tests/laws.py for the tiny models and exact laws)."""
    found = {
        path.relative_to(TESTS).as_posix(): imported_test_modules(path.read_text())
        for path in sorted(TESTS.rglob("test_*.py"))
    }
    assert {name: sorted(modules) for name, modules in found.items() if modules} == {}


def test_the_test_import_rule_sees_every_form():
    """Negative control: each way of importing a test module is reported; a helper module is not."""
    for source in [
        "from test_jacobi import tiny_llamagen",
        "import test_jacobi",
        "import test_jacobi as jacobi_tests",
        "import numpy, test_jacobi.sub",
        "def helper():\n    from test_jacobi import exact_law\n",
    ]:
        assert imported_test_modules(source) == {"test_jacobi"}, source
    assert imported_test_modules("from laws import exact_law\nimport conftest") == set()


def test_no_function_in_accel_or_the_pipeline_is_longer_than_60_lines_nor_class_than_150():
    """A decoding method reads as small parts: a function past 60 lines is a loop or a check that
    wants a name of its own (the engines' loops are one, `pass_loop.decode_passes`), and an engine
    class past 150 lines holds what a helper of its own should (`SlotState`, a pass's shape). The
    pipeline too: `Pipeline` holds its state and public methods, its steps are functions beside it."""
    long = []
    for path in sorted([*(PACKAGE / "accel").rglob("*.py"), *(PACKAGE / "pipeline").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 150 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


KIND_FOLDERS = {"raster": "raster", "masked": "masked", "continuous": "continuous", "next-scale": "next_scale"}
ENGINES = ("pass_loop", "chain", "tree_passes", "static_tree", "zipar.engine", "zipar.plan", "zipar.tree_fronts")


def test_accel_folders_hold_what_their_names_say():
    """A newcomer finds a method by its kind's folder: every registered method's function lives in
    accel/<kind>/ (auto, the policy, in accel/policy/); core/ imports no kind's folder; the
    engines register no method (their methods are wrappers elsewhere)."""
    from visar.accel import METHODS

    misplaced = []
    for name, method in METHODS.items():
        folder = "policy" if name == "auto" else KIND_FOLDERS[method.model_kind]
        if not method.fn.__module__.startswith(f"visar.accel.{folder}."):
            misplaced.append(f"{name}: {method.fn.__module__}")
        if method.fn.__module__.removeprefix("visar.accel.raster.") in ENGINES:
            misplaced.append(f"{name} is registered in an engine module, {method.fn.__module__}")
    assert not misplaced, misplaced
    kinds = {f"visar.accel.{folder}" for folder in (*KIND_FOLDERS.values(), "policy")}
    core = {name: deps for name, deps in GRAPH.items() if within(name, "visar.accel.core")}
    assert core and not any(within(dep, kind) for deps in core.values() for dep in deps for kind in kinds), core
