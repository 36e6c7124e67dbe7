"""One-time notices (src/notice.h): a slow fallback a user should see once, on stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_notice_is_written_once_a_key_from_any_thread():
    """In a fresh process: 8 threads give one key, one line reaches stderr and one text the log;
    another key is another line; the texts keep their order."""
    code = textwrap.dedent(
        """
        import threading
        import blutrain.tensor as bt
        wrote = []
        def give():
            wrote.append(bt._C._notice_once("ln C=770", "[op] slow path for C = 770"))
        ts = [threading.Thread(target=give) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert sorted(wrote) == [False] * 7 + [True], wrote
        assert bt._C._notice_once("ln C=771", "[op] slow path for C = 771")
        assert not bt._C._notice_once("ln C=770", "[op] another text, same key")
        print(bt._C._notices())
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "blutrain.tensor: [op] slow path for C = 770",
        "blutrain.tensor: [op] slow path for C = 771",
    ], r.stderr
    assert r.stdout.strip() == str(["[op] slow path for C = 770", "[op] slow path for C = 771"])
