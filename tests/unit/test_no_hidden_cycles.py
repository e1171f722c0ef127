"""No import under `if TYPE_CHECKING:` closes a cycle (issue 37, acceptance 6).

`lint-imports` leaves such imports out (`exclude_type_checking_imports`): they are annotations, not dependencies at
run time. So a module may name, for its types only, a module that imports it, and the cycle is in the code but
neither the contracts nor a reader see it. Here every module of the package is parsed; an import under
`if TYPE_CHECKING:` that targets a lorafaas module which, through imports at run time, imports the importing module
again fails the test. Imports inside functions (lazy ones) count as run time: they run.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Known offenders, each (importing module, module imported under TYPE_CHECKING), to be removed when fixed: none.
ALLOWED: tuple[tuple[str, str], ...] = ()


def modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file, for every module and package under `root / package`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _known(name: str, known: dict[str, Path]) -> str | None:
    """`name`, or the closest enclosing module that exists (`pkg.mod.Thing` -> `pkg.mod`); None outside."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(name: str) -> list[str]:
    """Importing `a.b.c` runs `a`, then `a.b`, then `a.b.c`."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def imports(module: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules `module` imports at run time, anywhere in it, the packages they are in included; modules it imports
    under `if TYPE_CHECKING:`), both limited to `known`."""
    is_package = path.name == "__init__.py"
    runtime: set[str] = set()
    typing_only: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if node.level:  # relative: from the module's package, one level up per extra dot
            base_parts = module.split(".") if is_package else module.split(".")[:-1]
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]

    def visit(node: ast.AST, under_type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit(stmt, True)
            for stmt in node.orelse:
                visit(stmt, under_type_checking)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in targets(node):
                found = _known(target, known)
                if found is None:
                    continue
                if under_type_checking:
                    typing_only.add(found)
                else:
                    runtime.update(p for p in _with_parents(found) if p in known)
        for child in ast.iter_child_nodes(node):
            visit(child, under_type_checking)

    visit(ast.parse(path.read_text(), str(path)), False)
    runtime.discard(module)
    typing_only.discard(module)
    return runtime, typing_only


def hidden_cycles(root: Path, package: str) -> dict[tuple[str, str], list[str]]:
    """(importing module, module imported under TYPE_CHECKING) -> the run-time import path back to the importer."""
    known = modules(root, package)
    runtime: dict[str, set[str]] = {}
    typing_only: dict[str, set[str]] = {}
    for name, file in known.items():
        runtime[name], typing_only[name] = imports(name, file, known)
    found: dict[tuple[str, str], list[str]] = {}
    for importer, targets in typing_only.items():
        for target in sorted(targets):
            back: dict[str, str | None] = {target: None}  # breadth first from the target, over run-time imports
            todo = deque([target])
            while todo and importer not in back:
                current = todo.popleft()
                for nxt in sorted(runtime[current]):
                    if nxt not in back:
                        back[nxt] = current
                        todo.append(nxt)
            if importer in back:
                chain: list[str] = []
                step: str | None = importer
                while step is not None:
                    chain.append(step)
                    step = back[step]
                found[importer, target] = [importer, *reversed(chain)]
    return found


def test_no_import_under_type_checking_closes_a_cycle() -> None:
    found = hidden_cycles(REPO, "lorafaas")
    offenders = {edge: path for edge, path in found.items() if edge not in ALLOWED}
    assert not offenders, "\n".join(
        f"{a} imports {b} under TYPE_CHECKING, and {' -> '.join(path[1:])} at run time" for (a, b), path in
        sorted(offenders.items()))


def test_the_check_finds_a_hidden_cycle_a_lazy_one_and_one_through_a_package(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "engine.py": "from pkg import helper\n",  # engine -> helper at run time
        "helper.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import Engine\n",
        "lazy.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import server\n",
        "server.py": "def handler():\n    from . import lazy\n",  # server -> lazy, inside a function
        "sub/__init__.py": "from pkg.sub import inner\n",  # importing pkg.sub.x runs pkg.sub, which imports inner
        "sub/inner.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.user import User\n",
        "user.py": "from pkg.sub.other import thing\n",
        "sub/other.py": "thing = 1\n",
        "fine.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.engine import Engine\n"
                   "else:\n    import pkg.helper\n",  # no cycle: engine does not import fine
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = hidden_cycles(tmp_path, "pkg")
    assert found == {
        ("pkg.helper", "pkg.engine"): ["pkg.helper", "pkg.engine", "pkg.helper"],
        ("pkg.lazy", "pkg.server"): ["pkg.lazy", "pkg.server", "pkg.lazy"],
        ("pkg.sub.inner", "pkg.user"): ["pkg.sub.inner", "pkg.user", "pkg.sub", "pkg.sub.inner"],
    }
