"""The choices a caller may make about the kernels: which backend runs each pass, and how.

Every default is what the measurements chose (docs/design.md), so ordinary calls pass
nothing; tests and tuning sweeps pass a :class:`KernelOptions` to pin a backend, turn gathered KV
tiles off or try other launch settings. Each kernel's settings are one frozen dataclass whose
fields default to None, "the kernel's own default for this call's shape"; the launcher fills them
in (its ``default_config``).

    >>> KernelOptions(forward_backend="triton", triton_forward=TritonForwardConfig(num_warps=8))
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal, TypeVar

__all__ = [
    "Backend",
    "GluonDkdvConfig",
    "GluonDqConfig",
    "GluonForwardConfig",
    "KernelOptions",
    "TritonBackwardConfig",
    "TritonDecodeConfig",
    "TritonForwardConfig",
]

# "auto": the Gluon kernel where it supports the call (ops/backends.py), else Triton.
Backend = Literal["auto", "triton"]
_BACKENDS = ("auto", "triton")

_Config = TypeVar("_Config")


class _Settings:
    """What the per-kernel settings share: their set fields override a kernel's defaults."""

    def over(self: _Config, defaults: _Config) -> _Config:
        """``defaults`` with every field set here (not None) in its place."""
        changes = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        return replace(defaults, **changes) if changes else defaults


@dataclass(frozen=True)
class TritonForwardConfig(_Settings):
    """The Triton forward kernel's launch (ops/triton/forward.py).

    use_tma: K and V through bulk tensor copies, where the GPU and their strides allow.
    host_desc: with TMA, descriptors made once on the host (never for packed sequences).
    heads_per_group: heads whose query tiles run interleaved (``program_order``).
    pair: the unmasked loop takes two KV tiles per step (2 * block_n keys per MMA).
    q_in_regs: q stays in registers as the A operand of QK^T.
    """

    num_warps: int | None = None
    num_stages: int | None = None
    use_tma: bool | None = None
    host_desc: bool | None = None
    heads_per_group: int | None = None
    pair: bool | None = None
    q_in_regs: bool | None = None


@dataclass(frozen=True)
class TritonBackwardConfig(_Settings):
    """The launch of the Triton dK/dV kernels or of the Triton dQ kernel (ops/triton/backward.py).

    use_tma: bulk tensor copies (dK/dV: of q and dO; dQ: of K and V) where the GPU, the strides
    and (dK/dV) the sequence lengths allow. heads_per_group: as for the forward. a_in_regs: the
    MMAs' A operands stay in registers.
    """

    num_warps: int | None = None
    num_stages: int | None = None
    use_tma: bool | None = None
    heads_per_group: int | None = None
    a_in_regs: bool | None = None


@dataclass(frozen=True)
class TritonDecodeConfig(_Settings):
    """The Triton decode kernel's launch over a paged KV cache (ops/triton/decode.py): warps,
    pipeline depth, and keys per K/V tile (``block_n``, dividing the page size: a page is read
    in ``block_size // block_n`` slices). Decode has one backend and is not a pass of
    :class:`KernelOptions`: bench_decode.py's sweep hands it to the launcher.

    prefetch_entries: 0 (the default) reads each list entry, then its page id, then the page;
    a power of two W reads W entries' page ids as vectors before walking them, so that each
    page waits on its own loads only (two dependent round trips fewer per page)."""

    num_warps: int | None = None
    num_stages: int | None = None
    block_n: int | None = None
    prefetch_entries: int | None = None


@dataclass(frozen=True)
class GluonForwardConfig(_Settings):
    """The Gluon forward kernel's launch (ops/gluon/forward_sm90.py).

    num_buffers: K/V ring slots. entries_per_step: KV tiles per softmax step. q_in_regs: q as a
    register operand. persistent: one program per SM taking work items, else one per item.
    heads_per_group: heads whose work items are interleaved.
    """

    num_buffers: int | None = None
    entries_per_step: int | None = None
    q_in_regs: bool | None = None
    persistent: bool | None = None
    heads_per_group: int | None = None


@dataclass(frozen=True)
class GluonDqConfig(_Settings):
    """The Gluon dQ kernel's launch (ops/gluon/backward_sm90.py): K/V ring slots, persistent
    programs, heads whose work items are interleaved."""

    num_buffers: int | None = None
    persistent: bool | None = None
    heads_per_group: int | None = None


@dataclass(frozen=True)
class GluonDkdvConfig(_Settings):
    """The Gluon dK/dV kernel's launch (ops/gluon/backward_sm90.py): ring slots per stream, and
    (batch, KV head) pairs per group of its work queue (None: chosen per pattern by
    ``dkdv_order``)."""

    num_buffers: int | None = None
    heads_per_group: int | None = None


@dataclass(frozen=True)
class KernelOptions:
    """Which backend runs each pass of a call, and the settings of each kernel.

    forward_backend, dq_backend, dkdv_backend: "auto" (the Gluon kernel on sm_90 where it
        supports the call, else Triton) or "triton".
    gather_dq, gather_dkdv: whether the dQ and dK/dV layouts gather lone pattern blocks smaller
        than a KV tile into shared tiles (dK/dV only where each KV head has one pattern head).
    triton_forward, triton_dq, triton_dkdv, gluon_forward, gluon_dq, gluon_dkdv: each kernel's
        launch settings; the ones left None keep the kernel's default.
    """

    forward_backend: Backend = "auto"
    dq_backend: Backend = "auto"
    dkdv_backend: Backend = "auto"
    gather_dq: bool = True
    gather_dkdv: bool = True
    triton_forward: TritonForwardConfig = field(default_factory=TritonForwardConfig)
    triton_dq: TritonBackwardConfig = field(default_factory=TritonBackwardConfig)
    triton_dkdv: TritonBackwardConfig = field(default_factory=TritonBackwardConfig)
    gluon_forward: GluonForwardConfig = field(default_factory=GluonForwardConfig)
    gluon_dq: GluonDqConfig = field(default_factory=GluonDqConfig)
    gluon_dkdv: GluonDkdvConfig = field(default_factory=GluonDkdvConfig)

    def __post_init__(self) -> None:
        for name in ("forward_backend", "dq_backend", "dkdv_backend"):
            if getattr(self, name) not in _BACKENDS:
                raise ValueError(f"{name} must be one of {_BACKENDS}, got {getattr(self, name)!r}")
        for name, kind in _SETTINGS.items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                )


_SETTINGS = {
    "triton_forward": TritonForwardConfig,
    "triton_dq": TritonBackwardConfig,
    "triton_dkdv": TritonBackwardConfig,
    "gluon_forward": GluonForwardConfig,
    "gluon_dq": GluonDqConfig,
    "gluon_dkdv": GluonDkdvConfig,
}
