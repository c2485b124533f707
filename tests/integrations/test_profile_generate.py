"""benchmarks/profile_generate.py: the step split and kernel categories of a profiler trace (a
CUDA trace built here with known answers: dense and S2 layers' decode told apart by their order,
the lm_head, sampling, overlaps counted once, kernels placed by their launch), the CPU operators'
self time, and the whole script on the CPU (--smoke)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_GUARD_S

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _profile_generate():
    sys.path.insert(0, str(BENCHMARKS))
    import profile_generate

    return profile_generate


def _event(cat, name, ts, dur, tid=1, **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args=args)


def _cuda_step(t0: float, corr: int) -> list[dict]:
    """One step of a 3-layer model (layers s2, dense, s2) from ``t0`` (µs): an eager add and
    input copy, one CUDA-graph replay of the forward, an eager argmax."""
    pg = _profile_generate()
    graph = [  # (name, start, end, grid): the graph's kernels, in the order they run
        ("triton_poi_fused_embedding_0", 40, 45, None),
        ("nvjet_tst_128x64_qkv", 50, 60, None),  # layer 0 (S2)
        (pg.WRITE_KERNEL, 60, 62, [1, 1, 1]),
        ("Memset (Device)", 62, 63, None),  # the operator's split counters
        (pg.DECODE_KERNEL, 63, 73, [8, 12, 1]),
        ("nvjet_tst_128x64_o", 73, 80, None),
        ("triton_red_fused_add_mean_mul_pow_rsqrt_1", 80, 84, None),  # layer 1 (dense)
        (pg.WRITE_KERNEL, 84, 86, [1, 1, 1]),
        (pg.DECODE_KERNEL, 86, 106, [8, 33, 1]),
        ("gemvx_kernel", 106, 110, None),
        (pg.WRITE_KERNEL, 110, 112, [1, 1, 1]),  # layer 2 (S2)
        (pg.DECODE_KERNEL, 112, 122, [8, 12, 1]),
        ("sm90_xmma_gemm_bf16bf16", 120, 130, None),  # overlaps the decode by 2 µs
        ("triton_per_fused_mean_rsqrt_2", 130, 133, None),  # final norm
        ("gemv2T_kernel_val", 133, 140, None),  # lm_head, split-K
        ("splitKreduce_kernel", 140, 141, None),
        ("triton_poi_fused_copy_3", 141, 143, None),  # the graph's own copy after the lm_head
    ]
    events = [
        _event("cuda_runtime", "cudaLaunchKernel", t0 + 5, 3, correlation=corr + 3),
        _event("kernel", "vectorized_elementwise_kernel<add>", t0 + 15, 2, correlation=corr + 3),
        _event("cuda_runtime", "cudaMemcpyAsync", t0 + 10, 3, correlation=corr),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", t0 + 20, 5, correlation=corr),
        _event("cuda_runtime", "cudaGraphLaunch", t0 + 30, 8, correlation=corr + 1),
        _event("cuda_runtime", "cudaLaunchKernel", t0 + 145, 4, correlation=corr + 2),
        _event(
            "kernel", "void at::native::reduce_kernel<ArgMaxOps>", t0 + 150, 2, correlation=corr + 2
        ),
    ]
    for name, start, end, grid in graph:
        cat = "gpu_memset" if name.startswith("Memset") else "kernel"
        extra = {"grid": grid} if grid else {}
        events.append(_event(cat, name, t0 + start, end - start, correlation=corr + 1, **extra))
    return events


def _mark(ts):
    return _event("user_annotation", _profile_generate().MARK, ts, 1)


def test_cuda_trace_steps_and_categories():
    pg = _profile_generate()
    events = [_mark(0), _mark(1000), _mark(2000)]
    events += [  # the prefill's kernel, before the first mark: no step's
        _event("cuda_runtime", "cudaLaunchKernel", -600, 4, correlation=1),
        _event("kernel", "nvjet_prefill", -500, 50, correlation=1),
    ]
    events += _cuda_step(0, 10) + _cuda_step(1000, 20)
    # Launched in step 0, run after the next mark by the GPU's clock: still step 0's.
    events += [
        _event("cuda_runtime", "cudaLaunchKernel", 990, 4, correlation=30),
        _event("kernel", "CatArrayBatchedCopy", 1001, 2, correlation=30),
    ]
    result = pg.analyse({"traceEvents": events}, ["s2", "dense", "s2"])
    first, second = result["steps"]
    want = {
        "s2attn decode, S2 layers": 20,
        "s2attn decode, dense layers": 20,
        "page writes": 6,
        "s2attn op, other launches": 1,
        "GEMMs": 10 + 7 + 4 + 8,  # the last one less the 2 µs the decode already covers
        "lm_head GEMM": 8,
        "norms, elementwise": 5 + 4 + 3 + 2,
        "sampling/logits, generate's loop": 2 + 2 + 2,  # the add, argmax and cat
        "memcpy/memset": 5,
        "other": 0,
    }
    assert first["categories"] == pytest.approx({k: v / 1e3 for k, v in want.items()})
    assert first["busy_ms"] == pytest.approx(0.109)
    assert first["graph_ms"] == pytest.approx(0.109 - 0.011)  # less the add, copy, argmax, cat
    assert first["wall_ms"] == pytest.approx(1.0) and first["gap_ms"] == pytest.approx(0.891)
    assert first["attention_calls"] == second["attention_calls"] == 3
    assert second["categories"]["sampling/logits, generate's loop"] == pytest.approx(0.004)
    assert second["busy_ms"] == pytest.approx(0.107)
    assert result["grids"] == {"s2": [(8, 12, 1)], "dense": [(8, 33, 1)]}
    top = {t["name"]: t for t in result["top"]}
    assert top[pg.DECODE_KERNEL]["calls"] == 6 and top[pg.DECODE_KERNEL]["ms"] == pytest.approx(
        0.08
    )
    assert "nvjet_prefill" not in top


def test_cpu_operators_self_time_and_s2attn_calls():
    """On the CPU: each operator's self time, its inner operators' time going to them; what
    runs inside an s2attn operator is that call's, layer by layer."""
    pg = _profile_generate()
    ops = [
        _event("cpu_op", "aten::linear", 10, 20),
        _event("cpu_op", "aten::mm", 12, 10),
        _event("cpu_op", "s2attn::static_decode", 40, 30),
        _event("cpu_op", "aten::index_put_", 45, 5),
        _event("cpu_op", "s2attn::static_decode", 80, 10),
        _event("cpu_op", "aten::argmax", 95, 1),
    ]
    result = pg.analyse({"traceEvents": [_mark(0), _mark(100), *ops]}, ["dense", "s2"])
    (step,) = result["steps"]
    cats = step["categories"]
    assert cats["s2attn decode, dense layers"] == pytest.approx(0.030)
    assert cats["s2attn decode, S2 layers"] == pytest.approx(0.010)
    assert cats["lm_head GEMM"] == pytest.approx(0.020)  # the linear and its mm
    assert cats["sampling/logits, generate's loop"] == pytest.approx(0.001)
    assert step["busy_ms"] == pytest.approx(0.061) and step["attention_calls"] == 2
    top = {t["name"]: t for t in result["top"]}
    assert top["aten::linear"]["ms"] == pytest.approx(0.010)  # 20 µs less its mm's 10
    assert top["s2attn::static_decode"]["calls"] == 2


