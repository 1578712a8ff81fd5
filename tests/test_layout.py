"""The house rules that can be checked mechanically: no import cycles, no switches on class names.

The import graph counts every ``import`` / ``from ... import`` in a module, function-level ones included, so a
cycle hidden behind a late import fails too.
"""

from __future__ import annotations

import ast
import pathlib

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "src"
PACKAGE = SOURCE / "beamsearch"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SOURCE).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {c for c in [target, *(f"{target}.{a.name}" for a in node.names)] if c in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    found.discard(name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as a path that returns to its start, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["beamsearch.engine"]  # the walk found the package and its imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _name_comparisons(source: str) -> list[int]:
    """Lines comparing something's ``.__name__`` (``type(x).__name__ == "T"``, ``cls.__name__ in names``)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare) and any(
        isinstance(part, ast.Attribute) and part.attr == "__name__" for part in [node.left, *node.comparators])]


def test_no_behaviour_switches_on_class_names():
    offenders = [f"{name}:{line}" for name, path in _modules().items() for line in _name_comparisons(path.read_text())]
    assert not offenders, f"compare types with isinstance, not by name: {offenders}"


def test_the_name_check_finds_planted_comparisons():
    assert _name_comparisons("if type(x).__name__ == 'T': pass\nok = cls.__name__ in names") == [1, 2]
    assert _name_comparisons("if __name__ == '__main__': pass\nname = type(x).__name__") == []
