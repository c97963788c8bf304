"""No vacuous CUDA test: every test in tests/cuda/ asserts that what it trained or computed was on a
CUDA device, so a run that silently fell back to the CPU fails instead of passing.

What counts (read from the source, by its syntax tree), anywhere in the body of a test function
(``test_*``, at module level or in a class) of a ``tests/cuda/test_*.py`` module, nested function
definitions excluded (they may never run):

- a call of ``assert_on_cuda`` (tests/support.py) with at least one argument, or
- an ``assert`` statement with an ``==`` comparison of an attribute named ``type`` and the string
  ``"cuda"`` (``assert images.device.type == "cuda"``).

``EXEMPT`` names the tests that put nothing on the GPU by design, each with its reason.

Nor does a CUDA test ``return`` from its own body: an early return passes whatever the rest would
have checked (a GPU missing from a table, say), where a failure or an explicit branch says what
happened. (That the heaviest tests, ``@pytest.mark.run_last``, run after every other one is
checked by tests/unit/test_gpu_check.py on the order of the check's JUnit report.)
"""

from __future__ import annotations

import ast

import pytest

from tests.support import REPO

CUDA_TESTS = REPO / "tests" / "cuda"
EXEMPT = {
    "test_local_rank_beyond_the_gpus_is_a_config_error": (
        "checks the error a launch gives before any tensor exists"
    ),
    "test_the_mfu_peak_of_this_gpu_follows_precision_tf32": (
        "reads the GPU's name and torch's TF32 flags; runs nothing on the GPU"
    ),
}


def _is_cuda_type_compare(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    operands = [node.left, *node.comparators]
    for op, left, right in zip(node.ops, operands, operands[1:]):
        if not isinstance(op, ast.Eq):
            continue
        for a, b in ((left, right), (right, left)):
            if (
                isinstance(a, ast.Attribute)
                and a.attr == "type"
                and isinstance(b, ast.Constant)
                and b.value == "cuda"
            ):
                return True
    return False


def _own_nodes(function: ast.AST):
    """The nodes of ``function``'s body, without those of functions defined inside it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def asserts_cuda(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the test function's own body holds a CUDA-device assertion (module docstring)."""
    for node in _own_nodes(function):
        if isinstance(node, ast.Call) and node.args:
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name == "assert_on_cuda":
                return True
        if isinstance(node, ast.Assert) and any(
            _is_cuda_type_compare(part) for part in ast.walk(node.test)
        ):
            return True
    return False


def returns_early(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the test function's own body holds a ``return`` (module docstring)."""
    return any(isinstance(node, ast.Return) for node in _own_nodes(function))


def _test_functions_in(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    found = []
    for node in tree.body:
        bodies = node.body if isinstance(node, ast.ClassDef) else [node]
        for item in bodies:
            is_function = isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and item.name.startswith("test_"):
                found.append(item)
    return found


def lint(source: str) -> list[str]:
    """Names of the test functions in ``source`` without a CUDA-device assertion."""
    tree = ast.parse(source)
    tests = _test_functions_in(tree)
    return [f.name for f in tests if f.name not in EXEMPT and not asserts_cuda(f)]


def test_every_cuda_test_asserts_that_it_ran_on_cuda():
    modules = sorted(CUDA_TESTS.glob("test_*.py"))
    assert len(modules) >= 9, modules
    tests = {
        f"{path.name}::{f.name}"
        for path in modules
        for f in _test_functions_in(ast.parse(path.read_text()))
    }
    assert len(tests) >= 30, sorted(tests)
    missing = {path.name: lint(path.read_text()) for path in modules}
    assert not {name: tests for name, tests in missing.items() if tests}, missing
    exempt_found = {name.split("::")[1] for name in tests} & EXEMPT.keys()
    assert exempt_found == EXEMPT.keys(), "an exemption names a test that no longer exists"


@pytest.mark.parametrize(
    ("body", "counts"),
    [
        ("assert_on_cuda(model)", True),
        ("assert_on_cuda()", False),  # nothing checked
        ("support.assert_on_cuda(probe['device'], probe['batch_devices'])", True),
        ("assert images.device.type == 'cuda'", True),
        ("assert 'cuda' == x.device.type and y", True),
        ("assert images.device.type != 'cuda'", False),
        ("assert images.device.type == 'cpu'", False),
        ("images.device.type == 'cuda'", False),  # a bare comparison asserts nothing
        ("assert probe['device'] == 'cuda:0'", False),  # a string: use assert_on_cuda
        ("def helper():\n        assert_on_cuda(model)", False),  # may never run
        ("pass", False),
    ],
)
def test_what_counts_as_a_cuda_device_assertion(body, counts):
    source = f"def test_x(model, images, probe, x, y, support):\n    {body}\n"
    assert lint(source) == ([] if counts else ["test_x"])


def test_methods_of_test_classes_are_linted_and_exemptions_apply():
    source = (
        "class TestGroup:\n"
        "    def test_a(self):\n        pass\n"
        "    def test_b(self, t):\n        assert t.type == 'cuda'\n"
        "def test_local_rank_beyond_the_gpus_is_a_config_error():\n    pass\n"
    )
    assert lint(source) == ["test_a"]


def test_no_cuda_test_returns_early():
    returning = {
        f"{path.name}::{f.name}"
        for path in sorted(CUDA_TESTS.glob("test_*.py"))
        for f in _test_functions_in(ast.parse(path.read_text()))
        if returns_early(f)
    }
    assert not returning, f"these CUDA tests return early, passing vacuously: {sorted(returning)}"


@pytest.mark.parametrize(
    ("body", "returns"),
    [
        ("if x:\n        return\n    assert_on_cuda(x)", True),
        ("for t in x:\n        if t:\n            return t", True),
        ("def helper():\n        return x", False),  # a nested function's own return
        ("assert_on_cuda(x)", False),
    ],
)
def test_what_counts_as_an_early_return(body, returns):
    (function,) = _test_functions_in(ast.parse(f"def test_x(x):\n    {body}\n"))
    assert returns_early(function) is returns
