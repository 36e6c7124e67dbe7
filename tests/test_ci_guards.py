"""What makes CI's test run able to fail: pytest-timeout is active with a per-test and a
whole-run limit (a hang fails), and the PyTorch reference is installed (its absence fails the
run instead of skipping every fidelity test)."""

from __future__ import annotations


def test_hangs_fail(request):
    cfg = request.config
    assert cfg.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    per_test = float(cfg.getini("timeout"))
    whole_run = float(cfg.getini("session_timeout"))
    assert 0 < per_test <= 600, per_test
    assert per_test < whole_run <= 3600, whole_run
    assert cfg.getini("timeout_method") == "thread"  # also stops a hang inside C++ code


def test_the_pytorch_reference_is_installed():
    import torch

    assert torch.__version__
