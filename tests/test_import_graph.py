"""The import graph of the `stepd` package: no cycles, and the layers import downward only.

Why this test exists: the core issue counted four import cycles in the package,
the actor runtime's ten modules among them, kept "working" by imports under
``if TYPE_CHECKING:`` and inside functions. A cycle hides the layering: no
module in it can be read, typed or tested without all the others. They are
gone; this keeps them gone, and keeps the layer rules of docs/architecture.md
("Layers") from eroding one convenient import at a time.

It reads the source with `ast` and imports nothing. Folders map to module
names the way pyproject's ``[tool.setuptools] package-dir`` installs them
(``actors/`` is `stepd.actors`, ...). Every import statement counts: at
module level, under ``if TYPE_CHECKING:``, in ``try``/``except``, inside
functions and class bodies. A type-only or function-local import still ties
two modules together; it only hides where.

* Cycles: an edge from a module to one of its own parent packages is left out
  (Python imports the parent package first anyway, so it orders nothing).
* Layers: `LAYER_RULES` over every import, `EAGER_RULES` over what runs at
  import time; each row is a downward rule that holds today.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# -- reading the package --------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """Where an import statement is, and whether it runs when its module is imported."""

    where: str  # path:line
    eager: bool  # not inside a function, nor under `if TYPE_CHECKING:`


@dataclass
class Graph:
    """Modules (name -> file) and imports (importer -> imported module -> sites)."""

    modules: dict[str, Path]
    edges: dict[str, dict[str, list[Site]]] = field(default_factory=dict)

    def targets(self, module: str, *, parents: bool = True, eager: bool = False) -> set[str]:
        """What `module` imports: without its own parent packages unless `parents`;
        only at import time if `eager`."""
        return {
            target
            for target, sites in self.edges.get(module, {}).items()
            if (parents or not module.startswith(target + "."))
            and (not eager or any(site.eager for site in sites))
        }

    def __repr__(self) -> str:  # not the whole graph in a failure's traceback
        return f"<Graph of {len(self.modules)} modules>"

    def where(self, module: str, target: str) -> str:
        return ", ".join(site.where for site in self.edges[module][target])


def installed_modules(root: Path) -> dict[str, Path]:
    """Every module the package installs, by name, as pyproject's setuptools table says.

    A listed package lives in the folder of its longest `package-dir` key that
    is a prefix of it, plus the rest of its dotted name as subfolders.
    """
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    modules: dict[str, Path] = {}
    for package in setuptools["packages"]:
        base = max(
            (key for key in package_dir if key in ("", package) or package.startswith(key + ".")),
            key=len,
            default="",
        )
        rest = package[len(base) :].lstrip(".").split(".") if package != base else []
        folder = root.joinpath(package_dir.get(base, ""), *[part for part in rest if part])
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported_modules(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: Iterable[str]
) -> set[str]:
    """The package's modules one import statement names, relative imports resolved.

    ``import a.b.c`` names the deepest of them that is a module of ours;
    ``from pkg import mod`` names the submodule when `mod` is one, else `pkg`.
    """
    known = set(known)
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
        return found
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, node.module] if node.module else parts)
    else:
        base = node.module or ""
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            found.add(f"{base}.{alias.name}")
        elif base in known:
            found.add(base)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement anywhere in `tree`, and whether it runs at import time."""
    todo: deque[tuple[ast.AST, bool]] = deque([(tree, True)])
    while todo:
        node, eager = todo.popleft()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, eager
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend((child, False) for child in ast.iter_child_nodes(node))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend((child, False) for child in node.body)
            todo.extend((child, eager) for child in node.orelse)
        else:  # module, class bodies, try/except, with, loops, match...
            todo.extend((child, eager) for child in ast.iter_child_nodes(node))


def build_graph(root: Path) -> Graph:
    """Parse every installed module and collect its imports of the package's modules."""
    graph = Graph(installed_modules(root))
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out: dict[str, list[Site]] = {}
        for node, eager in import_statements(tree):
            site = Site(f"{path.relative_to(root)}:{node.lineno}", eager)
            for target in imported_modules(node, module, path.stem == "__init__", graph.modules):
                if target != module:
                    out.setdefault(target, []).append(site)
        graph.edges[module] = out
    return graph


# -- cycles ---------------------------------------------------------------------


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.targets(v, parents=False)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return sorted(found)


def describe_cycles(graph: Graph, components: Iterable[list[str]]) -> str:
    lines = []
    for component in components:
        lines.append(f"{len(component)} modules import each other: {', '.join(component)}")
        for v in component:
            for w in sorted(graph.targets(v, parents=False) & set(component)):
                lines.append(f"  {v} -> {w}  ({graph.where(v, w)})")
    return "\n".join(lines)


# -- layers ---------------------------------------------------------------------


