"""shardworker.heap: a step's freed blocks stay in the process for the next step.

Each case runs in a fresh interpreter, so glibc starts from its defaults. What is checked is glibc's own
account (mallinfo2) of a 16 MiB block, the size of a prefill step's activations: by default it is mapped
on its own and unmapped on free (the next step faults it in again); after `keep_freed_memory` it comes
from the heap, and freeing it leaves it there, ready for reuse.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, json, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
kept = None
if sys.argv[1] in ("keep", "loading"):
    from shardworker.heap import keep_freed_memory, loading
    kept = keep_freed_memory()
if sys.argv[1] == "loading":  # a block freed inside a load is returned at once; after it, blocks are kept again
    with loading():
        inside = libc.malloc(16 << 20)
        mapped_inside = libc.mallinfo2().hblkhd >= 16 << 20
        libc.free(inside)
    kept = kept and mapped_inside
block = libc.malloc(16 << 20)
allocated = libc.mallinfo2()
libc.free(block)
freed = libc.mallinfo2()
print(json.dumps({"kept": kept, "mapped_alone": allocated.hblkhd >= 16 << 20,
                  "heap_free_after": freed.fordblks, "heap_after": freed.arena, "heap_during": allocated.arena}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def test_by_default_a_step_sized_block_is_mapped_alone_and_returned_on_free() -> None:
    r = _probe("default")
    assert r["mapped_alone"]
    assert r["heap_free_after"] < 16 << 20


@pytest.mark.parametrize("mode", ["keep", "loading"])
def test_kept_a_step_sized_block_comes_from_the_heap_and_stays_there_when_freed(mode: str) -> None:
    r = _probe(mode)
    assert r["kept"] is True
    assert not r["mapped_alone"]
    assert r["heap_during"] >= 16 << 20
    assert r["heap_after"] == r["heap_during"]  # not trimmed
    assert r["heap_free_after"] >= 16 << 20  # free for the next step, in memory already touched
