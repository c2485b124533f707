"""Bits per byte by position in natural text: :func:`position_bpb` is the bits per byte of each
sequence in buckets of target position (:func:`position_edges`: the first 1k bytes predicted,
then doubling ranges up to the length), over windows that begin at the start of long validation
documents (:func:`long_documents`): far context there is the same file, so a model that ignores
it predicts the late buckets no better than the early ones. Logits are made for at most
``scoring._LOGIT_ROWS`` positions at a time, as for
:func:`~s2attn.training.evaluate.validation_bpb`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import scoring
from .data import SourceCorpus
from .intervals import MIN_SEQUENCES, _check_int
from .vocab import BOS

__all__ = ["long_documents", "position_bpb", "position_edges"]


# The last bucket holds at most this many positions: the far end a model that ignores far
# context shows itself in (the first 1k positions against the last 16k).
LAST_BUCKET = 16384


def position_edges(length: int) -> list[int]:
    """Bucket boundaries for :func:`position_bpb` at ``length`` target positions: ``[0, first,
    2 first, 4 first, ..., length]`` with ``first`` 1024, or the largest power of two within an
    eighth of a shorter length, and an edge ``LAST_BUCKET`` before the end where the doublings
    leave a longer last bucket. At 131072: 0, 1k, 2k, ..., 64k, 112k, 128k (9 buckets)."""
    _check_int("length", length, 1)
    first = min(1024, 2 ** max(0, math.floor(math.log2(max(1, length // 8)))))
    edges = [0]
    while first < length:
        edges.append(first)
        first *= 2
    if length - LAST_BUCKET > edges[-1]:
        edges.append(length - LAST_BUCKET)
    return [*edges, length]


def long_documents(corpus: SourceCorpus, length: int, count: int, seed: int) -> torch.Tensor:
    """``(k, length + 1)`` int64: ``BOS`` and the first ``length`` bytes of up to ``count``
    documents of ``corpus`` that hold at least ``length`` bytes, picked in an order shuffled by
    ``seed``; ``k`` is ``count`` or every such document there is. Raises ``ValueError`` when fewer
    than two are readable."""
    _check_int("length", length, 1)
    _check_int("count", count, 1)
    eligible = [i for i, size in enumerate(corpus.sizes) if size >= length]
    random.Random(f"long-documents/{seed}").shuffle(eligible)
    rows = []
    for i in eligible:
        try:
            with open(corpus.path(i), "rb") as f:
                data = f.read(length)
        except OSError:
            continue
        if len(data) < length:  # shrunk since the corpus was listed
            continue
        row = torch.empty(length + 1, dtype=torch.int64)
        row[0] = BOS
        row[1:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows.append(row)
        if len(rows) == count:
            break
    if len(rows) < MIN_SEQUENCES:
        raise ValueError(too_few_documents(corpus, length, len(rows)))
    return torch.stack(rows)


def too_few_documents(corpus: SourceCorpus, length: int, found: int) -> str:
    return (
        f"bits per byte by position at length {length} needs at least {MIN_SEQUENCES} "
        f"validation documents of {length} bytes or more, and {corpus!r} has {found} (the longest "
        f"holds {max(corpus.sizes)} bytes): lower the length or add --data-root"
    )


def _token_cross_entropy(model, batch: torch.Tensor) -> torch.Tensor:
    """``(b, n)`` float64 next-token cross-entropy (nats) of ``batch`` (``(b, n + 1)`` ids), each
    computed in float32, with at most ``_LOGIT_ROWS`` positions' logits at a time where the model
    allows it (see :func:`~s2attn.training.evaluate.validation_bpb`)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    split = scoring._decoder_and_head(model)
    if split is None:
        logits = scoring._logits(model, inputs).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return loss.double().view(targets.shape)
    decoder, head = split
    hidden = scoring._hidden(decoder, inputs).flatten(0, 1)
    flat = targets.flatten()
    loss = torch.empty(flat.shape, dtype=torch.float64, device=hidden.device)
    rows = scoring._LOGIT_ROWS
    for first in range(0, hidden.shape[0], rows):
        part = slice(first, first + rows)
        loss[part] = F.cross_entropy(head(hidden[part]).float(), flat[part], reduction="none")
    return loss.view(targets.shape)


def position_bpb(
    model,
    sequences: torch.Tensor,
    edges: Sequence[int],
    *,
    device: str | torch.device,
    autocast_dtype: torch.dtype | None = None,
    batch_size: int = 1,
) -> torch.Tensor:
    """Bits per byte of each sequence in each bucket of target positions.

    Args:
        model: as for :func:`~s2attn.training.evaluate.validation_bpb`, already on ``device``.
        sequences: ``(count, n + 1)`` int64 ids; the model reads ``x[:, :-1]`` and predicts
            ``x[:, 1:]``, whose entry ``t`` (its target position) follows ``t + 1`` tokens.
        edges: increasing ints from 0 to ``n``: bucket ``b`` holds target positions
            ``[edges[b], edges[b + 1])`` (:func:`position_edges` gives the default).
        device, autocast_dtype: as for :func:`~s2attn.training.evaluate.validation_bpb`.
        batch_size: sequences per forward pass.

    Returns ``(count, len(edges) - 1)`` float64 CPU: the mean cross-entropy in bits of each
    sequence's targets in each bucket.
    """
    scoring._check_batch(sequences, "sequences")
    n = sequences.shape[1] - 1
    edges = list(edges)
    if (
        len(edges) < 2
        or edges[0] != 0
        or edges[-1] != n
        or any(not isinstance(e, int) or a >= e for a, e in zip(edges, edges[1:]))
    ):
        raise ValueError(f"edges must be increasing ints from 0 to {n} (the targets), got {edges}")
    _check_int("batch_size", batch_size, 1)
    out = []
    with scoring._evaluating(model, device, autocast_dtype):
        for first in range(0, sequences.shape[0], batch_size):
            batch = sequences[first : first + batch_size].to(device=device, dtype=torch.int64)
            loss = _token_cross_entropy(model, batch).cpu()
            out.append(torch.stack([loss[:, a:b].mean(1) for a, b in zip(edges, edges[1:])], 1))
    return torch.cat(out) / math.log(2)
