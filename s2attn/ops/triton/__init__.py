"""Triton kernels: the forward (forward.py) and the backward's dK/dV and dQ passes (backward.py),
with the row-delta pass they read (row_delta.py), each file its kernels and their launchers;
common.py holds the pieces they share. Over a paged KV cache: the decode kernel (decode.py), the
page writes (page_write.py) and a step's per-KV-head page tables over pages of whole blocks
(page_tables.py)."""
