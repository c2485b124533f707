"""Long-context tasks (s2attn.training.tasks): each generator's samples decoded and their answers
derived from the context alone, the scorer on models that know or guess the answer, the intervals
against hand computations, bits per byte by position against a float64 computation, and ``s2attn
eval --tasks`` end to end."""

from __future__ import annotations

import argparse
import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tqdm")

from helpers import DEVICE, assert_close

from s2attn.training import evaluate, intervals, positions, presets, scoring, tasks
from s2attn.training.data import SourceCorpus
from s2attn.training.vocab import BOS, KEY, VALUE, VOCAB_SIZE

DIGITS = set(b"0123456789")


@pytest.fixture(scope="module")
def val_corpus(corpus_root):
    return SourceCorpus([corpus_root], split="val", val_fraction=0.3)


# ------------------------------------------------------------------ reading a sample's bytes
def _parse(sample, task):
    """Every planted item of the context, read from its tokens alone: ``(start, key, rhs)`` for
    ``KEY key VALUE rhs`` (rhs: value_len digits, or key_len letters naming a variable) and
    ``(start, key, None)`` for a bare ``KEY key``; plus the question and the answer."""
    tokens = sample.tokens.tolist()
    context = tokens[: sample.answer_start]
    # The question: the last special token run of the context, from its last KEY (or VALUE KEY).
    q = max(i for i, t in enumerate(context) if t == KEY)
    if context[q - 1] == VALUE:
        q -= 1
    question, body = context[q:], context[:q]
    assert body[0] == BOS and BOS not in body[1:], "one BOS, at the start"
    items = []
    for i, t in enumerate(body):
        if t != KEY:
            continue
        key = bytes(body[i + 1 : i + 1 + task.key_len])
        after = i + 1 + task.key_len
        if after < len(body) and body[after] == VALUE:
            first = body[after + 1]
            width = task.value_len if first in DIGITS else task.key_len
            rhs = bytes(body[after + 1 : after + 1 + width])
            items.append((i, key, rhs))
        else:
            items.append((i, key, None))
    specials = sum(t in (KEY, VALUE) for t in body)
    assert specials == sum(1 if rhs is None else 2 for *_, rhs in items), "stray KEY/VALUE"
    return items, question, tokens[sample.answer_start :]


def _check_multikey(sample, task):
    items, question, answer = _parse(sample, task)
    assert question[0] == KEY and question[-1] == VALUE and len(question) == 2 + task.key_len
    asked = bytes(question[1:-1])
    keys = [k for _, k, _ in items]
    assert len(items) == task.keys and len(set(keys)) == task.keys
    (target,) = [(s, v) for s, k, v in items if k == asked]
    assert list(target[1]) == answer and len(set(v for *_, v in items)) == task.keys
    close = sum(sum(a != b for a, b in zip(k, asked)) == 1 for k in keys)
    assert close >= task.near_misses
    assert sample.evidence_starts == [target[0]]


def _check_multivalue(sample, task):
    items, question, answer = _parse(sample, task)
    asked = bytes(question[1:-1])
    mine = [(s, v) for s, k, v in items if k == asked]  # in order of appearance
    assert len(mine) == task.values and len(items) == task.values + task.distractors
    expected = []
    for _, v in mine:
        expected += ([VALUE] if expected else []) + list(v)
    assert answer == expected
    assert sample.evidence_starts == [s for s, _ in mine]


def _check_vartrack(sample, task):
    items, question, answer = _parse(sample, task)
    assigned = {}
    for start, name, rhs in items:
        assert name not in assigned, "every variable is assigned once"
        if rhs[0] not in DIGITS:
            assert rhs in assigned, "a variable is assigned before it is read"
        assigned[name] = (start, rhs)
    assert len(assigned) == task.chains * task.hops
    name, chain = bytes(question[1:-1]), []
    while True:
        start, rhs = assigned[name]
        chain.append(start)
        if rhs[0] in DIGITS:
            break
        name = rhs
    assert list(rhs) == answer and len(chain) == task.hops
    assert sum(rhs[0] in DIGITS for _, rhs in assigned.values()) == task.chains
    assert sample.evidence_starts == sorted(chain)


