"""The S2 backend's decode step (s2attn.integrations.vllm_backend), a layer at a time, with a
forward context made by hand: what a GPU runs inside vLLM's CUDA graphs (the step's batch
composed from the block tables, the new token written through it, the decode kernel reading
through it), here under the Triton interpreter. Every page row starts NaN, so a token written
anywhere but where the decode reads it fails the comparison with the reference.

Runs only where vLLM is installed (``make test-vllm``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import DEVICE, assert_close

pytest.importorskip("vllm")
backend = pytest.importorskip("s2attn.integrations.vllm_backend")

from test_vllm_paged import (  # noqa: E402
    DIM,
    HEADS,
    KV_HEADS,
    make_cache,
    reference,
    stripe_cache,
    striped_pattern,
)

from s2attn.integrations.vllm_paged import DecodeBuffers, kv_head_pages  # noqa: E402
from s2attn.ops.dispatch import supports_triton  # noqa: E402

pytestmark = pytest.mark.skipif(
    not supports_triton(torch.device(DEVICE)), reason="needs the Triton kernels"
)
PAGE = 32  # striped_pattern's block, vLLM's page


def impl_for(pattern, stripes, monkeypatch):
    # The impl reads the device its stripe offsets go to from vLLM's config.
    config = SimpleNamespace(device_config=SimpleNamespace(device=torch.device(DEVICE)))
    monkeypatch.setattr(backend, "get_current_vllm_config", lambda: config)
    impl = backend.S2AttentionImpl(
        HEADS, DIM, 1 / math.sqrt(DIM), KV_HEADS, s2_pattern=pattern, stripes=stripes
    )
    impl.stripe_layer = "layer.stripes" if stripes is not None else None
    return impl


@pytest.mark.parametrize("striped", [False, True], ids=["union", "stripes"])
def test_decode_steps_write_and_read_through_the_steps_page_table(striped, monkeypatch):
    """Three decode steps of two requests plus a padding request (length 0) whose rows of the
    block tables are request 0's, as stale rows could be: each step's new token written by
    do_kv_cache_update, then attended by forward, equals the reference over every token so far
    (the padding request's token, written into request 0's pages, would change it)."""
    if striped:
        pattern, stripes, kv_cache, _, keys, values, lengths, window_table, stripe_table = (
            # Each request's new tokens in a stripe block of one KV head (head 0: block 8; head
            # 1: block 7), which that head reads from its stripe page.
            stripe_cache(torch.float32, lengths=(258, 228))
        )
    else:
        pattern = striped_pattern()
        stripes, lengths = None, [300, 161]
        kv_cache, window_table, keys, values = make_cache(lengths, PAGE, torch.float32)
    impl = impl_for(pattern, stripes, monkeypatch)
    layer = SimpleNamespace(layer_name="layer")
    buffers = DecodeBuffers(4, KV_HEADS, torch.device(DEVICE))
    gen = torch.Generator().manual_seed(5)
    lengths = list(lengths)
    for step in range(3):
        new_k = torch.randn(2, KV_HEADS, DIM, generator=gen).to(DEVICE)
        new_v = torch.randn(2, KV_HEADS, DIM, generator=gen).to(DEVICE)
        q = torch.randn(3, HEADS, DIM, generator=gen).to(DEVICE)
        keys = [torch.cat([k, nk[None]]) for k, nk in zip(keys, new_k)]
        values = [torch.cat([v, nv[None]]) for v, nv in zip(values, new_v)]
        lengths = [n + 1 for n in lengths]
        seq_lens = torch.tensor([*lengths, 0], dtype=torch.int32, device=DEVICE)
        table = torch.cat([window_table, window_table[:1]])
        metadata = backend.S2AttentionMetadata(
            num_actual_tokens=3,
            max_query_len=1,
            query_start_loc=torch.arange(4, dtype=torch.int32, device=DEVICE),
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=torch.full((3,), -1, dtype=torch.int64, device=DEVICE),  # unread
            decode=buffers,
        )
        context = SimpleNamespace(attn_metadata={"layer": metadata}, slot_mapping={})
        # vLLM lays a layer's and its stripe layer's pages out in one tensor.
        context.no_compile_layers = {"layer.stripes": SimpleNamespace(kv_cache=kv_cache)}
        if striped:
            stripes_of = torch.cat([stripe_table, stripe_table[:1]])
            context.attn_metadata["layer.stripes"] = SimpleNamespace(block_table=stripes_of)
        monkeypatch.setattr(backend, "get_forward_context", lambda context=context: context)
        pad = torch.zeros(1, KV_HEADS, DIM, device=DEVICE)
        k_step, v_step = torch.cat([new_k, pad]), torch.cat([new_v, pad])
        impl.do_kv_cache_update(layer, k_step, v_step, kv_cache, metadata.slot_mapping)
        out = torch.full((3, HEADS * DIM), float("nan"), device=DEVICE)
        impl.forward(layer, q, k_step, v_step, kv_cache, metadata, out)
        got = out.view(3, HEADS, DIM)[:2]
        want = reference(q[:2], keys, values, [1, 1], pattern, 1 / math.sqrt(DIM))
        assert_close(got, want.to(got.dtype), torch.float32, f"backend decode, step {step}")
        assert len(metadata.decode_batches) == 1  # composed once for the group's layers
    if striped:  # stripe pages in another tensor than the layer's are refused
        impl._shares_pages = False
        context.no_compile_layers["layer.stripes"].kv_cache = kv_cache.clone()
        with pytest.raises(RuntimeError, match="another tensor than its layer's"):
            impl.do_kv_cache_update(layer, k_step, v_step, kv_cache, metadata.slot_mapping)
    page_table = next(iter(metadata.decode_batches.values())).page_table
    assert torch.equal(page_table[2], kv_head_pages(torch.zeros_like(table[:1]), KV_HEADS)[0])
    if not striped:
        assert torch.equal(page_table[:2], kv_head_pages(table[:2], KV_HEADS))
