"""Bad input fails at the boundary with a TypeError or ValueError that names the argument; no kernel
runs in this file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DEVICE, DTYPES

import s2attn
from s2attn import BlockPattern, local_stride_pattern
from s2attn.input_checks import check_heads, check_int

DTYPE = DTYPES[0]
PATTERN = local_stride_pattern(4, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3)


def _t(*shape, dtype=DTYPE, device=DEVICE) -> torch.Tensor:
    return torch.randn(*shape).to(device, dtype)


def _qkv(batch=2, seq_q=64, seq_k=64, heads=4, kv_heads=4, dim=32):
    k, v = (_t(batch, seq_k, kv_heads, dim) for _ in range(2))
    return _t(batch, seq_q, heads, dim), k, v


def _packed(lens_q, lens_k, heads=4, kv_heads=4, dim=32):
    k, v = (_t(sum(lens_k), kv_heads, dim) for _ in range(2))
    return _t(sum(lens_q), heads, dim), k, v


def _cu(values, dtype=torch.int32, device=DEVICE) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _raises(error, match, *args, **kwargs):
    with pytest.raises(error, match=match):
        s2attn.sparse_attention(*args, **kwargs)


# ---------------------------------------------------------------------------- types and kinds
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("bad", [None, [[1.0]], np.zeros((2, 64, 4, 32), dtype=np.float32)])
def test_non_tensor_inputs(which, bad):
    args = list(_qkv())
    args[which] = bad
    _raises(TypeError, f"{'qkv'[which]} must be a torch.Tensor", *args, PATTERN)


def test_pattern_must_be_a_block_pattern():
    _raises(TypeError, "pattern", *_qkv(), PATTERN.mask)
    _raises(TypeError, "pattern", *_qkv(), None)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in _qkv())
    _raises(TypeError, "q has dtype", q, k, v, PATTERN)


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtypes_must_match(which):
    q, k, v = _qkv()
    other = torch.float32 if DTYPE != torch.float32 else torch.float16
    if which == "k":
        k = k.to(other)
    else:
        v = v.to(other)
    _raises(TypeError, f"{which} has dtype", q, k, v, PATTERN)


@pytest.mark.parametrize("which", ["k", "v"])
def test_devices_must_match(which):
    q, k, v = _qkv()
    if which == "k":
        k = k.to("meta")
    else:
        v = v.to("meta")
    _raises(ValueError, f"{which} is on meta", q, k, v, PATTERN)


# ------------------------------------------------------------------------------------ shapes
def test_batch_mismatch():
    q, k, v = _qkv()
    _raises(ValueError, "k has batch", q, k[:1], v[:1], PATTERN)
    _raises(ValueError, "k and v", q, k, v[:, :32], PATTERN)


def test_head_mismatch():
    q, k, v = _qkv(heads=4, kv_heads=3)
    _raises(ValueError, r"q heads \(4\) must be a multiple of k/v heads \(3\)", q, k, v, PATTERN)
    q, k, v = _qkv(heads=4, kv_heads=2)
    _raises(ValueError, "k and v", q, k, v[:, :, :1], PATTERN)


def test_head_dim_mismatch_and_range():
    q, k, v = _qkv()
    _raises(ValueError, "k/v head dim 16 differs from q's 32", q, k[..., :16], v[..., :16], PATTERN)
    _raises(ValueError, "k and v", q, k, v[..., :16], PATTERN)
    for dim in (8, 512):
        _raises(ValueError, "head dim", *_qkv(dim=dim), PATTERN)


def test_wrong_ranks():
    q, k, v = _qkv()
    _raises(ValueError, "q must be", q[None], k, v, PATTERN)
    _raises(ValueError, "q must be", q[0, 0], k, v, PATTERN)
    _raises(ValueError, "k has shape", q, k[0], v, PATTERN)
    _raises(ValueError, "v has shape", q, k, v[0], PATTERN)
    _raises(ValueError, "k has 4 dims", q[0], k, v, PATTERN, cu_seqlens_q=_cu([0, 64]))


def test_pattern_heads_must_match_q_or_kv_heads():
    match = r"pattern has 4 heads; expected the q heads \(8\) or the k/v heads \(2\)"
    _raises(ValueError, match, *_qkv(heads=8, kv_heads=2), PATTERN)


@pytest.mark.parametrize(
    "value", [np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3), torch.tensor(3).int()]
)
def test_check_int_takes_any_integral_type(value):
    got = check_int("num_pages", value)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize(
    "value", [True, np.True_, 3.0, "3", None, torch.tensor(3.0), torch.tensor([3, 3])]
)
def test_check_int_refuses_other_types_by_name(value):
    with pytest.raises(TypeError, match="num_pages must be an integer"):
        check_int("num_pages", value)


def test_check_int_refuses_values_below_the_minimum():
    with pytest.raises(ValueError, match="num_pages must be an integer >= 1, got 0"):
        check_int("num_pages", np.int64(0))


def _heads_error(q, k, pattern_heads) -> str:
    with pytest.raises(ValueError) as caught:
        check_heads(q, k, pattern_heads)
    return str(caught.value)


def test_heads_check_returns_query_heads_per_pattern_head():
    q, k, _ = _qkv(heads=8, kv_heads=2)
    assert check_heads(q, k, 8) == 1 and check_heads(q, k, 2) == 4
    q, k, _ = _packed([30, 34], [30, 34], heads=8, kv_heads=2)
    assert check_heads(q, k, 8) == 1 and check_heads(q, k, 2) == 4


@pytest.mark.parametrize(
    "heads, kv_heads, seq_q, seq_k, pattern_heads",
    [(4, 4, 64, 64, 4), (8, 2, 64, 64, 8), (8, 2, 64, 64, 2), (8, 2, 48, 64, 8)],
    ids=["mha", "gqa-q-heads", "gqa-kv-heads", "gqa-fewer-queries"],
)
def test_heads_in_dim_1_get_the_layout_and_the_transpose(
    heads, kv_heads, seq_q, seq_k, pattern_heads
):
    """q, k, v laid out (batch, heads, seq, dim) by SDPA habit: whichever check trips (the GQA
    ratio when seq_q and seq_k differ, the pattern's heads otherwise), the error names
    flash-attn's layout and the transpose that fixes it."""
    q, k, v = _qkv(heads=heads, kv_heads=kv_heads, seq_q=seq_q, seq_k=seq_k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    message = _heads_error(q, k, pattern_heads)
    assert "must be (batch, seq, heads, dim), flash-attn's layout" in message
    assert "pass q.transpose(1, 2), and k and v likewise" in message
    assert f"q has shape {tuple(q.shape)}" in message


def test_heads_mismatch_names_the_layout_without_a_wrong_transpose():
    q, k, _ = _qkv(heads=8, kv_heads=2)
    message = _heads_error(q, k, 4)  # neither layout's heads: no transpose would help
    assert message.startswith("pattern has 4 heads; expected the q heads (8) or the k/v heads (2)")
    assert "(batch, seq, heads, dim), flash-attn's layout" in message
    assert "transpose" not in message
    q, k, _ = _qkv(heads=6, kv_heads=4)
    assert "must be a multiple of k/v heads (4)" in _heads_error(q, k, 6)
    q, k, _ = _packed([30, 34], [30, 34], heads=8, kv_heads=2)  # packed: one layout only
    message = _heads_error(q, k, 4)
    assert "pattern has 4 heads" in message and "layout" not in message


def test_block_size_must_be_valid():
    with pytest.raises(ValueError, match="block_size"):
        BlockPattern(torch.ones(4, 8, 8, dtype=torch.bool), block_size=24)
    with pytest.raises(ValueError, match="block_size"):
        local_stride_pattern(4, max_seq_len=128, block_size=8, local_blocks=2, vert_stride=3)


def test_sequence_longer_than_the_pattern():
    _raises(ValueError, "max_seq_len 128", *_qkv(seq_q=129, seq_k=129), PATTERN)
    _raises(ValueError, "max_seq_len 128", *_qkv(seq_q=64, seq_k=200), PATTERN)
    cu = _cu([0, 64, 194])
    qkv = _packed([64, 130], [64, 130])
    _raises(ValueError, "max_seq_len", *qkv, PATTERN, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_more_queries_than_keys():
    _raises(ValueError, r"seq_q \(64\) must be <= seq_k \(32\)", *_qkv(seq_q=64, seq_k=32), PATTERN)
    qkv = _packed([10, 40], [20, 30])
    cu = dict(cu_seqlens_q=_cu([0, 10, 50]), cu_seqlens_k=_cu([0, 20, 50]))
    _raises(ValueError, r"sequence 1: seq_q \(40\) must be <= seq_k \(30\)", *qkv, PATTERN, **cu)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.1"])
def test_softmax_scale(scale):
    _raises(ValueError, "softmax_scale", *_qkv(), PATTERN, softmax_scale=scale)


# -------------------------------------------------------------------------------- cu_seqlens
VALID_CU = [0, 20, 50]


@pytest.mark.parametrize(
    "cu_q, cu_k, error, match",
    [
        (None, VALID_CU, ValueError, "cu_seqlens_q is required"),
        (VALID_CU, None, ValueError, "cu_seqlens_k is required"),
        (_cu(VALID_CU, torch.int64), VALID_CU, TypeError, "cu_seqlens_q must have dtype"),
        (VALID_CU, _cu(VALID_CU, torch.float32), TypeError, "cu_seqlens_k must have dtype"),
        (VALID_CU, [0, 30, 20, 50], ValueError, "cu_seqlens_k must be non-decreasing"),
        ([0, 20, 49], VALID_CU, ValueError, r"cu_seqlens_q\[-1\] = 49"),
        (VALID_CU, [0, 20, 60], ValueError, r"cu_seqlens_k\[-1\] = 60"),
        ([5, 20, 50], VALID_CU, ValueError, "cu_seqlens_q must start at 0"),
        ([50], VALID_CU, ValueError, "cu_seqlens_q must be 1-D"),
        (_cu([VALID_CU]), VALID_CU, ValueError, "cu_seqlens_q must be 1-D"),
        (VALID_CU, [0, 10, 20, 50], ValueError, "cu_seqlens_q has 2 sequences"),
        (_cu(VALID_CU, device="meta"), VALID_CU, ValueError, "cu_seqlens_q is on meta"),
    ],
)
def test_bad_cu_seqlens(cu_q, cu_k, error, match):
    q, k, v = _packed([20, 30], [20, 30])
    # Lists stand for int32 tensors on q's device.
    cu_q, cu_k = (_cu(cu) if isinstance(cu, list) else cu for cu in (cu_q, cu_k))
    _raises(error, match, q, k, v, PATTERN, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_cu_seqlens_must_be_a_tensor():
    qkv = _packed([20, 30], [20, 30])
    cu = dict(cu_seqlens_q=VALID_CU, cu_seqlens_k=_cu(VALID_CU))
    _raises(TypeError, "cu_seqlens_q must be a torch.Tensor", *qkv, PATTERN, **cu)


def test_cu_seqlens_only_for_packed_inputs():
    _raises(ValueError, "only for packed", *_qkv(), PATTERN, cu_seqlens_q=_cu([0, 64, 128]))


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_below_the_longest_sequence(name):
    qkv = _packed([20, 30], [20, 30])
    cu = dict(cu_seqlens_q=_cu(VALID_CU), cu_seqlens_k=_cu(VALID_CU))
    _raises(ValueError, f"{name}=29 is below", *qkv, PATTERN, **cu, **{name: 29})


# ------------------------------------------------------------------ packed qkv, module, merge
def test_qkvpacked_validation():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        s2attn.sparse_attention_qkvpacked([1.0], PATTERN)
    for shape in [(2, 64, 4, 4, 32), (2, 64, 3, 4), (2, 2, 64, 3, 4, 32)]:
        with pytest.raises(ValueError, match="qkv must be"):
            s2attn.sparse_attention_qkvpacked(_t(*shape), PATTERN)
    with pytest.raises(ValueError, match="cu_seqlens_q is required"):
        s2attn.sparse_attention_qkvpacked(_t(64, 3, 4, 32), PATTERN)
    with pytest.raises(ValueError, match="pattern has 4 heads"):
        s2attn.sparse_attention_qkvpacked(_t(1, 64, 3, 2, 32), PATTERN)


def test_module_validation():
    with pytest.raises(TypeError, match="pattern"):
        s2attn.SparseAttention("not a pattern")
    attn = s2attn.SparseAttention(PATTERN)
    with pytest.raises(ValueError, match="max_seq_len"):
        attn(*_qkv(seq_q=256, seq_k=256))


def test_merge_partials_validation():
    out, lse = _t(2, 64, 4, 32), torch.randn(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="lses"):
        s2attn.merge_partials([out, out], [lse])
    with pytest.raises(ValueError, match="outs"):
        s2attn.merge_partials([], [])
    with pytest.raises(ValueError, match=r"outs\[1\]"):
        s2attn.merge_partials([out, out[:, :32]], [lse, lse])
    with pytest.raises(ValueError, match=r"lses\[1\]"):
        s2attn.merge_partials([out, out], [lse, lse.transpose(1, 2)])
    with pytest.raises(ValueError, match=r"lses\[0\]"):  # packed out (total, heads, dim)
        s2attn.merge_partials([out[0]], [lse])
