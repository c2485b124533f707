"""Megatron-core: S2CoreAttention on Megatron's layouts (sbhd and packed thd) against the
dense-mask reference, tensor-parallel head ranges, the masks it refuses, the HHST layer spec, and a
tiny GPTModel (gloo, one process) whose forward and backward match the same model on the
reference attention. Skipped where megatron-core is not installed (``pip install
's2attn[megatron]'``)."""

from __future__ import annotations

import socket
import types
import warnings

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close

import s2attn

with warnings.catch_warnings():  # megatron warns at import that Apex and TE are missing
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")
    s2mc = pytest.importorskip("s2attn.integrations.megatron")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron"
)

HEADS, HEAD_DIM, BLOCK = 4, 16, 16
MAX_SEQ_LEN = 64
PATTERN = dict(block_size=BLOCK, local_blocks=1, vert_stride=2)
SETTINGS = dict(max_seq_len=MAX_SEQ_LEN, **PATTERN)  # get_hhst_layer_spec's keywords


def make_config(num_query_groups=2, **overrides):
    kwargs = dict(
        num_layers=3, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
        num_query_groups=num_query_groups, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=torch.float32,
    )  # fmt: skip
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def fake_tp(rank, size):
    """A stand-in for Megatron's process-group collection: only the TP group's rank and size."""
    group = types.SimpleNamespace(rank=lambda: rank, size=lambda: size)
    return types.SimpleNamespace(tp=group)


def core_attention(config=None, layer_number=2, dense_layers=(0,), tp=(0, 1), **kwargs):
    config = make_config() if config is None else config
    settings = s2mc.S2Settings(**PATTERN, dense_layers=dense_layers)
    mask_type = kwargs.pop("attn_mask_type", AttnMaskType.causal)
    group = kwargs.pop("pg_collection", None) or fake_tp(*tp)
    return s2mc.S2CoreAttention(
        config,
        layer_number,
        mask_type,
        "self",
        pg_collection=group,
        s2=settings,
        max_seq_len=MAX_SEQ_LEN,
        **kwargs,
    )


def sbhd(seq, batch, heads, dtype, requires_grad=False):
    return torch.randn(seq, batch, heads, HEAD_DIM, device=DEVICE, dtype=dtype).requires_grad_(
        requires_grad
    )


def reference_sbhd(q, k, v, pattern):
    """The dense-mask reference on Megatron's (seq, batch, heads, dim): (seq, batch, heads*dim)."""
    out = s2attn.attention_reference(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), pattern
    )
    return out.transpose(0, 1).reshape(q.shape[0], q.shape[1], -1)


def causal_mask(seq):
    return torch.ones(1, 1, seq, seq, dtype=torch.bool, device=DEVICE).triu(1)


# ----------------------------------------------------------------------- the module
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer_number, kv_heads", [(1, 2), (2, 2), (2, 4)])
def test_sbhd_matches_reference(dtype, layer_number, kv_heads):
    """Layer 1 is dense, layer 2 is S2; GQA (4 query / 2 KV heads) and MHA; with Megatron's
    causal mask tensor and without, 40 tokens (not a multiple of the block)."""
    torch.manual_seed(0)
    attn = core_attention(make_config(num_query_groups=kv_heads), layer_number)
    if layer_number == 1:
        pattern = s2attn.dense_pattern(HEADS, max_seq_len=64, block_size=BLOCK)
    else:
        pattern = s2attn.local_stride_pattern(
            HEADS,
            max_seq_len=64,
            block_size=BLOCK,
            local_blocks=1,
            vert_stride=2,
            num_kv_heads=kv_heads,
        )
    assert attn.is_dense == (layer_number == 1)
    assert torch.equal(attn.pattern.mask, pattern.mask)
    q, k, v = sbhd(40, 2, HEADS, dtype), sbhd(40, 2, kv_heads, dtype), sbhd(40, 2, kv_heads, dtype)
    want = reference_sbhd(q, k, v, pattern)
    for mask in (None, causal_mask(40)):
        out = attn(q, k, v, mask)
        assert out.shape == (40, 2, HEADS * HEAD_DIM) and out.dtype == dtype
        assert_close(
            out.float(), want, dtype, f"layer {layer_number} sbhd, mask {mask is not None}"
        )


