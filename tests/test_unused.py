"""Nothing in the product that only tests use: every function, class and method defined in
agent/ is used somewhere in agent/ itself. A definition only tests, the lab or the benchmarks
call belongs beside them (tests/oracles.py holds the oracles that left this way).

Read from the source (ast), by name: a top-level definition counts as used where its module
names it, where another agent module imports it and names it, or as `module.name` through an
imported module; a method counts as used wherever any agent code reads an attribute of that
name, also as getattr(obj, "name") (a method cannot be traced to its class without types, so a method whose name another
class uses too is taken as used: the check errs towards silence, never towards noise)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.builders import ROOT

# Entry points and protocol methods: called by name from outside agent/'s own code.
ALLOWED = {
    "agent/ops/httpserve.py BoundedServer.process_request",  # socketserver.BaseServer calls these
    "agent/ops/httpserve.py BoundedServer.process_request_thread",
    "agent/ops/httpserve.py BoundedServer.handle_error",
}


def unused(package: Path) -> list[str]:
    """Definitions in `package` (a directory) that nothing else in it uses, as
    "<path> <name>" (path relative to the package's parent, name Class.method for methods)."""
    base = package.parent
    trees = {p.relative_to(base).as_posix(): ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}
    modules = {path.removesuffix(".py").removesuffix("/__init__").replace("/", "."): path for path in trees}
    names: dict[tuple[str, str], int] = defaultdict(int)  # (module path, top-level name) -> uses
    attributes: dict[str, int] = defaultdict(int)  # attribute name -> reads anywhere
    for path, tree in trees.items():
        local = _bindings(tree, modules, path)  # local name -> (module path, name) or (module path, "")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attributes[node.attr] += 1
                owner = local.get(node.value.id) if isinstance(node.value, ast.Name) else None
                if owner is not None and owner[1] == "":
                    names[(owner[0], node.attr)] += 1
            elif isinstance(node, ast.Name):
                names[local.get(node.id, (path, node.id))] += 1
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                attributes[node.args[1].value] += 1  # getattr(obj, "name"): a read by name
    found = []
    for path, tree in trees.items():
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if names[(path, node.name)] <= _self_uses(node, node.name):
                found.append(f"{path} {node.name}")
            for sub in node.body if isinstance(node, ast.ClassDef) else ():
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _dunder(sub.name) \
                        and attributes[sub.name] <= _self_uses(sub, sub.name, attribute=True):
                    found.append(f"{path} {node.name}.{sub.name}")
    return found


def _bindings(tree: ast.Module, modules: dict[str, str], path: str) -> dict[str, tuple[str, str]]:
    """What a file's imports of the package bind: a name to (module, name), a module to (module, "")."""
    bound: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                local = alias.asname or alias.name
                if f"{node.module}.{alias.name}" in modules:
                    bound[local] = (modules[f"{node.module}.{alias.name}"], "")
                elif node.module in modules:
                    bound[local] = (modules[node.module], alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = (modules[alias.name], "")
    return bound


def _self_uses(node: ast.AST, name: str, attribute: bool = False) -> int:
    """Uses of a name inside its own definition (recursion is no use)."""
    kind = ast.Attribute if attribute else ast.Name
    return sum(1 for n in ast.walk(node) if isinstance(n, kind) and (n.attr if attribute else n.id) == name)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def test_every_definition_in_the_agent_is_used_by_the_agent() -> None:
    found = [f for f in unused(ROOT / "agent") if f not in ALLOWED]
    assert found == [], "used only from tests, the lab, the benchmarks, or nowhere: move them there or delete them"


def test_the_allow_list_names_real_definitions() -> None:
    # An entry point renamed away must leave the list too, or the list hides a new one.
    found = set(unused(ROOT / "agent"))
    assert ALLOWED <= found


def test_the_finder_can_fail(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "lib.py").write_text(
        "def used(): return 1\n"
        "def only_tests(): return only_tests()\n"  # recursion alone is no use
        "def through_module(): return 3\n"
        "class Thing:\n"
        "    def read(self): return self.helper()\n"
        "    def helper(self): return 2\n"
        "    def orphan(self): return self.orphan()\n"
        "    def probed(self): return 4\n"
        "    def __repr__(self): return 'Thing'\n")
    (pkg / "main.py").write_text(
        "from pkg.sub.lib import Thing, used\n"
        "from pkg.sub import lib\n"
        "def run(): return used() + lib.through_module() + Thing().read() + getattr(Thing(), 'probed')()\n")
    assert sorted(unused(pkg)) == ["pkg/main.py run", "pkg/sub/lib.py Thing.orphan", "pkg/sub/lib.py only_tests"]
