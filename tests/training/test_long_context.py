"""Long context (issue 41): RoPE settings through train and eval, --init-from across lengths and
variants, the refusals of bad extensions and of evaluations that cannot fit, logits in chunks,
the medium preset, and benchmarks/long_context.py end to end on the CPU (interrupted by its
deadline, then resumed to completion)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from helpers import HANG_GUARD_S, s2_layers_on_reference, tiny_train_argv, train_args
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from s2attn.integrations import transformers as s2hf
from s2attn.training import data, evaluate, presets, run_plan, scoring, train

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SMALL = tiny_train_argv(batch_size=2)


@pytest.fixture(autouse=True)
def _reference_attention(monkeypatch):
    s2_layers_on_reference(monkeypatch)


def _args(out: Path, root: Path, *extra: str) -> argparse.Namespace:
    return train_args(SMALL, out, root, *extra)


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus_root) -> Path:
    """A tiny HHST model trained a few steps at 64 tokens: the run the tests extend."""
    out = tmp_path_factory.mktemp("base") / "hhst"
    with pytest.MonkeyPatch.context() as mp:
        s2_layers_on_reference(mp)
        assert train.run(_args(out, corpus_root, "--steps", "4", "--val-every", "0")) == 0
    return out


# ------------------------------------------------------------------------------ presets, RoPE
def test_medium_preset_has_100_to_150m_parameters():
    config = presets.model_config("medium", "hhst")
    with torch.device("meta"):
        counted = sum(p.numel() for p in presets.build_model(config).parameters())
    print(f"medium: {counted / 1e6:.1f}M parameters")
    assert presets.parameter_count(config) == counted
    assert 100e6 <= counted <= 150e6
    types = config.s2attn["layer_types"]
    assert [i for i, t in enumerate(types) if t == "dense"] == [4, 8]
    # Every block reachable from every later block through some head of an S2 layer.
    assert s2hf.layer_pattern(config, 0).is_union_complete()


@pytest.mark.parametrize("legacy", [False, True], ids=["rope_parameters", "rope_scaling"])
def test_rope_settings_reach_the_rotary_embedding(legacy, monkeypatch, tmp_path):
    """Both forms of transformers' RoPE arguments give the same rotation, survive
    save_pretrained, and linear scaling divides the positions by the factor."""
    monkeypatch.setattr(presets, "_ROPE_PARAMETERS", not legacy)
    scaled = presets.model_config(
        "tiny", "hhst", seq_len=256, rope_theta=20000.0, rope_scaling="linear", rope_factor=4.0
    )
    plain = presets.model_config("tiny", "hhst", seq_len=256, rope_theta=20000.0)
    want = {"rope_theta": 20000.0, "rope_scaling": "linear", "rope_factor": 4.0}
    assert presets.rope_settings(scaled) == want
    presets.build_model(scaled).save_pretrained(tmp_path)
    loaded = LlamaConfig.from_pretrained(tmp_path)
    assert presets.rope_settings(loaded) == want
    assert presets.rope_settings(plain)["rope_scaling"] == "none"

    x = torch.zeros(1, 1, 64)
    positions = torch.arange(0, 256, 4)[None]
    cos_scaled, _ = LlamaForCausalLM(loaded).model.rotary_emb(x, positions)
    cos_plain, _ = LlamaForCausalLM(plain).model.rotary_emb(x, positions // 4)
    torch.testing.assert_close(cos_scaled, cos_plain, rtol=1e-5, atol=1e-5)
    theta_10k, _ = LlamaForCausalLM(presets.model_config("tiny", "hhst")).model.rotary_emb(
        x, positions // 4
    )
    assert not torch.allclose(theta_10k, cos_plain)  # the base reached the rotation too


def test_init_from_extends_across_variants_and_eval_loads_it(tmp_path, corpus_root, base):
    """An HHST run's weights extended to twice the length as a dense model with another RoPE:
    every weight loads, the saved config records the length and RoPE, a run from that one
    inherits its RoPE, and `s2attn eval` holds the new length but refuses a longer one."""
    out = tmp_path / "dense128"
    extend = [
        "--init-from",
        str(base),
        "--variant",
        "dense",
        "--seq-len",
        "128",
        "--rope-theta",
        "20000",
        "--rope-scaling",
        "linear",
        "--rope-factor",
        "2",
    ]
    plan = run_plan.prepare(_args(out, corpus_root, *extend))
    model = train._initial_model(plan, resuming=False)
    saved = load_file(str(base / "model.safetensors"))
    state = model.state_dict()
    assert set(saved) | {"lm_head.weight"} == set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name

    assert train.run(_args(out, corpus_root, *extend, "--steps", "1", "--val-every", "0")) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 128
    assert presets.rope_settings(LlamaConfig.from_pretrained(out)) == {
        "rope_theta": 20000.0,
        "rope_scaling": "linear",
        "rope_factor": 2.0,
    }
    again = run_plan.prepare(
        _args(
            tmp_path / "next",
            corpus_root,
            "--init-from",
            str(out),
            "--variant",
            "hhst",
            "--seq-len",
            "128",
        )
    )
    assert {
        k: getattr(again.options, k) for k in ("rope_theta", "rope_scaling", "rope_factor")
    } == {
        "rope_theta": 20000.0,
        "rope_scaling": "linear",
        "rope_factor": 2.0,
    }

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    common = ["--device", "cpu", "--no-progress", "--val-batches", "1"]
    result = tmp_path / "eval.json"
    args = parser.parse_args([str(out), *common, "--seq-len", "128", "--out", str(result)])
    assert evaluate.run(args) == 0
    assert json.loads(result.read_text())["val_tokens"] == 2 * 128
    with pytest.raises(ValueError, match="--seq-len 129 exceeds the model's context limit of 128"):
        evaluate.run(parser.parse_args([str(out), *common, "--seq-len", "129"]))


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rope-factor", "2"], "--rope-factor 2.0 needs --rope-scaling linear"),
        (["--rope-scaling", "linear"], "--rope-scaling linear needs --rope-factor"),
        (["--rope-scaling", "linear", "--rope-factor", "0.5"], "--rope-factor must be .*>= 1"),
        (["--rope-theta", "0"], "--rope-theta must be a positive number"),
        (["--rope-theta", "nan"], "--rope-theta must be a positive number"),
        (["--seq-len", "256", "--max-seq-len", "128"], "--seq-len 256 exceeds --max-seq-len"),
    ],
)
def test_bad_extension_is_refused_before_writing(extra, message, tmp_path, corpus_root, base):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        train.run(_args(out, corpus_root, "--init-from", str(base), *extra))
    assert not out.exists()


def test_init_from_another_architecture_lists_the_fields(tmp_path, corpus_root):
    """A model with other KV heads and vocabulary (but the tiny preset's other sizes) is refused
    with exactly the fields that differ, before anything is written."""
    config = presets.model_config("tiny", "dense", seq_len=64)
    config.num_key_value_heads, config.vocab_size = 4, 300
    source = tmp_path / "other"
    LlamaForCausalLM(config).save_pretrained(source)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        train.run(_args(out, corpus_root, "--init-from", str(source)))
    text = str(info.value)
    print(text)
    fields = "num_key_value_heads 4 there, 2 here; vocab_size 300 there, 260 here."
    assert f"holds another architecture: {fields}" in text
    for same in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        assert same not in text
    assert not out.exists()


def test_eval_refuses_a_pass_that_cannot_fit(tmp_path, corpus_root, base, monkeypatch):
    """An evaluation whose largest forward pass needs more memory than is free fails with the
    memory it needs, before any model or data is loaded."""
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    needed = evaluate.forward_memory(LlamaConfig.from_pretrained(base), 16 * 64, activation_bytes=4)
    monkeypatch.setattr(evaluate, "free_memory", lambda device: needed - 1)
    loaded = []
    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    out = tmp_path / "eval.json"
    args = parser.parse_args(
        [str(base), "--device", "cpu", "--batch-size", "16", "--out", str(out)]
    )
    gib = f"{needed / 2**30:.2f}"
    with pytest.raises(ValueError, match=f"16 x 64 tokens a forward pass needs about {gib} GiB"):
        evaluate.run(args)
    assert not loaded and not out.exists()
    # One sequence a pass fits.
    monkeypatch.setattr(evaluate, "free_memory", lambda device: needed)
    small = evaluate.forward_memory(LlamaConfig.from_pretrained(base), 64, activation_bytes=4)
    assert small < needed


def test_forward_memory_grows_with_tokens_and_bounds_the_weights():
    config = presets.model_config("small", "hhst", seq_len=131072)
    weights = presets.parameter_count(config) * 4
    at_32k, at_128k = (evaluate.forward_memory(config, n) for n in (32768, 131072))
    assert weights < at_32k < at_128k
    # The small model's 128k evaluation is a few GiB, far from an H100's 80.
    assert at_128k < 8 * 2**30


def test_eval_batch_defaults_to_one_sequence_at_long_lengths(tmp_path, base, monkeypatch):
    monkeypatch.setattr(evaluate, "_BATCH_TOKENS", 64)  # 64 tokens is "long" here
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    out = tmp_path / "eval.json"
    args = parser.parse_args(
        [str(base), "--device", "cpu", "--no-progress", "--val-batches", "2", "--out", str(out)]
    )
    assert evaluate.run(args) == 0
    result = json.loads(out.read_text())
    assert result["batch_size"] == 1 and result["val_tokens"] == 2 * 64
    assert result["wall_s"] > 0


# ------------------------------------------------------------------------------ chunked logits
def test_chunked_logits_match_the_whole_logits(base, corpus_root, monkeypatch):
    """Bits per byte and needle predictions with the head applied in chunks of 7 positions
    equal those from the model's whole (batch, seq, vocab) logits."""
    model = LlamaForCausalLM.from_pretrained(base).float().eval()
    corpus = data.SourceCorpus([corpus_root], split="val", val_fraction=0.3)
    batches = evaluate.validation_batches(corpus, 64, 3, 2, seed=0)
    needles = [
        s for g in evaluate.needle_samples(corpus, 64, [0, 0.5, 1], 2, 0).values() for s in g
    ]

    class Whole(torch.nn.Module):  # not a PreTrainedModel: the unchunked path
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids):
            return self.inner(input_ids, use_cache=False)

    monkeypatch.setattr(scoring, "_LOGIT_ROWS", 7)
    assert scoring._decoder_and_head(model) is not None
    chunked = evaluate.validation_bpb(model, batches, device="cpu")
    whole = evaluate.validation_bpb(Whole(), batches, device="cpu")
    print(f"chunked {chunked:.6f}, whole {whole:.6f}")
    assert chunked == pytest.approx(whole, rel=1e-6)
    tokens = torch.stack([s.tokens for s in needles])[:, :-1]
    where = [slice(s.answer_start - 1, s.answer_start + s.answer_len - 1) for s in needles]
    with torch.no_grad():
        got = scoring._predictions(model, tokens, where)
        want = Whole()(tokens).logits.argmax(-1)
    for row, w in enumerate(where):
        assert torch.equal(got[row], want[row, w])


