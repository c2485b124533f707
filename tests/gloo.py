"""Tests on several CPU processes: ``spawn(world, body, *args)`` runs a test body on that many
gloo ranks and fails with every rank's traceback, or names the ranks that hung."""

from __future__ import annotations

import datetime
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import HANG_GUARD_S

# Bounds every collective and the whole test only so that a bug that hangs a rank fails.
TIMEOUT_S = HANG_GUARD_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, errors, kernels: bool, body, args) -> None:
    try:
        # Most runs take the dense-mask reference instead of the (slow) interpreted kernels: what
        # they test is the split, the collectives and the merge; one case runs the kernels.
        if not kernels:
            from s2attn.ops import dispatch

            dispatch.supports_triton = lambda device: False
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        try:
            body(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def spawn(world: int, body, *args, kernels: bool = False) -> None:
    """Run ``body(rank, world, *args)`` on ``world`` gloo ranks; fail with every rank's error.

    ``kernels``: sparse_attention takes its Triton kernels where it can (the interpreter on the
    CPU); otherwise the workers use the dense-mask reference."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, errors, kernels, body, args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S + 30
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if hung or messages or any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"ranks hung: {hung}\n" + "\n".join(messages))
