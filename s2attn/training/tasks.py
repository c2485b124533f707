"""Long-context evaluations harder than one needle: synthetic tasks, and bits per byte by position.

**Synthetic tasks**, in the manner of RULER. Each is a frozen dataclass holding its shape, whose
:meth:`~Task.sample` plants its items at uniform random depths in filler text (a chain's
assignments in chain order) and ends with a question and its answer:

- :class:`MultiKey` (``multikey``): ``keys`` needles ``KEY k VALUE v`` with distinct keys and
  values, ``near_misses`` of the distractors one letter away from the key asked for; question
  ``KEY k VALUE``, answer ``v``.
- :class:`MultiValue` (``multivalue``): one key planted ``values`` times with distinct values,
  among ``distractors`` needles of other keys; question ``KEY k VALUE``, answer every value of
  ``k`` in the order they appear, separated by ``VALUE``.
- :class:`VariableTracking` (``vartrack``): ``chains`` chains of ``hops`` assignments, ``KEY x1
  VALUE digits``, ``KEY x2 VALUE x1``, ..., ``KEY xh VALUE xh-1``; question ``KEY xh VALUE`` for
  one chain, answer the digits its first variable holds.
- :class:`Aggregation` (``aggregate``): ``keys`` keys mentioned as ``KEY w`` all through the
  context, one of them ``top`` times, every other ``runner_up`` times; question ``VALUE KEY``,
  answer the most frequent key.

Keys are lowercase letters, values digits; ``KEY`` and ``VALUE`` never occur in the filler, so
every item is found only where it was planted. A :class:`TaskSample` is a
:class:`~s2attn.training.needles.NeedleSample`, so :func:`~s2attn.training.scoring.needle_accuracy`
scores every task alike: the whole answer, by greedy argmax under teacher forcing.
:func:`task_samples` builds them deterministically from a seed over the validation text (sample
``i`` of every task has the filler of the needle grid's sample ``i``), :func:`task_accuracy`
scores them with a Wilson score interval
(:func:`~s2attn.training.intervals.wilson_interval`, 95%).

**Natural text** (``positions``): bits per byte by target position
(:func:`~s2attn.training.positions.position_bpb`). The interval of a bucket's mean is a
percentile bootstrap over sequences (:func:`~s2attn.training.intervals.bootstrap_interval`),
since every sequence has the same tokens in a bucket.

**The command**: ``s2attn eval --tasks multikey,multivalue,vartrack,aggregate,positions`` at each
of ``--lengths`` (:func:`add_arguments`, :func:`plan`, :meth:`TaskPlan.run`) prints a table with
every cell's n and interval and writes them under ``"tasks"`` in the eval's JSON.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from . import scoring
from .data import SourceCorpus, needle_filler
from .intervals import (
    LEVEL,
    MIN_SEQUENCES,
    RESAMPLES,
    _check_int,
    bootstrap_interval,
    wilson_interval,
)
from .needles import NeedleSample, plant
from .positions import long_documents, position_bpb, position_edges, too_few_documents
from .vocab import KEY, VALUE

__all__ = [
    "TASKS",
    "Aggregation",
    "MultiKey",
    "MultiValue",
    "Task",
    "TaskPlan",
    "TaskSample",
    "VariableTracking",
    "add_arguments",
    "plan",
    "task_accuracy",
    "task_samples",
]

_LETTERS = b"abcdefghijklmnopqrstuvwxyz"
_DIGITS = b"0123456789"


@dataclass
class TaskSample(NeedleSample):
    """A :class:`~s2attn.training.needles.NeedleSample` of a synthetic task.

    Attributes (besides ``tokens``, ``answer_start``, ``answer_len``; ``needle_start`` is the
    first of ``evidence_starts``):
        task: the task's name.
        evidence_starts: where each planted item that the answer depends on begins (its ``KEY``
            token), in the order the items appear.
    """

    task: str
    evidence_starts: list[int]


def _words(rng: random.Random, count: int, length: int, alphabet: bytes, taken: set) -> list:
    """``count`` random words of ``length`` symbols of ``alphabet``, distinct from each other
    and from ``taken`` (which gains them)."""
    out = []
    while len(out) < count:
        word = bytes(rng.choice(alphabet) for _ in range(length))
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def _near_misses(rng: random.Random, key: bytes, count: int, taken: set) -> list:
    """``count`` distinct keys that differ from ``key`` in exactly one letter."""
    out = []
    while len(out) < count:
        at = rng.randrange(len(key))
        letter = rng.choice([c for c in _LETTERS if c != key[at]])
        word = key[:at] + bytes([letter]) + key[at + 1 :]
        if word not in taken:
            taken.add(word)
            out.append(word)
    return out


def _ids(*parts: int | bytes) -> torch.Tensor:
    """Token ids of special tokens and byte strings in a row."""
    out: list[int] = []
    for p in parts:
        out.extend(p if isinstance(p, bytes) else [p])
    return torch.tensor(out, dtype=torch.int64)


@dataclass(frozen=True)
class Task:
    """What every task shares: key and value lengths, the length check and the sample's
    assembly. A task defines ``name``, ``_items_len`` (tokens of its items, question and answer)
    and ``_sample``."""

    name: ClassVar[str]
    # Counts of distractors, which a task may go without.
    _may_be_zero: ClassVar[tuple[str, ...]] = ()
    key_len: int = 4
    value_len: int = 6

    def __post_init__(self):
        for f in fields(self):
            least = 0 if f.name in self._may_be_zero else 1
            _check_int(f"{type(self).__name__}.{f.name}", getattr(self, f.name), least)
        keys, values = self._distinct()
        if keys > len(_LETTERS) ** self.key_len or values > len(_DIGITS) ** self.value_len:
            raise ValueError(
                f"{type(self).__name__} needs {keys} distinct keys of key_len={self.key_len} "
                f"letters and {values} distinct values of value_len={self.value_len} digits: "
                "raise key_len or value_len"
            )

    def min_length(self) -> int:
        """The shortest sample: the leading ``BOS``, the items, the question and the answer,
        with no filler."""
        return 1 + self._items_len()

    def check_length(self, length: object, what: str = "length") -> None:
        """Raise ``ValueError`` naming :meth:`min_length` unless ``length`` reaches it."""
        needed = self.min_length()
        if isinstance(length, bool) or not isinstance(length, int) or length < needed:
            raise ValueError(
                f"{what}: the {self.name} task ({self._shape()}) needs samples of at least "
                f"{needed} tokens, got {length!r}"
            )

    def chance(self) -> float | None:
        """The accuracy of a uniform guess among the context's candidates of the answer's kind,
        where there is one such guess."""
        return None

    def describe(self) -> dict:
        """The task's name, shape and shortest sample, for a results file."""
        return {"task": self.name, **asdict(self), "min_length": self.min_length()}

    def sample(self, filler: torch.Tensor, length: int, rng: random.Random) -> TaskSample:
        """One sample of exactly ``length`` tokens: the task's items in the first ``length -
        min_length()`` tokens of ``filler`` (``(n,)`` ids in ``[0, KEY)``), then the
        question and the answer (the last ``answer_len`` tokens). ``rng`` draws every random
        choice. Raises ``ValueError`` when ``length`` is below :meth:`min_length`."""
        self.check_length(length)
        if not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
        items, depths, evidence, question, answer = self._sample(rng)
        context, starts = plant(filler, length - self.min_length(), items, depths)
        tokens = torch.cat([context, question, answer])
        evidence_starts = sorted(starts[i] for i in evidence)
        return TaskSample(
            tokens=tokens,
            answer_start=length - len(answer),
            answer_len=len(answer),
            needle_start=evidence_starts[0],
            task=self.name,
            evidence_starts=evidence_starts,
        )

    def _needle_len(self) -> int:
        return 2 + self.key_len + self.value_len

    def _items_len(self) -> int:
        raise NotImplementedError

    def _distinct(self) -> tuple[int, int]:
        """How many distinct keys and values a sample draws."""
        raise NotImplementedError

    def _shape(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def _sample(self, rng: random.Random):
        """(items, their depths, indices of the items the answer depends on, question,
        answer)."""
        raise NotImplementedError


@dataclass(frozen=True)
class MultiKey(Task):
    """One key asked for among ``keys`` needles (see the module docstring)."""

    name: ClassVar[str] = "multikey"
    _may_be_zero: ClassVar[tuple[str, ...]] = ("near_misses",)
    keys: int = 32
    near_misses: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.near_misses > min(self.keys - 1, 25 * self.key_len):
            raise ValueError(
                f"MultiKey.near_misses must be <= keys - 1 = {self.keys - 1} and <= 25 * "
                f"key_len = {25 * self.key_len}, got {self.near_misses}"
            )

    def _items_len(self) -> int:
        return self.keys * self._needle_len() + 2 + self.key_len + self.value_len

    def _distinct(self) -> tuple[int, int]:
        return self.keys, self.keys

    def chance(self) -> float:
        return 1 / self.keys

    def _sample(self, rng):
        taken: set = set()
        (key,) = _words(rng, 1, self.key_len, _LETTERS, taken)
        others = _near_misses(rng, key, self.near_misses, taken)
        others += _words(rng, self.keys - 1 - self.near_misses, self.key_len, _LETTERS, taken)
        values = _words(rng, self.keys, self.value_len, _DIGITS, set())
        items = [_ids(KEY, k, VALUE, v) for k, v in zip([key, *others], values)]
        depths = [rng.random() for _ in items]
        return items, depths, [0], _ids(KEY, key, VALUE), _ids(values[0])


@dataclass(frozen=True)
class MultiValue(Task):
    """Every value of one key, in order (see the module docstring)."""

    name: ClassVar[str] = "multivalue"
    _may_be_zero: ClassVar[tuple[str, ...]] = ("distractors",)
    values: int = 4
    distractors: int = 4

    def _items_len(self) -> int:
        answer = self.values * self.value_len + self.values - 1
        return (self.values + self.distractors) * self._needle_len() + 2 + self.key_len + answer

    def _distinct(self) -> tuple[int, int]:
        return 1 + self.distractors, self.values + self.distractors

    def _sample(self, rng):
        taken: set = set()
        key, *others = _words(rng, 1 + self.distractors, self.key_len, _LETTERS, taken)
        values = _words(rng, self.values + self.distractors, self.value_len, _DIGITS, set())
        keys = [key] * self.values + others
        items = [_ids(KEY, k, VALUE, v) for k, v in zip(keys, values)]
        # The key's values at sorted depths, in index order: _context plants items of one place
        # in index order, so they appear in index order and the answer lists them so.
        depths = sorted(rng.random() for _ in range(self.values))
        depths += [rng.random() for _ in others]
        parts: list[int | bytes] = [values[0]]
        for v in values[1 : self.values]:
            parts += [VALUE, v]
        return items, depths, list(range(self.values)), _ids(KEY, key, VALUE), _ids(*parts)


@dataclass(frozen=True)
class VariableTracking(Task):
    """The value at the end of one chain of assignments (see the module docstring)."""

    name: ClassVar[str] = "vartrack"
    chains: int = 4
    hops: int = 4

    def _items_len(self) -> int:
        chain = self._needle_len() + (self.hops - 1) * (2 + 2 * self.key_len)
        return self.chains * chain + 2 + self.key_len + self.value_len

    def _distinct(self) -> tuple[int, int]:
        return self.chains * self.hops, self.chains

    def chance(self) -> float:
        return 1 / self.chains

    def _sample(self, rng):
        names = _words(rng, self.chains * self.hops, self.key_len, _LETTERS, set())
        values = _words(rng, self.chains, self.value_len, _DIGITS, set())
        items, depths = [], []
        for c in range(self.chains):
            chain = names[c * self.hops : (c + 1) * self.hops]
            items.append(_ids(KEY, chain[0], VALUE, values[c]))
            items += [_ids(KEY, x, VALUE, prev) for prev, x in zip(chain, chain[1:])]
            # Sorted depths with the chain's items in index order: each variable is assigned
            # before it is read, as in a program.
            depths += sorted(rng.random() for _ in chain)
        target = rng.randrange(self.chains)
        evidence = list(range(target * self.hops, (target + 1) * self.hops))
        last = names[(target + 1) * self.hops - 1]
        return items, depths, evidence, _ids(KEY, last, VALUE), _ids(values[target])


@dataclass(frozen=True)
class Aggregation(Task):
    """The most frequent of several keys (see the module docstring)."""

    name: ClassVar[str] = "aggregate"
    keys: int = 8
    top: int = 8
    runner_up: int = 6

    def __post_init__(self):
        super().__post_init__()
        if self.runner_up >= self.top:
            raise ValueError(
                f"Aggregation.runner_up must be < top = {self.top}, got {self.runner_up}"
            )

    def _mentions(self) -> int:
        return self.top + (self.keys - 1) * self.runner_up

    def _items_len(self) -> int:
        return self._mentions() * (1 + self.key_len) + 2 + self.key_len

    def _distinct(self) -> tuple[int, int]:
        return self.keys, 0

    def chance(self) -> float:
        return 1 / self.keys

    def _sample(self, rng):
        words = _words(rng, self.keys, self.key_len, _LETTERS, set())
        mentions = [words[0]] * self.top + [w for w in words[1:] for _ in range(self.runner_up)]
        items = [_ids(KEY, w) for w in mentions]
        depths = [rng.random() for _ in items]
        return items, depths, list(range(self.top)), _ids(VALUE, KEY), _ids(words[0])


TASKS: dict[str, Task] = {
    t.name: t for t in (MultiKey(), MultiValue(), VariableTracking(), Aggregation())
}
POSITIONS = "positions"
TASK_NAMES = (*TASKS, POSITIONS)


def task_samples(
    corpus: SourceCorpus, task: Task, length: int, count: int, seed: int
) -> list[TaskSample]:
    """``count`` deterministic samples of ``task``, each ``length`` tokens.

    Sample ``i`` takes the filler of the needle grid's sample ``i`` (text of ``corpus``, normally
    the validation split, from a stream shuffled by ``seed`` and ``i``) and draws its keys,
    values and depths from a generator seeded by the task's name, ``seed`` and ``i``. Raises
    ``ValueError`` naming the length needed when ``length`` is below ``task.min_length()``.

    Example::

        samples = task_samples(SourceCorpus(split="val"), MultiKey(), 32768, 100, seed=0)
        result = task_accuracy(model, samples, device="cuda", autocast_dtype=torch.bfloat16)
    """
    if not isinstance(task, Task):
        raise TypeError(f"task must be one of the tasks of {__name__}, got {type(task).__name__}")
    task.check_length(length)
    _check_int("count", count, 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    out = []
    for i in range(count):
        # The seeds of evaluate.needle_samples' filler, so sample i reads the same text there.
        filler = needle_filler(corpus, length, seed=seed * 1_000_003 + i)
        out.append(task.sample(filler, length, random.Random(f"{task.name}/{seed}/{i}")))
    return out


def task_accuracy(
    model,
    samples: Sequence[NeedleSample],
    *,
    device: str | torch.device,
    autocast_dtype: torch.dtype | None = None,
    batch_size: int = 8,
    level: float = LEVEL,
) -> dict:
    """:func:`~s2attn.training.scoring.needle_accuracy` of ``samples``, with its count and
    Wilson score interval: ``{"n", "correct", "accuracy", "ci": [low, high]}``."""
    accuracy = scoring.needle_accuracy(
        model, samples, device=device, autocast_dtype=autocast_dtype, batch_size=batch_size
    )
    correct = round(accuracy * len(samples))
    return {
        "n": len(samples),
        "correct": correct,
        "accuracy": accuracy,
        "ci": list(wilson_interval(correct, len(samples), level)),
    }


# ---------------------------------------------------------------------------- the command
def _task_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in TASK_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated tasks of {','.join(TASK_NAMES)}, got {text!r}"
        )
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``s2attn eval`` for these evaluations."""
    parser.add_argument(
        "--tasks",
        type=_task_list,
        default=[],
        help="comma-separated long-context evaluations at each of --lengths: "
        f"{','.join(TASK_NAMES)} (see docs/training.md)",
    )
    parser.add_argument(
        "--task-samples",
        type=int,
        default=100,
        help="samples per task and length (for positions: documents, as many as there are)",
    )


@dataclass(frozen=True)
class TaskPlan:
    """The evaluations ``s2attn eval --tasks`` runs, checked: ``tasks`` at every one of
    ``lengths``, ``samples`` samples (or documents) each."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int

    def run(
        self,
        model,
        corpus: SourceCorpus,
        *,
        seed: int,
        device: str,
        autocast_dtype: torch.dtype | None,
        batch_size: int,
        progress: bool,
    ) -> dict:
        """Evaluate, print the tables and return ``{"tasks": {...}}`` for the eval's JSON (empty
        when there is nothing to run)."""
        if not self.tasks:
            return {}
        from tqdm.auto import tqdm

        result: dict = {
            "level": LEVEL,
            "accuracy_interval": "Wilson score",
            "bpb_interval": f"percentile bootstrap over sequences ({RESAMPLES} resamples)",
            "seed": seed,
        }
        cells = [(t, n) for t in self.tasks for n in self.lengths]
        with tqdm(total=len(cells), desc="tasks", unit="cell", disable=not progress) as bar:
            for name, n in cells:
                bar.set_postfix(task=name, length=n)
                if name == POSITIONS:
                    cell = self._positions(
                        model, corpus, n, seed, device, autocast_dtype, batch_size
                    )
                else:
                    task = TASKS[name]
                    samples = task_samples(corpus, task, n, self.samples, seed)
                    cell = task_accuracy(
                        model,
                        samples,
                        device=device,
                        autocast_dtype=autocast_dtype,
                        batch_size=batch_size,
                    )
                    cell["chance"] = task.chance()
                    result.setdefault(name, {"shape": task.describe()})
                result.setdefault(name, {})[str(n)] = cell
                bar.update()
        _print_tables(result)
        return {"tasks": result}

    def _positions(self, model, corpus, n, seed, device, autocast_dtype, batch_size) -> dict:
        sequences = long_documents(corpus, n, self.samples, seed)
        edges = position_edges(n)
        per_sequence = position_bpb(
            model,
            sequences,
            edges,
            device=device,
            autocast_dtype=autocast_dtype,
            batch_size=batch_size,
        )
        low, high = bootstrap_interval(per_sequence, seed=seed)
        return {
            "n": per_sequence.shape[0],
            "buckets": [
                {"start": a, "end": b, "bpb": float(m), "ci": [float(lo), float(hi)]}
                for a, b, m, lo, hi in zip(edges, edges[1:], per_sequence.mean(0), low, high)
            ],
            "per_sequence": per_sequence.tolist(),
        }


def plan(
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: int,
    *,
    limit: int,
    roots,
    val_fraction: float,
) -> TaskPlan:
    """Check ``s2attn eval``'s task options before any model or data is loaded: every task fits
    every length (refused with the length it needs), no length passes the model's context
    ``limit``, and for ``positions`` the validation split (``roots``, ``val_fraction``) holds
    documents of every length."""
    _check_int("--task-samples", samples, 1)
    tasks = tuple(tasks)
    for t in tasks:
        if t not in TASK_NAMES:
            raise ValueError(f"--tasks: {t!r} is none of {', '.join(TASK_NAMES)}")
    if not tasks:
        return TaskPlan((), tuple(lengths), samples)
    for n in lengths:
        if n > limit:
            raise ValueError(
                f"--lengths: {n} exceeds the model's context limit of {limit} tokens (its S2 "
                "patterns' / position table's length; train with a larger --max-seq-len)"
            )
        for t in tasks:
            if t in TASKS:
                TASKS[t].check_length(n, "--lengths")
            else:
                _check_int("--lengths entries", n, 1)
    if POSITIONS in tasks:
        corpus = SourceCorpus(roots, split="val", val_fraction=val_fraction)
        for n in lengths:
            found = sum(size >= n for size in corpus.sizes)
            if found < MIN_SEQUENCES:
                raise ValueError(f"--tasks positions: {too_few_documents(corpus, n, found)}")
    return TaskPlan(tasks, tuple(lengths), samples)


def _print_tables(result: dict) -> None:
    level = f"{100 * result['level']:g}%"
    rows = [
        (t, n, c) for t, by in result.items() if t in TASKS for n, c in by.items() if n != "shape"
    ]
    if rows:
        print(
            f"long-context tasks: exact answers of n samples, {level} Wilson score interval; "
            "chance: a uniform guess among the context's candidates"
        )
        print(
            f"{'task':<11} {'length':>7} {'n':>5} {'accuracy':>9} {level + ' CI':>16} {'chance':>7}"
        )
        for t, n, c in rows:
            chance = "-" if c["chance"] is None else f"{c['chance']:.3f}"
            ci = f"[{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]"
            print(
                f"{t:<11} {scoring._length_label(int(n)):>7} {c['n']:>5} "
                f"{c['accuracy']:>9.3f} {ci:>16} {chance:>7}"
            )
    if POSITIONS in result:
        print(
            "bits per byte by target position over n documents from their start, "
            f"{level} percentile bootstrap interval over documents"
        )
        print(f"{'length':>7} {'n':>5} {'positions':>15} {'bpb':>8} {level + ' CI':>18}")
        for n, c in result[POSITIONS].items():
            for b in c["buckets"]:
                where = f"[{_label(b['start'])}, {_label(b['end'])})"
                ci = f"[{b['ci'][0]:.4f}, {b['ci'][1]:.4f}]"
                print(
                    f"{scoring._length_label(int(n)):>7} {c['n']:>5} {where:>15} "
                    f"{b['bpb']:>8.4f} {ci:>18}"
                )


def _label(position: int) -> str:
    return scoring._length_label(position) if position else "0"
