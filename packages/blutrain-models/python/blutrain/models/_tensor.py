"""blutrain.tensor, checked to be the API level this package was written for.

Every module of blutrain.models that runs tensors imports it from here (``from ._tensor import
bt``), so an older blutrain-tensor fails at import with one message saying what to install,
not later with an AttributeError deep in a training step. The packages ship together: there
are no fallbacks for older builds.
"""

from __future__ import annotations

import blutrain.tensor as bt

# The blutrain.tensor API level (bt.API_LEVEL) this package needs: 1 = bt.optim (adamw_,
# grad_norm, clip_coef), bt.backends, bt.__version__; 2 = the captured-graph contract
# (bt.is_capturing, bt.Graph's replay).
REQUIRED_API_LEVEL = 2


class TensorVersionError(ImportError):
    """The installed blutrain-tensor is older than this blutrain-models needs."""


try:
    from blutrain.tensor import API_LEVEL
except ImportError:  # builds before API levels existed
    API_LEVEL = 0

if API_LEVEL < REQUIRED_API_LEVEL:
    raise TensorVersionError(
        f"blutrain-models needs blutrain-tensor API level >= {REQUIRED_API_LEVEL}, but the "
        f"installed blutrain-tensor ({bt.__file__}) has level {API_LEVEL}: reinstall "
        "packages/blutrain-tensor from the same checkout (pip install --no-build-isolation "
        "packages/blutrain-tensor)"
    )

__all__ = ["API_LEVEL", "REQUIRED_API_LEVEL", "TensorVersionError", "bt"]
