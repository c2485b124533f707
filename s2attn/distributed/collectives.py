"""The ``torch.distributed`` calls context parallelism makes, as it makes them: the group's size
and rank (refusing an uninitialised process group), the device its collectives take tensors on,
and an all-to-all of rows over flat buffers, which gloo needs."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single",
    "all_to_all",
    "comm_device",
    "reduce_scatter_single",
    "world_and_rank",
]

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """The group's size and this process's rank in it (a RuntimeError before init_process_group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("s2attn.distributed needs torch.distributed.init_process_group first")
    return dist.get_world_size(group), dist.get_rank(group)


def comm_device(group) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_to_all(send: torch.Tensor, send_rows: list[int], recv_rows: list[int], group):
    """(rows, ...) split by destination rank -> the (rows, ...) received, by source rank."""
    send = send.contiguous()
    per_row = math.prod(send.shape[1:])
    recv = send.new_empty(sum(recv_rows), *send.shape[1:])
    # Flat buffers: gloo splits only one-dimensional tensors.
    dist.all_to_all_single(
        recv.view(-1),
        send.view(-1),
        output_split_sizes=[n * per_row for n in recv_rows],
        input_split_sizes=[n * per_row for n in send_rows],
        group=group,
    )
    return recv