# ------------------------------------------------------------------------ the experiment script
def _script(name: str = "long_context"):
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_equal_time_reads_dense_between_its_validations():
    report = _script("long_context_report")
    timed = [({"val_bpb": 2.0}, 10.0), ({"loss": 1.0}, 15.0), ({"val_loss": 1.0}, 20.0)]
    assert report.at_time(timed, 15.0) == pytest.approx(1.5)  # older rows name it val_loss
    assert report.at_time(timed, 40.0) == 1.0  # dense finished sooner: its last value
    assert report.at_time(timed, 5.0) is None  # before its first validation: unknown


def test_scheduler_starts_only_what_fits_before_the_deadline(tmp_path):
    lc = _script()
    o = lc.parse(
        [
            "--smoke",
            "--runs",
            str(tmp_path),
            "--deadline",
            "100",
            "--margin-s",
            "20",
            "--min-job-s",
            "50",
        ]
    )
    jobs = lc.plan_jobs(o)
    now = [1000.0]
    sched = lc.Scheduler(jobs, o, {}, clock=lambda: now[0])
    first = jobs[0]
    assert first.name == "base1k/s0" and not first.deps
    ok, limit = sched.may_start(first)
    assert ok and limit == 80  # the time left minus the margin
    assert "--time-limit" in first.command(limit) and "--resume" not in first.command(limit)
    now[0] += 60  # 40 s left: below --min-job-s
    assert sched.may_start(first) == (False, None)
    evaluation = next(j for j in jobs if j.kind == "eval")
    assert sched.may_start(evaluation)[0] is False  # no speed known: 60 s estimated > 40 - 20
    # A dependency whose model file is there but whose process still runs is not done yet.
    first.out.mkdir(parents=True)
    (first.out / "model.safetensors").write_bytes(b"")
    sched.running[first.name] = (None, "0", now[0])
    assert "base/s0" not in {j.name for j in sched.ready()}
    del sched.running[first.name]
    assert "base/s0" in {j.name for j in sched.ready()}


