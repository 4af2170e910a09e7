"""The shape of the code: no import cycle among the project's modules, no private name taken
from another package by production code, the config schema imports nothing of the project,
CPU-only code lives in the CPU backend, files and the loop stay small. Read from the source
(AST), so it holds without importing anything."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_gspo", "moe")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def sources() -> dict:
    """module name -> (path, AST) of every production module."""
    out = {}
    for package in PACKAGES:
        for base, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(base, f)
                    with open(path) as fh:
                        out[module_name(path)] = (path, ast.parse(fh.read()))
    return out


MODULES = sources()


def type_checking_lines(tree) -> set:
    """Lines inside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def imports(module: str) -> list:
    """(imported project module, names taken from it, line) of every import in ``module``,
    module-level or inside a function (a lazy import runs too); ``from pkg import mod`` counts as
    an import of ``pkg.mod``."""
    path, tree = MODULES[module]
    skip = type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PACKAGES:
            names = []
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in MODULES:
                    out.append((sub, [], node.lineno))
                else:
                    names.append(alias.name)
            if names:
                out.append((node.module, names, node.lineno))
    return out


def graph() -> dict:
    return {m: sorted({target for target, _, _ in imports(m) if target in MODULES and target != m})
            for m in MODULES}


def cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(graph())
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_planted_cycle():
    edges = graph()
    edges["megatron_gspo.config.errors"] = edges["megatron_gspo.config.errors"] + [
        "megatron_gspo.trainer.loop"]
    assert any("megatron_gspo.config.errors" in c for c in cycles(edges))


def package_of(module: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to itself)."""
    path = MODULES[module][0]
    return module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]


def private_imports() -> list:
    """``from X import _name`` (and ``X._name`` on an imported module) where X is another
    package's module."""
    out = []
    for m in MODULES:
        mine = package_of(m)
        aliases = {}
        for target, names, line in imports(m):
            if target in MODULES and package_of(target) != mine:
                for name in names:
                    if name.startswith("_") and not name.startswith("__"):
                        out.append(f"{m}:{line}: {name} from {target}")
        tree = MODULES[m][1]
        for node in ast.walk(tree):  # modules imported whole, then their private attributes
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in MODULES and package_of(sub) != mine:
                        aliases[alias.asname or alias.name] = sub
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                out.append(f"{m}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def test_no_private_name_crosses_a_package():
    assert private_imports() == []


def test_the_config_schema_imports_nothing_of_the_project():
    """The dataclasses and their own checks; what needs other modules is config.checks, run at
    start-up by config.load."""
    for m in MODULES:
        if m.startswith("megatron_gspo.config.") and m not in ("megatron_gspo.config.checks",
                                                               "megatron_gspo.config.load"):
            outside = [t for t, _, _ in imports(m) if not t.startswith("megatron_gspo.config")]
            assert outside == [], (m, outside)


def test_cpu_only_code_lives_in_the_cpu_backend():
    """Outside backends/, no module branches on the CPU: the device's backend is chosen in one
    place (``backends.backend_for``)."""
    offenders = []
    for m, (path, tree) in MODULES.items():
        if m.startswith("megatron_gspo.backends"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value == "cpu" for c in node.comparators):
                offenders.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == [], "\n".join(offenders)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_file_over_450_lines(package):
    long = {m: len(open(p).read().splitlines()) for m, (p, _) in MODULES.items()
            if m.split(".")[0] == package}
    assert {m: n for m, n in long.items() if n > 450} == {}


def function_lines(module: str, name: str) -> int:
    _, tree = MODULES[module]
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return node.end_lineno - node.lineno + 1


def test_the_loop_reads_as_the_algorithm():
    assert function_lines("megatron_gspo.trainer.loop", "train") <= 40
    assert function_lines("megatron_gspo.trainer.loop", "rl_step") <= 20
