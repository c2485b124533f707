"""What scoring a language model takes, shared by :mod:`s2attn.training.evaluate` (validation bits
per byte, the needle grid, ``s2attn eval``) and :mod:`s2attn.training.tasks` (the long-context
tasks): eval mode under optional autocast, logits or greedy predictions at most ``_LOGIT_ROWS``
positions at a time, and the exact-answer accuracy of retrieval samples
(:func:`needle_accuracy`). A module of its own so that the tasks and the command that runs them
import it, not each other."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from .needles import NeedleSample

__all__ = ["needle_accuracy"]

# Positions whose logits exist at once: (8192, vocab) float32 is a few MiB for bytes, while a
# (batch, 128k, vocab) float32 tensor would be GiBs for a larger vocabulary.
_LOGIT_ROWS = 8192


@contextlib.contextmanager
def _evaluating(model, device, autocast_dtype: torch.dtype | None):
    """Eval mode, no autograd and optional autocast for the block; the model's training flag
    is restored afterwards, so training can call these functions between steps."""
    was_training = getattr(model, "training", None)
    if was_training is not None:
        model.eval()
    device_type = torch.device(device).type
    try:
        with (
            torch.no_grad(),
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
        ):
            yield
    finally:
        if was_training:
            model.train()


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    # A transformers model would otherwise build a KV cache that nothing reads.
    if isinstance(model, PreTrainedModel):
        return model(input_ids, use_cache=False).logits
    return model(input_ids).logits


def _decoder_and_head(model):
    """(decoder, output head) of a transformers causal LM whose logits are the head applied to
    the decoder's last hidden state (Llama and its kin); None for anything else."""
    if not isinstance(model, PreTrainedModel):
        return None
    decoder, head = model.base_model, model.get_output_embeddings()
    if decoder is model or not isinstance(head, torch.nn.Linear):
        return None
    if getattr(model.config, "final_logit_softcapping", None):
        return None
    return decoder, head


def _hidden(decoder, input_ids: torch.Tensor) -> torch.Tensor:
    return decoder(input_ids=input_ids, use_cache=False).last_hidden_state


def _sum_cross_entropy(model, batch: torch.Tensor) -> float:
    """Summed next-token cross-entropy (nats) of ``batch`` (``(b, n + 1)`` ids), in float32, with
    at most ``_LOGIT_ROWS`` positions' logits at a time where the model allows it."""
    inputs, targets = batch[:, :-1], batch[:, 1:].flatten()
    split = _decoder_and_head(model)
    if split is None:
        logits = _logits(model, inputs)
        # The loss in float32 whatever the model computes in: bf16 logits would round it.
        return F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="sum").item()
    decoder, head = split
    hidden = _hidden(decoder, inputs).flatten(0, 1)
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for first in range(0, hidden.shape[0], _LOGIT_ROWS):
        rows = slice(first, first + _LOGIT_ROWS)
        total += F.cross_entropy(head(hidden[rows]).float(), targets[rows], reduction="sum")
    return total.item()


def _predictions(model, tokens: torch.Tensor, positions: list[slice]) -> list[torch.Tensor]:
    """Greedy next-token predictions of ``model`` reading ``tokens`` (``(b, n)``): for row ``r``
    the argmax at ``positions[r]``."""
    split = _decoder_and_head(model)
    if split is None:
        predicted = _logits(model, tokens).argmax(dim=-1)
        return [predicted[r, where] for r, where in enumerate(positions)]
    decoder, head = split
    hidden = _hidden(decoder, tokens)
    return [head(hidden[r, where]).argmax(dim=-1) for r, where in enumerate(positions)]


def _check_batch(batch: object, what: str) -> None:
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.shape[1] < 2:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(
            f"{what} must be a (batch, seq_len + 1) tensor with seq_len >= 1, got {shape}"
        )
    if batch.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} must hold int64 token ids, got {batch.dtype}")


def needle_accuracy(
    model,
    samples: Sequence[NeedleSample],
    *,
    device: str | torch.device,
    autocast_dtype: torch.dtype | None = None,
    batch_size: int = 8,
) -> float:
    """The fraction of ``samples`` whose whole answer ``model`` predicts exactly.

    The model reads each sample but its last token (``(batch, length - 1)`` ids, one forward
    pass per batch); answer token ``t`` counts as predicted when the argmax of the logits at
    position ``t - 1`` is that token. Since every earlier answer token must be right too, this
    equals greedy generation of the answer after the question.

    Args:
        model: as for :func:`validation_bpb`, already on ``device``.
        samples: :class:`~s2attn.training.needles.NeedleSample` s; samples of equal length share a
            batch, so any mix of lengths works.
        device, autocast_dtype: as for :func:`validation_bpb`.
        batch_size: samples per forward pass.

    Returns a number in ``[0, 1]``.
    """
    if len(samples) == 0:
        raise ValueError("samples must hold at least one NeedleSample, got none")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for i, s in enumerate(samples):
        if not isinstance(s, NeedleSample):
            raise ValueError(f"samples[{i}] must be a NeedleSample, got {type(s).__name__}")
        if not 1 <= s.answer_start <= s.answer_start + s.answer_len <= len(s.tokens):
            raise ValueError(
                f"samples[{i}]: answer [{s.answer_start}, "
                f"{s.answer_start + s.answer_len}) lies outside its "
                f"{len(s.tokens)} tokens or at position 0"
            )
    by_length: dict[int, list[NeedleSample]] = {}
    for s in samples:
        by_length.setdefault(len(s.tokens), []).append(s)
    correct = 0
    with _evaluating(model, device, autocast_dtype):
        for group in by_length.values():
            for first in range(0, len(group), batch_size):
                chunk = group[first : first + batch_size]
                tokens = torch.stack([s.tokens for s in chunk]).to(device=device, dtype=torch.int64)
                guesses = [
                    slice(s.answer_start - 1, s.answer_start + s.answer_len - 1) for s in chunk
                ]
                predicted = _predictions(model, tokens[:, :-1], guesses)
                for row, s in enumerate(chunk):
                    answer = slice(s.answer_start, s.answer_start + s.answer_len)
                    correct += bool(torch.equal(predicted[row], tokens[row, answer]))
    return correct / len(samples)


def _length_label(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)
