"""Evaluation (s2attn.training.evaluate): bits per byte against a hand computation, needle accuracy
on models that know or cannot know the answer, and the ``s2attn eval`` command end to end."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from helpers import DEVICE, HANG_GUARD_S, assert_close

from s2attn.training import evaluate, presets
from s2attn.training.data import SourceCorpus
from s2attn.training.vocab import VOCAB_SIZE

# Small enough that the grid cells of the CLI test cost little, long enough for a needle.
LENGTH = 48


def _tiny_config(variant: str = "hhst", max_seq_len: int = 64):
    config = presets.model_config("tiny", variant, seq_len=max_seq_len)
    if variant != "dense":
        # The exact dense-mask reference of the same patterns: the Triton interpreter would take
        # seconds per forward pass, and the kernels have their own tests.
        config._attn_implementation = "s2attn_reference"
    return config


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """A few source-like files, so no test walks site-packages."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        body = "".join(
            f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n" for j in range(40)
        )
        (root / f"mod_{i}.py").write_text(body)
    return root


@pytest.fixture(scope="module")
def val_corpus(corpus_root):
    return SourceCorpus([corpus_root], split="val", val_fraction=0.5)


class _Output(SimpleNamespace):
    logits: torch.Tensor


class _Oracle(torch.nn.Module):
    """Puts the largest logit on the true next token of each sample it was built with (found by
    its input), on a fixed wrong token (``wrong``) or on the current token (``echo``)."""

    def __init__(self, samples=(), mode: str = "oracle", wrong_on=()):
        super().__init__()
        self.full = {tuple(s.tokens[:-1].tolist()): s.tokens for s in samples}
        self.mode = mode
        # Samples whose last answer token it gets wrong (all the others right).
        self.wrong_on = {tuple(s.tokens[:-1].tolist()) for s in wrong_on}

    def forward(self, input_ids: torch.Tensor) -> _Output:
        b, n = input_ids.shape
        logits = torch.zeros(b, n, VOCAB_SIZE)
        for row in range(b):
            if self.mode == "wrong":
                target = torch.zeros(n, dtype=torch.long)
            elif self.mode == "echo":
                target = input_ids[row]
            else:
                key = tuple(input_ids[row].tolist())
                target = self.full[key][1:].clone()
                if key in self.wrong_on:
                    target[-1] = (target[-1] + 1) % VOCAB_SIZE
            logits[row, torch.arange(n), target] = 1.0
        return _Output(logits=logits.to(input_ids.device))


def test_validation_bpb_is_cross_entropy_in_bits():
    torch.manual_seed(0)
    model = presets.build_model(_tiny_config(), seed=0).to(DEVICE)
    # Unequal batches: a mean of batch means would differ from the mean over all tokens.
    batches = [torch.randint(0, 256, (3, 33)), torch.randint(0, 256, (1, 21))]
    model.train()
    got = evaluate.validation_bpb(model, batches, device=DEVICE)
    assert model.training, "validation_bpb must restore the model's training mode"

    total, count = 0.0, 0
    with torch.no_grad():
        model.eval()
        for x in batches:
            x = x.to(DEVICE)
            logp = model(x[:, :-1]).logits.double().log_softmax(-1)
            total -= logp.gather(-1, x[:, 1:, None]).sum().item()
            count += x[:, 1:].numel()
    expected = total / count / math.log(2)
    print(f"bpb {got:.6f}, by hand {expected:.6f}")
    assert_close(torch.tensor([got]), torch.tensor([expected]), torch.float32, "bits per byte")
    # An untrained model predicts about uniformly over the vocabulary.
    assert abs(got - math.log2(VOCAB_SIZE)) < 0.5


def test_needle_samples_are_deterministic_and_hold_the_answer(val_corpus):
    depths = [0.0, 0.5, 1.0]
    a = evaluate.needle_samples(val_corpus, LENGTH, depths, per_depth=3, seed=5)
    b = evaluate.needle_samples(val_corpus, LENGTH, depths, per_depth=3, seed=5)
    c = evaluate.needle_samples(val_corpus, LENGTH, depths, per_depth=3, seed=6)
    assert list(a) == depths and all(len(v) == 3 for v in a.values())
    for d in depths:
        for s, t, u in zip(a[d], b[d], c[d]):
            assert torch.equal(s.tokens, t.tokens)
            assert not torch.equal(s.tokens, u.tokens)
            assert s.tokens.shape == (LENGTH,)
            assert s.answer_start + s.answer_len == LENGTH
            value = s.tokens[s.needle_start + 6 : s.needle_start + 12]  # KEY k k k k VALUE
            assert torch.equal(value, s.tokens[s.answer_start :])
    starts = [a[d][0].needle_start for d in depths]
    assert starts[0] == 1 and starts[0] < starts[1] < starts[2]


