"""blutrain-tensor's version and the level of its public Python API.

``__version__`` is the installed distribution's version (from its metadata, so it cannot drift
from pyproject.toml). ``API_LEVEL`` is an integer raised whenever the public API gains something a
dependent may rely on; a dependent states the level it was written for and refuses an older
blutrain-tensor at import, with a message saying what to install::

    import blutrain.tensor as bt
    if getattr(bt, "API_LEVEL", 0) < 1:   # getattr: builds older than level 1 lack the name
        raise ImportError("blutrain-models needs blutrain-tensor API level >= 1 ...")

Levels:
  1. ``bt.optim`` (``adamw_``, ``grad_norm``, ``clip_coef``, ``scale_``), ``bt.backends``
     (``flash_attention_cpu``), ``bt.__version__``, ``bt.API_LEVEL``.
  2. the captured-graph contract (docs/graph_format.md): ``bt.is_capturing``, ``bt.op_schemas``,
     ``bt.load_graph``, ``bt.Graph`` with ``to_json`` / ``hash`` / ``replay``.
  3. ``bt.op_log()`` / ``bt.OpLogEntry``: the eager op log.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

API_LEVEL: int = 3

try:
    __version__: str = version("blutrain-tensor")
except PackageNotFoundError:  # imported from a source tree that was never pip-installed
    __version__ = "0+unknown"
