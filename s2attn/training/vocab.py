"""The byte-level vocabulary: bytes are tokens 0-255, and four specials follow (``BOS`` starts
every document, ``PAD`` pads, ``KEY`` and ``VALUE`` mark the retrieval samples' needles); with
:func:`encode` and :func:`decode` between text and token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BOS", "KEY", "NUM_BYTES", "PAD", "VALUE", "VOCAB_SIZE", "decode", "encode"]

NUM_BYTES = 256
BOS = 256  # starts every document, so it also separates concatenated documents
PAD = 257  # never produced by the stream; free for padding
KEY = 258  # needle: KEY k1..kn VALUE v1..vm; the question repeats it with the answer last
VALUE = 259
VOCAB_SIZE = 260

_SPECIAL_NAMES = {BOS: "<BOS>", PAD: "<PAD>", KEY: "<KEY>", VALUE: "<VALUE>"}


def encode(text: str | bytes) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes (no BOS is added)."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    if not isinstance(text, (bytes, bytearray)):
        raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
    return list(text)


def decode(ids: Sequence[int] | torch.Tensor | np.ndarray) -> str:
    """Text of token ids: byte runs decoded as UTF-8 (invalid bytes replaced), specials as
    ``<BOS>``, ``<PAD>``, ``<KEY>``, ``<VALUE>``."""
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, np.ndarray):
        ids = ids.reshape(-1).tolist()
    parts: list[str] = []
    run = bytearray()
    for t in ids:
        t = int(t)
        if 0 <= t < NUM_BYTES:
            run.append(t)
            continue
        if t not in _SPECIAL_NAMES:
            raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got {t}")
        parts.append(run.decode("utf-8", errors="replace"))
        run.clear()
        parts.append(_SPECIAL_NAMES[t])
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)