def test_sbhd_gradients_match_reference():
    torch.manual_seed(1)
    attn = core_attention()
    q, k, v = (sbhd(48, 2, h, torch.float32, requires_grad=True) for h in (HEADS, 2, 2))
    grad = torch.randn(48, 2, HEADS * HEAD_DIM, device=DEVICE)
    grads = torch.autograd.grad(attn(q, k, v, None), (q, k, v), grad)
    want = torch.autograd.grad(reference_sbhd(q, k, v, attn.pattern), (q, k, v), grad)
    for name, got, ref in zip("qkv", grads, want):
        assert_close(got, ref, torch.float32, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_thd_packed_matches_reference(dtype):
    """Two sequences (20 and 28 tokens) packed, plus 4 tokens of padding after the last one."""
    torch.manual_seed(2)
    attn = core_attention()
    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=DEVICE)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=28, max_seqlen_kv=28
    )
    q = torch.randn(52, HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(52, 2, HEAD_DIM, device=DEVICE, dtype=dtype) for _ in range(2))
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (52, HEADS * HEAD_DIM)
    want = s2attn.attention_reference(
        q[:48].float(), k[:48].float(), v[:48].float(), attn.pattern,
        cu_seqlens_q=cu, cu_seqlens_k=cu,
    ).reshape(48, -1)  # fmt: skip
    assert_close(out[:48].float(), want, dtype, "thd packed")
    assert torch.equal(out[48:], torch.zeros_like(out[48:])), "padding past the pack must be 0"


