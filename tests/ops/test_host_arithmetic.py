"""The host's stand-ins for Triton's constexpr arithmetic (``s2attn/ops/triton/common.py``), which
launches compute on every call: they must agree with Triton's wherever the launches use them."""

from __future__ import annotations

import random

import triton

from s2attn.ops.triton.common import cdiv, next_power_of_2


def _values() -> list[int]:
    rng = random.Random(0)
    powers = [2**e + d for e in range(40) for d in (-1, 0, 1)]
    return sorted({n for n in [*range(1, 4100), *powers, *rng.sample(range(1, 2**40), 200)] if n})


def test_next_power_of_2_is_tritons():
    for n in _values():
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_is_tritons():
    for a in _values()[::7]:
        for b in (1, 2, 3, 4, 16, 63, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
