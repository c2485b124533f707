"""Triton kernels: the forward (forward.py) and the backward's dK/dV and dQ passes (backward.py),
with the row-delta pass they read (row_delta.py), each file its kernels and their launchers;
common.py holds the pieces they share. Over a paged KV cache: the decode kernel (decode.py) and
the page writes (page_write.py)."""
