"""The page pool as its own object (free list, holder counts, copy on write), and the cache's two
kinds behind one constructor."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import DEVICE

import s2attn
from s2attn.inference import (
    DynamicKVCache,
    ModelKVCache,
    PagedKVCache,
    PagePool,
    StaticKVCache,
    paged_kv_cache,
)


def make_pool(num_pages: int = 6) -> PagePool:
    return PagePool(num_pages, block_size=4, head_dim=8, dtype=torch.float32, device=DEVICE)


def test_pages_come_from_the_free_list_and_return_to_it():
    pool = make_pool()
    first = pool.take(2)
    assert sorted(first.tolist()) == [0, 1] and pool.live == 2 and pool.num_free == 4
    assert pool.holders().tolist() == [1, 1, 0, 0, 0, 0]
    pool.release(torch.tensor([1], dtype=torch.int32))
    assert pool.live == 1 and pool.holders()[1] == 0
    # A stack: the page freed last is handed out next.
    assert pool.take(1).tolist() == [1]
    with pytest.raises(RuntimeError, match="4 free pages, 5 asked for"):
        pool.take(5)
    pool.reset()
    assert pool.live == 0 and pool.free_pages() == [5, 4, 3, 2, 1, 0]


def test_a_shared_page_is_freed_by_its_last_holder():
    pool = make_pool()
    pool.take(3)
    pool.hold_exactly(torch.tensor([0, 0, 2], dtype=torch.int32))  # page 1 lost its holder
    assert pool.shared and pool.holders().tolist() == [2, 0, 1, 0, 0, 0]
    assert sorted(pool.free_pages()) == [1, 3, 4, 5]
    assert pool.would_free(torch.tensor([0], dtype=torch.int32)).numel() == 0
    assert pool.would_free(torch.tensor([0, 0], dtype=torch.int32)).tolist() == [0]
    pool.release(torch.tensor([0], dtype=torch.int32))
    assert pool.holders()[0] == 1 and 0 not in pool.free_pages()
    pool.release(torch.tensor([0], dtype=torch.int32))
    assert pool.holders()[0] == 0 and 0 in pool.free_pages()


def test_copy_on_write_gives_a_holder_its_own_copy():
    pool = make_pool()
    page = pool.take(1)
    pool.hold_exactly(torch.tensor([0, 0], dtype=torch.int32))
    pool.k_pages[0].fill_(3.0)
    pool.v_pages[0].fill_(-1.0)
    fresh = pool.copy_on_write(page)
    assert fresh.tolist() != page.tolist()
    assert pool.holders()[0] == 1 and pool.holders()[fresh[0]] == 1 and pool.live == 2
    assert torch.equal(pool.k_pages[fresh[0]], pool.k_pages[0])
    assert torch.equal(pool.v_pages[fresh[0]], pool.v_pages[0])
    pool.k_pages[fresh[0]].zero_()  # the copy is its own memory
    assert (pool.k_pages[0] == 3.0).all()


def test_copy_runs_copies_whole_runs_of_pages():
    pool = make_pool(4)
    for i in range(4):
        pool.k_pages[i].fill_(float(i))
    pool.copy_runs(torch.tensor([1, 1]), 2)  # runs of two pages: run 0 becomes run 1
    assert [float(pool.k_pages[i, 0, 0]) for i in range(4)] == [2.0, 3.0, 2.0, 3.0]


def test_the_factory_picks_the_kind():
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    args = dict(batch_size=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=DEVICE)
    assert type(paged_kv_cache(pattern, **args)) is DynamicKVCache
    static = paged_kv_cache(pattern, **args, static=True)
    assert type(static) is StaticKVCache and static.static and static.pool.num_free == 0
    assert type(StaticKVCache(pattern, **args)) is StaticKVCache
    assert type(DynamicKVCache(pattern, **args)) is DynamicKVCache
    with pytest.raises(TypeError, match="static must be a bool"):
        paged_kv_cache(pattern, **args, static=1)
    with pytest.raises(ValueError, match="sizes its own pool"):
        paged_kv_cache(pattern, **args, static=True, num_pages=8)
    layers = ModelKVCache([None, pattern], **args, max_seq_len=128, block_size=16, static=True)
    assert all(type(layer) is StaticKVCache for layer in layers)


def test_the_shared_base_is_not_built_directly():
    pattern = s2attn.local_stride_pattern(
        4, max_seq_len=128, block_size=16, local_blocks=2, vert_stride=3, num_kv_heads=2
    )
    with pytest.raises(TypeError, match=r"s2attn\.paged_kv_cache\(pattern, \.\.\., static="):
        PagedKVCache(pattern, batch_size=2, num_kv_heads=2, head_dim=8, device=DEVICE)


def test_model_cache_takes_the_layer_cache_keywords():
    """ModelKVCache passes its keywords to paged_kv_cache for each layer: the two stay one list,
    and the kinds' classes take the same ones, static aside."""
    factory = inspect.signature(paged_kv_cache).parameters
    model = inspect.signature(ModelKVCache.__init__).parameters
    layer = inspect.signature(PagedKVCache.__init__).parameters
    names = list(model)[2:]
    assert names == list(factory)[1:]
    assert [model[n].default for n in names] == [factory[n].default for n in names]
    kept = [n for n in factory if n != "static"]
    assert list(layer)[1:] == kept
    assert [layer[n].default for n in kept] == [factory[n].default for n in kept]
