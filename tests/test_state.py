"""MaTEx's process state has one home, ``matex._state``, with one reset.

Pure AST, no TensorFlow: no module of ``matex/`` or ``readers/`` keeps state of
its own, either as a ``global`` it rebinds or as a module-level container it
fills (an empty dict, list or set, a weak dictionary, a ``threading.local``).
Such state belongs in ``_state`` (``namespace``, ``table``, ``weak_table``,
``local``), where ``registered()`` lists it and ``clear_session`` resets the
caches among it. The reset itself is tested on several ranks in
``tests/mpi/test_keras_api.py``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "matex" / "_state.py"

# calls whose result, bound at module level, is state to fill (a lock is not: it guards)
_MADE_EMPTY = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "local",
               "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}


def _sources():
    for package in ("matex", "readers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != HOME:
                yield path, ast.parse(path.read_text(), str(path))


def _empty_container(value) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set)):
        items = getattr(value, "keys", None) or getattr(value, "elts", None)
        # empty, or a one-constant list: a cell flipped later (`_done = [False]`)
        return not items or (isinstance(value, ast.List) and len(items) == 1
                             and isinstance(items[0], ast.Constant))
    if isinstance(value, ast.Call) and not value.args and not value.keywords:
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _MADE_EMPTY
    return False


def _module_level(tree):
    """Statements run at import: the module's body, into its if/try/with blocks."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue   # runs when called, or holds a class's own attributes
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, []) or [])


def test_no_module_rebinds_a_global_of_its_own():
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}"
             for path, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Global)]
    assert found == [], "state to move into matex._state:\n" + "\n".join(found)


def test_no_module_fills_a_container_of_its_own():
    found = []
    for path, tree in _sources():
        for node in _module_level(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                    and _empty_container(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if [ast.unparse(t) for t in targets] == ["__all__"]:
                    continue   # a package that exports nothing yet: no state
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                             + ", ".join(ast.unparse(t) for t in targets))
    assert found == [], "state to move into matex._state:\n" + "\n".join(found)


def test_the_check_sees_what_it_forbids():
    """The two checks above find each form of module state (so their silence means something)."""
    tree = ast.parse("import threading, weakref\n_a = {}\n_b: dict = {}\n_c = []\n"
                     "_d = threading.local()\n_e = weakref.WeakKeyDictionary()\n"
                     "if True:\n    _f = set()\n_g = {'kept': 1}\n_h = (1, 2)\n_i = [False]\n"
                     "_j = [1, 2]\n"
                     "def f():\n    global _z\n    _z = 1\n    local = {}\n")
    filled = [node for node in _module_level(tree)
              if isinstance(node, (ast.Assign, ast.AnnAssign)) and _empty_container(node.value)]
    assert sorted(ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)
                  for n in filled) == ["_a", "_b", "_c", "_d", "_e", "_f", "_i"]
    assert [n.names for n in ast.walk(tree) if isinstance(n, ast.Global)] == [["_z"]]


def test_the_home_resets_caches_in_place_and_keeps_process_state():
    """``clear_session`` empties session tables and namespaces in place; process state stays."""
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        from matex import _state
    finally:
        sys.path.pop(0)
    cache = _state.table("test.state.cache")
    kept = _state.table("test.state.kept", lifetime="process")
    marks = _state.namespace("test.state.marks", lifetime="session", steps=0, plan=None)
    cache["plan"], kept["comm"], marks.steps, marks.plan = 1, 2, 3, "p"
    assert _state.table("test.state.cache") is cache   # a second import: the same entry
    _state.clear_session()
    assert cache == {} and kept == {"comm": 2} and (marks.steps, marks.plan) == (0, None)
    assert _state.entry("test.state.cache") is cache
    assert _state.registered()["test.state.kept"] == "process"
    try:
        marks.step = 1   # misspelt: not new, unreset state
    except AttributeError as error:
        assert "has no attribute 'step'" in str(error)
    else:
        raise AssertionError("an undeclared attribute was set")
