"""Type hints on every public function and class, and mypy on the public API (issue #26).

``test_public_api_is_annotated`` walks MaTEx's public API with ``inspect``: every
name each public module exports (``__all__``, lazy names included) or defines
without a leading underscore (modules below a public package included), and for a
class every public method, ``__init__``, ``__call__`` and property defined by
MaTEx (not inherited from Keras or TensorFlow). Each must annotate every
parameter and its return. ``self``/``cls`` are exempt; so are ``*args`` and
``**kwargs``, which MaTEx only uses to pass arguments through to Keras.

``test_mypy_public_modules`` runs mypy (``[tool.mypy]`` in pyproject.toml) on the
public modules; private modules they import are checked silently
(``follow_imports = "silent"``), so only the public surface must be clean.
"""

import ast
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import types
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The public modules: the package and its public subpackages/modules. matex.keras
# re-exports Keras's own API (not MaTEx's to annotate); its own names are none.
PUBLIC_MODULES = (
    "matex", "matex.errors", "matex.callbacks", "matex.compression", "matex.localsgd",
    "matex.hpo", "matex.parallel", "matex.science", "matex.timeline", "matex.flight",
    "matex.launcher", "matex.readers",
)

# Methods Python calls for us that are part of how a class is used.
_PUBLIC_DUNDERS = ("__init__", "__call__")


def _own(obj):
    return (getattr(obj, "__module__", None) or "").startswith("matex")


def _problems(where, fn):
    """Missing annotations of ``fn``, as strings naming ``where``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):      # a builtin without a signature: nothing to say
        return []
    out = []
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if i == 0 and p.name in ("self", "cls", "mcs"):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.annotation is inspect.Parameter.empty:
            out.append("%s: parameter %r has no annotation" % (where, p.name))
    if sig.return_annotation is inspect.Signature.empty:
        out.append("%s: no return annotation" % where)
    return out


def _members(cls):
    """``cls``'s own attributes and those it inherits from MaTEx's classes (mixins such as
    ``PipelineModel``'s checkpoints), nearest first; Keras's and TensorFlow's are not ours."""
    seen = {}
    for klass in cls.__mro__:
        if klass is cls or _own(klass):
            for name, member in vars(klass).items():
                seen.setdefault(name, member)
    return seen.items()


def _class_problems(where, cls):
    out = []
    for name, member in _members(cls):
        if name.startswith("_") and name not in _PUBLIC_DUNDERS:
            continue
        label = "%s.%s" % (where, name)
        if isinstance(member, (staticmethod, classmethod)):
            out += _problems(label, member.__func__)
        elif isinstance(member, property):
            if member.fget is not None:
                out += _problems(label, member.fget)
        elif isinstance(member, types.FunctionType):
            out += _problems(label, member)
    return out


def public_modules():
    """``PUBLIC_MODULES`` and every module below them with no underscored part
    (``matex.launcher.hosts``, ``matex.callbacks.monitor``...)."""
    import matex

    found = list(PUBLIC_MODULES)
    for info in pkgutil.walk_packages(matex.__path__, "matex."):
        parts = info.name.split(".")
        if parts[1] != "keras" and not any(p.startswith("_") for p in parts[1:]):
            found.append(info.name)
    return sorted(set(found), key=found.index)


def public_api():
    """``(qualified name, object)`` for every public name of every public module: its
    ``__all__`` (lazy names included), and every unprefixed function or class it defines."""
    seen = set()
    for modname in public_modules():
        module = importlib.import_module(modname)
        names = list(getattr(module, "__all__", ()))
        names += [n for n, v in vars(module).items() if not n.startswith("_")
                  and getattr(v, "__module__", None) == modname]
        for name in names:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) or not _own(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield "%s.%s" % (modname, name), obj


def _type_checking_names(module):
    """The names ``module`` imports under ``if TYPE_CHECKING:`` (annotations only), imported."""
    names = {}
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):        # no source: nothing imported for annotations
        return names
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            code = compile(ast.Module(body=node.body, type_ignores=[]), module.__name__, "exec")
            exec(code, names)   # noqa: S102 - the module's own import statements
    names.pop("__builtins__", None)
    return names


def _functions(obj):
    """``obj``'s own functions: itself, or a class's public methods and property getters."""
    if inspect.isfunction(obj):
        return [obj]
    out = []
    for name, member in _members(obj):
        if name.startswith("_") and name not in _PUBLIC_DUNDERS:
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        elif isinstance(member, property):
            member = member.fget
        if isinstance(member, types.FunctionType):
            out.append(member)
    return out


