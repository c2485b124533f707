"""benchmarks/bench_vllm.py and profile_vllm.py without vLLM or a GPU: their reports, rendered from
a run's results (the H200 run the docs cite, and rows made here), name every engine and row, so
that a device run never ends in a report that fails to print."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_vllm  # noqa: E402
import profile_vllm  # noqa: E402

RUN = ROOT / "docs" / "results" / "2026-12-02_h200_vllm.json"
SERVING = ROOT / "docs" / "results" / "2026-11-27_h100_serving.json"


def args(**overrides):
    base = dict(prompts=[32768, 131072], new=128, chunk=8192, repeats=2, stride=64)
    return SimpleNamespace(**{**base, **overrides})


def test_the_report_of_a_run_names_each_engine_and_bound():
    run = json.loads(RUN.read_text())
    # The same HHST engine again as hhst-union, with the async-scheduling field recorded.
    union = {**run["results"][1], "config": "hhst-union", "async_scheduling": True}
    text = bench_vllm.markdown([*run["results"], union], run["env"], args())
    rows = [line for line in text.splitlines() if line.startswith("| hhst-union | 131072 |")]
    assert len(rows) == 2  # the main table and the KV bounds table
    assert "| hhst | 131072 | 3.49 | 2.79 | 92.9 | 0.91 | 34 | 1302 | 8.39 |" in text
    assert "S2ATTN_VLLM_KV_PAGES=union" in text
    assert "asynchronous scheduling on" in text and "asynchronous scheduling not recorded" in text
    assert "15 S2AttentionSpec of 2 layers, 15 S2StripeSpec of 2 layers" in text


def test_generate_rows_come_from_the_serving_benchmarks_results(tmp_path):
    (tmp_path / "generate").mkdir()
    (tmp_path / "generate" / "2026-11-27_h100_serving.json").write_text(SERVING.read_text())
    rows = bench_vllm.generate_rows(tmp_path, SimpleNamespace(generate=False))
    text = bench_vllm.generate_markdown(rows)
    assert "| HHST V64 static+compiled | 131072 | n/a | 90.6 | 1 | 93 | 1.374 |" in text
    assert bench_vllm.generate_rows(tmp_path / "none", SimpleNamespace(generate=False)) == []
    assert bench_vllm.generate_markdown([]) == ""


def test_the_profile_report_lists_kernels_and_host_functions():
    result = dict(
        wall_ms=9.2,
        wall_runs=[9.1, 9.2, 9.4],
        gpu_ms=4.9,
        kernels=[["_decode_kernel", 30.0, 11.2, 0.336]],
        host=[["vllm_paged.py:368(fill)", 15.0, 1740.0]],
        groups=31,
    )
    env = json.loads(RUN.read_text())["env"]
    text = profile_vllm.markdown(result, env, SimpleNamespace(config="hhst", prompt=131072))
    assert "Wall 9.20 ms a step" in text and "KV-cache groups 31" in text
    assert "| _decode_kernel | 30.0 | 11.2 | 0.336 |" in text
    assert "| vllm_paged.py:368(fill) | 15.0 | 1740 |" in text
