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
    # The same HHST engine again as hhst-union, from a run that did not record asynchronous
    # scheduling.
    union = {**run["results"][1], "config": "hhst-union"}
    union.pop("async_scheduling")
    text = bench_vllm.markdown([*run["results"], union], run["env"], args())
    rows = [line for line in text.splitlines() if line.startswith("| hhst-union | 131072 |")]
    assert len(rows) == 2  # the main table and the KV bounds table
    assert "| hhst | 131072 | 3.39 | 2.87 | 223.6 | 1.82 | 34 | 2056 | 12.38 |" in text
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


class ScriptedEngine:
    """An engine whose one request gives a token a step, each step 1 ms on a clock of its own,
    and whose page reading costs 5 ms: a batch-1 rate that counted it would show."""

    def __init__(self, new: int) -> None:
        self.new, self.tokens, self.clock, self.reads = new, 0, 0.0, []
        self.engine = SimpleNamespace(has_unfinished_requests=lambda: self.tokens < self.new)

    def submit(self, prompts, new):
        assert new == self.new

    def pages_held(self):
        self.clock += 5e-3
        self.reads.append(self.tokens)
        return [self.tokens]

    def step(self):
        self.clock += 1e-3
        self.tokens += 1
        out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(self.tokens)))])
        return self.clock, [out]

    def group_bytes(self, pages):
        return {"s2": pages[0]}


def test_batch_1_decode_leaves_out_the_steps_that_read_the_pages(monkeypatch):
    engine = ScriptedEngine(new=20)
    monkeypatch.setattr(bench_vllm.time, "perf_counter", lambda: engine.clock)
    monkeypatch.setattr(bench_vllm, "prompt", lambda length, seed: {})
    row = bench_vllm.single_request(engine, 64, 20, seed=0)
    # Pages read only in the last ACCOUNTING_STEPS steps, the last reading kept.
    steps = bench_vllm.ACCOUNTING_STEPS
    assert engine.reads == list(range(20 - steps, 20))
    assert row["pages"] == [19] and row["kv_bytes"] == {"s2": 19}
    # One token a millisecond over the untimed steps' predecessors: 1,000 tokens/s exactly.
    assert row["tok_s"] == pytest.approx(1000.0)
    assert row["ttft_s"] == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="no decode step to time"):
        bench_vllm.single_request(ScriptedEngine(new=steps + 1), 64, steps + 1, seed=0)


def test_generate_compiles_the_longest_prompt_only(monkeypatch, tmp_path):
    commands = []
    monkeypatch.setattr(bench_vllm.subprocess, "call", lambda command: commands.append(command))
    assert bench_vllm.generate_rows(tmp_path, args(generate=True, prompts=[32768, 131072])) == []
    (command,) = commands
    assert command[command.index("--prompts") + 1] == "32768,131072"
    assert command[command.index("--compiled-prompts") + 1] == "131072"


def test_the_largest_batch_retries_after_a_compiled_step_ran_out_of_memory(monkeypatch):
    import bench_serving
    import torch
    from torch._inductor import cudagraph_trees

    resets, tried = [], []

    def decode(model, batch, ctx, new, fill):
        tried.append(batch)
        # A retry before the CUDA-graph trees were reset would fail inside Inductor.
        assert len(resets) == len(tried) - 1
        if batch > 22 or batch == 1:
            raise torch.OutOfMemoryError(f"batch {batch}")
        return dict(batch=batch)

    monkeypatch.setattr(bench_serving, "decode", decode)
    monkeypatch.setattr(cudagraph_trees, "reset_cudagraph_trees", lambda: resets.append(1))
    assert bench_serving.fitting_batch(None, 131072, 16, None, 25) == dict(batch=21)
    assert tried == [25, 23, 21] and len(resets) == 2

    tried.clear()
    resets.clear()
    with pytest.raises(torch.OutOfMemoryError):  # nothing smaller to try
        bench_serving.fitting_batch(None, 131072, 16, None, 1)
    assert tried == [1]
