"""bfloat16 without ml_dtypes: bf16 values travel as uint16 bit patterns (rounded to nearest
even, as PyTorch rounds).  Used by checkpoints and by the llm.c / Hugging Face conversions."""

from __future__ import annotations

import numpy as np


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), rounding to nearest even; NaN stays a quiet NaN."""
    x = np.array(x, dtype=np.float32, order="C")  # a copy: never a view of the caller's data
    u = x.view(np.uint32)
    one, half = np.uint32(1), np.uint32(0x7FFF)
    out = ((u + half + ((u >> np.uint32(16)) & one)) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_fp32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
