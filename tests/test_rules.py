"""Pattern families (s2attn.rules): a family defined outside the package, here a dilated window
with no closed forms for its checks, builds patterns through family_pattern and S2Settings and
goes through a transformers config; its checks (walked from its generated lists) equal the
dense-mask answers, and the local-stride family's rules are values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from test_pattern import _assert_checks_equal_the_mask

from s2attn.builders import family_pattern
from s2attn.rules import FAMILIES, DenseRule, HeadRule, LocalStride, LocalStrideRule
from s2attn.rules.base import PatternFamily
from s2attn.stack import S2Settings, config_layer_pattern


@dataclass(frozen=True)
class DilatedRule(HeadRule):
    """Query block i keeps KV blocks i - dilation * k for k in [0, window) (and, bidirectional,
    i + dilation * k): a window with holes, which no closed form here answers for."""

    window: int
    dilation: int

    def row_lists(self, nb, causal, device=None, rows=None):
        first, stop = (0, nb) if rows is None else rows
        i = torch.arange(first, stop)[:, None]
        j = torch.arange(nb)[None, :]
        d = i - j if causal else (i - j).abs()
        keep = (d >= 0) & (d % self.dilation == 0) & (d // self.dilation < self.window)
        row, col = keep.nonzero(as_tuple=True)
        return keep.sum(1).to(device), (row + first).to(device), col.to(device)

    def counts(self, nb, causal):
        counts, rows, cols = self.row_lists(nb, causal)
        return int(counts.sum()), int(counts[-1]), int((cols == nb - 1).sum())

    def dense_reason(self, nb, causal, block_size):
        return None


@dataclass(frozen=True)
class Dilated(PatternFamily):
    name = "dilated"
    window: int = 4
    dilation: int = 2

    def group_rules(self, num_heads, num_groups):
        return [DilatedRule(self.window, self.dilation)] * num_groups


def _dilated_mask(heads, nb, window, dilation, causal) -> torch.Tensor:
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    d = i - j if causal else (i - j).abs()
    keep = (d >= 0) & (d % dilation == 0) & (d // dilation < window)
    return keep.expand(heads, nb, nb).clone()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window, dilation, nb", [(4, 2, 13), (3, 3, 7), (1, 2, 5), (6, 1, 9)])
def test_a_family_without_closed_forms_checks_like_its_mask(causal, window, dilation, nb):
    p = family_pattern(
        Dilated(window, dilation),
        4,
        max_seq_len=nb * 16,
        block_size=16,
        num_kv_heads=2,
        causal=causal,
    )
    mask = _dilated_mask(4, nb, window, dilation, causal)
    assert p.rules == (DilatedRule(window, dilation),) * 4
    # Head slices and crops stay rules (until the lists are built) and keep the same blocks.
    part, corner = p[1:3], p.crop(nb // 2 + 1)
    assert part.rules == p.rules[1:3] and corner.rules == p.rules
    assert torch.equal(part.mask, mask[1:3])
    assert torch.equal(corner.mask, mask[:, : nb // 2 + 1, : nb // 2 + 1])
    assert torch.equal(p.mask, mask)
    _assert_checks_equal_the_mask(p, mask, (causal, window, dilation, nb))


def test_a_family_goes_through_settings_and_a_transformers_config(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from s2attn.integrations import transformers as s2hf

    settings = S2Settings(block_size=16, dense_layers=(0,), family=Dilated(3, 2))
    assert settings.window == 3 and settings.replace(dilation=4).family == Dilated(3, 4)
    config = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=256,
    )
    with pytest.raises(TypeError, match="local_blocks"):
        s2hf.configure(config, settings, local_blocks=2)  # not a field of this family
    # A family a config cannot be read back with (not listed in FAMILIES) is refused.
    with pytest.raises(ValueError, match="'dilated', not a pattern family"):
        s2hf.configure(config, settings)
    assert not hasattr(config, "s2attn")
    monkeypatch.setitem(FAMILIES, "dilated", Dilated)
    s2hf.configure(config, settings)
    assert config.s2attn["family"] == "dilated"
    assert S2Settings.from_config(config) == settings
    got = config_layer_pattern(config, 1)
    want = settings.pattern(4, max_seq_len=256, num_kv_heads=2)
    assert got.rules == want.rules and torch.equal(got.mask, want.mask)
    assert config_layer_pattern(config, 0) is None


def test_local_stride_rules_are_values():
    """Equal rules of one family are one rule (the pattern builds their lists once); rules of
    other families never equal them; the family's fields are plain, checked values."""
    assert LocalStrideRule(2, 4, 1) == LocalStrideRule(2, 4, 1)
    assert len({LocalStrideRule(2, 4, 1), LocalStrideRule(2, 4, 1), DenseRule()}) == 2
    assert DilatedRule(2, 4) != LocalStrideRule(2, 4, 0)
    family = LocalStride(local_blocks=torch.tensor(3), vert_stride=4)
    assert type(family.local_blocks) is int
    with pytest.raises(ValueError, match="vert_stride"):
        LocalStride(vert_stride=0)
    with pytest.raises(TypeError, match="homo_head"):
        LocalStride(homo_head=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        family.local_blocks = 2


def test_a_config_saved_before_families_reads_as_local_stride():
    """Configs saved before the "family" entry hold the local-stride fields alone."""
    entry = {
        "block_size": 16,
        "local_blocks": 2,
        "vert_stride": 4,
        "max_seq_len": 128,
        "num_dense_heads": 0,
        "homo_head": False,
        "head_offset": 1,
        "layer_types": ["s2", "dense"],
    }
    want = S2Settings(
        block_size=16, dense_layers=(1,), local_blocks=2, vert_stride=4, head_offset=1
    )
    assert S2Settings.from_config(entry) == want
    del entry["vert_stride"]
    with pytest.raises(ValueError, match="lacks vert_stride"):
        S2Settings.from_config(entry)