def _report_row(phase, variant, val, tokens_per_s, curve):
    grid = {"1024": {"0": 1.0, "1": 0.9}}
    return dict(
        phase=phase, variant=variant, seed=1, done=True, seq_len=1024, steps=10, step=10,
        tokens=10_240, train_s=10_240 / tokens_per_s, wall_s=None, tokens_per_s=tokens_per_s,
        steady_tokens_per_s=2 * tokens_per_s, step_s=None, peak_gib=1.0, final_val=curve[-1][1],
        density=1.0, parameters=1, rope=None, device="GPU X", date="2026-11-27 10:00 UTC",
        versions={"torch": "2", "triton": "3"}, val_bpb=val, needle=grid, needle_mean=0.95,
        needle_min=0.9,
        curve=[{"step": 5 * i, "train_s": t, "val_bpb": v} for i, (t, v) in enumerate(curve)],
    )  # fmt: skip


def test_merge_makes_one_report_of_invocations_run_apart(tmp_path):
    """Dense and HHST reported by two invocations: the merged report compares them as one
    invocation would, lists both commands, and refuses reports of other phases or without their
    command."""
    lc, report = _script(), _script("long_context_report")
    o = lc.parse(["--smoke", "--runs", str(tmp_path / "runs")])
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o).items()}
    env = dict(device="GPU X", torch="2", triton="3", cuda="13", date="", s2attn="0.1")
    dense = _report_row("128k", "dense", 0.70, 100.0, [(0.0, 1.0), (50.0, 0.8), (102.4, 0.75)])
    hhst = _report_row("128k", "hhst", 0.72, 400.0, [(0.0, 1.0), (25.6, 0.78)])
    for name, row in (("d", dense), ("h", hhst)):
        rows = report.compare_with_dense([row])
        report.write_report(rows, env, settings, {}, [f"--variants {name}"], tmp_path / name, name)
    paths = [next((tmp_path / n).glob("*.json")) for n in "dh"]
    lc.main(["--merge", *map(str, paths), "--out-dir", str(tmp_path / "m"), "--name", "m"])
    merged = json.loads(next((tmp_path / "m").glob("*.json")).read_text())
    row = next(r for r in merged["rows"] if r["variant"] == "hhst")
    assert row["vs_dense"] == pytest.approx(0.72 / 0.70 - 1)
    assert row["speedup"] == pytest.approx(4.0) and row["steady_speedup"] == pytest.approx(4.0)
    assert row["dense_at_equal_time"] == pytest.approx(1.0 - 0.2 * 25.6 / 50.0)  # at hhst's 25.6 s
    assert merged["commands"] == ["--variants d", "--variants h"] and merged["env"]["cuda"] == "13"
    text = next((tmp_path / "m").glob("*.md")).read_text()
    assert "+2.86%" in text and "--variants d` and `python" in text
    assert next((tmp_path / "m").glob("*_needle_128k.png")).stat().st_size > 0

    other = json.loads(paths[1].read_text())
    other["settings"]["phase"]["128k"]["steps"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="differs from .* in the 128k phase"):
        report.merge_reports([paths[0], tmp_path / "other.json"], tmp_path / "x", "x")
    # A 32k-phase setting differs, but neither report ran that phase: merged.
    other["settings"]["phase"]["128k"]["steps"] -= 1
    other["settings"]["phase"]["32k"]["steps"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    report.merge_reports([paths[0], tmp_path / "other.json"], tmp_path / "y", "y")
    assert len(json.loads(next((tmp_path / "y").glob("*.json")).read_text())["rows"]) == 2
    del other["commands"]
    (tmp_path / "old.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="records no command"):
        report.merge_reports([tmp_path / "old.json", paths[0]], tmp_path / "x", "x")


def test_variant_specs_are_formatted_per_phase(tmp_path):
    lc = _script()
    o = lc.parse(
        [
            "--smoke",
            "--runs",
            str(tmp_path),
            "--variants",
            "hhst,mine",
            "--variant-args",
            "mine=--variant local --rope-factor {scale} --x {len}",
        ]
    )
    jobs = {j.name: j for j in lc.plan_jobs(o)}
    assert set(jobs) >= {"32k/mine/s0", "128k/mine/s0", "eval/128k/hhst/s0", "base/s0"}
    args = jobs["128k/mine/s0"].args
    assert args[args.index("--rope-factor") + 1] == "4" and args[args.index("--x") + 1] == "1024"
    assert args[args.index("--rope-theta") + 1] == "160000"  # the phase's default: 10000 x 4**2
    assert args[args.index("--init-from") + 1] == str(o.runs / "32k" / "mine" / "s0")
    assert "--gradient-checkpointing" in args
    assert "--gradient-checkpointing" not in jobs["32k/mine/s0"].args
    with pytest.raises(SystemExit):
        lc.parse(["--smoke", "--runs", str(tmp_path), "--variants", "nope"])


def test_variants_128k_and_base_from_choose_the_jobs(tmp_path):
    """--variants-128k keeps some variants out of 128k; --base-from starts the 32k phase from
    bases saved elsewhere (no base jobs, no dependency on them), and refuses a folder without
    one; {theta_sq} is 10000 x the length ratio squared."""
    lc = _script()
    bases = tmp_path / "bases"
    for seed in (0, 1):
        (bases / f"s{seed}").mkdir(parents=True)
        (bases / f"s{seed}" / "model.safetensors").write_bytes(b"")
        (bases / f"s{seed}" / "run.json").write_text("{}")
    argv = ["--smoke", "--runs", str(tmp_path / "runs"), "--seeds", "0,1"]
    argv += ["--variants", "dense,hhst,sq", "--variants-128k", "hhst,sq"]
    argv += ["--variant-args", "sq=--variant hhst --rope-theta {theta_sq}"]
    jobs = {j.name: j for j in lc.plan_jobs(lc.parse([*argv, "--base-from", str(bases)]))}
    assert not any(name.startswith(("base", "eval/base")) for name in jobs)
    assert "128k/dense/s0" not in jobs and {"128k/hhst/s1", "128k/sq/s1", "32k/dense/s1"} <= set(
        jobs
    )
    first = jobs["32k/hhst/s1"]
    assert first.deps == [] and first.args[first.args.index("--init-from") + 1] == str(bases / "s1")
    assert jobs["128k/sq/s0"].deps == ["32k/sq/s0"]
    sq = jobs["128k/sq/s0"].args
    assert sq[sq.index("--rope-theta", sq.index("--variant")) + 1] == "160000"  # 10000 x 4**2
    planned = {j.name for j in lc.plan_jobs(lc.parse(argv))}
    assert {"base1k/s0", "base/s1", "eval/base/s0"} <= planned
    with pytest.raises(SystemExit):
        lc.parse([*argv, "--base-from", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit):
        lc.parse([*argv, "--variants-128k", "local"])


def test_a_128k_only_variant_starts_from_another_variants_32k_weights(tmp_path):
    """--variants-128k NAME:FROM trains NAME at 128k only, from FROM's 32k run; FROM must be a
    32k variant and NAME a known one."""
    lc = _script()
    argv = ["--smoke", "--runs", str(tmp_path), "--variants", "dense,hhst"]
    argv += ["--variant-args", "wide=--variant hhst --vert-stride 4"]
    jobs = {j.name: j for j in lc.plan_jobs(lc.parse([*argv, "--variants-128k", "hhst,wide:hhst"]))}
    assert "32k/wide/s0" not in jobs and "128k/dense/s0" not in jobs
    wide = jobs["128k/wide/s0"]
    assert wide.deps == ["32k/hhst/s0"] and "eval/128k/wide/s0" in jobs
    assert wide.args[wide.args.index("--init-from") + 1] == str(tmp_path / "32k" / "hhst" / "s0")
    assert wide.args[wide.args.index("--vert-stride") + 1] == "4"
    for bad in ("wide:local", "nope:hhst"):
        with pytest.raises(SystemExit):
            lc.parse([*argv, "--variants-128k", bad])


def test_tasks_option_reaches_the_eval_commands(tmp_path):
    """--tasks plans an `s2attn eval --tasks` job per trained model and task at the phase length,
    with --task-samples and --task-args, leaving out the tasks too long for the phase (the smoke
    base's 256 tokens: multikey needs 397); a job is done by its own result file alone."""
    lc = _script()
    argv = ["--smoke", "--runs", str(tmp_path), "--variants", "dense,hhst"]
    argv += ["--tasks", "multikey,positions,multikey", "--task-samples", "7"]
    jobs = {j.name: j for j in lc.plan_jobs(lc.parse([*argv, "--task-args", "--data-root /d"]))}
    job = jobs["tasks/128k/hhst/s0/multikey"]
    assert job.kind == "eval" and job.deps == ["128k/hhst/s0"]
    cmd = job.command(None)
    assert cmd[cmd.index("eval") + 1] == str(tmp_path / "128k" / "hhst" / "s0")
    for flag, value in (("--tasks", "multikey"), ("--task-samples", "7"), ("--lengths", "1024"),
                        ("--seq-len", "1024"), ("--val-batches", "0"),
                        ("--out", str(job.out / "tasks" / "multikey.json")),
                        ("--data-root", "/d")):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value, flag
    assert job.eval_tokens == 7 * 1024
    planned = {n for n in jobs if n.startswith("tasks/")}
    phases = [f"{p}/{v}" for p in ("32k", "128k") for v in ("dense", "hhst")]
    expected = {f"tasks/{p}/s0/{t}" for p in phases for t in ("multikey", "positions")}
    assert planned == expected | {"tasks/base/s0/positions"}
    base = jobs["tasks/base/s0/positions"].args
    assert base[base.index("--tasks") + 1] == "positions"
    assert base[base.index("--lengths") + 1] == "256"
    # After the needle grid's evaluation of the same phase and seed.
    names = [j.name for j in lc.plan_jobs(lc.parse(argv))]
    assert names.index("eval/32k/hhst/s0") < names.index("tasks/32k/dense/s0/multikey")
    assert names.index("tasks/32k/hhst/s0/positions") < names.index("128k/dense/s0")

    (job.out / "tasks").mkdir(parents=True)
    (job.out / "eval.json").write_text("{}")
    (job.out / "tasks" / "positions.json").write_text("{}")
    assert jobs["eval/128k/hhst/s0"].done() and not job.done()
    assert jobs["tasks/128k/hhst/s0/positions"].done()
    (job.out / "tasks" / "multikey.json").write_text("{}")
    assert job.done()

    plain = {j.name for j in lc.plan_jobs(lc.parse(["--runs", str(tmp_path)]))}
    assert not any(name.startswith("tasks/") for name in plain)  # off by default on the GPU
    smoke = {j.name for j in lc.plan_jobs(lc.parse(["--smoke", "--runs", str(tmp_path)]))}
    assert {f"tasks/32k/local/s0/{t}" for t in ("multikey", "aggregate", "vartrack")} <= smoke
    for bad in (["--tasks", "multikey,nope"], ["--task-samples", "0"]):
        with pytest.raises(SystemExit):
            lc.parse([*argv, *bad])


def _task_results(accuracy: float, per_sequence: list[list[float]]) -> dict:
    """`s2attn eval --tasks multikey,positions --lengths 1024`'s "tasks", at 100 samples and
    buckets [0, 128), [128, 256), [256, 512), [512, 1024)."""
    from s2attn.training.intervals import bootstrap_interval, wilson_interval

    correct = round(100 * accuracy)
    low, high = bootstrap_interval(per_sequence, seed=1)
    means = torch.tensor(per_sequence).mean(0).tolist()
    edges = [0, 128, 256, 512, 1024]
    buckets = [
        {"start": a, "end": b, "bpb": m, "ci": [lo, hi]}
        for a, b, m, lo, hi in zip(edges, edges[1:], means, low.tolist(), high.tolist())
    ]
    return {
        "level": 0.95,
        "seed": 1,
        "multikey": {
            "shape": {"task": "multikey", "min_length": 397},
            "1024": {
                "n": 100,
                "correct": correct,
                "accuracy": accuracy,
                "ci": list(wilson_interval(correct, 100)),
                "chance": 1 / 32,
            },
        },  # fmt: skip
        "positions": {
            "1024": {"n": len(per_sequence), "buckets": buckets, "per_sequence": per_sequence}
        },
    }


def test_report_tabulates_the_tasks_from_a_json_report(tmp_path):
    """A JSON report with dense and HHST tasks at 1024 tokens: the table gives each task's
    accuracy with its interval, n and the gap to dense in points, and positions' first and last
    buckets, what far context is worth and the last bucket's gap to dense, both document by
    document; a task too long for a phase gets its line there."""
    lc, report = _script(), _script("long_context_report")
    o = lc.parse(["--smoke", "--runs", str(tmp_path / "runs"), "--tasks", "multikey,positions"])
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o).items()}
    env = dict(device="GPU X", torch="2", triton="3", cuda="13", date="", s2attn="0.1")
    dense_docs = [[2.0, 1.8, 1.6, 1.5], [2.2, 1.9, 1.7, 1.4], [2.1, 1.7, 1.5, 1.3]]
    hhst_docs = [[2.0, 1.8, 1.7, 1.6], [2.3, 2.0, 1.8, 1.6], [2.0, 1.7, 1.6, 1.3]]
    rows = [
        _report_row("128k", "dense", 0.70, 100.0, [(0.0, 1.0), (50.0, 0.8)]),
        _report_row("128k", "hhst", 0.72, 400.0, [(0.0, 1.0), (25.6, 0.78)]),
        dict(_report_row("base", "hhst", 0.9, 100.0, [(0.0, 1.0)]), seq_len=256),
    ]
    rows[0].update(tasks=_task_results(0.9, dense_docs), tasks_corpus="val")
    rows[1].update(tasks=_task_results(0.85, hhst_docs), tasks_corpus="val")
    report.write_report(report.compare_with_dense(rows), env, settings, {}, ["x"], tmp_path, "a")
    [fixture] = tmp_path.glob("*_a.json")
    lc.main(["--merge", str(fixture), "--out-dir", str(tmp_path / "m"), "--name", "m"])
    text = next((tmp_path / "m").glob("*.md")).read_text()
    merged = json.loads(next((tmp_path / "m").glob("*.json")).read_text())
    hhst = next(r for r in merged["rows"] if r["variant"] == "hhst" and r["phase"] == "128k")
    dense = next(r for r in merged["rows"] if r["variant"] == "dense")

    section = text.split("### 128k: long-context tasks at 1024 tokens")[1].split("\n\n")[1]
    header, _, dense_line, hhst_line = section.splitlines()
    assert "multikey" in header and "bits/byte [0, 128)" in header
    assert "bits/byte [512, 1k)" in header and "last vs dense" in header
    low, high = dense["tasks"]["multikey"]["1024"]["ci"]
    assert f"0.900 [{low:.3f}, {high:.3f}] n 100 |" in dense_line
    assert "0.850 [" in hhst_line and "n 100 (-5.0 pt)" in hhst_line
    last_gap = sum(h[-1] - d[-1] for h, d in zip(hhst_docs, dense_docs)) / 3
    assert hhst["tasks_vs_dense"]["positions"]["mean"] == pytest.approx(last_gap)
    gap = hhst["tasks_vs_dense"]["positions"]
    assert gap["ci"][0] <= gap["mean"] <= gap["ci"][1]
    assert f"{last_gap:+.4f} [" in hhst_line
    far = sum(d[0] - d[-1] for d in dense_docs) / 3
    assert dense["far_context"]["mean"] == pytest.approx(far) and f"{far:.4f} [" in dense_line
    last = dense["tasks"]["positions"]["1024"]["buckets"][-1]
    assert "| 3 | 2.1000 [" in dense_line  # documents, the first bucket's mean
    assert f"{last['bpb']:.4f} [{last['ci'][0]:.4f}" in dense_line
    assert "`multikey` needs samples of 397 tokens or more: not run at 256." in text
    assert "### base: long-context tasks at 256 tokens" in text


def test_time_limit_stops_after_the_step_that_crosses_it(tmp_path, corpus_root):
    out = tmp_path / "run"
    assert (
        train.run(
            _args(out, corpus_root, "--steps", "3", "--log-every", "1", "--time-limit", "1e-9")
        )
        == 0
    )
    progress = json.loads((out / "checkpoint" / "progress.json").read_text())["progress"]
    assert progress["step"] == 1 and not (out / "model.safetensors").exists()


def test_pipeline_on_the_cpu_resumes_after_its_deadline(tmp_path, capsys):
    """base -> 32k phase -> 128k phase -> evaluations and tasks -> report at toy sizes, over four
    invocations: the first stops its first job early (--stop-at through --train-args), the second
    resumes it and stops it at its deadline, the third finishes it from its checkpoint and does
    the rest, the fourth skips everything. The second's deadline counts on the test's clock,
    which passes it as soon as the resumed job is launched: what each invocation does is the
    same however loaded the host is."""
    runs, results = tmp_path / "runs", tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    data_args = f"--data-root {ROOT / 's2attn'} --val-fraction 0.2"
    argv = [
        "--smoke",
        "--runs",
        str(runs),
        "--out-dir",
        str(results),
        "--gpus",
        "0,1",
        "--variants",
        "dense,hhst",
        "--poll-s",
        "0.3",
        # Two of --smoke's five tasks (a job each), one too long for the base.
        "--tasks",
        "aggregate,positions",
    ]
    lc = _script()

    def invoke(*extra: str) -> str:
        cmd = [sys.executable, str(BENCHMARKS / "long_context.py"), *argv, *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        print(done.stdout[-4000:], done.stderr[-3000:])
        assert done.returncode == 0
        return done.stdout

    stopped = invoke("--train-args", f"{data_args} --stop-at 2")
    assert "base1k/s0: stopped with a checkpoint before its last step" in stopped
    assert "jobs unfinished" in stopped and "run the same command again" in stopped
    assert not (runs / "base" / "s0").exists()  # nothing after an unfinished job

    log = runs / "logs" / "base1k_s0.log"

    def clock() -> float:  # stands still until the scheduler has launched the resumed job
        launched = (line for line in log.read_text().splitlines() if line.startswith("$ "))
        return 3601.0 if any("--resume" in line for line in launched) else 0.0

    def in_process(*extra: str, clock=time.monotonic) -> str:
        o = lc.parse([*argv, *extra])
        capsys.readouterr()
        lc.Scheduler(lc.plan_jobs(o), o, lc.job_environment(o), clock=clock).run()
        out = capsys.readouterr().out
        print(out)
        return out

    first = in_process("--deadline", "3600", clock=clock)
    # The one job ready, given the time left less the margin as its time limit, and stopped at
    # the deadline; nothing after it starts.
    launches = re.findall(r"\] ((?:starting|resuming) .*)", first)
    assert launches == ["resuming base1k/s0 on slot 0, time limit 3555 s"]
    assert "base1k/s0: stopping it (deadline)" in first and "jobs unfinished" in first

    second = invoke()
    assert "resuming base1k/s0" in second and "all jobs done" in second
    assert "resuming at step 2" in log.read_text()  # from its checkpoint, not from the start
    third = in_process()
    skipped = next(line for line in third.splitlines() if "already done, skipped" in line)
    assert "starting" not in third and "all jobs done" in third
    assert set(re.findall(r"\] (\S+): done in", second)) | {"base1k/s0"} == set(
        skipped.split("skipped: ")[1].split(", ")
    )

    [report] = results.glob("*_long_context.json")
    rows = json.loads(report.read_text())["rows"]
    assert {(r["phase"], r["variant"]) for r in rows} == {
        ("base", "hhst"),
        ("32k", "dense"),
        ("32k", "hhst"),
        ("128k", "dense"),
        ("128k", "hhst"),
    }
    for r in rows:
        assert r["done"] and r["val_bpb"] > 0 and set(r["needle"]) and r["tokens_per_s"] > 0
        expected_len = {"base": 256, "32k": 512, "128k": 1024}[r["phase"]]
        assert r["seq_len"] == expected_len and max(map(int, r["needle"])) == expected_len
    by = {(r["phase"], r["variant"]): r for r in rows}
    assert by["32k", "dense"]["tokens"] == by["32k", "hhst"]["tokens"] > 0  # equal tokens
    assert by["128k", "hhst"]["rope"]["rope_theta"] == 160000.0  # 10000 x (1024 / 256)**2
    assert by["128k", "hhst"]["dense_at_equal_time"] is not None
    assert by["128k", "hhst"]["vs_dense"] is not None
    for phase in ("base", "32k", "128k"):
        assert (results / report.name.replace(".json", f"_needle_{phase}.png")).is_file()
    for r in rows:  # the tasks, each at the phase length; aggregate needs 257 tokens
        ran = set(_script("long_context_report").task_cells(r))
        assert ran == ({"positions"} if r["phase"] == "base" else {"aggregate", "positions"})
        assert r["tasks"]["positions"][str(r["seq_len"])]["n"] == 3
    assert by["128k", "hhst"]["tasks_vs_dense"]["positions"]["mean"] is not None
    markdown = report.with_suffix(".md").read_text()
    assert "## 32k: 4 steps of 2 x 512 tokens" in markdown and "dense at equal time" in markdown
    assert "### 128k: long-context tasks at 1024 tokens" in markdown
    assert "`aggregate` needs samples of 257 tokens or more: not run at 256." in markdown
