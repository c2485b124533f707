"""The exchange of K and V rows a rank's :class:`~.plan.ExchangePlan` names: the rows it receives
(differentiable: the backward returns their gradients to their owners), the store they join, and
each chunk's compact keys gathered from it."""

from __future__ import annotations

import math

import torch

from .collectives import all_to_all
from .plan import Chunk, ExchangePlan

__all__ = ["ExchangeKV", "chunk_keys", "rank_store", "return_gradients", "send_rows"]


def send_rows(x: torch.Tensor, plan: ExchangePlan, group) -> torch.Tensor:
    """A rank's shard (batch, local_seq, kv_heads, dim) -> the rows other ranks send it
    (batch, received, dim), by source rank, KV head and position."""
    batch, _, _, dim = x.shape
    rows = x.reshape(batch, -1, dim)
    # Row-major by destination with the batch inside a row, so each rank's part is one span.
    send = rows[:, plan.send].transpose(0, 1)
    return all_to_all(send, plan.send_counts, plan.recv, group).transpose(0, 1)


def return_gradients(grad: torch.Tensor, plan: ExchangePlan, group, shape) -> torch.Tensor:
    """The received rows' gradients (batch, received, dim) -> the gradient of the rank's shard
    (``shape``) from every rank's: each row's goes back to its owner, which sums them."""
    batch, _, _, dim = shape
    returned = all_to_all(grad.transpose(0, 1), plan.recv, plan.send_counts, group)
    local = grad.new_zeros(batch, math.prod(shape[1:3]), dim)
    local.index_add_(1, plan.send, returned.transpose(0, 1))
    return local.view(shape)


class ExchangeKV(torch.autograd.Function):
    """:func:`send_rows`, whose backward is :func:`return_gradients`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: ExchangePlan, group) -> torch.Tensor:
        ctx.plan, ctx.group, ctx.shape = plan, group, x.shape
        return send_rows(x, plan, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return return_gradients(grad, ctx.plan, ctx.group, ctx.shape), None, None


def rank_store(x: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """The rank's store (batch, rows, dim): its own rows, the received ones, one zero row."""
    batch, _, _, dim = x.shape
    return torch.cat([x.reshape(batch, -1, dim), received, x.new_zeros(batch, 1, dim)], dim=1)


def chunk_keys(store: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The chunk's compact keys (batch, keys, kv_heads, dim), gathered from the store."""
    keys, kv_heads = chunk.gather.shape
    return store[:, chunk.gather.view(-1)].view(store.shape[0], keys, kv_heads, -1)