def _check_aggregate(sample, task):
    items, question, answer = _parse(sample, task)
    assert question == [VALUE, KEY] and all(rhs is None for *_, rhs in items)
    counts: dict[bytes, int] = {}
    for _, k, _ in items:
        counts[k] = counts.get(k, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert len(counts) == task.keys and ranked[0] > ranked[1], "one most frequent key"
    (top,) = [k for k, c in counts.items() if c == ranked[0]]
    assert list(top) == answer
    assert ranked == [task.top] + [task.runner_up] * (task.keys - 1)
    assert sample.evidence_starts == [s for s, k, _ in items if k == top]


CHECKS = {
    "multikey": _check_multikey,
    "multivalue": _check_multivalue,
    "vartrack": _check_vartrack,
    "aggregate": _check_aggregate,
}


@pytest.mark.parametrize("name", list(tasks.TASKS))
@pytest.mark.parametrize("extra", [0, 300])
def test_samples_hold_an_answer_derivable_from_the_context(val_corpus, name, extra):
    task = tasks.TASKS[name]
    length = task.min_length() + extra
    a = tasks.task_samples(val_corpus, task, length, count=4, seed=5)
    b = tasks.task_samples(val_corpus, task, length, count=4, seed=5)
    c = tasks.task_samples(val_corpus, task, length, count=4, seed=6)
    for s, t, u in zip(a, b, c):
        assert torch.equal(s.tokens, t.tokens) and s.evidence_starts == t.evidence_starts
        assert not torch.equal(s.tokens, u.tokens)
        assert s.tokens.shape == (length,) and s.tokens.dtype == torch.int64
        assert s.answer_start + s.answer_len == length and s.task == name
        assert s.needle_start == s.evidence_starts[0]
        CHECKS[name](s, task)
    # Spread through the context: with filler, some sample has evidence in both halves.
    if extra and name != "multikey":
        assert any(min(s.evidence_starts) < length / 2 < max(s.evidence_starts) for s in a + c)


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_samples_too_short_are_refused_with_the_length_needed(val_corpus, name):
    task = tasks.TASKS[name]
    needed = task.min_length()
    with pytest.raises(ValueError, match=f"{name} task .* needs samples of at least {needed} tok"):
        tasks.task_samples(val_corpus, task, needed - 1, count=1, seed=0)
    with pytest.raises(ValueError, match=f"at least {needed} tokens"):
        task.sample(torch.zeros(10, dtype=torch.int64), needed - 1, random.Random(0))


def test_task_shapes_are_checked():
    for bad in (
        lambda: tasks.MultiKey(keys=4, near_misses=4),
        lambda: tasks.Aggregation(top=3, runner_up=3),
        lambda: tasks.VariableTracking(hops=0),
        lambda: tasks.MultiValue(distractors=-1),
        lambda: tasks.VariableTracking(key_len=1, chains=7, hops=4),  # 28 names of 26 letters
        lambda: tasks.MultiKey(keys=11, value_len=1),  # 11 values of 10 digits
    ):
        with pytest.raises(ValueError, match="must be|needs .* distinct"):
            bad()
    # Distractors may be absent; the shape changes the length needed.
    assert tasks.MultiValue(distractors=0).min_length() < tasks.MultiValue().min_length()
    assert tasks.MultiKey(near_misses=0).min_length() == tasks.MultiKey().min_length()


# ------------------------------------------------------------------------------ the scorer
class _Output(SimpleNamespace):
    logits: torch.Tensor


class _Stub(torch.nn.Module):
    """Puts the largest logit, for each sample it was built with (found by its input), on the
    true next token (``answers=None``), or at the answer's positions on the answer that
    ``answers(sample, rng)`` picks; random logits for inputs it does not know."""

    def __init__(self, samples=(), answers=None, seed=0):
        super().__init__()
        self.samples = {tuple(s.tokens[:-1].tolist()): s for s in samples}
        self.answers, self.rng = answers, random.Random(seed)

    def forward(self, input_ids):
        b, n = input_ids.shape
        logits = torch.randn(b, n, VOCAB_SIZE, generator=torch.Generator().manual_seed(n))
        for row in range(b):
            s = self.samples.get(tuple(input_ids[row].tolist()))
            if s is None:
                continue
            target = s.tokens[1:].clone()
            if self.answers is not None:
                target[s.answer_start - 1 :] = torch.tensor(self.answers(s, self.rng))
            logits[row, torch.arange(n)] = 0.0
            logits[row, torch.arange(n), target] = 1.0
        return _Output(logits=logits)


def _guess_value(task):
    """A guess among the context's candidates: a needle's value (multikey), a chain's digits
    (vartrack) or a mentioned key (aggregate)."""

    def pick(sample, rng):
        items, _, _ = _parse(sample, task)
        if task.name == "aggregate":
            candidates = sorted({k for _, k, _ in items})
        else:
            candidates = sorted({v for *_, v in items if v[0] in DIGITS})
        return list(rng.choice(candidates))

    return pick


@pytest.mark.parametrize("name", ["multikey", "vartrack", "aggregate"])
def test_scorer_gives_one_for_an_oracle_and_chance_for_a_guess(val_corpus, name):
    task = tasks.TASKS[name]
    n = 160
    samples = tasks.task_samples(val_corpus, task, task.min_length() + 40, count=n, seed=2)

    def score(model):
        return tasks.task_accuracy(model, samples, device="cpu", batch_size=16)

    oracle = score(_Stub(samples))
    assert oracle["n"] == n and oracle["correct"] == n and oracle["accuracy"] == 1.0
    assert oracle["ci"] == pytest.approx(list(intervals.wilson_interval(n, n)))
    assert score(_Stub())["accuracy"] == 0.0  # random logits: chance is 260**-answer_len

    guess = score(_Stub(samples, answers=_guess_value(task), seed=1))
    p = task.chance()
    sigma = math.sqrt(p * (1 - p) / n)
    print(f"{name}: a guess scores {guess['accuracy']:.3f}, chance {p:.3f} (sigma {sigma:.3f})")
    assert abs(guess["accuracy"] - p) < 3 * sigma
    assert guess["ci"][0] <= guess["accuracy"] <= guess["ci"][1]


def test_multivalue_counts_only_every_value_in_order(val_corpus):
    task = tasks.TASKS["multivalue"]
    samples = tasks.task_samples(val_corpus, task, task.min_length() + 50, count=20, seed=3)

    def reversed_values(sample, rng):
        answer, width = sample.tokens[sample.answer_start :].tolist(), task.value_len
        out: list[int] = []
        for first in reversed(range(0, len(answer), width + 1)):
            out += ([VALUE] if out else []) + answer[first : first + width]
        assert out != answer
        return out

    result = tasks.task_accuracy(
        _Stub(samples, answers=reversed_values), samples, device="cpu", batch_size=8
    )
    assert result["accuracy"] == 0.0


# ---------------------------------------------------------------------------- the intervals
def test_wilson_interval_matches_a_hand_computation():
    # 7 of 20 at 95%, z = 1.959964: centre (0.35 + z^2/40) / (1 + z^2/20) = 0.37417, half-width
    # z / (1 + z^2/20) * sqrt(0.35 * 0.65 / 20 + z^2/1600) = 0.19298.
    low, high = intervals.wilson_interval(7, 20)
    assert low == pytest.approx(0.18119, abs=2e-5) and high == pytest.approx(0.56715, abs=2e-5)
    # 0 of 10: [0, z^2 / (10 + z^2)] = [0, 0.27753]; 10 of 10 mirrors it.
    assert intervals.wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=2e-5)
    assert intervals.wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=2e-5)
    # 99%: z = 2.575829 widens it.
    assert intervals.wilson_interval(7, 20, 0.99)[0] < low
    for bad in ((21, 20), (-1, 20), (1, 0)):
        with pytest.raises(ValueError):
            intervals.wilson_interval(*bad)


