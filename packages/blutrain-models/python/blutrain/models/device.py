"""Where a run executes: CPU threads, the device, precision and recomputation defaults, memory
and the peak FLOP/s that MFU is measured against.

Every function loads blutrain.tensor when called; `set_threads` sets the one CPU thread budget
(op loops and BLAS) at any time.
"""

from __future__ import annotations

import os
import resource

# Dense peak FLOP/s for MFU, by device name substring and precision (no sparsity).
_PEAK_FLOPS = {
    "H200": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12},
    "H100": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12},
}


def set_threads(n: int = 0) -> int:
    """Set the process's CPU thread budget (bt.set_num_threads) and return it.

    One budget for everything: blutrain.tensor's op loops and the BLAS under blutrain-linalg
    run on one pool of n threads (a GEMM gets all n while the op loops are idle, and the
    reverse), so adding a thread never oversubscribes the cores. n = 0 means automatic:
    OMP_NUM_THREADS when the user set it, else every CPU this process may use
    (bt.available_cpus(): its affinity mask, capped by its cgroup CPU quota). Callable at any
    time, before or after blutrain.tensor is imported.
    """
    from ._tensor import bt

    if n <= 0:
        env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        n = int(env) if env.isdigit() and int(env) > 0 else bt.available_cpus()
    bt.set_num_threads(n)
    return n


def threads_note(device: str) -> str:
    """The CPU run's first log line's ", 2 threads of 2 CPUs" ("" on a GPU)."""
    if is_cuda(device):
        return ""
    from ._tensor import bt

    n, cpus = bt.get_num_threads(), bt.available_cpus()
    return f", {n} thread{'s' if n != 1 else ''} of {cpus} CPU{'s' if cpus != 1 else ''}"


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when this blutrain.tensor build runs ops on a GPU here, else "cpu";
    "cuda" or "cuda:N" where there is no GPU is a ValueError saying why."""
    from ._tensor import bt

    gpu = bt.cuda_built() and bt.cuda_device_count() > 0
    if device == "auto":
        return "cuda" if gpu else "cpu"
    if is_cuda(device) and not gpu:
        why = (
            "this blutrain.tensor build has no CUDA backend"
            if not bt.cuda_built()
            else "no CUDA device is visible"
        )
        raise ValueError(f"[train] device {device!r}: {why} (use --device cpu or auto)")
    if is_cuda(device) and ":" in device and int(device.split(":")[1]) >= bt.cuda_device_count():
        raise ValueError(
            f"[train] device {device!r}: only {bt.cuda_device_count()} CUDA device(s) are visible"
        )
    return device


def resolve_precision(precision: str, device: str) -> str:
    """ "auto" -> bf16 on a GPU, fp32 on the CPU; else the canonical name (fp32, tf32, bf16)."""
    from .gpt2 import precision_name

    if str(precision).lower() == "auto":
        return "bf16" if is_cuda(device) else "fp32"
    p = precision_name(precision)
    if p == "bf16" and not is_cuda(device):
        raise ValueError("[train] precision bf16 needs a CUDA device; use fp32 on the CPU")
    return p


def resolve_recompute(recompute: str, device: str, precision: str) -> str:
    """ "auto" -> "ln" for fp32 on a GPU, else "none"; any other spec unchanged.

    fp32 activations take twice bf16's memory; rebuilding the two LayerNorm outputs of each
    block in backward (bitwise the same numbers) takes GPT-2 124M's fp32 peak from 11.17 to
    10.05 GiB at B=16, T=1024, within the noise of its GEMM-bound step (56,840 -> 56,822 tok/s,
    session 25). tf32 keeps them: the same recompute cost its faster step about 3% (237,442 ->
    229,187 tok/s as a graph, partly the machine) and its 11.17 GiB is already under its aim;
    bf16 keeps everything too (6.78 GiB)."""
    if str(recompute).lower() != "auto":
        return recompute
    from .gpt2 import precision_name

    return "ln" if precision_name(precision) == "fp32" and is_cuda(device) else "none"


def memory_bytes(device: str) -> tuple[int, int]:
    """(current, peak) bytes: blutrain.tensor's CUDA allocator on a GPU, the process's resident
    memory on the CPU."""
    if is_cuda(device):
        from ._tensor import bt

        return int(bt.cuda.memory_allocated(device)), int(bt.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return rss, max(peak, rss)


def peak_memory_bytes(device: str) -> int:
    """Peak bytes: the CUDA allocator's peak on a GPU, the peak resident memory on the CPU."""
    return memory_bytes(device)[1]


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (N counts the tied head once) + attention's 12 L T C."""
    return 6.0 * cfg.n_params() + 12.0 * cfg.n_layer * seq_len * cfg.n_embd


def peak_flops(device: str, precision: str) -> float | None:
    """Dense peak FLOP/s of this GPU at `precision` (fp32, tf32 or bf16); None on the CPU or an
    unknown GPU. BLUTRAIN_PEAK_FLOPS overrides it."""
    env = os.environ.get("BLUTRAIN_PEAK_FLOPS")
    if env:
        return float(env)
    if not is_cuda(device):
        return None
    from ._tensor import bt
    from .gpt2 import precision_name

    name = bt.cuda.get_device_name(device)
    for key, table in _PEAK_FLOPS.items():
        if key in name:
            return table.get(precision_name(precision))
    return None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
