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
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    # (within pytest.ini's 300 s per test, whose timeout would end the run without this report)
    rep = tensor_fuzz.run(seed, cases, device, workers, budget_s=240.0)
    print(rep.summary())
    shown = "\n".join(tensor_fuzz.format_failure(f) for f in rep.failures[:40])
    assert not rep.failures, f"{rep.summary()}\n{shown}"
    assert rep.ran == cases, rep.summary()


def test_a_slow_or_killed_case_is_rerun_alone_and_a_real_hang_or_crash_fails(monkeypatch):
    """Note [hang and crash verdicts] in tensor_fuzz.py: on a loaded machine a worker may be
    starved past the timeout, or killed from outside; neither fails a case that then runs alone,
    while a case that hangs or crashes alone still fails with its reproducer."""
    monkeypatch.setattr(tensor_fuzz, "CASE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(tensor_fuzz, "CONFIRM_TIMEOUT_S", 3.0)
    monkeypatch.setenv("BT_FUZZ_CASE_TIMEOUT", "2")  # (the workers' "slow" sleeps 3 of them)
    monkeypatch.setenv("BT_FUZZ_INJECT", "slow:3,hang:7,crash:11,killed:15")
    rep = tensor_fuzz.run(5, 20, "cpu", workers=1, chunk=20)
    verdicts = {f["index"]: f["status"] for f in rep.failures}
    assert verdicts == {7: "hang", 11: "crash"}, rep.summary()
    assert (rep.ran, rep.hangs, rep.crashes) == (20, 1, 1), rep.summary()
    text = rep.summary()
    assert "case 3: no progress for 2 s in its worker, then alone" in text, text
    assert "case 15: crashed in its worker (exit code -9;" in text, text
    assert "repeat this run: BT_FUZZ_SEED=5 BT_FUZZ_CASES=20 python -m pytest" in text, text
    for f in rep.failures:
        shown = tensor_fuzz.format_failure(f)
        assert f"tensor_fuzz.py case 5 {f['index']}" in shown, shown
        assert tensor_fuzz.render(tensor_fuzz.make_case(5, f["index"], "cpu")) in shown, shown


def test_the_failure_message_gives_the_seed_and_both_reproducers(monkeypatch):
    monkeypatch.setenv("BT_FUZZ_SEED", "31337")
    monkeypatch.setenv("BT_FUZZ_CASES", "12")
    monkeypatch.setenv("BT_FUZZ_INJECT", "crash:4")
    with pytest.raises(AssertionError) as e:
        _run("cpu", 6000)
    msg = str(e.value)
    assert "fuzz seed 31337 on cpu: 12 of 12 cases" in msg, msg
    assert "BT_FUZZ_SEED=31337 BT_FUZZ_CASES=12 python -m pytest " in msg, msg
    assert "python packages/blutrain-tensor/tests/tensor_fuzz.py case 31337 4" in msg, msg


def test_a_worker_that_cannot_start_fails_the_run_instead_of_skipping_cases(monkeypatch):
    broken = ["sh", "-c", "echo no interpreter >&2; exit 3"]
    monkeypatch.setattr(tensor_fuzz, "WORKER_PREFIX", broken)
    rep = tensor_fuzz.run(7, 10, "cpu", workers=1, chunk=10)
    assert [f["status"] for f in rep.failures] == ["worker-start"], rep.summary()
    assert "no interpreter" in rep.failures[0]["detail"]
    assert rep.ran == 0 and "repeat this run: BT_FUZZ_SEED=7 BT_FUZZ_CASES=10" in rep.summary()


def test_a_run_past_its_budget_reports_the_cases_it_did_not_run(monkeypatch):
    monkeypatch.setenv("BT_FUZZ_INJECT", "slow:12")  # (a starved worker: past the budget)
    monkeypatch.setattr(tensor_fuzz, "CASE_TIMEOUT_S", 1.0)
    monkeypatch.setenv("BT_FUZZ_CASE_TIMEOUT", "1")
    rep = tensor_fuzz.run(9, 40, "cpu", workers=1, chunk=20, budget_s=0.5)
    gaps = [f["code"] for f in rep.failures if f["status"] == "out-of-time"]
    assert gaps and gaps[-1] == "cases [20, 40) not run", rep.summary()
    assert rep.ran < 40 and "repeat this run: BT_FUZZ_SEED=9 BT_FUZZ_CASES=40" in rep.summary()


def test_each_case_seeds_the_generator_from_seed_and_index():
    """A reproducer line repeats the dropout mask or randn draw that the batch run saw (the
    generator's offset would otherwise carry the worker's history)."""
    assert tensor_fuzz.case_seed(3, 10) == tensor_fuzz.case_seed(3, 10)
    assert len({tensor_fuzz.case_seed(s, i) for s in (3, 4) for i in range(50)}) == 100
    seen = set()
    for i in range(40):
        bt.randn(7)  # (history a worker would have)
        spec = tensor_fuzz.make_case(3, i, "cpu").spec
        tensor_fuzz.run_case(3, i, "cpu")
        if spec != "manual_seed":
            assert bt.initial_seed() == tensor_fuzz.case_seed(3, i), spec
            seen.add(spec)
    assert len(seen) > 20


def test_a_hook_case_leaves_nothing_alive():
    """A hook case's lambda closes over the case's namespace, which holds the hooked tensor, and
    the tensor's C++ hook list holds the lambda: a cycle Python's collector cannot see. run_case
    clears the namespace, or the tensor lives to the end (nanobind then reports it)."""
    idx = next(i for i in range(2000) if "hook" in tensor_fuzz.make_case(3, i, "cpu").spec)
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import tensor_fuzz; "
        f"r = tensor_fuzz.run_case(3, {idx}, 'cpu'); assert r['status'] == 'ok', r"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nanobind: leaked" not in r.stderr, r.stderr[-2000:]


def test_fuzz_cpu():
    _run("cpu", 6000)


@pytest.mark.gpu
def test_fuzz_cuda():
    if not bt.cuda_built() or bt.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    _run("cuda", 4000)


def test_sums_in_the_dtype_are_compared_within_their_rounding_bound():
    """scatter_add / index_add add one term at a time in the result's dtype, as PyTorch does
    (bf16: 2.03125 + 2**31 - 2**31 is 0 there and here); the exact float64 reference failed them
    (fuzz seed 1042310026 case 5882).  Their reference now carries Higham's bound n u sum|x|, which
    still catches a wrong value."""
    assert tensor_fuzz.run_case(1042310026, 5882, "cpu")["status"] == "ok"
    x = bt.zeros(2, 2, dtype=bt.bfloat16)
    x[1, 1] = 2.03125
    src = bt.tensor([[0.0, 2.0**31], [0.0, -(2.0**31)]], dtype=bt.bfloat16)
    got = bt.scatter_add(x, 0, bt.tensor([[0, 1], [0, 1]]), src)
    assert got.float().numpy()[1, 1] == 0.0  # as torch.scatter_add
    want = tensor_fuzz.summed_in_dtype(
        np.array([[0.0, 0.0], [0.0, 2.03125]]),
        np.array([[0.0, 0.0], [0.0, 2.03125 + 2.0**32]]),
        np.array([[2, 0], [0, 2]]),
        "bfloat16",
    )
    g = tensor_fuzz.A(got.float().numpy().astype(np.float64), "bfloat16")
    assert tensor_fuzz.compare(g, want, 1.0, bt) is None
    wrong = tensor_fuzz.A(np.array([[0.0, 0.0], [0.0, 2.0**28]]), "bfloat16")
    assert tensor_fuzz.compare(wrong, want, 1.0, bt) is not None
    assert tensor_fuzz.compare(g, tensor_fuzz.A(want.a, "bfloat16"), 1.0, bt) is not None


def test_sums_and_means_are_compared_within_their_rounding_bound():
    """A float sum's error is at most n u sum|x|: int64 near 2**63 cast to float32 and cancelled
    (fuzz seeds 1013179725 case 4024, 1269557148 case 6753, ...) leave 0.25 or 0.5 as the mean
    depending on the order of the adds; both within the bound, which still catches a wrong value."""
    for seed, index in ((1013179725, 4024), (1269557148, 6753), (1519236596, 5033)):
        assert tensor_fuzz.run_case(seed, index, "cpu")["status"] == "ok", (seed, index)
    ref = tensor_fuzz_ops.reduce_ref("mean")
    x = tensor_fuzz.A(np.array([-(2.0**63), 2.0**63, 1.0, 1.0]), "float32")
    want = ref(x)
    assert tensor_fuzz.compare(tensor_fuzz.A(np.array(0.0), "float32"), want, 1.0, bt) is None
    wrong = tensor_fuzz.A(np.array(2.0**50), "float32")
    assert tensor_fuzz.compare(wrong, want, 1.0, bt) is not None
    small = ref(tensor_fuzz.A(np.array([1.0, 2.0, 4.0]), "float32"))  # (no huge terms: tight)
    assert tensor_fuzz.compare(tensor_fuzz.A(np.array(2.34), "float32"), small, 1.0, bt)


def test_the_gradient_check_passes_over_ties_and_kinks_only():
    """A max over two values 1e-7 apart has no derivative there: the check skips it; a smooth
    function, or a max with no tie, still compares."""
    A = tensor_fuzz.A
    kink = tensor_fuzz_ops._kink
    tie = [A(np.array([1.0, 1.0 + 1e-7, 0.3]), "float64")]
    assert kink(lambda v: float(np.max(v[0].a) * 3.0), tie, 0, 0, 1e-6)
    assert not kink(lambda v: float(np.max(v[0].a) * 3.0), tie, 0, 2, 1e-6)
    apart = [A(np.array([1.0, 1.2, 0.3]), "float64")]
    assert not kink(lambda v: float(np.max(v[0].a) * 3.0), apart, 0, 1, 1e-6)
    assert not kink(lambda v: float(np.sin(v[0].a).sum()), apart, 0, 1, 1e-6)
    assert kink(lambda v: float(np.abs(v[0].a - 0.3).sum()), apart, 0, 2, 1e-6)
