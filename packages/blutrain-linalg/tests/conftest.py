"""Skips tests marked gpu where no CUDA device is visible."""

from __future__ import annotations

import os
import sys

import pytest


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_runtest_logreport(report):
    # BLUTRAIN_TEST_EAGER=1 prints each failure as it happens, so a later hard crash of the
    # process (a GPU driver fault, say) cannot swallow the reports (gpu_check.sh sets it).
    if report.failed and os.environ.get("BLUTRAIN_TEST_EAGER"):
        sys.stderr.write(
            f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n"
        )
        sys.stderr.flush()
