"""The installed type stubs cover every public name of bt and every public Tensor method.

Names from the C++ module are typed by _tensor.pyi (nanobind stubgen plus
src/python/stub_patterns.txt for the methods __init__.py attaches to Tensor); names defined in
Python are typed inline in __init__.py (the package ships py.typed).
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import blutrain.tensor as bt

PKG = Path(bt.__file__).parent
STUB = PKG / "_tensor.pyi"


def _stub_tree() -> ast.Module:
    assert STUB.is_file(), f"no stub installed at {STUB}"
    return ast.parse(STUB.read_text())


def _names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = node
    return out


def _fully_annotated(fn: ast.FunctionDef) -> bool:
    a = fn.args
    params = a.posonlyargs + a.args + a.kwonlyargs
    params += [p for p in (a.vararg, a.kwarg) if p is not None]
    params = [p for p in params if p.arg not in ("self", "cls")]
    return fn.returns is not None and all(p.annotation is not None for p in params)


def _stub_tensor_class() -> dict[str, ast.stmt]:
    cls = _names(_stub_tree().body)["Tensor"]
    assert isinstance(cls, ast.ClassDef)
    return _names(cls.body)


def test_every_public_tensor_method_is_in_the_stub():
    stub = _stub_tensor_class()
    public = {n for n in dir(bt.Tensor) if not n.startswith("_")}
    # dunders that __init__.py attaches (the rest come from the C++ bindings or object)
    public |= {"__array__", "__iter__", "__float__", "__int__", "__index__", "__format__"}
    missing = sorted(n for n in public if n not in stub)
    assert not missing, f"Tensor members without a stub: {missing}"
    for name, node in stub.items():
        if isinstance(node, ast.FunctionDef):
            assert _fully_annotated(node), f"Tensor.{name} stub lacks annotations"


def test_python_attached_tensor_methods_match_their_stub_signatures():
    stub = _stub_tensor_class()
    attached = [
        "register_hook", "register_post_accumulate_grad_hook", "max", "min", "tolist",
        "__array__", "__iter__", "__float__", "__int__", "__index__", "__format__", "softmax",
        "log_softmax", "matmul", "type_as", "new_zeros", "new_ones", "gelu", "clamp", "where",
    ]  # fmt: skip
    for name in attached:
        fn = getattr(bt.Tensor, name)
        assert inspect.isfunction(fn), f"Tensor.{name} is no longer attached in Python"
        node = stub[name]
        assert isinstance(node, ast.FunctionDef)
        a = node.args
        stub_params = [p.arg for p in a.posonlyargs + a.args]
        if a.vararg:
            stub_params.append("*" + a.vararg.arg)
        rt = inspect.signature(fn).parameters.values()
        rt_params = [("*" + p.name) if p.kind is p.VAR_POSITIONAL else p.name for p in rt]
        assert stub_params == rt_params, f"Tensor.{name}: stub {stub_params} vs runtime {rt_params}"


def test_every_public_name_of_bt_is_typed():
    stub = _names(_stub_tree().body)
    init = _names(ast.parse((PKG / "__init__.py").read_text()).body)
    untyped = []
    for name in bt.__all__:
        assert hasattr(bt, name), f"bt.__all__ lists {name!r}, which bt lacks"
        node = init.get(name)
        if isinstance(node, ast.ImportFrom) and node.module == "_tensor":
            if name not in stub:
                untyped.append(name)
            continue
        if name == "nn":
            assert (PKG / "nn.py").is_file()
            continue
        if node is None:
            untyped.append(name)
        elif isinstance(node, ast.FunctionDef) and not _fully_annotated(node):
            untyped.append(name)
    assert not untyped, f"public names with no typed definition: {untyped}"


def test_python_submodules_are_typed_and_documented():
    for mod in ("optim", "backends", "cuda"):
        tree = ast.parse((PKG / f"{mod}.py").read_text())
        defs = _names(tree.body)
        for name in getattr(bt, mod).__all__:
            node = defs.get(name)
            assert node is not None, f"bt.{mod}.{name} is not defined in {mod}.py"
            if isinstance(node, ast.FunctionDef):
                assert _fully_annotated(node), f"bt.{mod}.{name} lacks annotations"
                assert ast.get_docstring(node), f"bt.{mod}.{name} has no docstring"


def test_mypy_reads_the_stubs(tmp_path):
    pytest.importorskip("mypy")
    good = tmp_path / "good.py"
    good.write_text(
        textwrap.dedent(
            """
            import blutrain.tensor as bt

            x = bt.randn(3, 4, requires_grad=True)
            v = x.max(1).values
            y: bt.Tensor = x.softmax(-1).log_softmax(0).clamp(0.0, 1.0).gelu("tanh")
            z: list[float] = x.tolist()
            h = x.register_hook(lambda g: g * 2)
            h.remove()
            f: float = float(x.sum())
            w = bt.cross_entropy(bt.randn(2, 5, 3), bt.zeros(2, 3, dtype=bt.int64))
            bt.clip_grad_norm_([x], 1.0)
            m, v = [bt.zeros_like(x)], [bt.zeros_like(x)]
            coef = bt.optim.clip_coef(bt.optim.grad_norm([x.grad]), 1.0)
            bt.optim.adamw_([x], [x], m, v, lr=1e-3, step=bt.tensor(1.0), grad_scale=coef)
            level: int = bt.API_LEVEL
            version: str = bt.__version__
            for row in x:
                row.new_zeros(2, 2).type_as(y).matmul(y.where(y > 0, 0.0))
            """
        )
    )
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import blutrain.tensor as bt\nbt.randn(2).softmax('a')\nbt.gradcheck(1)\n"
        "bt.optim.adamw_([], [], [], [], lr=1e-3)\n"  # step is required
    )
    env = dict(os.environ, MYPYPATH="")
    cmd = [sys.executable, "-m", "mypy", "--no-incremental", "--python-version", "3.11"]
    r = subprocess.run([*cmd, str(good)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "softmax" in r.stdout and "gradcheck" in r.stdout, r.stdout
    assert '"step"' in r.stdout and "adamw_" in r.stdout, r.stdout
