"""S2Settings, the S2 settings of a layer stack: from a preset through a transformers config (saved
and loaded again) to the patterns, and the CLI's demo stack built from the same object."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig

from s2attn import dense_pattern, local_stride_pattern
from s2attn.integrations import transformers as s2hf
from s2attn.stack import S2Settings
from s2attn.training import presets


def _same_pattern(got, want) -> None:
    assert (got.block_size, got.causal, got.num_heads) == (
        want.block_size,
        want.causal,
        want.num_heads,
    )
    assert torch.equal(got.mask, want.mask)


@pytest.mark.parametrize("variant", ["hhst", "s2", "local", "homo"])
def test_preset_settings_round_trip_through_a_saved_config(tmp_path, variant):
    """The settings a variant takes from its preset are those its saved-and-loaded config holds,
    and every layer's pattern there is the one the settings build (dense layers: none)."""
    preset = presets.PRESETS["tiny"]
    seq_len, max_seq_len = 128, 256
    settings = presets.variant_settings(preset, variant, seq_len=seq_len, max_seq_len=max_seq_len)
    config = presets.model_config(preset, variant, seq_len=seq_len, max_seq_len=max_seq_len)
    config.save_pretrained(tmp_path)
    loaded = LlamaConfig.from_pretrained(tmp_path)
    assert S2Settings.from_config(loaded) == settings
    assert S2Settings.from_config(config) == settings
    want = settings.pattern(
        preset.num_heads, max_seq_len=max_seq_len, num_kv_heads=preset.num_kv_heads
    )
    kinds = settings.layer_types(preset.num_layers)
    assert kinds == loaded.s2attn["layer_types"]
    for layer, kind in enumerate(kinds):
        got = s2hf.layer_pattern(loaded, layer)
        if kind == "dense":
            assert got is None
        else:
            _same_pattern(got, want)


def test_variants_derive_from_the_preset_settings():
    preset = presets.PRESETS["small"]
    s2 = preset.s2
    at = dict(seq_len=4096, max_seq_len=4096)
    assert presets.variant_settings(preset, "dense", **at) is None
    assert presets.variant_settings(preset, "hhst", **at) == s2
    assert presets.variant_settings(preset, "s2", **at) == s2.replace(dense_layers=())
    assert presets.variant_settings(preset, "homo", **at) == s2.replace(homo_head=True)
    local = presets.variant_settings(preset, "local", **at)
    # The window alone, as dense as the S2 pattern at 4k: 8 blocks of 64 (see PRESETS["small"]).
    assert (local.local_blocks, local.vert_stride, local.homo_head, local.head_offset) == (
        8,
        4096 // 64 + 1,
        True,
        1,
    )
    assert local.dense_layers == s2.dense_layers
    overridden = s2.replace(vert_stride=4, dense_layers=(0, 5))
    config = presets.model_config(preset, "hhst", s2=overridden)
    assert S2Settings.from_config(config) == overridden


def test_configure_takes_the_settings_or_their_fields():
    """configure(config, settings) stores every field, the keywords replace single fields, and
    an integer dense_layers counts layers spread through the stack (never first: see
    test_dense_layers_spread_through_the_stack)."""

    def config():
        return LlamaConfig(
            num_hidden_layers=4,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=32,
            max_position_embeddings=256,
        )

    settings = S2Settings(
        block_size=16, local_blocks=2, vert_stride=4, dense_layers=(3, 1), num_dense_heads=2
    )
    assert settings.dense_layers == (1, 3)
    assert S2Settings.from_config(s2hf.configure(config(), settings)) == settings
    given = s2hf.configure(config(), settings, head_offset=1, dense_layers=1)
    assert S2Settings.from_config(given) == settings.replace(head_offset=1, dense_layers=(2,))
    fields = s2hf.configure(config(), block_size=16, local_blocks=2, vert_stride=4)
    assert S2Settings.from_config(fields) == S2Settings(
        block_size=16, local_blocks=2, vert_stride=4, dense_layers=(1, 3)
    )
    _same_pattern(
        s2hf.layer_pattern(given, 1),
        local_stride_pattern(
            4,
            max_seq_len=256,
            block_size=16,
            local_blocks=2,
            vert_stride=4,
            num_kv_heads=2,
            num_dense_heads=2,
            head_offset=1,
        ),
    )
    with pytest.raises(ValueError, match=r"dense_layers must be layer indices in \[0, 4\)"):
        s2hf.configure(config(), settings.replace(dense_layers=(4,)))


