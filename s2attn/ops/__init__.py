"""Triton kernels and their launchers. They take layouts and strides, never patterns."""
