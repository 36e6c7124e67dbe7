import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _compile_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One disk cache for the whole session (MLIR compile time dominates these tests), unless
    the caller set BLUTRAIN_COMPILE_CACHE."""
    if "BLUTRAIN_COMPILE_CACHE" not in os.environ:
        os.environ["BLUTRAIN_COMPILE_CACHE"] = str(tmp_path_factory.mktemp("compile-cache"))
    # LLVM -O0: the same numbers at every level (no fast-math flags are ever set), a third of
    # -O1's compile time, which dominates these tests
    os.environ.setdefault("BLUTRAIN_COMPILE_OPT", "0")
