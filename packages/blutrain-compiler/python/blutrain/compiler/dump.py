"""BLUTRAIN_COMPILE_DUMP=dir: every stage of a compilation written under dir/<graph hash>/."""

from __future__ import annotations

import os

from .cache import atomic_write


class Dump:
    def __init__(self, path: str) -> None:
        self.dir = path
        os.makedirs(path, exist_ok=True)

    def write(self, name: str, text: str | bytes) -> None:
        data = text.encode() if isinstance(text, str) else text
        atomic_write(os.path.join(self.dir, name), data)