def test_settings_refuse_bad_dense_layers():
    with pytest.raises(ValueError, match="dense_layers"):
        S2Settings(dense_layers=(-1,))
    with pytest.raises(ValueError, match="dense_layers"):
        S2Settings(dense_layers=("0",))
    with pytest.raises(ValueError, match=r"dense_layers must be layer indices in \[0, 2\)"):
        S2Settings(dense_layers=(2,)).layer_types(2)


def test_layer_patterns_are_the_stack_of_the_config():
    """The CLI demo's stack (layer_patterns) is the stack a configured model attends with."""
    settings = S2Settings(block_size=16, local_blocks=2, vert_stride=4, dense_layers=(0,))
    layers = settings.layer_patterns(3, 4, max_seq_len=128)
    _same_pattern(layers[0], dense_pattern(4, max_seq_len=128, block_size=16))
    assert layers[1] is layers[2]
    config = LlamaConfig(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=32,
        max_position_embeddings=128,
    )
    s2hf.configure(config, settings)
    _same_pattern(s2hf.layer_pattern(config, 1), layers[1])


def test_dense_layers_spread_through_the_stack():
    """A count of dense layers goes to the middle of equal slices of the stack: one of six is
    layer 3 (the `small` preset's, which retrieves), two of sixteen are 4 and 12; the first layer
    only when more than half are dense."""
    from s2attn.stack import spread_dense_layers

    assert spread_dense_layers(1, 6) == (3,)
    assert spread_dense_layers(2, 16) == (4, 12)
    assert spread_dense_layers(0, 5) == ()
    assert spread_dense_layers(6, 6) == tuple(range(6))
    for layers in range(1, 33):
        for count in range(layers + 1):
            spread = spread_dense_layers(count, layers)
            assert len(set(spread)) == count and all(0 <= i < layers for i in spread)
            assert 0 not in spread or 2 * count > layers
    with pytest.raises(ValueError, match="dense_layers must be in"):
        spread_dense_layers(7, 6)


def test_settings_hold_a_family_and_read_its_fields_through():
    """The local-stride fields given to S2Settings are its family's; they read and replace as the
    settings' own, and a name of neither is refused by name."""
    from s2attn.rules import LocalStride

    settings = S2Settings(block_size=16, local_blocks=2, vert_stride=4, dense_layers=(0,))
    assert settings.family == LocalStride(local_blocks=2, vert_stride=4)
    assert settings == S2Settings(16, (0,), LocalStride(local_blocks=2, vert_stride=4))
    assert settings.vert_stride == 4 and settings.replace(vert_stride=8).family.vert_stride == 8
    assert settings.replace(block_size=32).family == settings.family
    with pytest.raises(AttributeError, match="window"):
        _ = settings.window
    with pytest.raises(TypeError, match="S2Settings got window: neither a field of S2Settings"):
        settings.replace(window=3)
    with pytest.raises(TypeError, match=r"max_seq_len.*LocalStride \(local_blocks, vert_stride"):
        S2Settings(max_seq_len=64)  # a model's length, not a setting
    with pytest.raises(TypeError, match="family must be a PatternFamily"):
        S2Settings(family=(2, 4))
    with pytest.raises(ValueError, match="block_size"):
        S2Settings(block_size=24)
    with pytest.raises(ValueError, match="vert_stride"):
        S2Settings(vert_stride=0)
    assert len({settings, settings.replace(), S2Settings(**PATTERN_FIELDS)}) == 2


PATTERN_FIELDS = dict(block_size=16, local_blocks=2, vert_stride=8, dense_layers=(0,))
