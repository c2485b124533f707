"""Context parallelism: one long sequence split over the ranks of a ``torch.distributed`` group.

Each rank holds a shard of the sequence, laid out by :func:`shard`, and
:func:`context_parallel_attention` returns that rank's shard of the output; autograd returns each
rank its shards of dq, dk and dv. The result equals one-device :func:`s2attn.sparse_attention` on
the whole sequence.

A rank receives only the K/V tokens its queries read, per KV head, in one ``all_to_all_single``
each for K and V; the backward sends each received token's gradient back to its owner the same
way. Under a strided S2 pattern that is a few percent of an all-gather's ``(W - 1) / W`` of the
sequence (:func:`context_parallel_bytes` against :func:`communication_bytes`). Each of a rank's
two query chunks is computed against *compact* keys: the blocks it reads, with the chunk's rows of
the pattern renumbered onto them. Under a causal pattern the far blocks all lie before the chunk
and the tail keeps absolute spacing, so the kernels' causal rule (queries aligned bottom-right to
the keys) is the original one. A bidirectional chunk reads keys on both sides and needs no order,
but must be whole blocks (``local_seq / 2`` a multiple of the block size). So a rank holds its
shard, the rows it receives and its two chunks' compact keys: under S2, proportional to the blocks
it reads, not to the sequence.

The modules, from the sequence's layout to the call:

    sharding.py          shard, unshard: chunks r and 2W - 1 - r of 2W on rank r (load balance)
    collectives.py       the torch.distributed calls as the package makes them
    plan.py              a rank's plan: the rows it reads from each rank (built from its own rows
                         of the pattern, sent to the others once) and its chunks' compact keys
    exchange.py          the rows moved as the plan says (autograd returns their gradients)
    footprint.py         bytes moved and held per rank, against an all-gather's
    context_parallel.py  context_parallel_attention, after the ranks' agreement check
"""

from .context_parallel import context_parallel_attention
from .footprint import communication_bytes, context_parallel_bytes, context_parallel_kv_bytes
from .sharding import shard, unshard

__all__ = [
    "communication_bytes",
    "context_parallel_attention",
    "context_parallel_bytes",
    "context_parallel_kv_bytes",
    "shard",
    "unshard",
]
