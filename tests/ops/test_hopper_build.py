"""The Gluon kernels built for sm_90a on any machine, with the ptxas that ships with Triton: no
register spills and no serialized wgmma.

Both slow a kernel without changing its results, so no exactness test sees them, and ptxas
reports serialization only as an info line that Triton does not show (docs/design.md,
change 35: a loop with a branch around the step made ptxas serialize every wgmma of the dQ
kernel, 2-5% slower). The build runs in a process of its own (``hopper_build.py``): under
``TRITON_INTERPRET=1``, which the CPU tests set, the kernels cannot be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

BUILD = Path(__file__).with_name("hopper_build.py")
ROOT = BUILD.parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
# Spill bytes (stores, loads) each build may have: the dim-128 dK/dV kernel spills a few scalars
# in its entry loop, as it did when it landed (docs/design.md, #15), and since its
# bulk-copy output (change 40) five more outside it, stored once per item (44 -> 64 bytes).
SPILLS = {
    "forward-64": (0, 0),
    "forward-128": (0, 0),
    "dq-128": (0, 0),
    "dkdv-64": (0, 0),
    "dkdv-128": (64, 56),
}

pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="Triton's bundled ptxas is missing")


@pytest.mark.parametrize("case", list(SPILLS))
def test_builds_without_spills_or_serialized_wgmma(case):
    # Triton picks its PTX version from the ptxas it would run. Inductor points TRITON_PTXAS_PATH
    # at torch's own (CUDA 13) once anything in this process compiled, and PTX for it is newer
    # than Triton's bundled ptxas, which this test runs, reads.
    unset = ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    # The script imports s2attn from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.fspath(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, os.fspath(BUILD), case],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout
    assert "Used " in report, report  # ptxas did report on the kernel
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    stores, loads = (int(n) for n in spills.groups())
    assert stores <= SPILLS[case][0] and loads <= SPILLS[case][1], report
    assert "serialized" not in report, report
