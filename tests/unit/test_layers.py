"""The package's layers, checked from the source: imports run down only.

    CLI (megatrain_ray/__main__.py, its arguments in cli_arguments.py)
      -> megatrain_ray/driver/        trainer, cluster, checkpointing, faults, placement, runtime, parallel
      -> actors/                      thin Ray-or-local shells: HostShard, OptimizerWorker, GPUWorker
      -> data plane                   megatrain_ray/engine/, store/, optim/, data/, quant/
      -> megatrain_ray/model/, config/   pure descriptions
    megatrain_ray/planning/ (memory plan, speed model) reads config + model (+ store layout helpers and
    quant/'s byte counts).
    Leaves anyone may import: observe/ (logs, metrics), system/ (topology, files), exceptions.py,
    dtypes.py, messages.py, units.py, extras.py (how to install an optional extra).

Every .py file under megatrain_ray/ and actors/ is parsed with `ast` (nothing is imported, so the
check is cheap and sees imports that never run): `import x` and `from x import y` anywhere in the
file, at module level, under `if TYPE_CHECKING:` and inside functions, are resolved to module
names (`from a import b` is the module a.b when that file exists, else a). Each rule is one test;
a failure lists every violation as `file:line imports module (rule)`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("megatrain_ray", "actors")
OURS = set(ROOTS)

DATA_PLANE = ("engine", "store", "optim", "data", "quant")
LEAF_MODULES = ("exceptions", "dtypes", "messages", "units", "extras")
LAZY_COMMENT = re.compile(r"#\s*lazy:\s*\S")


@dataclass(frozen=True)
class Import:
    file: str  # path relative to the repository, as in the failure messages
    line: int
    source: str  # the importing module
    target: str  # the imported module, resolved
    in_function: bool
    justified: bool  # a `# lazy: why` comment on the import's lines or the line above

    def violation(self, rule: str) -> str:
        return f"{self.file}:{self.line} imports {self.target} ({rule})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _files() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package."""
    files = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            files[_module_name(path)] = path
    return files


