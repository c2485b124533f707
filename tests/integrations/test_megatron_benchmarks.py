"""benchmarks/megatron_gpt.py and benchmarks/megatron_tp.py on the CPU (gloo ranks, the tiny
model): TP = 1 and 2 train to the same losses, an 11% dq error fails the gradient check, heads that
do not divide by the tensor-parallel size are refused on every rank, and the loss comparison fails
a drift beyond its tolerance. Skipped where megatron-core is not installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG_GUARD_S, ON_GPU

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU smoke runs (gloo ranks)")

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _run(*cmd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    print(done.stdout[-4000:], done.stderr[-3000:])
    return done


def _torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """megatron_gpt.py on ``ranks`` gloo ranks; ``--tee 3`` prefixes each rank's lines with it."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    script = [str(BENCHMARKS / "megatron_gpt.py"), *args]
    return _run(*launch, "--tee", "3", *script)


def _megatron_tp():
    sys.path.insert(0, str(BENCHMARKS))
    import megatron_tp

    return megatron_tp


def test_tp_sizes_train_to_the_same_losses(tmp_path):
    """The driver runs TP = 1 and 2 (same seed, data and initial weights) and finds every step's
    loss within the float32 tolerance; each run passes its own checks."""
    done = _run(str(BENCHMARKS / "megatron_tp.py"), "--smoke", "--out-dir", str(tmp_path))
    assert done.returncode == 0
    (result,) = tmp_path.glob("*_megatron_tp_smoke.json")
    payload = json.loads(result.read_text())
    assert payload["same"] and payload["passed"] and payload["tol"] == 1e-4
    assert payload["statuses"] == {"1": 0, "2": 0}
    tp1, tp2 = payload["losses"]["1"], payload["losses"]["2"]
    assert len(tp1) == len(tp2) == 10 and tp1[-1] < tp1[0]
    torch.testing.assert_close(tp2, tp1, rtol=1e-4, atol=0)
    for n in (1, 2):  # each run's gathered layer checks passed at its TP size
        (run,) = tmp_path.glob(f"*_megatron_gpt_tp{n}_smoke.json")
        layers = json.loads(run.read_text())["layers"]
        assert [c["passed"] for c in layers] == [True, True]


def test_loss_comparison_fails_a_drift_beyond_tolerance():
    compare = _megatron_tp().compare
    base = [5.5, 4.0, 3.0]
    _, ok = compare({1: base, 2: base, 4: [x * 1.01 for x in base]}, 2e-2)
    assert ok
    rows, ok = compare({1: base, 2: base, 4: [5.5, 4.0, 3.0 * 1.03]}, 2e-2)
    assert not ok and [r[-1] for r in rows] == [True, True, False]
    _, ok = compare({1: base, 2: base[:2]}, 2e-2)  # a run that stopped early
    assert not ok


def test_injected_dq_error_fails_the_gradient_check(tmp_path):
    """``--inject-dq-error 0.11`` scales the checked layers' dq by 1.11: the check on fresh inputs
    fails (as it would under bf16's 1e-2) while the output and dk, dv still pass."""
    done = _torchrun(1, "--smoke", "--inject-dq-error", "0.11", "--out-dir", str(tmp_path))
    assert done.returncode == 1 and "FAILED" in done.stdout
    (result,) = tmp_path.glob("*_megatron_gpt_smoke.json")
    payload = json.loads(result.read_text())
    assert payload["loss"]["passed"] and payload["packed"]["passed"]
    for layer in payload["layers"]:
        assert layer["checks"] == dict(out=True, trained_grads=False, fresh=False)
        assert 0.1 < layer["fresh"]["dq"] < 0.12
        assert layer["fresh"]["dk"] < layer["tol"] and layer["fresh"]["dv"] < layer["tol"]


def test_indivisible_heads_are_refused_on_every_rank(tmp_path):
    """3 heads over 2 tensor-parallel ranks: both ranks exit with the error, and neither hangs."""
    done = _torchrun(
        2,
        "--smoke",
        "--heads",
        "3",
        "--kv-heads",
        "1",
        "--hidden",
        "48",
        "--out-dir",
        str(tmp_path),
    )
    assert done.returncode != 0
    message = "--heads 3 does not divide by the tensor-parallel size 2"
    for rank in (0, 1):
        line = re.compile(rf"^\[\w*{rank}\]:{re.escape(message)}", re.MULTILINE)
        assert line.search(done.stdout + done.stderr), f"rank {rank} did not refuse"
