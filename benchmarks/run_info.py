"""What every benchmark records beside its numbers: the device, library versions and date, and the
stem its result files are named by."""

from __future__ import annotations

import datetime

import torch
import triton

import s2attn


def environment() -> dict:
    return dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        s2attn=s2attn.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def versions_line(env: dict) -> str:
    return (
        f"{env['date']} · torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']} · "
        f"s2attn {env['s2attn']}"
    )


def result_stem(env: dict, name: str) -> str:
    """``<date>_<device>_<name>``, e.g. ``2026-11-22_h100_decode``."""
    device = env["device"].split()[1].lower() if " " in env["device"] else env["device"]
    return f"{env['date'][:10]}_{device}_{name}"
