"""The options of `s2attn train` (s2attn.training.options): one flag per field, the preset's values
where none is given, and each bound refused with the flag's name. No model is built here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("transformers")

from s2attn.training import presets
from s2attn.training.options import RunControls, TrainOptions, add_arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--out", "unused", "--device", "cpu", *argv])


def test_every_flag_is_one_field():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    options = {f.name for f in dataclasses.fields(TrainOptions)}
    controls = {f.name for f in dataclasses.fields(RunControls)}
    # data_root is a control on the command line, and in the record the roots the corpus found.
    assert options & controls == {"data_root"}
    assert flags == (options | controls)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_unset_options_take_the_presets_values(name):
    preset = presets.PRESETS[name]
    options = TrainOptions.resolve(_parse("--preset", name))
    for key in ("steps", "seq_len", "batch_size", "warmup_steps", "val_every", "val_batches"):
        assert getattr(options, key) == getattr(preset, key), key
    assert options.lr == preset.lr and isinstance(options.lr, float)
    assert options.max_seq_len == preset.seq_len
    assert options.needle_fraction == preset.needle_fraction
    assert options.needles_per_sample == preset.needles_per_sample
    assert options.s2() == preset.s2
    assert options.dense_layers == tuple(preset.s2.dense_layers)

    given = TrainOptions.resolve(
        _parse("--preset", name, "--vert-stride", "3", "--local-blocks", "2", "--dense-layers", "1")
    )
    assert given.s2() == preset.s2.replace(vert_stride=3, local_blocks=2, dense_layers=(1,))


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--steps", "0"),
        ("--seq-len", "0"),
        ("--max-seq-len", "0"),
        ("--grad-accum", "0"),
        ("--warmup-steps", "-1"),
        ("--vert-stride", "0"),
        ("--local-blocks", "0"),
        ("--needles-per-sample", "0"),
        ("--val-every", "-1"),
        ("--val-needles", "-1"),
        ("--log-every", "0"),
        ("--checkpoint-every", "-1"),
    ],
)
def test_a_value_below_its_bound_names_the_flag(flag, value):
    with pytest.raises(ValueError, match=f"^{flag} must be >= "):
        TrainOptions.resolve(_parse(flag, value))


def test_run_controls_are_checked_against_the_steps():
    args = _parse("--stop-at", "0")
    with pytest.raises(ValueError, match="--stop-at must be >= 1, got 0"):
        RunControls.resolve(args, steps=5)
    with pytest.raises(ValueError, match="--stop-at 6 is beyond --steps 5"):
        RunControls.resolve(_parse("--stop-at", "6"), steps=5)
    with pytest.raises(ValueError, match="--time-limit must be a positive number"):
        RunControls.resolve(_parse("--time-limit", "0"), steps=5)
    controls = RunControls.resolve(_parse("--data-root", "a", "--data-root", "b"), steps=5)
    assert [str(r) for r in controls.data_root] == ["a", "b"] and not controls.resume
