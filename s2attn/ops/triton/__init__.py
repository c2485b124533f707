"""Triton kernels: the forward (forward.py) and the backward's dK/dV and dQ passes (backward.py),
each file its kernels and their launchers; common.py holds the pieces they share. Over a paged
KV cache: the decode kernel (decode.py) and the page writes (page_write.py)."""
