"""s2attn: S2 (sparsely-sharded) attention, block-sparse per head and per context range, in Triton.

On a CPU, calls run an exact PyTorch path that walks the kept blocks in bounded memory; set
``TRITON_INTERPRET=1`` before importing s2attn to run the Triton kernels under the interpreter
instead.
"""

from .attention import merge_partials, sparse_attention, sparse_attention_qkvpacked
from .builders import local_stride_pattern
from .inference import (
    ModelKVCache,
    PagedKVCache,
    capture_decode_step,
    paged_kv_cache,
    sparse_attention_with_kvcache,
)
from .modules import SparseAttention
from .pattern import BlockPattern, dense_pattern
from .reference import attention_reference

__all__ = [
    "BlockPattern",
    "ModelKVCache",
    "PagedKVCache",
    "SparseAttention",
    "attention_reference",
    "capture_decode_step",
    "dense_pattern",
    "local_stride_pattern",
    "merge_partials",
    "paged_kv_cache",
    "sparse_attention",
    "sparse_attention_qkvpacked",
    "sparse_attention_with_kvcache",
]

__version__ = "0.1.0"
