"""The shapes several benchmarks share, so that their tables measure one problem.

The main attention table (``bench_attention.py``), the decode table (``bench_decode.py``) and the
tuning scripts that take them apart: 32 query heads of dim 128 (8 KV heads where grouped), pattern
block 64, local window 16 blocks. ``SMOKE_MODEL``: the tiny Llama of the CPU smoke runs of
``bench_autocast.py`` and ``bench_training.py``.
"""

HEADS = 32
KV_HEADS = 8  # the grouped-query cases: GQA 32/8
DIM = 128
BLOCK = 64
LOCAL_BLOCKS = 16

SMOKE_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
)