def test_bootstrap_interval_covers_the_mean_with_the_normal_width():
    values = np.random.default_rng(0).normal(size=(400, 2)) * [1.0, 3.0] + [5.0, -1.0]
    low, high = intervals.bootstrap_interval(values, seed=1)
    again = intervals.bootstrap_interval(values, seed=1)
    assert np.array_equal(low, again[0]) and np.array_equal(high, again[1])
    mean, sem = values.mean(0), values.std(0, ddof=1) / math.sqrt(400)
    assert np.all(low < mean) and np.all(mean < high)
    half = (high - low) / 2
    print(f"bootstrap half-widths {half}, normal {1.96 * sem}")
    assert np.allclose(half, 1.96 * sem, rtol=0.1)
    with pytest.raises(ValueError, match="n >= 2"):
        intervals.bootstrap_interval(values[:1])


# ------------------------------------------------------------------ bits per byte by position
def test_position_edges():
    # the last 16k apart at 128k (the doublings alone end in 64k-128k)
    assert positions.position_edges(131072) == [0] + [1024 * 2**k for k in range(7)] + [
        114688,
        131072,
    ]
    assert positions.position_edges(32768) == [0, 1024, 2048, 4096, 8192, 16384, 32768]
    assert positions.position_edges(64) == [0, 8, 16, 32, 64]
    assert positions.position_edges(5) == [0, 1, 2, 4, 5]


