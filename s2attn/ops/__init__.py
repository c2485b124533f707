"""The attention kernels and the choice among them. Kernels take layouts and strides, never
patterns.

    backends.py   the backends of each pass (forward, dK/dV, dQ, decode), one table per pass:
                  the tiles each walks, the calls it takes, its launcher
    dispatch.py   the entry points (forward, backward, decode): walk the tables, launch
    layout.py     pattern -> the passes' tile layouts (forward, dK/dV transpose, dQ)
    decode_layout.py  pattern -> a decode step's lists over a paged KV cache
    options.py    KernelOptions: backends and launch settings callers may pin (tests, sweeps)
    env.py        facts of the machine and process (interpreter, GPU capability, TMA, switches)
    shapes.py     what every launcher derives from the inputs and a layout: sequence lengths
                  (Varlen), the LSE dtype, query tiles, head groups, key-bound checks
    launcher.py   repeat launches without Triton's per-call binding (every kernel)
    triton/       Triton kernels and their launchers: forward, backward (dK/dV, dQ); decode
                  and page_write over a paged KV cache
    gluon/        warp-specialized Gluon kernels for Hopper: forward_sm90, backward_sm90
    cpu.py        the passes in plain PyTorch, where no Triton backend runs
"""
