"""benchmarks/bench_cpu.py --smoke runs its rows (alone and beside the process it starts) and
writes its table and JSON: the plumbing, not a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu.py"


def test_smoke_run_writes_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--smoke", "--repeats", "1", "--threads", "1", "--out-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = tmp_path.glob("*_attention_smoke.json")
    rows = json.loads(result.read_text())["rows"]
    assert {(r["provider"], r["competing"]) for r in rows} == {
        (p, c) for p in ("s2attn", "sdpa") for c in (False, True)
    }
    assert all(r["fwd_s"] > 0 and r["fwd_bwd_s"] >= r["fwd_s"] for r in rows)
    assert (tmp_path / result.name.replace(".json", ".md")).read_text().count("| s2attn |") == 2
