"""The test suite's own rules (issue 27: tests that can fail): every test checks something it could get wrong.

A ``test_*`` function, at module level or in a class, passes this check when its own body (not a function or
class nested in it, which might never run) holds at least one of:

- an ``assert`` statement;
- ``pytest.raises`` or ``pytest.warns``, as a ``with`` or called;
- a library's own check: ``torch.testing.assert_*`` (``assert_close``), ``numpy.testing.assert_*``;
- a call to a helper named ``assert_*`` or ``check_*`` (leading underscores allowed) that is defined at module
  level in the same file or imported from a helper module in tests/, and that itself checks something by these
  same rules: a helper named ``assert_x`` that asserts nothing does not count.

A test whose whole body is ``pytest.skip(...)`` is exempt; a test that skips only sometimes is not.

And the package's own shape (issue 27: the house), each module of ``lightning_fuse`` one job: no module over 300
lines of code (docstrings, comments and blank lines aside), none importing more than 8 of the package's other
modules, and no cycle of imports; an import under ``if TYPE_CHECKING:``, which names types for annotations and never
runs, counts as an import all the same (a module that names many others' types depends on them).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

TESTS = Path(__file__).parent
PYTEST_CHECKS = ("pytest.raises", "pytest.warns")
LIBRARY_CHECKS = ("torch.testing.", "numpy.testing.", "np.testing.")  # then assert_*: they raise on a mismatch


def helper_name(name: str) -> bool:
    return name.lstrip("_").startswith(("assert_", "check_"))


def own_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef):
    """Every node of ``function``'s body, leaving out nested functions, lambdas and classes."""
    todo = list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def dotted(node: ast.expr) -> str:
    """``torch.testing.assert_close`` for that attribute chain; "" for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = dotted(node.value)
        return f"{owner}.{node.attr}" if owner else ""
    return ""


def is_library_check(call: ast.Call) -> bool:
    """``pytest.raises``/``pytest.warns``, or ``torch.testing.assert_*`` and the like."""
    name = dotted(call.func)
    return name in PYTEST_CHECKS or any(name.startswith(prefix + "assert_") for prefix in LIBRARY_CHECKS)


class Suite:
    """The module-level functions of every tests/*.py and what each test file imports from tests/."""

    def __init__(self, root: Path = TESTS) -> None:
        self.trees = {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(root.glob("*.py"))}
        self.functions = {
            (module, node.name): node
            for module, tree in self.trees.items()
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        self.imports: dict[str, dict[str, tuple[str, str]]] = {module: {} for module in self.trees}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module:
                    source = node.module.removeprefix("tests.")
                    for alias in node.names:
                        if source in self.trees:
                            self.imports[module][alias.asname or alias.name] = (source, alias.name)

    def resolve(self, module: str, name: str) -> tuple[str, str] | None:
        """The (module, function) a call to ``name`` in ``module`` runs, if it is a helper defined in tests/."""
        if (module, name) in self.functions:
            return module, name
        found = self.imports[module].get(name)
        return found if found in self.functions else None

    def checks(self, module: str, function: ast.FunctionDef | ast.AsyncFunctionDef,
               calling: frozenset[tuple[str, str]] = frozenset()) -> bool:  # fmt: skip
        """Whether ``function`` checks something itself or through helpers (``calling``: those on the way here)."""
        for node in own_nodes(function):
            if isinstance(node, ast.Assert):
                return True
            if isinstance(node, ast.Call):
                if is_library_check(node):
                    return True
                if isinstance(node.func, ast.Name) and helper_name(node.func.id):
                    helper = self.resolve(module, node.func.id)
                    if helper is not None and helper not in calling and self.checks(
                        helper[0], self.functions[helper], calling | {helper}
                    ):  # fmt: skip
                        return True  # (a helper that only calls itself, or back, checks nothing)
        return False

    def tests(self):
        """(module, "Class.test" or "test", node) for every test function of every tests/test_*.py."""
        for module, tree in self.trees.items():
            if not module.startswith("test_"):
                continue
            for node in tree.body:
                members = node.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test") else [node]
                prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                for member in members:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and member.name.startswith("test"):
                        yield module, prefix + member.name, member


def only_skips(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return bool(body) and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and dotted(node.value.func) == "pytest.skip"
        for node in body
    )


def offenders(suite: Suite) -> list[str]:
    return [f"tests/{module}.py::{name}" for module, name, node in suite.tests()
            if not only_skips(node) and not suite.checks(module, node)]  # fmt: skip


def test_every_test_checks_something():
    found = offenders(Suite())
    assert not found, (
        f"{len(found)} test(s) check nothing that could fail (no assert, no pytest.raises/warns, no "
        "torch.testing.assert_*, no call to a tests/ helper assert_*/check_* that asserts): assert what the test "
        "checks, or name the helper assert_*/check_*:\n" + "\n".join(found)
    )


# ------------------------------------------------------------------ the check itself can fail

