"""Test set-up: run kernels under the Triton interpreter when there is no GPU, and poison every
kernel output before launch so an unwritten element fails the comparison."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["S2ATTN_POISON_OUTPUTS"] = "1"
