"""The command line: ``s2attn demo`` (also ``python -m s2attn demo``), ``s2attn draw``, and the
model commands ``s2attn train`` and ``s2attn eval`` (:mod:`s2attn.models`).

``demo`` builds an HHST-like layer stack for a 32-head model, checks each S2 pattern (density,
KV-efficiency, union completeness), runs the Triton kernel on one S2 layer and compares it with
the dense-mask reference; on a GPU it also times the kernel against dense SDPA. Without a GPU the
kernel runs under the Triton interpreter, on a small shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _ensure_backend() -> None:
    """Without a GPU, re-run this command under the Triton interpreter.

    Triton decides between compiled and interpreted kernels when a kernel is defined, i.e. when
    s2attn is imported, so the variable must be set before that: hence a fresh process.
    """
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "s2attn", *sys.argv[1:]])


def _hhst_layers(
    num_layers: int,
    num_dense_layers: int,
    num_heads: int,
    seq: int,
    block: int,
    local_blocks: int,
    vert_stride: int,
):
    """The pattern of every layer of an HHST stack: the first layers dense, the rest S2."""
    import s2attn

    layers = []
    for i in range(num_layers):
        if i < num_dense_layers:
            layers.append(
                ("dense", s2attn.dense_pattern(num_heads, max_seq_len=seq, block_size=block))
            )
        else:
            pattern = s2attn.local_stride_pattern(
                num_heads,
                max_seq_len=seq,
                block_size=block,
                local_blocks=local_blocks,
                vert_stride=vert_stride,
                head_offset=i,
            )
            layers.append(("S2", pattern))
    return layers


def demo(args: argparse.Namespace) -> int:
    import torch
    import triton

    import s2attn

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        seq, block, local_blocks, vert_stride, dim, check_seq = 32768, 64, 16, 16, 128, 4096
        dtype = torch.bfloat16
        where = f"GPU: {torch.cuda.get_device_name()}"
    else:
        seq, block, local_blocks, vert_stride, dim, check_seq = 512, 16, 4, 8, 32, 512
        dtype = torch.float16
        where = "CPU: kernels under the Triton interpreter (small shape)"
    heads = 32
    print(f"s2attn {s2attn.__version__} · torch {torch.__version__} · triton {triton.__version__}")
    print(where)
    print(
        f"\nHHST stack: {args.layers} layers, the first {args.dense_layers} dense, 32 heads, "
        f"seq {seq}, block {block}, local {local_blocks} blocks, vertical stride {vert_stride}"
    )
    layers = _hhst_layers(
        args.layers, args.dense_layers, heads, seq, block, local_blocks, vert_stride
    )
    print(f"{'layer':>5} {'kind':>5} {'density':>8} {'KV-efficient':>13} {'union-complete':>15}")
    for i, (kind, p) in enumerate(layers):
        print(
            f"{i:>5} {kind:>5} {p.density(seq):>8.3f} {str(p.is_kv_efficient()):>13} "
            f"{str(p.is_union_complete()):>15}"
        )
    _, pattern = layers[-1]
    print("\nhead 0 of the last layer, first 32 blocks ('#' kept, '.' skipped):")
    print(pattern.draw(head=0, max_blocks=32))

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, check_seq, heads, dim, device=device, dtype=dtype) for _ in range(3))
    t0 = time.perf_counter()
    out, lse = s2attn.sparse_attention(q, k, v, pattern, return_lse=True)
    if on_gpu:
        torch.cuda.synchronize()
    ran = time.perf_counter() - t0
    ref, ref_lse = s2attn.attention_reference(
        q.float(), k.float(), v.float(), pattern, return_lse=True
    )
    err = ((out.float() - ref).norm() / ref.norm()).item()
    lse_err = ((lse - ref_lse).norm() / ref_lse.norm()).item()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    ok = err < tol and lse_err < tol and not out.isnan().any()
    print(
        f"\nkernel vs float32 reference at seq {check_seq} ({dtype}): relative error out "
        f"{err:.1e}, lse {lse_err:.1e} (tolerance {tol:.0e}) -> {'OK' if ok else 'MISMATCH'}"
        + ("" if on_gpu else f"  [{ran:.1f} s under the interpreter]")
    )
    if on_gpu:
        _time_against_sdpa(pattern, seq, heads, dim, dtype)
    return 0 if ok else 1


def _time_against_sdpa(pattern, seq: int, heads: int, dim: int, dtype) -> None:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import s2attn

    q, k, v = (torch.randn(1, seq, heads, dim, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        return run

    print(f"\nforward time at seq {seq}, 32 heads, dim {dim}, {dtype} (median of do_bench):")
    kept = 4 * dim * pattern.kept_token_pairs(seq)
    dense = 4 * dim * heads * seq * (seq + 1) / 2
    rows = [("s2attn (this pattern)", lambda: s2attn.sparse_attention(q, k, v, pattern), kept)]
    rows.append(("SDPA flash (FA2), dense", sdpa(SDPBackend.FLASH_ATTENTION), dense))
    rows.append(("SDPA cuDNN, dense", sdpa(SDPBackend.CUDNN_ATTENTION), dense))
    base = None
    for name, fn, flops in rows:
        try:
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except RuntimeError as exc:  # a backend this build lacks
            print(f"  {name:<26} unavailable ({str(exc).splitlines()[0][:60]})")
            continue
        base = base or ms
        print(
            f"  {name:<26} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s (FLOPs it computes)"
            f"  s2attn speed-up x{ms / base:.1f}"
        )


def draw(args: argparse.Namespace) -> int:
    import s2attn

    p = s2attn.local_stride_pattern(
        args.heads,
        max_seq_len=args.seq,
        block_size=args.block,
        local_blocks=args.local_blocks,
        vert_stride=args.vert_stride,
        causal=not args.bidirectional,
    )
    print(p)
    for h in range(min(args.heads, args.show_heads)):
        print(f"\nhead {h}:")
        print(p.draw(head=h, max_blocks=64))
    return 0


_MODEL_COMMANDS = {
    "train": ("s2attn.models.train", "train an HHST (or dense, S2, local, homo) language model"),
    "eval": ("s2attn.models.evaluate", "validation bits per byte and needle retrieval of a model"),
}


def _lazy_command(parser: argparse.ArgumentParser, module: str) -> None:
    """Give ``parser`` the arguments of ``module``, imported only when its command runs: the model
    commands pull in transformers, which ``demo`` and ``draw`` do not need."""
    import importlib

    command = importlib.import_module(module)
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="s2attn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="check and run an HHST-like pattern (GPU if present)")
    d.add_argument("--layers", type=int, default=8)
    d.add_argument("--dense-layers", type=int, default=2)
    d.set_defaults(func=demo)
    p = sub.add_parser("draw", help="print a local-stride pattern, head by head")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=4)
    p.add_argument("--vert-stride", type=int, default=4)
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--show-heads", type=int, default=4)
    p.set_defaults(func=draw)
    argv = sys.argv[1:] if argv is None else list(argv)
    for name, (module, help_text) in _MODEL_COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        if argv[:1] == [name]:
            _lazy_command(command, module)
    args = parser.parse_args(argv)
    if args.command == "demo":
        _ensure_backend()
    if args.command in _MODEL_COMMANDS:
        try:
            return args.func(args)
        except ValueError as exc:  # bad input, caught before anything was written
            print(f"s2attn {args.command}: error: {exc}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
