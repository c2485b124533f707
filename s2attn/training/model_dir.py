"""A model directory as ``s2attn eval`` reads it: a model that ``s2attn train`` (or
``save_pretrained``) wrote, with the run's ``run.json`` beside it when training wrote it. Reading
one checks it holds a readable config and whole weights (naming the unfinished run, and the
command that finishes it, when it holds none yet) and finds the longest input the model covers;
loading it puts it on its device as training ran it.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path

import torch

from .presets import check_weights_file

__all__ = ["load_model", "read_model_dir"]


def read_model_dir(model_dir: Path):
    """``(record, config, limit)`` of ``model_dir``: its ``run.json`` flattened (empty when there
    is none), its transformers config and its context limit. Loads no weights; raises
    ``ValueError`` naming what is missing or damaged."""
    from transformers import LlamaConfig

    record = _run_record(model_dir)
    if not (model_dir / "config.json").is_file():
        if record:
            raise ValueError(_unfinished_run(model_dir, record))
        raise ValueError(
            f"model_dir {str(model_dir)!r} holds no config.json: pass a directory "
            "written by `s2attn train` or save_pretrained"
        )
    try:
        config = LlamaConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_dir / 'config.json'} is not a readable config: {exc}") from None
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights and not any(model_dir.glob("*.bin")):
        raise ValueError(
            f"model_dir {str(model_dir)!r} holds a config.json but no weights (model.safetensors)"
        )
    for path in weights:
        check_weights_file(path, "model_dir")
    return record, config, _context_limit(config)


def load_model(model_dir: Path, device: str, progress: bool):
    """``(model, autocast_dtype)``: the model of ``model_dir`` on ``device``, in float32 on the
    CPU; float32 master weights on CUDA run under bf16 autocast, as training ran them.
    transformers' loading bar shows only with ``progress``."""
    from transformers import LlamaForCausalLM

    with contextlib.nullcontext() if progress else _no_hf_progress_bars():
        model = LlamaForCausalLM.from_pretrained(model_dir)
    autocast_dtype = None
    if device == "cpu":
        model = model.float()
    elif next(model.parameters()).dtype == torch.float32:
        autocast_dtype = torch.bfloat16
    return model.to(device), autocast_dtype


@contextlib.contextmanager
def _no_hf_progress_bars():
    """transformers' own bars (loading the weights) off for the block."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _run_record(model_dir: Path) -> dict:
    """``run.json`` of ``model_dir`` flattened: its options (under ``options`` or ``args``) over
    its top-level entries; empty when there is none."""
    path = model_dir / "run.json"
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(record, dict):
        return {}
    flat = {k: v for k, v in record.items() if not isinstance(v, dict)}
    for key in ("options", "args"):
        if isinstance(record.get(key), dict):
            flat.update(record[key])
    return flat


# Options that end a training process early: the command that finishes a run leaves them out.
_STOP_OPTIONS = ("--stop-at", "--time-limit")


def _unfinished_run(model_dir: Path, record: dict) -> str:
    """What to say about a training run's directory that holds no model yet, and the command
    that finishes it: the run's own, recorded in ``run.json``, with ``--resume``."""
    started = record.get("command")
    if isinstance(started, str) and started:
        words = shlex.split(started)
        kept: list[str] = []
        skip = False
        for word in words:
            if skip:
                skip = False
            elif word in _STOP_OPTIONS:
                skip = True
            elif not word.startswith(tuple(f"{o}=" for o in _STOP_OPTIONS)):
                kept.append(word)
        command = shlex.join(kept + ([] if "--resume" in kept else ["--resume"]))
    else:
        command = (
            f"python -m s2attn train --out {shlex.quote(str(model_dir))} --resume and the "
            "options it started with (run.json's)"
        )
    checkpoints = ("checkpoint", "checkpoint.old")
    if any((model_dir / name / "state.pt").is_file() for name in checkpoints):
        return (
            f"model_dir {str(model_dir)!r} is an interrupted `s2attn train` run: it holds a "
            "checkpoint but no model yet (a run saves its model after its last step); finish "
            f"it with `{command}`, then evaluate it"
        )
    return (
        f"model_dir {str(model_dir)!r} is an `s2attn train` run that has saved no model and no "
        "checkpoint: it is still starting, or stopped before its first checkpoint (then delete "
        "it and train again)"
    )


def _context_limit(config) -> int:
    """The longest input the model covers: its S2 patterns' length, else its RoPE table's."""
    text = config.get_text_config(decoder=True)
    settings = getattr(text, "s2attn", None)
    limit = text.max_position_embeddings
    if settings:
        limit = min(limit, settings["max_seq_len"])
    return limit
