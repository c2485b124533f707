"""Retrieval samples: needles ``KEY key VALUE value`` planted at chosen depths in filler text,
each asked for again at the end (``KEY key VALUE``, the value as the answer). Training mixes
samples of several needles into its stream (:func:`make_multi_needle_sample`); evaluation asks
for one (:func:`make_needle_sample`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .vocab import BOS, KEY, VALUE

__all__ = [
    "MultiNeedleSample",
    "NeedleSample",
    "make_multi_needle_sample",
    "make_needle_sample",
    "needle_overhead",
    "plant",
]

_KEY_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
_VALUE_ALPHABET = b"0123456789"


@dataclass
class MultiNeedleSample:
    """A retrieval sample with several needles; needle ``i`` is asked for in question ``i``'s slot
    of the question order, but every list here is indexed by needle.

    Attributes:
        tokens: ``(length,)`` int64: context (filler with needles), then the questions.
        needle_starts: where each needle (its ``KEY`` token) begins in ``tokens``.
        answer_starts: ``tokens[answer_starts[i] : answer_starts[i] + answer_len]`` is needle
            ``i``'s value, in its question at the end.
        answer_len: the value length.
        keys, values: each needle's key (lowercase letters) and value (digits), as bytes.
    """

    tokens: torch.Tensor
    needle_starts: list[int]
    answer_starts: list[int]
    answer_len: int
    keys: list[bytes]
    values: list[bytes]


@dataclass
class NeedleSample:
    """A single-needle retrieval sample (the evaluation form).

    Attributes:
        tokens: ``(length,)`` int64: filler with the needle planted, then the question and answer.
        answer_start: ``tokens[answer_start : answer_start + answer_len]`` is the value;
            predicting it needs the needle. The answer is the last ``answer_len`` tokens.
        answer_len: the value length.
        needle_start: where the needle (its ``KEY`` token) begins.
    """

    tokens: torch.Tensor
    answer_start: int
    answer_len: int
    needle_start: int


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def needle_overhead(num_needles: int, key_len: int, value_len: int) -> int:
    """Tokens a retrieval sample adds to its filler: the leading ``BOS`` and ``num_needles``
    needles and their questions (each ``KEY k VALUE v``)."""
    return 1 + 2 * num_needles * (2 + key_len + value_len)


def make_multi_needle_sample(
    filler: Sequence[int] | torch.Tensor | np.ndarray,
    length: int,
    depths: Sequence[float],
    rng: random.Random,
    key_len: int = 4,
    value_len: int = 6,
) -> MultiNeedleSample:
    """Plant one needle per entry of ``depths`` in ``filler`` and ask for them all at the end.

    Layout: ``BOS``, the first ``length - needle_overhead(...)`` filler tokens with each needle
    ``[KEY] key [VALUE] value`` inserted before filler position ``round(depth * filler_len)``
    (depth 0: the start of the context, right after the ``BOS``; 1: right before the questions),
    then one question
    ``[KEY] key [VALUE] value`` per needle, in an order shuffled by ``rng``. Keys are distinct
    random lowercase letters and values random digits; ``KEY``/``VALUE`` never occur in the
    filler, so each key is found only at its needle and its question.

    Args:
        filler: ``(n,)`` token ids in ``[0, KEY)``, at least the filler length long.
        length: the exact length of ``tokens``.
        depths: one number in ``[0, 1]`` per needle.
        rng: the source of keys, values and question order.
        key_len, value_len: tokens per key and per value.

    Raises ``ValueError`` when ``length`` cannot hold the needles and questions, for a depth
    outside ``[0, 1]``, and for too little or invalid filler.
    """
    depths = _checked_depths(length, depths, rng, key_len, value_len)
    n = len(depths)
    filler_len = length - needle_overhead(n, key_len, value_len)
    keys: list[bytes] = []
    while len(keys) < n:
        key = bytes(rng.choice(_KEY_ALPHABET) for _ in range(key_len))
        if key not in keys:
            keys.append(key)
    values = [bytes(rng.choice(_VALUE_ALPHABET) for _ in range(value_len)) for _ in range(n)]
    needles = [torch.tensor([KEY, *k, VALUE, *v], dtype=torch.int64) for k, v in zip(keys, values)]
    needle_len = 2 + key_len + value_len

    # The sample is a document of its own, so it starts as documents do. Without the BOS a needle
    # at depth 0 would sit on position 0, which every query attends to as its "sink" (position 0
    # sees only itself); models trained that way, dense ones included, rarely retrieve from it.
    context, needle_starts = plant(filler, filler_len, needles, depths)
    pieces = [context]
    questions = list(range(n))
    rng.shuffle(questions)
    context_len = 1 + filler_len + n * needle_len
    answer_starts = [0] * n
    for slot, i in enumerate(questions):
        pieces.append(needles[i])
        answer_starts[i] = context_len + slot * needle_len + 2 + key_len
    tokens = torch.cat(pieces)
    return MultiNeedleSample(tokens, needle_starts, answer_starts, value_len, keys, values)


def _checked_depths(
    length: int, depths: Sequence[float], rng, key_len: int, value_len: int
) -> list[float]:
    """The depths as a list, once the arguments of :func:`make_multi_needle_sample` but the
    filler (which :func:`plant` checks) are."""
    _check_positive_int("key_len", key_len)
    _check_positive_int("value_len", value_len)
    if not isinstance(rng, random.Random):
        raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
    depths = list(depths)
    if not depths:
        raise ValueError("depths must hold at least one depth, got an empty sequence")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
            raise ValueError(f"depth must be a number in [0, 1], got {d!r}")
    n = len(depths)
    if n > len(_KEY_ALPHABET) ** key_len:
        raise ValueError(f"key_len={key_len} allows fewer than {n} distinct keys")
    overhead = needle_overhead(n, key_len, value_len)
    if isinstance(length, bool) or not isinstance(length, int) or length < overhead:
        raise ValueError(
            f"length must be an int >= {overhead} ({n} needle(s) and question(s) with "
            f"key_len={key_len}, value_len={value_len}), got {length!r}"
        )
    return depths


def plant(
    filler: torch.Tensor, filler_len: int, items: list[torch.Tensor], depths: list[float]
) -> tuple[torch.Tensor, list[int]]:
    """``BOS``, then the first ``filler_len`` filler tokens with item ``i`` inserted before filler
    token ``round(depths[i] * filler_len)`` (items at one place keep their index order); and
    where each item begins. Raises ``ValueError`` for too little filler, or filler holding
    ``KEY``/``VALUE`` tokens."""
    filler = torch.as_tensor(filler).reshape(-1)
    if filler.numel() < filler_len:
        raise ValueError(f"filler must hold at least {filler_len} tokens, got {filler.numel()}")
    filler = filler[:filler_len].to(torch.int64)
    if filler_len and (int(filler.min()) < 0 or int(filler.max()) >= KEY):
        raise ValueError(f"filler must hold token ids in [0, {KEY}) (no KEY/VALUE tokens)")
    cuts = [round(d * filler_len) for d in depths]
    pieces = [torch.tensor([BOS], dtype=torch.int64)]
    starts = [0] * len(items)
    prev, at = 0, 1
    for i in sorted(range(len(items)), key=cuts.__getitem__):
        pieces.append(filler[prev : cuts[i]])
        at += cuts[i] - prev
        starts[i] = at
        pieces.append(items[i])
        at += len(items[i])
        prev = cuts[i]
    pieces.append(filler[prev:])
    return torch.cat(pieces), starts


def make_needle_sample(
    filler: Sequence[int] | torch.Tensor | np.ndarray,
    length: int,
    depth: float,
    rng: random.Random,
    key_len: int = 4,
    value_len: int = 6,
) -> NeedleSample:
    """One needle ``[KEY] key [VALUE] value`` planted at ``depth`` in ``filler``, then the question
    ``[KEY] key [VALUE]`` and the answer (``value``) as the last ``value_len`` tokens.

    Args:
        filler: ``(n,)`` token ids in ``[0, KEY)``; the first ``length - 1 - 2 * (2 + key_len +
            value_len)`` are used.
        length: the exact length of the sample.
        depth: in ``[0, 1]``; 0 puts the needle at the start of the context (right after the
            sample's ``BOS``), 1 right before the question; in between it goes before filler
            token ``round(depth * filler_len)``.
        rng: the source of the key and value.

    Returns a :class:`NeedleSample` with ``tokens`` of shape ``(length,)``. Raises ``ValueError``
    when ``length`` is too short to hold the needle, question and answer, or ``depth`` is outside
    ``[0, 1]``.

    Example::

        filler = needle_filler(SourceCorpus(split="val"), 4096, seed=0)
        s = make_needle_sample(filler, 4096, 0.5, random.Random(0))
        prompt, answer = s.tokens[: s.answer_start], s.tokens[s.answer_start :]
    """
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    s = make_multi_needle_sample(filler, length, [depth], rng, key_len, value_len)
    return NeedleSample(s.tokens, s.answer_starts[0], s.answer_len, s.needle_starts[0])
