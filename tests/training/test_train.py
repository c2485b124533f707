"""Training (s2attn.training.train): a tiny model learns, a resumed run repeats the uninterrupted
one exactly, the saved model loads back as S2, and bad input fails before anything is written."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
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
from transformers import LlamaForCausalLM

from s2attn import cli
from s2attn.training import data, metrics, presets, run_directory, run_plan, train, vocab

SMALL = tiny_train_argv(batch_size=4)
# Everything but time varies with the weights; time fields differ run to run.
_TIMING = ("tokens_per_s", "elapsed_s", "max_mem_gib", "step_s")


@pytest.fixture(autouse=True)
def _reference_attention(monkeypatch):
    s2_layers_on_reference(monkeypatch)


def _args(out: Path, root: Path, *extra: str) -> argparse.Namespace:
    return train_args(SMALL, out, root, *extra)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in _TIMING} for r in rows]


# Options of the run that `trained` makes, shared by the tests that read it.
TRAINED = ["--steps", "30", "--val-every", "15", "--log-every", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_root) -> Path:
    out = tmp_path_factory.mktemp("run") / "hhst"
    with pytest.MonkeyPatch.context() as mp:
        s2_layers_on_reference(mp)
        assert train.run(_args(out, corpus_root, *TRAINED)) == 0
    return out


def test_tiny_model_learns_and_logs(trained):
    rows = _rows(trained)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        for key in (
            "step",
            "loss_nats",
            "train_bpb",
            "tokens",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "elapsed_s",
        ):
            assert key in r and math.isfinite(r[key]), f"row {r['step']}: {key} missing or bad"
        assert r["tokens"] == r["step"] * 4 * 64
        assert not {"loss", "val_loss", "val_needle"} & set(r), "names without their unit"
    val = [r for r in rows if "val_bpb" in r]
    assert [r["step"] for r in val] == [15, 30]
    assert all(0 <= r["val_needle_acc"] <= 1 for r in val)
    first = sum(r["loss_nats"] for r in rows[:5]) / 5
    last = sum(r["loss_nats"] for r in rows[-5:]) / 5
    print(f"mean loss of steps 1-5: {first:.3f} nats, of steps 26-30: {last:.3f}")
    # Uniform guessing over 260 tokens is ln 260 = 5.56 nats; this repetitive code falls well
    # below 4 within 30 steps.
    assert first > 4.5 and last < 0.75 * first
    assert val[-1]["val_bpb"] < val[0]["val_bpb"] < math.log2(vocab.VOCAB_SIZE)

    record = json.loads((trained / "run.json").read_text())
    assert record["options"]["variant"] == "hhst" and record["options"]["seq_len"] == 64
    assert record["model"]["layer_types"] == ["dense", "s2"]
    assert record["data"]["train"]["split"] == "train" and record["data"]["val"]["split"] == "val"
    for name in ("config.json", "model.safetensors", "curves.png", "checkpoint/state.pt"):
        assert (trained / name).is_file(), name


def test_metrics_of_older_runs_read_under_todays_names(tmp_path):
    old = {
        "step": 10,
        "loss": 2.5,
        "train_bpb": 3.6,
        "tokens": 2560,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1e4,
        "val_loss": 3.1,
        "val_needle": 0.5,
        "elapsed_s": 4.0,
        "max_mem_gib": 1.5,
    }
    new = metrics.metrics_row(old)
    assert new == {
        "step": 10,
        "loss_nats": 2.5,
        "train_bpb": 3.6,
        "tokens": 2560,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1e4,
        "val_bpb": 3.1,
        "val_needle_acc": 0.5,
        "elapsed_s": 4.0,
        "max_mem_gib": 1.5,
    }
    assert metrics.metrics_row(new) == new
    # A run resumed by today's code after an older one logged part of it, killed mid-line.
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{json.dumps(old)}\n{json.dumps({**new, "step": 11})}\n{{"step": 12, "lo')
    rows = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [10, 11]
    assert all(r["val_bpb"] == 3.1 and r["loss_nats"] == 2.5 for r in rows)
    path.write_text(f'{{"step": 1\n{json.dumps(new)}\n')
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        metrics.read_metrics(path)


def test_schedule_warms_up_then_decays_to_a_tenth():
    factors = [train.lr_factor(s, 100, 10) for s in range(100)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_saved_model_loads_as_s2_with_the_trained_weights(trained):
    loaded = LlamaForCausalLM.from_pretrained(trained)
    expected = presets.model_config("tiny", "hhst", seq_len=64)
    assert loaded.config._attn_implementation == "s2attn"
    assert loaded.config.s2attn == expected.s2attn
    assert loaded.config.s2attn["layer_types"] == ["dense", "s2"]
    # The final checkpoint holds the trained weights, reached by a different route than
    # save_pretrained: both must give the same model.
    reference = presets.build_model(expected, seed=123)
    state = torch.load(trained / "checkpoint" / "state.pt", weights_only=True)["model"]
    reference.load_state_dict(state)
    assert not torch.equal(
        reference.model.embed_tokens.weight,
        presets.build_model(expected, seed=0).model.embed_tokens.weight,
    )
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = loaded.eval()(ids, use_cache=False).logits
        want = reference.eval()(ids, use_cache=False).logits
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.2e}"
    saved = load_file(trained / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_resume_repeats_the_uninterrupted_run(tmp_path, corpus_root, monkeypatch):
    opts = ["--steps", "6", "--log-every", "1", "--val-every", "3", "--checkpoint-every", "2"]
    whole = tmp_path / "whole"
    assert train.run(_args(whole, corpus_root, *opts)) == 0

    # A crash at the start of step 4: the last checkpoint is step 2's, and the log already has
    # step 3's row, which the resumed run must replace rather than repeat.
    real_stream = run_plan.train_stream

    def crashing_stream(options, corpus):
        stream = real_stream(options, corpus)
        batches = stream.next_batch_with_answers

        def next_batch_with_answers():
            if stream.rows >= 3 * stream.batch_size:
                raise RuntimeError("simulated crash")
            return batches()

        stream.next_batch_with_answers = next_batch_with_answers
        return stream

    split = tmp_path / "split"
    monkeypatch.setattr(run_plan, "train_stream", crashing_stream)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train.run(_args(split, corpus_root, *opts))
    monkeypatch.setattr(run_plan, "train_stream", real_stream)
    assert [r["step"] for r in _rows(split)] == [1, 2, 3]
    assert train.run(_args(split, corpus_root, *opts, "--resume")) == 0

    # And a planned stop (--stop-at) in the middle of a log interval: the checkpoint carries the
    # half-summed row, so step 6's row still averages steps 5 and 6.
    stopped = tmp_path / "stopped"
    assert train.run(_args(stopped, corpus_root, *opts, "--log-every", "2", "--stop-at", "5")) == 0
    assert not (stopped / "model.safetensors").exists()
    assert train.run(_args(stopped, corpus_root, *opts, "--log-every", "2", "--resume")) == 0

    expected = _untimed(_rows(whole))
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]
    assert _untimed(_rows(split)) == expected
    loss = {r["step"]: r["loss_nats"] for r in expected}
    want = {2: (loss[1] + loss[2]) / 2, 3: loss[3], 4: loss[4], 6: (loss[5] + loss[6]) / 2}
    got = _untimed(_rows(stopped))
    assert {r["step"]: r["loss_nats"] for r in got} == pytest.approx(want, rel=1e-6)
    assert [r.get("val_bpb") for r in got] == [
        None,
        loss_of(expected, 3),
        None,
        loss_of(expected, 6),
    ]
    weights = [load_file(d / "model.safetensors") for d in (whole, split, stopped)]
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]) and torch.equal(tensor, weights[2][name])


def test_resume_after_a_package_install_repeats_the_run(tmp_path, corpus_root, monkeypatch):
    """On the default data (no --data-root), a package installed between a stop and its resume
    changes nothing: the resumed run's losses and weights are the uninterrupted run's."""
    stdlib, site = tmp_path / "lib" / "python3.x", tmp_path / "venv" / "site-packages"
    shutil.copytree(corpus_root, stdlib)
    site.mkdir(parents=True)
    paths = {"stdlib": str(stdlib), "purelib": str(site), "platlib": str(site)}
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: dict(paths))
    monkeypatch.setattr(data, "_LISTING_CACHE", {})
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    opts = [*SMALL, "--steps", "4", "--log-every", "1", "--val-every", "2"]

    def args(out: Path, *extra: str) -> argparse.Namespace:
        return parser.parse_args([*opts, "--out", str(out), *extra])

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert train.run(args(whole)) == 0
    assert json.loads((whole / "run.json").read_text())["options"]["data_root"] == [
        str(stdlib.resolve())
    ]
    assert train.run(args(stopped, "--stop-at", "2")) == 0
    for where in (site, stdlib / "site-packages"):  # a venv's, and a system interpreter's
        (where / "new_pkg").mkdir(parents=True)
        (where / "new_pkg" / "__init__.py").write_text("def g(x):\n    return x\n" * 50)
    monkeypatch.setattr(data, "_LISTING_CACHE", {})  # as a new process would list the files
    assert train.run(args(stopped, "--resume")) == 0
    assert _untimed(_rows(stopped)) == _untimed(_rows(whole))
    weights = [load_file(d / "model.safetensors") for d in (whole, stopped)]
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name


@pytest.mark.parametrize("damaged", ["state.pt", "progress.json"])
def test_resume_from_a_damaged_checkpoint_names_the_file(damaged, tmp_path, corpus_root, capsys):
    """A checkpoint file cut short (a full disk, a copy stopped halfway): one line that names
    it, no torch traceback, and the run's files as they were."""
    out = tmp_path / "run"
    assert train.run(_args(out, corpus_root, "--steps", "4", "--stop-at", "2")) == 0
    path = out / "checkpoint" / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = {p: _snapshot(out)[p] for p in _snapshot(out) if p != "train.lock"}
    capsys.readouterr()
    argv = ["train", *SMALL, "--data-root", str(corpus_root), "--out", str(out)]
    assert cli.main([*argv, "--steps", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    print(err)
    assert err.startswith(f"s2attn train: error: cannot resume from {path}: the file is damaged")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert {p: _snapshot(out)[p] for p in _snapshot(out) if p != "train.lock"} == before


def test_without_matplotlib_a_run_saves_its_model_and_draws_no_curves(
    tmp_path, corpus_root, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    out = tmp_path / "run"
    assert train.run(_args(out, corpus_root, "--steps", "2")) == 0
    captured = capsys.readouterr()
    start = captured.err.splitlines()[0]
    assert start.startswith("s2attn train: warning: matplotlib (not installed)"), start
    assert "pip install 's2attn[models]'" in start
    assert "model and metrics (no curves.png)" in captured.out
    assert (out / "model.safetensors").is_file() and not (out / "curves.png").exists()


def test_the_model_is_saved_before_the_curves_are_drawn(tmp_path, corpus_root, monkeypatch):
    out = tmp_path / "run"

    def plot(*args):
        assert (out / "model.safetensors").is_file(), "the curves came before the model"
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(train, "plot_curves", plot)
    with pytest.raises(RuntimeError, match="plotting failed"):
        train.run(_args(out, corpus_root, "--steps", "2"))
    assert (out / "model.safetensors").is_file()


# `s2attn train` in another process whose batches, once its metrics (the first argument) hold 3
# rows, wait for a file (the second) to exist: the test's signal lands mid-run however slowly the
# host runs.
_HELD_TRAIN = """
import os, sys, time
from s2attn.cli import main
from s2attn.training import data
metrics, go, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
next_batch = data.TokenStream.next_batch_with_answers
def rows():
    try:
        with open(metrics) as f:
            return f.read().count("\\n")
    except FileNotFoundError:
        return 0
def held(self):
    while rows() >= 3 and not os.path.exists(go):
        time.sleep(0.01)
    return next_batch(self)
data.TokenStream.next_batch_with_answers = held
sys.exit(main(["train", *argv]))
"""


def test_ctrl_c_stops_with_a_checkpoint_and_resume_goes_on(tmp_path, corpus_root):
    """SIGINT: a checkpoint of the step in progress once it is done, exit status 130, no
    traceback, and the command that finishes the run, which appends to the log and ends where
    an uninterrupted run ends. Meanwhile a second run in the directory is refused, naming the
    first's pid; and no progress bar goes to a stderr that is not a terminal."""
    out = tmp_path / "run"
    opts = ["--variant", "dense", "--steps", "24", "--log-every", "1", "--val-every", "12"]
    argv = [
        *(a for a in SMALL if a != "--no-progress"),
        "--data-root",
        str(corpus_root),
        "--out",
        str(out),
        *opts,
    ]
    root = Path(train.__file__).resolve().parents[2]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    # Bytes: text mode would turn a bar's carriage returns into newlines.
    metrics, go = out / "metrics.jsonl", tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD_TRAIN, str(metrics), str(go), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not metrics.is_file() or metrics.read_text().count("\n") < 3:
            assert proc.poll() is None, f"training ended early: {proc.communicate()}"
            assert time.monotonic() < deadline, f"no 3 metrics rows within {HANG_GUARD_S} s"
            time.sleep(0.05)
        with pytest.raises(
            ValueError, match=rf"in use by another `s2attn train` \(pid {proc.pid}\)"
        ):
            train.run(_args(out, corpus_root, *opts, "--resume"))
        proc.send_signal(signal.SIGINT)
        go.touch()
        stdout, stderr = (text.decode() for text in proc.communicate(timeout=HANG_GUARD_S))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(stdout, stderr, sep="\n")
    assert proc.returncode == 130
    assert "Traceback" not in stderr and "\r" not in stderr
    step = json.loads((out / "checkpoint" / "progress.json").read_text())["progress"]["step"]
    assert 3 <= step < 24
    assert [r["step"] for r in _rows(out)] == list(range(1, step + 1))
    assert f"stopped at step {step} of 24 (Ctrl-C)" in stdout
    command = shlex.split(stdout.split("continue with:")[1].strip().splitlines()[0])
    assert command[:7] == ["python", "-m", "s2attn", "train", "--out", str(out), "--resume"]

    logged = metrics.read_bytes()
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert train.run(parser.parse_args(command[4:])) == 0
    assert metrics.read_bytes().startswith(logged)
    whole = tmp_path / "whole"
    assert train.run(_args(whole, corpus_root, *opts)) == 0
    assert _untimed(_rows(out)) == _untimed(_rows(whole))


def _ctrl_c_in_stream(monkeypatch, at_row: int | None, times: int) -> None:
    """Ctrl-C ``times`` times (os.kill runs the handler before it returns) when the model is
    built, in the output directory, before the first step (``at_row`` None), or when the
    training stream is asked for row ``at_row``."""
    if at_row is None:
        real_model = train._initial_model

        def model_with_ctrl_c(plan, resuming):
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
            return real_model(plan, resuming)

        monkeypatch.setattr(train, "_initial_model", model_with_ctrl_c)
        return
    real_stream = run_plan.train_stream

    def stream_with_ctrl_c(options, corpus):
        stream = real_stream(options, corpus)
        batches = stream.next_batch_with_answers

        def next_batch_with_answers():
            if stream.rows == at_row:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)
            return batches()

        stream.next_batch_with_answers = next_batch_with_answers
        return stream

    monkeypatch.setattr(run_plan, "train_stream", stream_with_ctrl_c)


def test_ctrl_c_before_the_first_step_leaves_a_resumable_run(tmp_path, corpus_root, monkeypatch):
    opts = ["--variant", "dense", "--steps", "3", "--log-every", "1"]
    whole = tmp_path / "whole"
    assert train.run(_args(whole, corpus_root, *opts)) == 0
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        _ctrl_c_in_stream(mp, at_row=None, times=1)
        assert train.run(_args(out, corpus_root, *opts)) == 130
    assert (out / "checkpoint" / "state.pt").is_file() and _rows(out) == []
    assert train.run(_args(out, corpus_root, *opts, "--resume")) == 0
    assert _untimed(_rows(out)) == _untimed(_rows(whole))


def test_a_second_ctrl_c_stops_at_once(tmp_path, corpus_root, monkeypatch, capsys):
    """No wait for the step in progress; the message points at the last checkpoint."""
    out = tmp_path / "run"
    opts = ["--variant", "dense", "--steps", "5", "--log-every", "1", "--checkpoint-every", "2"]
    with monkeypatch.context() as mp:
        _ctrl_c_in_stream(mp, at_row=3 * 4, times=2)  # at the start of step 4
        assert train.run(_args(out, corpus_root, *opts)) == 130
    err = capsys.readouterr().err
    print(err)
    assert "interrupted; the checkpoint of step 2 continues with:" in err
    assert "Traceback" not in err
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    assert train.run(_args(out, corpus_root, *opts, "--resume")) == 0
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4, 5]


def test_a_run_builds_its_stream_and_checks_its_directory_once(tmp_path, corpus_root, monkeypatch):
    """The training stream that prepare checks is the one that trains, and the output
    directory is checked once, under the lock; a resumed run alike."""
    calls = {"stream": 0, "check": 0}

    def counted(module, name, key):
        real = getattr(module, name)

        def call(*args):
            calls[key] += 1
            return real(*args)

        monkeypatch.setattr(module, name, call)

    counted(run_plan, "train_stream", "stream")
    counted(run_directory, "_check_out_dir", "check")
    out = tmp_path / "run"
    opts = ["--variant", "dense", "--steps", "2", "--log-every", "1"]
    assert train.run(_args(out, corpus_root, *opts, "--stop-at", "1")) == 0
    assert calls == {"stream": 1, "check": 1}
    assert train.run(_args(out, corpus_root, *opts, "--resume")) == 0
    assert calls == {"stream": 2, "check": 2}
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_a_stale_lock_file_does_not_block(tmp_path, corpus_root):
    """The lock file of a run that was killed stays behind, unlocked (the kernel drops a flock
    with its process): it neither blocks the next run nor counts as content."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.lock").write_text("999999\n")
    opts = ["--variant", "dense", "--steps", "1", "--log-every", "1"]
    assert train.run(_args(out, corpus_root, *opts)) == 0
    assert (out / "train.lock").read_text() == f"{os.getpid()}\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("no_progress", [False, True])
def test_progress_bar_on_a_terminal_unless_turned_off(
    no_progress, tmp_path, corpus_root, monkeypatch
):
    """The bar shows on a terminal, not with --no-progress (nor in a log: the Ctrl-C test)."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = _args(tmp_path / "run", corpus_root, "--variant", "dense", "--steps", "2")
    args.no_progress = no_progress
    assert train.run(args) == 0
    assert ("\r" in terminal.getvalue()) != no_progress, repr(terminal.getvalue())


def loss_of(rows: list[dict], step: int) -> float:
    return next(r["val_bpb"] for r in rows if r["step"] == step)


def _snapshot(path: Path) -> dict | None:
    if not path.exists():
        return None
    return {
        str(p.relative_to(path)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(path.rglob("*"))
    }


@pytest.mark.parametrize(
    "case, extra, message",
    [
        ("seq_len", ["--seq-len", "128", "--max-seq-len", "64"], "exceeds --max-seq-len"),
        ("dense_layer", ["--dense-layers", "0,2"], r"--dense-layers: \[2\] out of range"),
        ("preset", ["--preset", "huge"], "unknown preset 'huge'"),
        ("compile", ["--compile", "--compile-layers"], "two ways to compile the model; give one"),
        ("variant", ["--variant", "sparse"], "unknown variant 'sparse'"),
        ("empty_root", [], "--data-root .* hold no non-empty .py files"),
        ("foreign_dir", [], "holds no run.json"),
        ("other_run", ["--steps", "31"], r"holds a different run \(steps: saved 30, now 31\)"),
        ("same_run", [], "already holds this run; pass --resume"),
        ("stop_at_beyond", ["--steps", "5", "--stop-at", "6"], "--stop-at 6 is beyond --steps 5"),
        ("stop_at_zero", ["--stop-at", "0"], "--stop-at must be >= 1"),
        ("resume_new", ["--resume"], "--resume: nothing to resume in"),
        ("resume_empty", ["--resume"], "--resume: nothing to resume in"),
        ("resume_no_checkpoint", ["--resume"], "holds this run but no checkpoint"),
        ("again_no_checkpoint", [], "holds this run but no checkpoint"),
        ("init_nothing", ["--init-from", "."], "no model.safetensors there"),
        ("init_other_shape", ["--init-from", "TRAINED", "--variant", "dense"], None),
        ("init_truncated", [], "not a whole safetensors file"),
        (
            "seq_len_huge",
            ["--seq-len", "1000000000"],
            r"--seq-len 1000000000 x --batch-size 4: a training step needs at least [\d.e+]+ "
            r"GiB on cpu .* GiB is free",
        ),
    ],
)
def test_bad_input_fails_before_writing(case, extra, message, tmp_path, corpus_root, trained):
    root, out = corpus_root, tmp_path / "out"
    if case == "empty_root":
        root = tmp_path / "empty"
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "notes.txt").write_text("not python")
    elif case == "foreign_dir":
        out.mkdir()
        (out / "results.csv").write_text("a,b\n")
    elif case in ("other_run", "same_run"):
        out, extra = trained, [*TRAINED, *extra]
    elif case == "resume_empty":
        out.mkdir()
        (out / "train.lock").write_text("12345\n")  # what a run killed at its start leaves
    elif case in ("resume_no_checkpoint", "again_no_checkpoint"):
        # A run that crashed before its first checkpoint: its record and some metrics.
        out.mkdir()
        for name in ("run.json", "metrics.jsonl"):
            (out / name).write_bytes((trained / name).read_bytes())
        extra = [*TRAINED, *extra]
    elif case == "init_nothing":
        extra = ["--init-from", str(tmp_path)]
    elif case == "init_other_shape":
        # Another preset's weights: tiny's trained run into a model of other width.
        extra = [
            "--init-from",
            str(trained),
            "--preset",
            "small",
            "--seq-len",
            "64",
            "--batch-size",
            "1",
        ]
        message = "holds another architecture: num_hidden_layers 2 there, 6 here; hidden_size"
    elif case == "init_truncated":
        # A model cut short while it was copied: the file is named, before anything is read.
        source = tmp_path / "copied"
        source.mkdir()
        (source / "config.json").write_bytes((trained / "config.json").read_bytes())
        weights = (trained / "model.safetensors").read_bytes()
        (source / "model.safetensors").write_bytes(weights[: len(weights) // 2])
        extra = ["--init-from", str(source)]
        message = f"{re.escape(str(source / 'model.safetensors'))} is {message}"
    before = _snapshot(out)
    with pytest.raises(ValueError, match=message) as info:
        train.run(_args(out, root, *extra))
    print(info.value)
    assert _snapshot(out) == before


@pytest.mark.parametrize(
    "variant, extra",
    [
        ("dense", ["--grad-accum", "2"]),
        ("s2", ["--gradient-checkpointing"]),
        ("local", []),
        ("homo", ["--dense-layers", "1"]),
    ],
)
def test_every_variant_trains(variant, extra, tmp_path, corpus_root):
    out = tmp_path / variant
    assert (
        train.run(
            _args(
                out, corpus_root, "--variant", variant, "--steps", "2", "--log-every", "1", *extra
            )
        )
        == 0
    )
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and "val_bpb" in rows[-1]
    assert rows[-1]["tokens"] == 2 * 4 * 64 * (2 if "--grad-accum" in extra else 1)
    config = json.loads((out / "config.json").read_text())
    s2 = presets.PRESETS["tiny"].s2
    if "--dense-layers" in extra:
        s2 = s2.replace(dense_layers=(1,))
    want = presets.model_config("tiny", variant, seq_len=64, s2=s2)
    assert config.get("s2attn") == getattr(want, "s2attn", None)


@pytest.mark.parametrize(
    "flag, compiled_modules",
    [("--compile", ["LlamaForCausalLM"]), ("--compile-layers", ["LlamaDecoderLayer"] * 2)],
)
def test_compiled_model_trains_as_the_eager_one(
    flag, compiled_modules, tmp_path, corpus_root, monkeypatch
):
    """--compile compiles the model in place, --compile-layers each decoder layer (their saved
    weights keep their names), and either trains to the eager run's losses; aot_eager stands in
    for Inductor, which the GPU runs use."""
    compiled = []
    eager_compile = torch.nn.Module.compile

    def compile_aot_eager(self, **kwargs):
        compiled.append(type(self).__name__)
        eager_compile(self, backend="aot_eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile_aot_eager)
    opts = ["--steps", "3", "--log-every", "1", "--val-every", "3"]
    eager, comp = tmp_path / "eager", tmp_path / "compiled"
    assert train.run(_args(eager, corpus_root, *opts)) == 0
    assert not compiled
    assert train.run(_args(comp, corpus_root, *opts, flag)) == 0
    assert compiled == compiled_modules
    for a, b in zip(_rows(eager), _rows(comp), strict=True):
        assert b["loss_nats"] == pytest.approx(a["loss_nats"], rel=1e-4)
    assert b["val_bpb"] == pytest.approx(a["val_bpb"], rel=1e-4)
    options = json.loads((comp / "run.json").read_text())["options"]
    assert options[flag.removeprefix("--").replace("-", "_")] is True
    saved = load_file(comp / "model.safetensors")
    assert set(saved) == set(load_file(eager / "model.safetensors"))
    assert not any("_orig_mod" in name for name in saved)


def test_answer_weight_changes_only_the_objective(tmp_path, corpus_root):
    """Weighting the needle answers changes what is optimised (the weights move differently),
    not what is logged: the logged loss stays the plain language-model loss of the batch."""
    opts = ["--steps", "3", "--log-every", "1", "--val-every", "0"]
    opts += ["--needle-fraction", "1", "--needles-per-sample", "1"]
    plain, weighted = tmp_path / "plain", tmp_path / "weighted"
    assert train.run(_args(plain, corpus_root, *opts)) == 0
    assert train.run(_args(weighted, corpus_root, *opts, "--answer-weight", "50")) == 0
    first_plain, first_weighted = _rows(plain)[0], _rows(weighted)[0]
    # Step 1's loss is measured before any update: the same batch and weights, the same loss.
    assert first_plain["loss_nats"] == pytest.approx(first_weighted["loss_nats"], rel=1e-6)
    assert _rows(plain)[-1]["loss_nats"] != pytest.approx(
        _rows(weighted)[-1]["loss_nats"], rel=1e-6
    )
    with pytest.raises(ValueError, match="--answer-weight"):
        train.run(_args(tmp_path / "bad", corpus_root, *opts, "--answer-weight", "-1"))


def test_init_from_starts_at_the_saved_weights(tmp_path, corpus_root, trained):
    """--init-from loads a saved model's weights (here into a run at twice the length): with a
    vanishing learning rate, one step leaves them where they were, and the run's first loss
    is the trained model's, far below a fresh model's."""
    out = tmp_path / "longer"
    args = _args(
        out,
        corpus_root,
        "--init-from",
        str(trained),
        "--seq-len",
        "128",
        "--steps",
        "1",
        "--lr",
        "1e-12",
        "--warmup-steps",
        "0",
        "--log-every",
        "1",
    )
    with pytest.MonkeyPatch.context() as mp:
        s2_layers_on_reference(mp)
        assert train.run(args) == 0
    saved, now = (
        load_file(str(trained / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert saved.keys() == now.keys()
    for name in saved:
        torch.testing.assert_close(now[name], saved[name], rtol=0, atol=1e-6)
    fresh_loss, trained_loss = _rows(trained)[0]["loss_nats"], _rows(trained)[-1]["loss_nats"]
    first = _rows(out)[0]["loss_nats"]
    print(f"first loss {first:.3f}; trained run's first {fresh_loss:.3f}, last {trained_loss:.3f}")
    assert first < (fresh_loss + trained_loss) / 2


def test_validation_data_follow_val_seed_not_seed(tmp_path, corpus_root):
    """Runs of several training seeds validate on the same text and needles (--val-seed), so
    that their losses compare; another --val-seed reads other text."""

    def plan(*extra):
        return run_plan.prepare(_args(tmp_path / "run", corpus_root, "--val-needles", "4", *extra))

    a, b, c = plan("--seed", "0"), plan("--seed", "5"), plan("--seed", "0", "--val-seed", "3")
    assert a.val_batches and len(a.val_batches) == len(b.val_batches)
    assert all(torch.equal(x, y) for x, y in zip(a.val_batches, b.val_batches))
    assert [s.tokens.tolist() for s in a.val_needles] == [s.tokens.tolist() for s in b.val_needles]
    # (The fixture's few files may well open both streams alike; the needles' keys cannot.)
    assert [s.tokens.tolist() for s in a.val_needles] != [s.tokens.tolist() for s in c.val_needles]
    assert not (tmp_path / "run").exists()  # planning writes nothing