def unresolved_annotations():
    """Annotations that name nothing (``from __future__ import annotations`` keeps them text,
    and mypy sees TensorFlow and Keras as Any: a typo such as ``keras.optimizer.Adam`` would
    pass both)."""
    out = []
    for where, obj in public_api():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        for fn in _functions(obj):
            fn = inspect.unwrap(fn)
            module = sys.modules[fn.__module__]
            namespace = dict(vars(module), **_type_checking_names(module))
            try:
                typing.get_type_hints(fn, globalns=namespace)
            except Exception as exc:    # noqa: BLE001 - reported by name, whatever it is
                out.append("%s (%s): %s: %s" % (where, fn.__qualname__, type(exc).__name__, exc))
    return out


def missing_annotations():
    out = []
    for where, obj in public_api():
        if inspect.isclass(obj):
            out += _class_problems(where, obj)
        elif inspect.isfunction(obj):
            out += _problems(where, obj)
    return out


def test_walker_sees_what_it_should():
    """The walker reaches lazy names, classes' methods and properties, and flags gaps."""
    names = dict(public_api())
    for expected in ("matex.allreduce", "matex.DistributedOptimizer", "matex.hpo.minimize",
                     "matex.parallel.Grid", "matex.readers.DataSet", "matex.launcher.main",
                     "matex.callbacks.MetricAverageCallback", "matex.errors.RankFailure",
                     "matex.timeline.parse_steps", "matex.launcher.supervise.job_exit_status"):
        assert expected in names, expected

    class Sample:
        def __init__(self, a, b: int = 1, *args, **kwargs) -> None:
            pass

        def run(self, x: int) -> int:
            return x

        @property
        def size(self):
            return 1

        def _private(self, y):
            pass

    assert _class_problems("Sample", Sample) == [
        "Sample.__init__: parameter 'a' has no annotation",
        "Sample.size: no return annotation",
    ]


def test_public_api_is_annotated():
    problems = missing_annotations()
    assert not problems, "%d public functions/methods lack type hints:\n%s" % (
        len(problems), "\n".join(problems))


def test_public_annotations_resolve():
    problems = unresolved_annotations()
    assert not problems, "annotations naming nothing:\n" + "\n".join(problems)


def test_mypy_public_modules():
    assert importlib.util.find_spec("mypy") is not None, (
        "mypy is not installed: pip install -e '.[test]'")
    mypy = [sys.executable, "-m", "mypy"]
    proc = subprocess.run(mypy, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# A user's script: the lazily resolved names (matex.allreduce, matex.hpo.minimize,
# matex.parallel.send...) must reach the user's type checker with their signatures, not as
# the modules' __getattr__ (object/Any). Lines marked "# wrong" must each be reported.
USER_SCRIPT = """\
import keras
import numpy as np

import matex
import matex.compression
import matex.hpo
import matex.parallel
import matex.timeline

size: int = matex.size()
opt = matex.DistributedOptimizer(keras.optimizers.Adam(), compression="topk:0.01")
t = matex.allreduce(np.ones(3), op="sum")
gp = matex.hpo.LazyGP(2)
mean = gp.predict(np.zeros((1, 2)), return_std=False)
g = matex.parallel.grid(data=2)
shape: tuple[int, int, int] = g.shape
topk = matex.compression.TopK(0.01)
with matex.timeline.span("read"):
    pass
failed: bool = matex.errors.is_rank_failure(RuntimeError())
summed = matex.sparse_allreduce(np.arange(2), np.ones((2, 4)), (10, 4))
got = matex.parallel.recv((2, 3), "float32", source=0)


@matex.on_rank_loss
def note(info: object) -> str:
    return "lost"


said: str = note(None)
wrong_rank: str = matex.rank()  # wrong
matex.allreduce(t, op="sum", comm="world")  # wrong
matex.hpo.minimize(lambda hp, comm: 0.0, None, max_trials="many")  # wrong
matex.parallel.send(t, dest="one")  # wrong
matex.compression.TopK(0.01, min_size="big")  # wrong
matex.DistributedOptimizer("adam", delay="one")  # wrong
count: int = note(None)  # wrong
"""


def test_every_lazy_name_is_imported_for_type_checkers():
    """A name resolved by ``_lazy.attach`` is the module's ``__getattr__`` to a type checker
    unless the module also imports it under ``if TYPE_CHECKING:``."""
    missing = []
    for modname in public_modules():
        module = importlib.import_module(modname)
        lazy = getattr(module, "_LAZY", None)
        if lazy:
            seen = set(_type_checking_names(module))
            missing += ["%s.%s" % (modname, n) for n in sorted(set(lazy) - seen)]
    assert not missing, "lazy names not imported under TYPE_CHECKING: %s" % missing


def test_users_type_checker_sees_the_signatures(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml",
                           str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    # by file name: mypy replays a cached file's errors with the path it first had
    reported = {int(m.group(1)) for m in re.finditer(r"user_script\.py:(\d+): error:",
                                                       proc.stdout)}
    expected = {i for i, line in enumerate(USER_SCRIPT.splitlines(), 1)
                if line.endswith("# wrong")}
    assert reported == expected, proc.stdout + proc.stderr