SAMPLE = '''
import pytest
from helpers import assert_real, assert_empty, check_chain, check_ping

def assert_local(x):
    assert x

def check_nothing(x):
    print(x)

def test_asserts():
    assert 1

def test_raises():
    with pytest.raises(ValueError):
        int("x")

def test_warns():
    pytest.warns(UserWarning, lambda: None)

def raises(error):
    return contextlib.nullcontext()

def test_a_raises_of_its_own():
    with raises(ValueError):
        int("x")

def test_torch_check():
    torch.testing.assert_close(1.0, 1.0)

def test_a_look_alike_library_call():
    torch.assert_close(1.0, 1.0)

def test_local_helper():
    assert_local(1)

def test_imported_helper():
    assert_real(1)

def test_helper_through_helper():
    check_chain(1)

def test_helpers_that_call_each_other():
    check_ping(1)

def test_skipped():
    """Only on a GPU."""
    pytest.skip("needs a GPU")

def test_empty_helper():
    assert_empty(1)

def test_local_empty_helper():
    check_nothing(1)

def assert_forever(x):
    assert_forever(x)

def test_helper_that_only_calls_itself():
    assert_forever(1)

def test_unknown_helper():
    assert_elsewhere(1)

def test_hidden_in_a_plain_helper():
    fit_and_compare(1)

def test_assert_in_a_nested_function():
    def probe():
        assert 1

def test_skips_then_does_nothing():
    pytest.skip("sometimes")
    print(1)

class TestGroup:
    def test_method_asserts(self):
        assert 1

    def test_method_does_not(self):
        print(1)
'''

HELPERS = '''
def assert_real(x):
    assert x

def assert_empty(x):
    return x

def check_chain(x):
    assert_real(x)

def check_ping(x):
    check_pong(x)

def check_pong(x):
    check_ping(x)
    if x:
        assert_real(x)
'''


def test_the_check_finds_exactly_the_tests_that_check_nothing(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "helpers.py").write_text(HELPERS)
    assert offenders(Suite(tmp_path)) == [
        f"tests/test_sample.py::{name}"
        for name in ["test_a_raises_of_its_own", "test_a_look_alike_library_call", "test_empty_helper",
                     "test_local_empty_helper", "test_helper_that_only_calls_itself", "test_unknown_helper",
                     "test_hidden_in_a_plain_helper", "test_assert_in_a_nested_function",
                     "test_skips_then_does_nothing", "TestGroup.test_method_does_not"]
    ]  # fmt: skip


# ------------------------------------------------------------------ the package's shape (issue 27: "the house")

PACKAGE = TESTS.parent / "lightning_fuse"
MAX_CODE_LINES = 300
MAX_SIBLINGS = 8


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold code: not blank, not only a comment, not part of a docstring (a module's,
    a class's or a function's)."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):  # a string
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def imported_siblings(source: str, siblings: set[str]) -> set[str]:
    """The modules of ``siblings`` that ``source``, a module of ``lightning_fuse``, imports: ``from lightning_fuse
    import x``, ``from lightning_fuse.x import ...`` or ``import lightning_fuse.x``, at its top, in a function or
    under ``if TYPE_CHECKING:``."""
    found = set()
    todo = list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ImportFrom) and node.module == PACKAGE.name:
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{PACKAGE.name}."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith(f"{PACKAGE.name}."))
        todo.extend(ast.iter_child_nodes(node))
    return found & siblings


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package under ``root`` -> the other modules of it that it imports."""
    sources = {path.stem: path.read_text() for path in sorted(root.glob("*.py"))}
    return {name: imported_siblings(source, set(sources) - {name}) for name, source in sources.items()}


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of imports in ``graph`` (its first module again at its end), or ``[]`` where there is none."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        for imported in sorted(graph[module]):
            cycle = walk(imported, path + [module])
            if cycle:
                return cycle
        done.add(module)
        return []

    for module in sorted(graph):
        cycle = walk(module, [])
        if cycle:
            return cycle
    return []


def test_no_module_is_over_300_lines_of_code():
    sizes = {path.name: code_lines(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}
    over = {name: size for name, size in sizes.items() if size > MAX_CODE_LINES}
    assert not over, f"modules over {MAX_CODE_LINES} lines of code (docstrings, comments, blank lines aside): {over}"


def test_no_module_imports_more_than_8_of_its_siblings():
    over = {name: sorted(found) for name, found in import_graph().items() if len(found) > MAX_SIBLINGS}
    assert not over, f"modules importing more than {MAX_SIBLINGS} other modules of lightning_fuse: {over}"


def test_no_import_cycle():
    cycle = import_cycle(import_graph())
    assert not cycle, f"modules of lightning_fuse import each other: {' -> '.join(cycle)}"


SHAPE_SAMPLE = '''"""A module docstring,
over two lines."""

import os  # a comment
from typing import TYPE_CHECKING

from lightning_fuse import compat, not_a_module
from lightning_fuse.plan import Plan

if TYPE_CHECKING:
    from lightning_fuse.fit import FitState


class Thing:
    """A class docstring."""

    # a comment alone
    def method(self) -> str:
        """A function docstring."""
        import lightning_fuse.timing

        return (
            "a string over two lines,"
            " which is code"
        )
'''


def test_the_shape_checks_can_fail(tmp_path):
    assert code_lines(SHAPE_SAMPLE) == 13
    siblings = {"compat", "plan", "fit", "timing", "gpu"}
    assert imported_siblings(SHAPE_SAMPLE, siblings) == {"compat", "plan", "fit", "timing"}  # not_a_module, gpu: no
    for name, imports in {"a": "from lightning_fuse import b", "b": "import lightning_fuse.c", "c": "",
                          "d": "if TYPE_CHECKING:\n    from lightning_fuse.a import x"}.items():  # fmt: skip
        (tmp_path / f"{name}.py").write_text(imports)
    assert import_cycle(import_graph(tmp_path)) == []
    (tmp_path / "c.py").write_text("def late():\n    from lightning_fuse.d import y")
    assert import_cycle(import_graph(tmp_path)) == ["a", "b", "c", "d", "a"]  # through d's import for types
