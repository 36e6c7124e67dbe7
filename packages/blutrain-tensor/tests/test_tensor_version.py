"""bt.__version__ and bt.API_LEVEL: what a dependent checks at import."""

from __future__ import annotations

from importlib.metadata import version

import blutrain.tensor as bt


def test_version_is_the_installed_distributions():
    assert bt.__version__ == version("blutrain-tensor")
    assert bt.__version__ != "0+unknown"


def test_api_level_is_an_int_that_covers_the_public_optim_api():
    assert type(bt.API_LEVEL) is int and bt.API_LEVEL >= 1
    # level 1's names (see _version.py): a dependent requiring level 1 may use all of them
    for name in ("adamw_", "grad_norm", "clip_coef", "scale_"):
        assert callable(getattr(bt.optim, name))
    assert callable(bt.backends.use_flash_attention_cpu)