def tree(*packages: str) -> tuple[str, ...]:
    """Patterns for packages and everything under them."""
    return tuple(pattern for package in packages for pattern in (package, package + ".*"))


@dataclass(frozen=True)
class Layer:
    """A set of modules: those matching an `include` pattern and no `exclude` one (fnmatch)."""

    name: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()

    def __contains__(self, module: object) -> bool:
        return isinstance(module, str) and any(
            fnmatch.fnmatchcase(module, p) for p in self.include
        ) and not any(fnmatch.fnmatchcase(module, p) for p in self.exclude)


SANSIO = Layer("stepd.sansio", tree("stepd.sansio"))
#: The generic actor runtime: `stepd.actors` and its private modules, not its daemon.
RUNTIME = Layer("the actor runtime", ("stepd.actors", "stepd.actors._*"))
RUNTIME_PRIVATE = Layer("the actor runtime's private modules", ("stepd.actors._*",))
DAEMON = Layer("stepd.actors.daemon", tree("stepd.actors.daemon"))
STORAGE = Layer("stepd.storage", tree("stepd.storage"))
TRANSPORT = Layer("stepd.transport", tree("stepd.transport"))
#: The public API, ``stepd/`` but `stepd.sansio`: the SDK (`Client`, `Worker`,
#: `Workflow`, `embedded()`, `stepd.channels`), the CLI, `stepd serve` (`stepd.daemon`).
PUBLIC = Layer(
    "the public API (stepd/)",
    ("stepd", "stepd.*"),
    tree("stepd.sansio", "stepd.actors", "stepd.storage", "stepd.transport"),
)
#: What a client or worker process imports: the public API but the server's wiring.
SDK = Layer("the SDK", PUBLIC.include, (*PUBLIC.exclude, "stepd.daemon"))
SERVE = Layer("stepd.daemon (`stepd serve`)", ("stepd.daemon",))

#: (importers, forbidden, why): no module of `importers` imports one of `forbidden`.
#: A module in a forbidden layer itself is not held to the rule.
Rule = tuple[Layer, tuple[Layer, ...], str]

#: Over every import statement, type-only and function-local ones included.
LAYER_RULES: list[Rule] = [
    (SANSIO, (RUNTIME, DAEMON, STORAGE, TRANSPORT, PUBLIC),
     "stepd.sansio is the pure logic, no I/O: the daemon and the SDK both stand on it"),
    (RUNTIME, (DAEMON, STORAGE, TRANSPORT, PUBLIC),
     "the actor runtime is generic: the daemon is built on its public API, never the reverse"),
    (RUNTIME, (Layer("stepd.sansio but its enums", SANSIO.include, ("stepd.sansio.enums",)),),
     "the actor runtime imports nothing of ours but stepd.sansio.enums (docs/architecture.md)"),
    (STORAGE, (SANSIO, RUNTIME_PRIVATE, DAEMON, TRANSPORT, PUBLIC),
     ("storage/ stands below the daemon: of ours it imports only the actor runtime's public "
      "API (`Waiter`; docs/architecture.md says nothing at all)")),
    (DAEMON, (TRANSPORT, PUBLIC),
     "the daemon is called through its API (transport/, stepd.embedded) and never calls up"),
    (TRANSPORT, (PUBLIC,),
     "transport/ frames calls to the daemon's API; the SDK and the server wiring sit above it"),
]

TRANSPORT_BUT_AUTH = Layer(
    "stepd.transport but auth", TRANSPORT.include, ("stepd.transport", "stepd.transport.auth")
)
#: Over the imports that run when a module is imported, followed through the
#: modules they import (and the parent packages those imports load).
EAGER_RULES: list[Rule] = [
    (SDK, (DAEMON, STORAGE, SERVE, TRANSPORT_BUT_AUTH),
     ("a client or worker loads no daemon, LMDB or server: embedded() and `stepd serve` "
      "import them when called (stepd.transport.auth, keys and scopes, is all it shares)")),
]


def _forbidden(module: str, layers: Iterable[Layer]) -> Layer | None:
    return next((layer for layer in layers if module in layer), None)


def layer_violations(graph: Graph, rules: Iterable[Rule]) -> list[str]:
    """Every import that breaks one of `rules`: the importer, where, and why the rule exists.

    Imports of an importer's own parent packages count here: ``from stepd
    import Client`` in the daemon imports the SDK.
    """
    found = []
    for importers, forbidden, why in rules:
        for module in sorted(graph.modules):
            if module not in importers or _forbidden(module, forbidden):
                continue
            for target in sorted(graph.targets(module)):
                layer = _forbidden(target, forbidden)
                if layer is not None:
                    found.append(f"{module} imports {target}, of {layer.name} "
                                 f"({graph.where(module, target)}): {why}")
    return found