def test_kernel_names_are_s2attns():
    """The names the categories look for are the decode step's kernels."""
    pg = _profile_generate()
    from s2attn.ops.triton import decode, page_write

    assert hasattr(decode, pg.DECODE_KERNEL) and hasattr(page_write, pg.WRITE_KERNEL)


@pytest.mark.parametrize("extra", [[], ["--skip-guard-eval"]])
def test_smoke_run(tmp_path, extra):
    """The whole script on the CPU: results written, every step's categories summing to its
    busy time, both layer types' attention and the lm_head found; also with dynamo's guards
    skipped after the warm-up."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The script, not the kernels, is under test: the reference decode is faster than the
    # interpreted kernels, and the CPU profile names neither.
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "profile_generate.py"),
            "--smoke",
            "--out-dir",
            str(tmp_path),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    print(done.stdout[-4000:], done.stderr[-3000:])
    assert done.returncode == 0
    # A run without the guards writes files of its own name, beside a run with them.
    name = "profile_generate_skip_guard_eval_smoke" if extra else "profile_generate_smoke"
    (result,) = tmp_path.glob(f"*_{name}.json")
    text = result.with_suffix(".md").read_text()
    assert ("guards skipped after the warm-up" in text) == bool(extra)
    assert result.with_name(result.stem + ".trace.json.gz").exists()
    payload = json.loads(result.read_text())
    rows = payload["rows"]
    assert len(rows) == 2
    for row in rows:
        assert sum(row["categories"].values()) == pytest.approx(row["busy_ms"], abs=1e-6)
        assert 0 < row["busy_ms"] <= row["wall_ms"]
        assert row["attention_calls"] == 2
        cats = row["categories"]
        for name in (
            "s2attn decode, S2 layers",
            "s2attn decode, dense layers",
            "GEMMs",
            "lm_head GEMM",
            "sampling/logits, generate's loop",
        ):
            assert cats[name] > 0, name
    assert payload["layer_types"] == ["s2", "dense"]
    assert payload["floor"]["floor_ms"] > 0 and 0 < len(payload["profile"]["top"]) <= 15
