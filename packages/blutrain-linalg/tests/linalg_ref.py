"""float64 references and error measures shared by the tests."""

from __future__ import annotations

import numpy as np

# Relative Frobenius error allowed per mode (the targets; see _expected in the tests).
TOL = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 1e-2, "fp16": 3e-3, "f64": 1e-12}


def rel_err(d, ref) -> float:
    d = np.asarray(d, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(d - ref) / (denom if denom > 0 else 1.0))


def gelu64(z):
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def dgelu64(z):
    z = np.asarray(z, dtype=np.float64)
    s = np.sqrt(2.0 / np.pi)
    t = np.tanh(s * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * s * (1.0 + 3 * 0.044715 * z * z)
