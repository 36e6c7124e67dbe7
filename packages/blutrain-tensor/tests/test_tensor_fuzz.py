"""The property-based suite (tensor_fuzz.py, specs in tensor_fuzz_ops.py) and its coverage.

test_fuzz_cpu / test_fuzz_cuda run generated cases of every public op in worker processes (a crash
or hang fails the case that caused it, with a reproducer line) and check each outcome: a named
error for bad input, numpy's values (and gradients) for good input, no silent acceptance of what
PyTorch refuses.  A fresh seed each run, printed; BT_FUZZ_SEED fixes it, BT_FUZZ_CASES sets the
number of cases (default 6000 on the CPU: about a minute on 2 cores; a long run takes more).

test_every_public_op_has_a_spec fails for a public name (bt.*, Tensor methods and operators,
bt.nn.functional) that has neither a spec nor a reason in EXEMPT: a new op must get one.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

import blutrain.tensor as bt

sys.path.insert(0, str(Path(__file__).parent))
import tensor_fuzz  # noqa: E402
import tensor_fuzz_ops  # noqa: E402

# Tensor attributes that are Python's own, not ours.
PYTHON_OWN = {
    "__class__",
    "__delattr__",
    "__dir__",
    "__doc__",
    "__getattribute__",
    "__getstate__",
    "__init_subclass__",
    "__module__",
    "__new__",
    "__reduce__",
    "__reduce_ex__",
    "__setattr__",
    "__sizeof__",
    "__subclasshook__",
    "__array_ufunc__",  # None: numpy defers to our operators
    "__weakref__",
    "__dict__",
}


def public_names() -> set[str]:
    """Every public op name: bt.* callables, Tensor attributes, bt.nn.functional functions."""
    names = set()
    for n in bt.__all__:
        obj = getattr(bt, n)
        if n in ("nn",) or isinstance(obj, bt.dtype):
            continue
        if isinstance(obj, type) and n != "Tensor":
            names.add(n)  # a class: a spec or an EXEMPT reason
        elif callable(obj) and n != "Tensor":
            names.add(n)
    for n in dir(bt.Tensor):
        if n in PYTHON_OWN or (n.startswith("_") and not n.startswith("__")):
            continue
        names.add(f"Tensor.{n}")
    for n in dir(bt.nn.functional):
        if not n.startswith("_"):
            names.add(f"nn.functional.{n}")
    return names


def test_every_public_op_has_a_spec():
    specs = set(tensor_fuzz_ops.SPECS) | {n.replace("(set)", "") for n in tensor_fuzz_ops.SPECS}
    exempt = set(tensor_fuzz_ops.EXEMPT)
    missing = sorted(n for n in public_names() if n not in specs and n not in exempt)
    assert not missing, (
        "public ops without a fuzz spec (add one to tests/tensor_fuzz_ops.py, or a reason to "
        f"EXEMPT): {missing}"
    )
    stale = sorted(n for n in exempt if n not in public_names() and not n.startswith("Tensor.__"))
    assert not stale, f"EXEMPT names that are not public: {stale}"


def test_specs_generate_reproducibly():
    """A case is a function of (seed, index): what a reproducer line relies on."""
    for i in range(200):
        a = tensor_fuzz.render(tensor_fuzz.make_case(5, i, "cpu"))
        b = tensor_fuzz.render(tensor_fuzz.make_case(5, i, "cpu"))
        assert a == b


def _run(device: str, default_cases: int) -> None:
    seed = int(os.environ.get("BT_FUZZ_SEED", random.randrange(1 << 31)))
    cases = int(os.environ.get("BT_FUZZ_CASES", default_cases))
    workers = int(os.environ.get("BT_FUZZ_WORKERS", "2"))
    print(f"\nfuzz: seed {seed}, {cases} cases on {device} (BT_FUZZ_SEED={seed} repeats it)")
    rep = tensor_fuzz.run(seed, cases, device, workers)
    print(rep.summary())
    shown = "\n".join(tensor_fuzz.format_failure(f) for f in rep.failures[:40])
    assert not rep.failures, f"{rep.summary()}\n{shown}"
    assert rep.ran == cases


def test_fuzz_cpu():
    _run("cpu", 6000)


@pytest.mark.gpu
def test_fuzz_cuda():
    if not bt.cuda_built() or bt.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    _run("cuda", 4000)