def test_thd_padded_offsets_match_reference():
    """Sequences of 20 and 25 tokens, each padded at its end (to 22 and 26 slots): the real
    tokens' outputs are those of the unpadded sequences; bidirectional attention refuses it."""
    torch.manual_seed(7)
    attn = core_attention()
    cu = torch.tensor([0, 20, 45], dtype=torch.int32, device=DEVICE)
    padded = torch.tensor([0, 22, 48], dtype=torch.int32, device=DEVICE)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
    )  # fmt: skip
    q = torch.randn(48, HEADS, HEAD_DIM, device=DEVICE)
    k, v = (torch.randn(48, 2, HEAD_DIM, device=DEVICE) for _ in range(2))
    out = attn(q, k, v, None, packed_seq_params=params)
    real = torch.cat([torch.arange(0, 20), torch.arange(22, 47)]).to(DEVICE)
    want = s2attn.attention_reference(
        q[real], k[real], v[real], attn.pattern, cu_seqlens_q=cu, cu_seqlens_k=cu
    ).reshape(45, -1)
    assert_close(out[real], want, torch.float32, "thd with padded offsets")
    bidirectional = core_attention(attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(NotImplementedError, match="padded packed sequences.*causal"):
        bidirectional(q, k, v, None, packed_seq_params=params)


# --------------------------------------------------------------- tensor parallelism
def test_tp_head_range():
    assert s2mc.tp_head_range(8, 0, 2) == slice(0, 4)
    assert s2mc.tp_head_range(8, 1, 2) == slice(4, 8)
    assert s2mc.tp_head_range(8, 3, 4) == slice(6, 8)
    with pytest.raises(ValueError, match="6 heads do not divide by the tensor-parallel size 4"):
        s2mc.tp_head_range(6, 0, 4)
    with pytest.raises(ValueError, match="tp_rank must be an integer in"):
        s2mc.tp_head_range(8, 2, 2)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp_rank_takes_its_head_range(kv_heads):
    """Each rank's pattern is its head range of the full one, also with fewer KV heads than ranks
    (Megatron then raises the config's num_query_groups to the TP size; the pattern must not
    change), and a rank's output equals those heads of the full attention."""
    torch.manual_seed(3)
    settings = s2mc.S2Settings(**PATTERN, dense_layers=())
    full = s2mc.layer_pattern(settings, 2, HEADS, kv_heads, max_seq_len=MAX_SEQ_LEN)
    q, k, v = (sbhd(40, 1, HEADS, torch.float32) for _ in range(3))
    want = reference_sbhd(q, k, v, full).view(40, 1, HEADS, HEAD_DIM)
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        part = s2mc.layer_pattern(
            settings, 2, HEADS, kv_heads, max_seq_len=MAX_SEQ_LEN, tp_rank=rank, tp_size=2
        )
        assert torch.equal(part.mask, full.mask[heads])
        # What rank `rank` is handed: its 2 query heads, and 1 KV head (its own, or a replica).
        config = make_config(num_query_groups=max(kv_heads, 2))
        attn = s2mc.S2CoreAttention(
            config,
            2,
            AttnMaskType.causal,
            "self",
            pg_collection=fake_tp(rank, 2),
            s2=settings,
            max_seq_len=MAX_SEQ_LEN,
            num_query_groups=kv_heads,
        )
        assert torch.equal(attn.pattern.mask, full.mask[heads])
        out = attn(q[:, :, heads], k[:, :, heads], v[:, :, heads], None)
        assert_close(out.view(40, 1, 2, HEAD_DIM), want[:, :, heads], torch.float32, f"rank {rank}")


def test_tp_size_not_dividing_heads_is_refused():
    with pytest.raises(ValueError, match="4 heads do not divide by the tensor-parallel size 3"):
        core_attention(tp=(0, 3))


# ---------------------------------------------------------------------- bad input
def test_arbitrary_and_padding_masks_are_refused():
    attn = core_attention()
    q, k, v = (sbhd(32, 2, h, torch.float32) for h in (HEADS, 2, 2))
    arbitrary = torch.rand(2, 1, 32, 32, device=DEVICE) < 0.5
    padding = causal_mask(32).repeat(2, 1, 1, 1)
    padding[1, :, :, 28:] = True  # the second sequence's last 4 tokens are padding
    for mask in (arbitrary, padding, ~causal_mask(32)):
        with pytest.raises(NotImplementedError, match="attention_mask that is not the causal mask"):
            attn(q, k, v, mask)
    with pytest.raises(NotImplementedError, match="boolean attention masks.*torch.float32"):
        attn(q, k, v, causal_mask(32).float())
    with pytest.raises(ValueError, match="attention_mask must be"):
        attn(q, k, v, causal_mask(16))
    # The mask check is cached per tensor: changing a checked mask in place is seen again.
    mask = causal_mask(32)
    attn(q, k, v, mask)
    mask[0, 0, 5, 3] = True
    with pytest.raises(NotImplementedError, match="not the causal mask"):
        attn(q, k, v, mask)


def test_unsupported_settings_are_refused():
    q, k, v = (sbhd(32, 1, h, torch.float32) for h in (HEADS, 2, 2))
    with pytest.raises(NotImplementedError, match="attn_mask_type=AttnMaskType.arbitrary"):
        core_attention(attn_mask_type=AttnMaskType.arbitrary)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        core_attention()(q, k, v, None, attention_bias=torch.zeros(1, HEADS, 32, 32))
    dropout = core_attention(attention_dropout=0.1)
    with pytest.raises(NotImplementedError, match="p=0.1 in training.*attention_dropout=0.0"):
        dropout(q, k, v, None)
    dropout.eval()
    dropout(q, k, v, None)  # dropout is off outside training
    bidirectional = core_attention(attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(NotImplementedError, match="built bidirectional"):
        bidirectional(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    with pytest.raises(NotImplementedError, match="qkv_format='thd' only"):
        core_attention()(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


def test_bidirectional_matches_reference():
    torch.manual_seed(4)
    attn = core_attention(attn_mask_type=AttnMaskType.no_mask)
    assert not attn.pattern.causal
    q, k, v = (sbhd(48, 1, h, torch.float32) for h in (HEADS, 2, 2))
    want = reference_sbhd(q, k, v, attn.pattern)
    assert_close(attn(q, k, v, None), want, torch.float32, "bidirectional")
    no_masking = torch.zeros(1, 1, 48, 48, dtype=torch.bool, device=DEVICE)
    assert_close(attn(q, k, v, no_masking), want, torch.float32, "bidirectional, all-False mask")


# ------------------------------------------------------------------------ the spec
def test_spec_validates_its_arguments():
    config = make_config()
    with pytest.raises(ValueError, match=r"dense_layers must be 0-based layer indices in \[0, 3\)"):
        s2mc.get_hhst_layer_spec(config, max_seq_len=64, dense_layers=[3])
    with pytest.raises(ValueError, match=r"dense_layers must be in \[0, 3\]"):
        s2mc.get_hhst_layer_spec(config, max_seq_len=64, dense_layers=4)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        s2mc.get_hhst_layer_spec(config, max_seq_len=64, block_size=24)
    with pytest.raises(ValueError, match="base_spec must be a transformer layer spec"):
        s2mc.get_hhst_layer_spec(config, max_seq_len=64, base_spec=object())


def test_spec_takes_the_settings_or_their_fields():
    """One S2Settings for Megatron and transformers: the spec's core attention gets the settings
    given, each keyword replacing its field (a dense-layer count counts from the first)."""
    from s2attn.stack import S2Settings

    assert s2mc.S2Settings is S2Settings
    config = make_config()
    settings = S2Settings(**PATTERN, dense_layers=(2,), head_offset=1)

    def core_params(**kwargs):
        spec = s2mc.get_hhst_layer_spec(config, max_seq_len=MAX_SEQ_LEN, **kwargs)
        return spec.submodules.self_attention.submodules.core_attention.params

    params = core_params(settings=settings)
    assert params == {
        "s2": settings,
        "max_seq_len": MAX_SEQ_LEN,
        "num_query_groups": 2,
        "reference": False,
    }
    changed = core_params(settings=settings, dense_layers=1, vert_stride=4)["s2"]
    assert changed == settings.replace(dense_layers=(0,), vert_stride=4)
    assert core_params(**PATTERN)["s2"] == S2Settings(**PATTERN, dense_layers=(0, 1))
    with pytest.raises(ValueError, match=r"dense_layers must be layer indices in \[0, 3\)"):
        core_params(settings=settings.replace(dense_layers=(3,)))


@pytest.fixture(scope="module")
def model_parallel():
    """Megatron's model-parallel state on a one-process gloo group (TP = PP = 1)."""
    if torch.distributed.is_initialized() or parallel_state.model_parallel_is_initialized():
        pytest.skip("another test left a process group or Megatron's parallel state set up")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def tiny_gpt(reference: bool):
    config = make_config()
    spec = s2mc.get_hhst_layer_spec(config, dense_layers=[0], reference=reference, **SETTINGS)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 0.19 warns that GPTModel is deprecated
        return GPTModel(config, spec, vocab_size=128, max_sequence_length=64).to(DEVICE)


def test_gpt_model_layers_and_training_step_match_reference(model_parallel):
    """Layer 0 dense, layers 1-2 S2; forward, loss and every gradient match the same model on the
    dense-mask reference attention, in sbhd (with the causal mask) and packed thd."""
    model, reference = tiny_gpt(False), tiny_gpt(True)
    reference.load_state_dict(model.state_dict())
    kinds = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(isinstance(m, s2mc.S2CoreAttention) for m in kinds)
    assert [m.is_dense for m in kinds] == [True, False, False]
    assert kinds[0].pattern.density() == 1.0 and kinds[1].pattern.density() < 0.7
    assert kinds[1].pattern is kinds[2].pattern, "S2 layers should share one pattern (and layouts)"

    torch.manual_seed(6)
    ids = torch.randint(0, 128, (2, 48), device=DEVICE)
    pos = torch.arange(48, device=DEVICE)[None].expand(2, -1)
    losses = [m(ids, pos, causal_mask(48), labels=ids).mean() for m in (model, reference)]
    for m, loss in zip((model, reference), losses):
        m.zero_grad()
        loss.backward()
    assert_close(losses[0].detach(), losses[1].detach(), torch.float32, "loss")
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, grads[name].grad, torch.float32, f"grad {name}")

    cu = torch.tensor([0, 20, 48], dtype=torch.int32, device=DEVICE)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    packed_pos = torch.cat([torch.arange(20), torch.arange(28)]).to(DEVICE)[None]
    with torch.no_grad():
        packed = model(ids[:1], packed_pos, None, packed_seq_params=params)
        want = reference(ids[:1], packed_pos, None, packed_seq_params=params)
        alone = reference(ids[:1, 20:], torch.arange(28, device=DEVICE)[None], None)
    assert_close(packed, want, torch.float32, "packed logits")
    assert_close(packed[:, 20:], alone, torch.float32, "second packed sequence alone")


# ------------------------------------------- tensor parallelism on several processes (gloo)
TP_STEPS = 4


def _tp_training_body(rank, world, out_path):
    """TP = ``world``: the HHST GPTModel (CPU-initialized master weights, split by Megatron, so
    every TP size starts from the same model) trains ``TP_STEPS`` SGD steps on fixed data. Each
    rank's S2 layers hold its head range of the full pattern; rank 0 writes the losses."""
    import json

    parallel_state.initialize_model_parallel(world, 1)
    try:
        model = tiny_gpt(False)
        settings = s2mc.S2Settings(**PATTERN, dense_layers=[0])
        full = s2mc.layer_pattern(settings, 2, HEADS, 2, max_seq_len=MAX_SEQ_LEN)
        heads = s2mc.tp_head_range(HEADS, rank, world)
        for layer in model.decoder.layers[1:]:
            attention = layer.self_attention.core_attention
            assert (attention.tp_rank, attention.tp_size) == (rank, world)
            assert torch.equal(attention.pattern.mask, full.mask[heads])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(6)
        ids = torch.randint(0, 128, (2, 48))
        pos = torch.arange(48)[None].expand(2, -1)
        losses = []
        for _ in range(TP_STEPS):
            loss = model(ids, pos, causal_mask(48), labels=ids).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(losses, f)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU")
def test_tensor_parallel_training_matches_one_rank(tmp_path):
    """TP = 2 on two gloo processes: the losses of a few training steps equal TP = 1's on the same
    data and initial weights, and fall."""
    _assert_two_ranks_train_like_one(tmp_path, _tp_training_body, "TP")


def _assert_two_ranks_train_like_one(tmp_path, body, kind: str) -> None:
    """``body`` on one and on two gloo ranks writes the same per-step losses, which fall."""
    import json

    from gloo import spawn

    losses = {}
    for world in (1, 2):
        path = tmp_path / f"{kind}{world}.json"
        spawn(world, body, str(path))
        losses[world] = json.loads(path.read_text())
    print(f"losses per step, {kind}=1 {losses[1]}, {kind}=2 {losses[2]}")
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-5, atol=1e-6)
    assert losses[1][-1] < losses[1][0]


def _cp_training_body(rank, world, out_path):
    """Context parallelism over ``world`` gloo ranks (TP = 1): each rank feeds the GPTModel its
    shard of the tokens, positions, labels and causal mask (Megatron's layout: chunks r and
    2W - 1 - r), its S2 layers run s2attn.distributed over the context-parallel group, and the
    gradients are averaged over it as Megatron's data-parallel reduction does; rank 0 writes the
    global mean losses of ``TP_STEPS`` SGD steps."""
    import json

    from s2attn.distributed import shard

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    try:
        config = make_config(context_parallel_size=world)
        spec = s2mc.get_hhst_layer_spec(config, dense_layers=[0], **SETTINGS)
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(config, spec, vocab_size=128, max_sequence_length=64)
        group = parallel_state.get_context_parallel_group()
        expected = group if world > 1 else None
        assert all(layer.self_attention.core_attention.cp_group is expected
                   for layer in model.decoder.layers)  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(6)
        ids = torch.randint(0, 128, (2, 48))
        pos = torch.arange(48)[None].expand(2, -1)
        local_ids, local_pos = shard(ids, group), shard(pos, group)
        local_mask = shard(causal_mask(48), group, seq_dim=2) if world > 1 else causal_mask(48)
        if world > 1:  # a mask whose rows are not this rank's shard's: refused on every rank
            with pytest.raises(NotImplementedError, match="not the causal mask"):
                model(local_ids, local_pos, causal_mask(48)[:, :, :24], labels=local_ids)
            cu = torch.tensor([0, 24], dtype=torch.int32)
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
            with pytest.raises(NotImplementedError, match=PACKED_UNDER_CP):
                model(local_ids[:1], local_pos[:1], None, packed_seq_params=packed)
        losses = []
        for _ in range(TP_STEPS):
            loss = model(local_ids, local_pos, local_mask, labels=local_ids).mean()
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, group=group)
                p.grad /= world
            optimizer.step()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total, group=group)
            losses.append(total.item() / world)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(losses, f)
    finally:
        parallel_state.destroy_model_parallel()