def eager_violations(graph: Graph, rules: Iterable[Rule]) -> list[str]:
    """Every importer that loads a forbidden module at import time, with the chain that does."""
    found = []
    for importers, forbidden, why in rules:
        for module in sorted(graph.modules):
            if module not in importers or _forbidden(module, forbidden):
                continue
            came_from: dict[str, str | None] = {module: None}
            todo = deque([module])
            while todo:
                v = todo.popleft()
                parents = {".".join(v.split(".")[:i]) for i in range(1, v.count(".") + 1)}
                for w in sorted(graph.targets(v, eager=True) | parents):
                    if w in graph.modules and w not in came_from:
                        came_from[w] = v
                        todo.append(w)
            for target in sorted(came_from):
                layer = _forbidden(target, forbidden)
                if layer is not None:
                    chain = [target]
                    while (step := came_from[chain[-1]]) is not None:
                        chain.append(step)
                    found.append(f"{' -> '.join(reversed(chain))}, of {layer.name}: {why}")
    return found


# -- the tests ------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOT)


def test_the_graph_sees_the_whole_package(graph: Graph) -> None:
    # If the folder mapping missed modules, "no cycles" would come cheap.
    for name in ("stepd", "stepd.client", "stepd.sansio.run", "stepd.actors._runtime",
                 "stepd.actors.daemon.api", "stepd.storage", "stepd.transport.protocol",
                 "stepd.channels.websocket", "stepd.cli"):
        assert name in graph.modules, name
    assert "stepd.actors._ref" in graph.targets("stepd.actors._system")


def test_the_package_has_no_import_cycle(graph: Graph) -> None:
    found = cycles(graph)
    assert not found, "import cycles (type-only and function-local imports count):\n" + (
        describe_cycles(graph, found)
    )


def test_the_layers_import_downward_only(graph: Graph) -> None:
    found = layer_violations(graph, LAYER_RULES)
    assert not found, "imports against the layers (docs/architecture.md):\n" + "\n".join(found)


def test_the_sdk_loads_the_daemon_only_when_it_runs_one(graph: Graph) -> None:
    found = eager_violations(graph, EAGER_RULES)
    assert not found, "imports at import time against the layers:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "rule", LAYER_RULES + EAGER_RULES, ids=lambda rule: f"{rule[0].name}-{rule[1][0].name}"
)
def test_every_rule_can_fail(graph: Graph, rule: Rule) -> None:
    """A rule no module falls under, or whose every forbidden layer is empty, checks nothing."""
    importers, forbidden, _ = rule
    importer = next(
        m for m in sorted(graph.modules) if m in importers and not _forbidden(m, forbidden)
    )
    check = eager_violations if rule in EAGER_RULES else layer_violations
    for layer in forbidden:
        target = next(m for m in sorted(graph.modules) if m in layer)
        edges = {**graph.edges, importer: {target: [Site("synthetic.py:1", eager=True)]}}
        found = check(Graph(graph.modules, edges), [rule])
        assert any(v.startswith(importer) and f"{target}, of {layer.name}" in v
                   for v in found), (importer, target)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_every_kind_of_import(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pyproject.toml": '[tool.setuptools]\npackage-dir = {"p" = "p", "p.lib" = "lib"}\n'
                          'packages = ["p", "p.sub", "p.lib"]\n',
        "p/__init__.py": "from . import a\n",
        "p/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "p/b.py": "def f():\n    from p.sub import c\n",
        "p/sub/__init__.py": "",
        "p/sub/c.py": "try:\n    from .. import a\nexcept ImportError:\n    pass\n"
                      "class K:\n    import p.lib.d\n",
        "lib/__init__.py": "",
        "lib/d.py": "from p import lib\nimport p.sub.c\n",
    })
    graph = build_graph(tmp_path)
    assert set(graph.modules) == {"p", "p.a", "p.b", "p.sub", "p.sub.c", "p.lib", "p.lib.d"}
    assert graph.targets("p") == {"p.a"}  # `from . import a`: the submodule
    assert graph.targets("p.a") == {"p.b"}  # type-only
    assert graph.targets("p.b") == {"p.sub.c"}  # function-local
    assert graph.targets("p.sub.c") == {"p.a", "p.lib.d"}  # try/except, class body, relative
    assert graph.targets("p.lib.d") == {"p.lib", "p.sub.c"}
    assert graph.targets("p.lib.d", parents=False) == {"p.sub.c"}  # its own package: no order
    assert not graph.edges["p.a"]["p.b"][0].eager
    assert cycles(graph) == [["p.a", "p.b", "p.lib.d", "p.sub.c"]]
    message = describe_cycles(graph, cycles(graph))
    assert "p.b -> p.sub.c  (p/b.py:2)" in message
    assert "p.lib.d -> p.lib" not in message
