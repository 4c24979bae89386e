"""The shape of the code, held by a test: which package may import which, no import cycles, and
no function so long that it hides more than one idea (in the packages and in bench/).

Imports are read from the source (ast), every `import` and `from ... import` of a module,
those inside functions too (a lazy import still runs). Those under `if TYPE_CHECKING:` never
run: they count only for cycles (a loop of type-only imports still ties two modules together).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the repository's folders and the names they are installed under: one import name, `conveyor`
PACKAGES = {
    "conveyor": "conveyor",
    "api": "conveyor.api",
    "engine": "conveyor.engine",
    "kernels": "conveyor.kernels",
    "ledger": "conveyor.ledger",
    "migrations": "conveyor.migrations",
    "worker": "conveyor.worker",
}
SERVICE_LAYERS = ("conveyor.api", "conveyor.ledger", "conveyor.worker", "conveyor.dispatch")
WEB_AND_DATABASE = ("fastapi", "starlette", "sqlalchemy", "alembic", "psycopg", "celery", "redis")
LONGEST_FUNCTION = 60  # lines; a longer one says why in a comment starting "# long:"
SAYS_WHY = re.compile(r"#\s*long:")


def module_files() -> dict[str, Path]:
    files = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


MODULES = module_files()
# the benchmark scripts and their common modules: held to the same length, outside the graph
BENCH_MODULES = {f"bench.{p.stem}": p for p in sorted((ROOT / "bench").glob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    yield from _imports_in(ast.iter_child_nodes(tree), type_only)


def _imports_in(nodes: Iterable[ast.AST], type_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in nodes:
        if isinstance(node, ast.If) and _type_checking(node) and not type_only:
            yield from _imports_in(node.orelse, type_only)  # the else branch runs
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports_in(ast.iter_child_nodes(node), type_only)


def _lazy_imports(tree: ast.AST) -> set[str]:
    """Project modules a module imports by name at run time (`importlib.import_module` and a
    lazy `__getattr__` over a table of module names): every string in it that names one."""
    calls = any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "import_module"
        for node in ast.walk(tree)
    )
    if not calls:
        return set()
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES
    }


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports(module: str, type_only: bool = False) -> frozenset[str]:
    """What `module` imports (with `type_only`, under `if TYPE_CHECKING:` too): project
    modules by their full name, anything else by its top-level name."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found = _lazy_imports(tree)
    for node in _import_nodes(tree, type_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        source = _resolve(module, node)
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            found.add(submodule if submodule in MODULES else source)
    return frozenset(name if name in MODULES else name.split(".")[0] for name in found)


def project_imports(module: str, type_only: bool = False) -> set[str]:
    return {name for name in imports(module, type_only) if name in MODULES}


@cache
def reaches(module: str) -> frozenset[str]:
    """Everything `module` imports, directly or through the project's modules."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                if name in MODULES:
                    todo.append(name)
    return frozenset(seen)


def cycles(type_only: bool = True) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), through type-only
    imports too unless told otherwise."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(project_imports(v, type_only)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in project_imports(v, type_only):
                groups.append(sorted(group))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    return groups


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offenders(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """Modules of `packages` that reach one of `forbidden`, with what they reach."""
    found = {}
    for module in MODULES:
        if any(in_package(module, p) for p in packages):
            bad = sorted(
                name for name in reaches(module) if any(in_package(name, f) for f in forbidden)
            )
            if bad:
                found[module] = bad
    return found


def test_the_import_graph_is_read() -> None:
    # the checks below mean something only if the graph is what the code says
    assert "conveyor.api.app" in MODULES and "conveyor.engine.llm_engine" in MODULES
    assert "conveyor.dispatch.celery_app" in project_imports("conveyor.api.app")
    assert "torch" in reaches("conveyor.engine.llm_engine")
    assert "sqlalchemy" in reaches("conveyor.ledger.batch_lifecycle")


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_the_api_imports_neither_the_worker_nor_torch() -> None:
    forbidden = ("conveyor.worker", "torch", "conveyor.engine", "conveyor.kernels", "transformers")
    assert offenders(("conveyor.api",), forbidden) == {}


def test_the_engine_and_kernels_import_no_service_layer() -> None:
    engine = ("conveyor.engine", "conveyor.kernels")
    assert offenders(engine, SERVICE_LAYERS + WEB_AND_DATABASE) == {}


def test_the_wire_format_imports_no_torch_database_or_web_framework() -> None:
    forbidden = ("torch", "transformers", *(f"conveyor.{p}" for p in ("engine", "kernels")))
    forbidden += SERVICE_LAYERS[:3]
    assert offenders(("conveyor.wire_format",), forbidden + WEB_AND_DATABASE) == {}


# ---- layers ------------------------------------------------------------------------------------
# Each layer in a sentence, bottom first, and the layers below it that it may import (its own
# modules import each other freely). Nothing imports a layer above it, so no folder is both
# above and below another.
LAYERS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "leaves": (
        "the OpenAI wire format (bodies, lines, results, errors; batch and online) and what "
        "every layer shares (settings, logs, names): they import nothing of the project",
        ("conveyor.wire_format", "conveyor.settings", "conveyor.logs", "conveyor.version",
         "conveyor.env_args", "conveyor.served_names", "conveyor.demo_model"),
        (),
    ),
    "kernels": ("paged attention, by device", ("conveyor.kernels",), ()),
    "engine": (
        "the paged-KV engine, a library that knows nothing of the service",
        ("conveyor.engine",),
        ("kernels",),
    ),
    "ledger": (
        "the durable truth and the transport of work: the database, its migrations, the queues",
        ("conveyor.ledger", "conveyor.migrations", "conveyor.dispatch"),
        ("leaves",),
    ),
    "requests": (
        "what becomes of a request in the engine, from its line to its result",
        ("conveyor.request_outcome", "conveyor.batch_runner"),
        ("leaves", "kernels", "engine"),
    ),
    "service": (
        "the service's processes: the API (never the engine) and the worker",
        ("conveyor.api", "conveyor.worker"),
        ("leaves", "kernels", "engine", "ledger", "requests"),
    ),
    "top": (
        "what people run and call: the CLI, the HTTP client, the lm-eval model, the test "
        "harness, and the package's own lazy exports",
        ("conveyor.cli", "conveyor.__main__", "conveyor.client", "conveyor.lm_eval_model",
         "conveyor.testing", "conveyor"),
        ("leaves", "kernels", "engine", "ledger", "requests", "service"),
    ),
}  # fmt: skip


def layer_of(module: str) -> str | None:
    """The layer of `module`: the one naming the package that holds it (`conveyor` names only
    the package's own `__init__`); None for a module no layer names."""
    for name, (_, packages, _) in LAYERS.items():
        for package in packages:
            if module == package or (package != "conveyor" and in_package(module, package)):
                return name
    return None


def layer_violations() -> list[str]:
    found = []
    for module in MODULES:
        layer = layer_of(module)
        if layer is None:
            continue  # test_every_module_has_a_layer names it
        allowed = {layer, *LAYERS[layer][2]}
        for name in sorted(project_imports(module)):
            if layer_of(name) not in allowed:
                found.append(f"{module} ({layer}) imports {name} ({layer_of(name)})")
    return found


def test_every_module_has_a_layer() -> None:
    assert [module for module in MODULES if layer_of(module) is None] == []
    assert layer_of("conveyor.new_module") is None  # a new module is placed on purpose


def test_no_layer_imports_one_above_it() -> None:
    assert layer_violations() == []


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("conveyor.ledger.models", "conveyor.worker.runtime"),  # the truth reaching up
        ("conveyor.wire_format.errors", "conveyor.settings"),  # a leaf leaning on a leaf: fine
        ("conveyor.engine.llm_engine", "conveyor.wire_format.errors"),  # the engine on the wire
    ],
)
def test_a_layer_violation_is_found(module: str, planted: str, monkeypatch) -> None:
    real = project_imports
    monkeypatch.setitem(
        globals(),
        "project_imports",
        lambda m, t=False: real(m, t) | ({planted} if m == module else set()),
    )
    found = any(v.startswith(f"{module} (") and planted in v for v in layer_violations())
    assert found == (planted != "conveyor.settings")