class _Causal(torch.nn.Module):
    """A stub whose logits at position t depend on tokens 0..t (a running mean of embeddings)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        # Buffers, so that .to(device) moves them as position_bpb's device moves the tokens.
        self.register_buffer("embed", torch.randn(VOCAB_SIZE, 16, generator=g))
        self.register_buffer("out", torch.randn(16, VOCAB_SIZE, generator=g))

    def forward(self, input_ids):
        count = torch.arange(1, input_ids.shape[1] + 1, device=input_ids.device)
        e = self.embed[input_ids].cumsum(1) / count[:, None]
        return _Output(logits=e @ self.out)


def _bucket_means(logits: torch.Tensor, sequences: torch.Tensor, edges) -> torch.Tensor:
    logp = logits.double().log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]
    return torch.stack([-logp[:, a:b].mean(1) for a, b in zip(edges, edges[1:])], 1) / math.log(2)


@pytest.mark.parametrize("model_kind", ["stub", "transformers"])
def test_position_bpb_is_the_per_position_cross_entropy_by_bucket(model_kind, monkeypatch):
    torch.manual_seed(0)
    sequences = torch.randint(0, 256, (5, 41))
    edges = [0, 3, 10, 25, 40]
    if model_kind == "stub":
        model = _Causal().to(DEVICE)
    else:
        model = presets.build_model(presets.model_config("tiny", "dense", seq_len=64), seed=0)
        model = model.to(DEVICE)
        # Logits in chunks that split sequences and batches unevenly.
        monkeypatch.setattr(scoring, "_LOGIT_ROWS", 17)
    got = positions.position_bpb(model, sequences, edges, device=DEVICE, batch_size=2)
    with torch.no_grad():
        logits = model(sequences[:, :-1].to(DEVICE)).logits.cpu()
    expected = _bucket_means(logits, sequences, edges)
    assert got.dtype == torch.float64 and got.shape == (5, 4)
    assert_close(got, expected, torch.float32, f"bucket bits per byte ({model_kind})")
    for bad in ([0, 10, 10, 40], [1, 40], [0, 39], [0]):
        with pytest.raises(ValueError, match="edges must be increasing"):
            positions.position_bpb(model, sequences, bad, device=DEVICE)


def test_long_documents_start_at_a_document_and_are_refused_when_too_few(val_corpus):
    length = 1000
    rows = positions.long_documents(val_corpus, length, count=3, seed=4)
    assert rows.shape == (3, length + 1) and torch.equal(
        rows, positions.long_documents(val_corpus, length, count=3, seed=4)
    )
    files = {val_corpus.read(i)[:length] for i, s in enumerate(val_corpus.sizes) if s >= length}
    for row in rows:
        assert row[0] == BOS and bytes(row[1:].tolist()) in files
    assert len({bytes(r[1:].tolist()) for r in rows}) == 3
    every = positions.long_documents(val_corpus, length, count=1000, seed=4)
    assert every.shape[0] == len(files)
    longest = max(val_corpus.sizes)
    with pytest.raises(ValueError, match=f"length {longest + 1} needs at least 2 .*{longest}"):
        positions.long_documents(val_corpus, longest + 1, count=5, seed=0)


# ---------------------------------------------------------------------------- the command
LIMIT = 512


def _model_dir(tmp_path, corpus_root):
    model_dir = tmp_path / "model"
    # Dense: the tasks read any model alike, and the S2 layers' CPU reference would cost most of
    # the test's time.
    config = presets.model_config("tiny", "dense", seq_len=LIMIT)
    presets.build_model(config, seed=0).save_pretrained(model_dir)
    record = {"options": {"variant": "dense", "preset": "tiny", "seq_len": 64, "seed": 3}}
    record["options"].update(batch_size=2, data_root=[str(corpus_root)], val_fraction=0.3)
    (model_dir / "run.json").write_text(json.dumps(record))
    return model_dir


def _eval_args(argv):
    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    return parser.parse_args(argv)


def test_eval_command_runs_every_task_and_writes_them(tmp_path, corpus_root, capsys):
    model_dir = _model_dir(tmp_path, corpus_root)
    out = tmp_path / "results" / "tasks.json"
    lengths = [400, LIMIT]
    argv = [str(model_dir), "--tasks", ",".join(tasks.TASK_NAMES), "--lengths", "400,512"]
    argv += ["--task-samples", "3", "--val-batches", "0", "--device", "cpu", "--out", str(out)]
    assert evaluate.run(_eval_args([*argv, "--no-progress"])) == 0
    printed = capsys.readouterr().out

    result = json.loads(out.read_text())["tasks"]
    assert result["level"] == 0.95 and result["accuracy_interval"] == "Wilson score"
    assert result["seed"] == 3
    for name, task in tasks.TASKS.items():
        assert result[name]["shape"] == task.describe()
        for n in lengths:
            cell = result[name][str(n)]
            assert cell["n"] == 3 and 0 <= cell["accuracy"] <= 1
            assert cell["correct"] == round(3 * cell["accuracy"])
            assert cell["ci"] == pytest.approx(list(intervals.wilson_interval(cell["correct"], 3)))
            assert f"{name:<11} {n:>7} {3:>5}" in printed
    for n in lengths:
        cell = result["positions"][str(n)]
        edges = positions.position_edges(n)
        assert [(b["start"], b["end"]) for b in cell["buckets"]] == list(zip(edges, edges[1:]))
        per_sequence = np.array(cell["per_sequence"])
        assert per_sequence.shape == (cell["n"], len(edges) - 1) and cell["n"] >= 2
        for j, b in enumerate(cell["buckets"]):
            assert b["bpb"] == pytest.approx(per_sequence[:, j].mean())
            assert b["ci"][0] <= b["bpb"] <= b["ci"][1]
            assert abs(b["bpb"] - math.log2(VOCAB_SIZE)) < 0.5  # untrained: about uniform
    assert "Wilson score interval" in printed and "percentile bootstrap" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "multikey", "--lengths", "300"], "multikey task .* at least 397 tokens"),
        (["--tasks", "aggregate", "--lengths", "600"], "600 exceeds the model's context limit"),
        (["--tasks", "vartrack", "--task-samples", "0"], "--task-samples must be an int >= 1"),
    ],
)
def test_eval_refuses_tasks_that_do_not_fit(tmp_path, corpus_root, argv, message):
    model_dir = _model_dir(tmp_path, corpus_root)
    out = tmp_path / "tasks.json"
    args = _eval_args([str(model_dir), *argv, "--device", "cpu", "--out", str(out)])
    with pytest.raises(ValueError, match=message):
        evaluate.run(args)
    assert not out.exists()


def test_unknown_tasks_and_documents_too_short_are_refused(corpus_root):
    with pytest.raises(SystemExit):
        _eval_args(["model", "--tasks", "multikey,haystack"])
    with pytest.raises(ValueError, match="positions: bits per byte by position at length 5000"):
        tasks.plan(["positions"], [5000], 4, limit=8192, roots=[corpus_root], val_fraction=0.3)


def test_eval_memory_check_covers_the_task_lengths(tmp_path, corpus_root, monkeypatch):
    model_dir = _model_dir(tmp_path, corpus_root)
    config = presets.model_config("tiny", "dense", seq_len=LIMIT)
    # Room for the validation pass at 64 tokens, not for a task pass at 512.
    free = (evaluate.forward_memory(config, 64, activation_bytes=4) * 3) // 2
    assert evaluate.forward_memory(config, LIMIT, activation_bytes=4) > free
    monkeypatch.setattr(evaluate, "free_memory", lambda device: free)
    argv = [str(model_dir), "--tasks", "positions", "--lengths", str(LIMIT), "--batch-size", "1"]
    with pytest.raises(ValueError, match=f"evaluating 1 x {LIMIT} tokens a forward pass needs"):
        evaluate.run(_eval_args([*argv, "--val-batches", "0", "--device", "cpu"]))
