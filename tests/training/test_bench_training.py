"""benchmarks/bench_training.py --preset: the variants that split an HHST step into its parts
(``floor``: no attention anywhere; ``hhst-floor``: the S2 layers without attention, the dense ones
attending) build what they say, and the table reports the S2 layers' share."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from s2attn.integrations import transformers as s2hf
from s2attn.training import presets

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))
    import bench_training

    return bench_training


def _args(**kw):
    defaults = dict(preset="tiny", checkpointing=False, steps=2, warmup=1, smoke=True)
    return argparse.Namespace(**{**defaults, **kw})


@pytest.mark.parametrize("variant", ["floor", "hhst-floor", "hhst"])
def test_each_layer_attends_as_the_variant_says(variant, monkeypatch):
    bt = _bench()
    calls = []
    real_floor, real_attention = bt.floor_attention, s2hf.attention_forward

    def floor(module, *args, **kwargs):
        calls.append((module.layer_idx, "floor"))
        return real_floor(module, *args, **kwargs)

    def attention(module, *args, **kwargs):
        calls.append((module.layer_idx, "attention"))
        return real_attention(module, *args, **kwargs)

    monkeypatch.setattr(bt, "floor_attention", floor)
    monkeypatch.setattr(s2hf, "attention_forward", attention)
    model = bt.build_preset(variant, 64, _args(), "cpu")
    # transformers holds the functions registered before the spies: register the spies instead.
    import transformers

    if variant == "hhst":
        transformers.AttentionInterface.register(s2hf.ATTN_IMPLEMENTATION, attention)
    if variant == "floor":
        transformers.AttentionInterface.register(bt.FLOOR_IMPLEMENTATION, floor)
    try:
        model(input_ids=torch.randint(0, 256, (1, 64)))
    finally:
        s2hf.register()
    dense = set(presets.PRESETS["tiny"].s2.dense_layers)
    layers = range(presets.PRESETS["tiny"].num_layers)
    want = {
        "floor": [(i, "floor") for i in layers],
        "hhst-floor": [(i, "attention" if i in dense else "floor") for i in layers],
        "hhst": [(i, "attention") for i in layers],
    }[variant]
    assert calls == want


def test_table_reports_the_s2_layers_share():
    bt = _bench()
    rows = [
        dict(variant=v, seq=32768, step_s=t, tokens_per_s=32768 / t, peak_gib=1.0)
        for v, t in (("dense", 2.0), ("hhst", 1.0), ("hhst-floor", 0.8), ("floor", 0.5))
    ]
    env = dict(device="cpu", date="today", torch="x", triton="y", cuda=None, s2attn="z")
    text = bt.markdown(rows, env, _args(model="1b", dense_layers=2))
    assert "| 32k | S2 layers' share of hhst | 0.200 | | 20.0% |" in text
    assert "| 32k | ceiling (dense / floor) | | | 4.00x |" in text


def test_a_stride_suffix_sets_the_s2_layers_stride_and_pairs_with_its_floor():
    """``hhst-V4`` builds the preset with its S2 layers at vertical stride 4 (the preset's own
    otherwise), and the table sets each HHST row beside the floor twin of the same stride."""
    bt = _bench()
    assert bt.split_s2("hhst-floor-V32") == ("hhst-floor", {"vert_stride": 32})
    both = {"vert_stride": 32, "local_blocks": 8}
    assert bt.split_s2("hhst-floor-L8-V32") == ("hhst-floor", both)
    assert bt.split_s2("hhst-V32-L8") == ("hhst", both)
    assert bt.split_s2("hhst-V4-V8") == ("hhst-V4", {"vert_stride": 8})  # no variant: refused
    assert bt.split_s2("hhst") == ("hhst", {})
    own = bt.build_preset("hhst", 64, _args(), "cpu").config.s2attn
    wide = bt.build_preset("hhst-V4", 64, _args(), "cpu").config.s2attn
    assert own["vert_stride"] == presets.PRESETS["tiny"].s2.vert_stride != 4
    assert wide["vert_stride"] == 4 and wide["layer_types"] == own["layer_types"]
    window = bt.build_preset("hhst-L3-V4", 64, _args(), "cpu").config.s2attn
    assert own["local_blocks"] == presets.PRESETS["tiny"].s2.local_blocks != 3
    assert (window["local_blocks"], window["vert_stride"]) == (3, 4)
    rows = [
        dict(variant=v, seq=32768, step_s=t, tokens_per_s=32768 / t, peak_gib=1.0)
        for v, t in (("hhst-V4+compile", 1.0), ("hhst-floor-V4+compile", 0.9), ("dense", 2.0))
    ]
    env = dict(device="cpu", date="today", torch="x", triton="y", cuda=None, s2attn="z")
    text = bt.markdown(rows, env, _args(model="1b", dense_layers=2))
    assert "| 32k | S2 layers' share of hhst-V4+compile | 0.100 | | 10.0% |" in text