def _comment_lines(text: str) -> set[int]:
    """Lines holding a `# lazy: <why>` comment (real comments, not text inside strings)."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and LAZY_COMMENT.match(tok.string):
            lines.add(tok.start[0])
    return lines


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_of(module: str, path: Path) -> list[Import]:
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    lazy = _comment_lines(text)
    rel = path.relative_to(REPO).as_posix()
    is_package = path.name == "__init__.py"
    known = _files()
    found: list[Import] = []

    def add(node: ast.stmt, target: str, in_function: bool) -> None:
        own_lines = range(node.lineno - 1, (node.end_lineno or node.lineno) + 1)  # the line above, then its own
        found.append(Import(rel, node.lineno, module, target, in_function, any(n in lazy for n in own_lines)))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(child, alias.name, in_function)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, module, is_package)
                targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names}
                for target in sorted(targets):
                    add(child, target, in_function)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


@cache
def _all_imports() -> tuple[Import, ...]:
    return tuple(imp for module, path in _files().items() for imp in _imports_of(module, path))


def _layer(module: str) -> str:
    """The layer a module of ours belongs to: cli, driver, actors, engine/store/optim/data, model, config,
    planning, observe, system, leaf (exceptions, dtypes, messages), root (the package itself); '' for
    anything else (not ours, or a folder no rule knows)."""
    parts = module.split(".")
    if parts[0] == "actors":
        return "actors"
    if parts[0] != "megatrain_ray":
        return ""
    if len(parts) == 1:
        return "root"
    if parts[1] in ("__main__", "cli_arguments"):
        return "cli"
    if parts[1] in LEAF_MODULES:
        return "leaf"
    if parts[1] in ("driver", "planning", "model", "config", "observe", "system", *DATA_PLANE):
        return parts[1]
    return ""


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def _check(rule: str, bad: Iterable[Import]) -> None:
    _report([imp.violation(rule) for imp in bad])


def _report(lines: Iterable[str]) -> None:
    lines = sorted(set(lines), key=_natural)
    if lines:
        pytest.fail(f"{len(lines)} import(s) break the layers:\n" + "\n".join(lines), pytrace=False)


def _natural(line: str) -> tuple:
    file, _, rest = line.partition(":")
    number, _, tail = rest.partition(" ")
    return (file, int(number), tail)


def test_every_module_belongs_to_a_layer():
    """A new top-level folder or module of megatrain_ray/ must be placed in a layer here first."""
    unplaced = sorted(f"{path.relative_to(REPO).as_posix()} ({module})" for module, path in _files().items()
                      if not _layer(module))
    assert not unplaced, "modules no layer rule knows:\n" + "\n".join(unplaced)


def test_only_the_driver_imports_actors_and_actors_never_import_the_driver_or_planning():
    rule_in = "rule 1: only megatrain_ray/driver/ imports actors (the CLI goes through the driver)"
    rule_out = "rule 1: actors never import megatrain_ray.driver, megatrain_ray.planning or the CLI"
    lines = []
    for imp in _all_imports():
        source, target = _layer(imp.source), _layer(imp.target)
        if target == "actors" and source not in ("driver", "actors"):
            lines.append(imp.violation(rule_in))
        if source == "actors" and target in ("driver", "planning", "cli"):
            lines.append(imp.violation(rule_out))
    _report(lines)


def test_data_plane_model_and_config_never_import_driver_planning_or_actors():
    lower = (*DATA_PLANE, "model", "config")
    _check("rule 2: the data plane, model and config never import the driver, planning, actors or the CLI",
           (imp for imp in _all_imports()
            if _layer(imp.source) in lower and _layer(imp.target) in ("driver", "planning", "actors", "cli")))


def test_model_never_imports_the_data_plane_and_config_only_leaves():
    _check("rule 3: model/ never imports store/, engine/, optim/ or data/",
           (imp for imp in _all_imports() if _layer(imp.source) == "model" and _layer(imp.target) in DATA_PLANE))
    allowed = ("config", "system", "observe")
    _check("rule 3: config/ imports only config/, exceptions, dtypes, system/ and observe/",
           (imp for imp in _all_imports()
            if _layer(imp.source) == "config" and _ours(imp.target) and _layer(imp.target) not in allowed
            and imp.target not in ("megatrain_ray.exceptions", "megatrain_ray.dtypes")))


def test_observe_system_and_leaf_modules_import_only_leaves():
    """observe/ is the lowest folder (logging): it imports only exceptions, dtypes, messages and observe/.
    system/ may also import observe/ (topology logs what it pins); nothing of observe/ needs system/, so
    that direction stays closed and the two cannot form a cycle. exceptions.py, dtypes.py and
    messages.py import only each other."""
    allowed = {"leaf": ("leaf",), "observe": ("leaf", "observe"), "system": ("leaf", "observe", "system")}
    _check("rule 4: observe/, system/ and the leaf modules import only leaves below them",
           (imp for imp in _all_imports()
            if _layer(imp.source) in allowed and _ours(imp.target)
            and _layer(imp.target) not in allowed[_layer(imp.source)]))


def test_the_package_never_imports_benchmarks_or_tests():
    _check("rule 5: the package never imports benchmarks or tests",
           (imp for imp in _all_imports() if imp.target.split(".")[0] in ("benchmarks", "tests")))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle of the graph, each once, starting at its smallest module (small graph:
    a depth-first search from each start over the modules not smaller than it)."""
    cycles = []
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    cycles.append(path)
                elif nxt > start and nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    return sorted(cycles)


def test_no_import_cycles_between_our_modules():
    """Module-level, TYPE_CHECKING and function-level imports all count: a function-level import that
    closes a loop only hides it. (Importing a.b also runs a/__init__.py; those implicit edges are left
    out, so a package re-exporting its own submodules is not a cycle.)"""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], list[Import]] = {}
    for imp in _all_imports():
        if _ours(imp.target) and imp.target != imp.source:
            edges.setdefault(imp.source, set()).add(imp.target)
            where.setdefault((imp.source, imp.target), []).append(imp)
    lines = []
    for cycle in _cycles(edges):
        loop = " -> ".join([*cycle, cycle[0]])
        for a, b in zip(cycle, [*cycle[1:], cycle[0]]):
            lines += [imp.violation(f"rule 6: cycle {loop}") for imp in where[(a, b)]]
    _report(lines)


def test_function_level_imports_of_our_modules_say_why_they_are_lazy():
    """`from megatrain_ray... import x` inside a def needs `# lazy: <why>` on its line or the line above
    (e.g. `# lazy: start-up time`, `# lazy: optional extra`); third-party imports inside functions
    (ray, matplotlib, transformers, yaml) need nothing."""
    _check("rule 7: function-level import without a `# lazy: <why>` comment",
           (imp for imp in _all_imports() if imp.in_function and _ours(imp.target) and not imp.justified))


def test_planning_reads_only_config_model_store_and_leaves():
    allowed = ("planning", "config", "model", "store", "quant", "leaf", "observe", "system")
    _check("rule 8: planning/ reads only config/, model/, store/ layout helpers, quant/ byte counts and the leaves",
           (imp for imp in _all_imports()
            if _layer(imp.source) == "planning" and _ours(imp.target) and _layer(imp.target) not in allowed))
