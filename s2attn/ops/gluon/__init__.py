"""Warp-specialized Gluon kernels for Hopper (sm_90): the forward (forward_sm90.py) and the
backward's dQ and dK/dV passes (backward_sm90.py), each with its launchers; common_sm90.py holds
what they share (work items, the producer partition, descriptors, the warp specialization), and
dkdv_queue_sm90.py the order of the dK/dV kernel's work items."""