def long_functions() -> list[str]:
    found = []
    for module, path in (MODULES | BENCH_MODULES).items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            said_why = any(SAYS_WHY.search(line) for line in lines[start - 2 : node.end_lineno])
            if length > LONGEST_FUNCTION and not said_why:
                found.append(f"{module}.{node.name} ({length} lines)")
    return found


def test_no_function_is_long_without_saying_why() -> None:
    assert long_functions() == []


@pytest.mark.parametrize(
    "module", ["conveyor.worker.runtime", "conveyor.api.batch_create", "bench.pipeline"]
)
def test_a_long_function_is_found(module: str, tmp_path: Path, monkeypatch) -> None:
    # the length check sees a function grown past the limit in a real module
    files = BENCH_MODULES if module in BENCH_MODULES else MODULES
    source = files[module].read_text() + "\n\ndef grown():\n" + "    x = 1\n" * 70
    path = tmp_path / "grown.py"
    path.write_text(source)
    monkeypatch.setitem(files, module, path)
    assert f"{module}.grown (71 lines)" in long_functions()


def test_a_cycle_is_found(monkeypatch) -> None:
    # ledger.models importing the API would close a loop through the API's own imports
    real = project_imports
    added = {"conveyor.ledger.models": {"conveyor.api.app"}}
    monkeypatch.setitem(
        globals(), "project_imports", lambda m, t=False: real(m, t) | added.get(m, set())
    )
    assert any({"conveyor.api.app", "conveyor.ledger.models"} <= set(group) for group in cycles())


