"""The C allocator of a process running CPU programs keeps freed memory for the next
launch (``gpu.backends.host_allocator``): repeated large temporaries stop costing page
faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Three 8 MiB temporaries per "launch", filled and freed, twenty times; prints the
# minor page faults of the last nineteen. With glibc's defaults the freed top of the
# heap (24 MiB, past its adaptive 16 MiB trim threshold) goes back to the kernel every
# time, and every launch faults its pages in again.
_LAUNCHES = """
import resource, sys
import numpy as np
from gpu.backends.host_allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def launch():
    blocks = [np.ones(2 << 20, dtype=np.float32) for _ in range(3)]
    return sum(float(b[-1]) for b in blocks)
launch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(19):
    launch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LAUNCHES, mode], check=True,
                         capture_output=True, text=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_serves_the_next_launch_without_page_faults() -> None:
    block_pages = (8 << 20) // 4096
    assert _faults("default") > 19 * block_pages // 4  # launches fault pages in again
    assert _faults("keep") < block_pages // 4
