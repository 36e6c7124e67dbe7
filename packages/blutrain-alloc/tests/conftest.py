import pytest

import blutrain.alloc as ba


def cuda_available() -> bool:
    try:
        return ba.device_count() > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (or a CPU-only build)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def host_clean():
    """Every host test starts and ends with nothing live in the pageable pool."""
    ba.set_memory_limit(0, "cpu")
    ba.empty_cache("cpu")
    before = ba.stats("cpu")
    assert before["active_blocks"] == 0
    yield
    ba.set_memory_limit(0, "cpu")
    after = ba.stats("cpu")
    assert after["active_blocks"] == 0, "a test leaked blocks"
    ba.empty_cache("cpu")