def test_a_type_only_cycle_is_found(tmp_path: Path, monkeypatch) -> None:
    # the loop that was: the block manager naming a type of the module that imports it
    module = "conveyor.engine.block_manager"
    path = tmp_path / "block_manager.py"
    path.write_text(
        MODULES[module].read_text()
        + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        + "    from conveyor.engine.prompt_logprobs import PromptLogprobs\n"
    )
    monkeypatch.setitem(MODULES, module, path)
    imports.cache_clear()
    try:
        assert "conveyor.engine.prompt_logprobs" not in project_imports(module)  # never runs
        group = {module, "conveyor.engine.prompt_logprobs"}
        assert any(group <= set(g) for g in cycles())
        assert not any(group <= set(g) for g in cycles(type_only=False))
    finally:
        imports.cache_clear()
        reaches.cache_clear()


# ---- one import name --------------------------------------------------------------------------
OLD_TOP_LEVEL = {folder for folder in PACKAGES if folder != "conveyor"}
TEST_MODULES = {
    ".".join(p.relative_to(ROOT).with_suffix("").parts): p
    for p in sorted(ROOT.glob("tests/**/*.py"))
}


def top_level_imports(files: dict[str, Path]) -> dict[str, list[str]]:
    """Modules that import a folder by its own name (`engine.x`) instead of `conveyor.engine.x`:
    installed, no such name exists."""
    found = {}
    for module, path in files.items():
        names = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif not node.level and node.module:
                names.add(node.module)
        bad = sorted(n for n in names if n.split(".")[0] in OLD_TOP_LEVEL)
        if bad:
            found[module] = bad
    return found


def test_everything_is_imported_under_conveyor() -> None:
    assert top_level_imports(MODULES | BENCH_MODULES | TEST_MODULES) == {}


def test_an_import_outside_conveyor_is_found(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("import os\nfrom engine.llm import LLM\nimport worker.main\n")
    assert top_level_imports({"planted": planted}) == {"planted": ["engine.llm", "worker.main"]}


def test_the_package_list_covers_every_folder() -> None:
    # a package missing from pyproject's list would be missing from the wheel
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {name: folder for folder, name in PACKAGES.items()}
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    listed = set(config["packages"])
    assert packages <= listed
    for data in listed - packages:  # a folder of data files inside a package, shipped with it
        parent, _, folder = data.rpartition(".")
        assert parent in packages and (MODULES[parent].parent / folder).is_dir(), data


def planted_imports(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> frozenset[str]:
    """What the import reader finds in `source`, planted as a module of the API."""
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    monkeypatch.setitem(MODULES, "conveyor.api.planted", planted)
    imports.cache_clear()
    try:
        return imports("conveyor.api.planted")
    finally:
        imports.cache_clear()


def test_an_import_in_the_else_of_type_checking_is_read(tmp_path: Path, monkeypatch) -> None:
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nelse:\n"
        "    import transformers\n    from conveyor.worker import main\n"
    )
    found = planted_imports(source, tmp_path, monkeypatch)
    assert {"transformers", "conveyor.worker.main"} <= found and "torch" not in found


def test_a_lazy_import_by_name_is_read(tmp_path: Path, monkeypatch) -> None:
    # engine/__init__'s lazy __getattr__ reaches its modules through a table of names
    assert "conveyor.engine.llm" in imports("conveyor.engine")
    source = (
        "import importlib\nTABLE = {'x': 'conveyor.worker.main'}\n"
        "def __getattr__(name):\n    return importlib.import_module(TABLE[name])\n"
    )
    found = planted_imports(source, tmp_path, monkeypatch)
    assert "conveyor.worker.main" in found


def test_only_a_comment_says_why_a_function_is_long(tmp_path: Path, monkeypatch) -> None:
    # a parameter named `long` is not a reason
    body = "    x = 1\n" * 70
    planted = tmp_path / "planted.py"
    planted.write_text(f"def f(long: str):\n{body}\n\ndef g():\n    # long: one table\n{body}")
    monkeypatch.setitem(MODULES, "conveyor.planted", planted)
    found = long_functions()
    assert "conveyor.planted.f (71 lines)" in found
    assert not any(name.startswith("conveyor.planted.g") for name in found)


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """What the package imports, it declares (in its dependencies or an extra): nothing rides
    in on another package's requirements."""
    import ast
    import sys
    from importlib import metadata

    def name(requirement: str) -> str:
        return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    declared = {name(r) for r in metadata.requires("conveyor") or []}
    owners = metadata.packages_distributions()
    undeclared = set()
    for folder in ("api", "conveyor", "engine", "kernels", "ledger", "worker", "migrations"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top in sys.stdlib_module_names or top == "conveyor":
                        continue
                    if not {name(d) for d in owners.get(top, [top])} & declared:
                        undeclared.add(f"{top} ({path.relative_to(ROOT)})")
    assert sorted(undeclared) == []