PACKED_UNDER_CP = r"packed sequences \(packed_seq_params.*under context parallelism"


def test_packed_sequences_under_context_parallelism_are_refused():
    """A context-parallel layer refuses a thd pack before any collective (here a stand-in group
    that has none), naming what it does not take and the context-parallel size."""
    cp = types.SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    group = types.SimpleNamespace(tp=fake_tp(0, 1).tp, cp=cp)
    config = make_config(context_parallel_size=2)
    attn = core_attention(config, dense_layers=(), pg_collection=group)
    assert attn.cp_group is cp
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device=DEVICE)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    q = torch.randn(16, HEADS, HEAD_DIM, device=DEVICE)
    k, v = (torch.randn(16, 2, HEAD_DIM, device=DEVICE) for _ in range(2))
    with pytest.raises(NotImplementedError, match=PACKED_UNDER_CP + r" \(context-parallel size 2"):
        attn(q, k, v, None, packed_seq_params=params)


def test_context_parallel_needs_its_group():
    config = make_config(context_parallel_size=2)
    with pytest.raises(ValueError, match="no context-parallel group of that size"):
        core_attention(config)


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU")
def test_context_parallel_training_matches_one_rank(tmp_path):
    """Megatron's context parallelism (CP = 2 on two gloo processes) through s2attn.distributed:
    the losses of a few training steps equal one rank's on the whole sequence, same data and
    initial weights."""
    _assert_two_ranks_train_like_one(tmp_path, _cp_training_body, "CP")


def _indivisible_heads_body(rank, world):
    """Three heads over two tensor-parallel ranks: every rank refuses, and none hangs (they all
    reach the barrier after)."""
    config = make_config(num_layers=1, hidden_size=3 * HEAD_DIM, num_attention_heads=3,
                         num_query_groups=1)  # fmt: skip
    group = types.SimpleNamespace(tp=torch.distributed.group.WORLD)
    with pytest.raises(ValueError, match="3 heads do not divide by the tensor-parallel size 2"):
        core_attention(config, dense_layers=(), pg_collection=group)
    torch.distributed.barrier()


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU")
def test_tensor_parallel_indivisible_heads_raise_on_every_rank():
    from gloo import spawn

    spawn(2, _indivisible_heads_body)