def test_needle_accuracy_separates_oracle_from_blind_models(val_corpus):
    cells = evaluate.needle_samples(val_corpus, LENGTH, [0.0, 0.5, 1.0], per_depth=3, seed=1)
    samples = [s for group in cells.values() for s in group]  # 9: batches of 4 leave one over
    short = evaluate.needle_samples(val_corpus, LENGTH - 7, [0.3], per_depth=2, seed=1)[0.3]
    mixed = samples + short

    def acc(model, which=mixed):
        return evaluate.needle_accuracy(model, which, device="cpu", batch_size=4)

    assert acc(_Oracle(mixed)) == 1.0
    assert acc(_Oracle(mode="wrong")) == 0.0
    assert acc(_Oracle(mode="echo")) == 0.0  # right tokens, one position late
    # Wrong on one answer token of 3 of the 11 samples, one of them alone in its batch (the 9th
    # of length LENGTH).
    wrong_on = cells[0.5][:1] + cells[1.0][2:] + short[1:]
    assert acc(_Oracle(mixed, wrong_on=wrong_on)) == 8 / 11


def _eval_args(argv):
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return parser.parse_args(argv)


def test_eval_command_writes_grid_and_heatmap(tmp_path, corpus_root):
    model_dir = tmp_path / "model"
    presets.build_model(_tiny_config(), seed=0).save_pretrained(model_dir)
    (model_dir / "run.json").write_text(
        json.dumps(
            {
                "options": {
                    "variant": "hhst",
                    "preset": "tiny",
                    "seq_len": LENGTH,
                    "seed": 3,
                    "batch_size": 2,
                    "data_root": [str(corpus_root)],
                },
            }
        )
    )
    out = tmp_path / "results" / "needle.json"
    args = _eval_args(
        [
            str(model_dir),
            "--needle",
            "--lengths",
            f"{LENGTH},{LENGTH + 16}",
            "--depths",
            "0,1",
            "--samples",
            "2",
            "--val-batches",
            "1",
            "--val-fraction",
            "0.5",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert evaluate.run(args) == 0

    result = json.loads(out.read_text())
    assert set(result["accuracy"]) == {str(LENGTH), str(LENGTH + 16)}
    for row in result["accuracy"].values():
        assert set(row) == {"0", "1"}
        assert all(0.0 <= v <= 1.0 for v in row.values())
    assert result["samples_per_cell"] == 2 and result["seed"] == 3
    assert result["variant"] == "hhst" and result["device"] == "cpu"
    assert result["val_tokens"] == 2 * LENGTH  # batch 2 and seq_len from run.json
    assert abs(result["val_bpb"] - math.log2(VOCAB_SIZE)) < 0.5  # untrained: about uniform
    png = out.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eval_shows_progress_bars_only_on_a_terminal(tmp_path, corpus_root, monkeypatch):
    """In a log (stderr a pipe) no bars, neither the needle grid's nor transformers' (loading
    the weights); on a terminal the grid's bar shows."""
    model_dir = tmp_path / "model"
    presets.build_model(_tiny_config("dense"), seed=0).save_pretrained(model_dir)
    argv = [str(model_dir), "--needle", "--lengths", str(LENGTH), "--depths", "0", "--samples"]
    argv += ["1", "--val-batches", "0", "--data-root", str(corpus_root), "--val-fraction", "0.5"]
    argv += ["--device", "cpu"]
    root = Path(evaluate.__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    # Bytes: text mode would turn the bars' carriage returns into newlines.
    logged = subprocess.run(
        [sys.executable, "-m", "s2attn", "eval", *argv],
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=HANG_GUARD_S,
    )
    assert logged.returncode == 0, logged.stderr.decode()
    assert b"\r" not in logged.stderr, logged.stderr
    assert b"needle accuracy" in logged.stdout

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert evaluate.run(_eval_args(argv)) == 0
    assert "needle grid" in terminal.getvalue() and "\r" in terminal.getvalue()


@pytest.mark.parametrize("variant, limit", [("hhst", 64), ("dense", 64)])
def test_eval_rejects_lengths_beyond_the_model(tmp_path, corpus_root, variant, limit):
    model_dir = tmp_path / "model"
    presets.build_model(_tiny_config(variant, max_seq_len=limit), seed=0).save_pretrained(model_dir)
    out = tmp_path / "needle.json"
    args = _eval_args(
        [
            str(model_dir),
            "--needle",
            "--lengths",
            f"{LENGTH},{limit + 1}",
            "--data-root",
            str(corpus_root),
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    with pytest.raises(
        ValueError, match=f"{limit + 1} exceeds the model's context limit of {limit}"
    ):
        evaluate.run(args)
    assert not out.exists()


def test_eval_rejects_a_directory_without_a_model(tmp_path):
    with pytest.raises(ValueError, match="holds no config.json"):
        evaluate.run(_eval_args([str(tmp_path), "--device", "cpu"]))


def _saved_model(model_dir: Path, corpus_root: Path) -> Path:
    presets.build_model(_tiny_config(), seed=0).save_pretrained(model_dir)
    options = {"variant": "hhst", "preset": "tiny", "seq_len": LENGTH, "batch_size": 2}
    record = {"options": {**options, "data_root": [str(corpus_root)], "val_fraction": 0.5}}
    (model_dir / "run.json").write_text(json.dumps(record))
    return model_dir


def test_eval_names_a_truncated_weights_file(tmp_path, corpus_root, monkeypatch):
    """A model.safetensors cut short (a copy stopped halfway) is named, before anything loads."""
    model_dir = _saved_model(tmp_path / "model", corpus_root)
    weights = model_dir / "model.safetensors"
    whole = weights.read_bytes()
    loaded = []
    monkeypatch.setattr(
        presets.LlamaForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a)
    )
    for cut in (len(whole) - 100, 100, 4):
        weights.write_bytes(whole[:cut])
        with pytest.raises(ValueError) as info:
            evaluate.run(_eval_args([str(model_dir), "--device", "cpu", "--no-progress"]))
        print(info.value)
        assert f"model_dir: {weights} is not a whole safetensors file" in str(info.value)
    assert not loaded


@pytest.mark.parametrize("checkpoint", [True, False])
def test_eval_on_an_unfinished_run_says_how_to_finish_it(checkpoint, tmp_path):
    """A run stopped early holds run.json and a checkpoint, no model: eval says it is an
    interrupted run and gives the command that finishes it (the run's own, with --resume and
    without the option that stopped it); with no checkpoint, that there is nothing to resume."""
    run = tmp_path / "run dir"
    run.mkdir()
    started = f"python -m s2attn train --out '{run}' --steps 9 --stop-at 3 --time-limit=60"
    (run / "run.json").write_text(json.dumps({"options": {"steps": 9}, "command": started}))
    if checkpoint:
        (run / "checkpoint").mkdir()
        (run / "checkpoint" / "state.pt").write_bytes(b"")
    with pytest.raises(ValueError) as info:
        evaluate.run(_eval_args([str(run), "--device", "cpu"]))
    message = str(info.value)
    print(message)
    if checkpoint:
        assert "is an interrupted `s2attn train` run" in message
        assert f"`python -m s2attn train --out '{run}' --steps 9 --resume`" in message
    else:
        assert "saved no model and no checkpoint" in message and "--resume" not in message


def test_eval_without_matplotlib_writes_the_results_and_no_heat_map(
    tmp_path, corpus_root, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    model_dir = _saved_model(tmp_path / "model", corpus_root)
    out = tmp_path / "needle.json"
    argv = [str(model_dir), "--needle", "--depths", "0", "--samples", "1", "--val-batches", "0"]
    capsys.readouterr()
    assert evaluate.run(_eval_args([*argv, "--device", "cpu", "--out", str(out)])) == 0
    err = capsys.readouterr().err
    assert err.startswith("s2attn eval: warning: matplotlib (not installed)"), err
    assert "pip install 's2attn[models]'" in err
    assert set(json.loads(out.read_text())["accuracy"]) == {str(LENGTH)}
    assert not out.with_suffix(".png").exists()


def test_plot_needle_heatmaps_draws_one_panel_per_model(tmp_path):
    results = {
        "dense": {"accuracy": {"64": {"0": 1.0, "1": 1.0}, "128": {"0": 1.0, "1": 0.9}}},
        "local": {"64": {"0": 1.0, "0.5": 0.2}},  # a bare accuracy dict and another grid
    }
    path = evaluate.plot_needle_heatmaps(results, tmp_path / "grid.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="results\\['bad'\\]"):
        evaluate.plot_needle_heatmaps({"bad": {"accuracy": {}}}, tmp_path / "bad.png")
