"""The command line: ``s2attn demo`` (also ``python -m s2attn demo``), ``s2attn draw``, and the
model commands ``s2attn train`` and ``s2attn eval`` (:mod:`s2attn.training`).

``demo`` builds an HHST-like layer stack for a 32-head model, checks each S2 pattern (density,
KV-efficiency, union completeness), runs the Triton kernel on one S2 layer and compares it with
the dense-mask reference; on a GPU it also times the kernel against dense SDPA. Without a GPU the
kernel runs under the Triton interpreter, on a small shape.

Bad option values are usage errors (exit status 2) that name the option. The model commands
check the packages they need (the ``models`` extra) before anything else, and name the extra when
one is missing (exit status 1). Output cut short by its reader (``s2attn draw | head``) ends the
command quietly, as SIGPIPE ends other command-line tools.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

_DESCRIPTION = """\
S2 (sparsely-sharded) attention: per-head block-sparse attention in Triton.
Check and draw S2 patterns, run the kernels against the dense reference, and
train and evaluate HHST language models.
"""

_EPILOG = """\
examples:
  s2attn demo                                  check an HHST stack and run the kernel
  s2attn draw --heads 4 --vert-stride 4        print a local-stride pattern, head by head
  s2attn train --preset tiny --out runs/tiny   train a tiny model (CPU, about 30 s)
  s2attn eval runs/tiny                        its validation bits per byte

Without a GPU the kernels run under the Triton interpreter, on small shapes.
"""

# The demo's shapes per device: pattern length and timing sequence, block size, local window and
# vertical stride (in blocks), head dimension; and on the GPU the longest sequence at which the
# kernel is checked against the float32 reference.
_DEMO_GPU = {"seq": 32768, "block": 64, "local_blocks": 16, "vert_stride": 16, "dim": 128}
_DEMO_CPU = {"seq": 512, "block": 16, "local_blocks": 4, "vert_stride": 8, "dim": 32}
_DEMO_GPU_CHECK_SEQ = 4096
_DEMO_HEADS = 32

# Blocks per axis that a picture shows (``BlockPattern.draw``'s ``max_blocks``).
_DRAW_BLOCKS = 64
_DEMO_DRAW_BLOCKS = 32


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``, else a usage error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _block_size(text: str) -> int:
    """An argparse ``type``: a power of two >= 16, as the kernels' block sizes must be."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 16 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two >= 16, got {text!r}")
    return value


def _legend(block_size: int, causal: bool, max_blocks: int) -> str:
    """What the characters of ``BlockPattern.draw`` mean."""
    lines = [
        f"legend (rows: query blocks, columns: KV blocks, {block_size} tokens each; "
        f"at most {max_blocks} of each shown):",
        "  #        attended",
        "  .        skipped by the pattern",
    ]
    if causal:
        lines.append(
            "  (blank)  hidden by the causal mask: the KV block comes after the query block"
        )
    return "\n".join(lines)


def _ensure_backend(argv: list[str]) -> None:
    """Without a GPU, re-run this command (``argv``) under the Triton interpreter.

    Triton decides between compiled and interpreted kernels when a kernel is defined, i.e. when
    s2attn is imported, so the variable must be set before that: hence a fresh process.
    """
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "s2attn", *argv])


def demo(args: argparse.Namespace) -> int:
    import torch
    import triton

    import s2attn
    from s2attn.stack import S2Settings

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    shape = _DEMO_GPU if on_gpu else _DEMO_CPU
    seq = shape["seq"] if args.seq is None else args.seq
    block, local_blocks = shape["block"], shape["local_blocks"]
    vert_stride, dim = shape["vert_stride"], shape["dim"]
    if on_gpu:
        check_seq = min(seq, _DEMO_GPU_CHECK_SEQ)
        dtype = torch.bfloat16
        where = f"GPU: {torch.cuda.get_device_name()}"
    else:
        check_seq = seq
        dtype = torch.float16
        where = "CPU: kernels under the Triton interpreter (small shape)"
    heads = _DEMO_HEADS
    print(f"s2attn {s2attn.__version__} · torch {torch.__version__} · triton {triton.__version__}")
    print(where)
    print(
        f"\nHHST stack: {args.layers} layers, the first {args.dense_layers} dense, {heads} heads, "
        f"seq {seq}, block {block}, local {local_blocks} blocks, vertical stride {vert_stride}"
    )
    stack = S2Settings(
        block_size=block,
        local_blocks=local_blocks,
        vert_stride=vert_stride,
        dense_layers=tuple(range(args.dense_layers)),
    )
    kinds = stack.layer_types(args.layers)
    layers = stack.layer_patterns(args.layers, heads, max_seq_len=seq)
    print(f"{'layer':>5} {'kind':>5} {'density':>8} {'KV-efficient':>13} {'union-complete':>15}")
    for i, (kind, p) in enumerate(zip(kinds, layers)):
        print(
            f"{i:>5} {'S2' if kind == 's2' else kind:>5} {p.density(seq):>8.3f} "
            f"{str(p.is_kv_efficient()):>13} {str(p.is_union_complete()):>15}"
        )
    pattern = layers[-1]
    print("\nhead 0 of the last layer")
    print(_legend(block, pattern.causal, _DEMO_DRAW_BLOCKS))
    print(pattern.draw(head=0, max_blocks=_DEMO_DRAW_BLOCKS))

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
    from s2attn.rules import LocalStride
    from s2attn.stack import S2Settings

    family = LocalStride(local_blocks=args.local_blocks, vert_stride=args.vert_stride)
    settings = S2Settings(block_size=args.block, dense_layers=(), family=family)
    p = settings.pattern(args.heads, max_seq_len=args.seq, causal=not args.bidirectional)
    print(p)
    print(_legend(args.block, p.causal, _DRAW_BLOCKS))
    show = args.show_heads if args.show_heads is not None else min(args.heads, 4)
    for h in range(show):
        print(f"\nhead {h}:")
        print(p.draw(head=h, max_blocks=_DRAW_BLOCKS))
    return 0


_MODEL_COMMANDS = {
    "train": (
        "s2attn.training.train",
        "train an HHST (or dense, S2, local, homo) language model",
    ),
    "eval": (
        "s2attn.training.evaluate",
        "validation bits per byte and needle retrieval of a model",
    ),
}


def _lazy_command(parser: argparse.ArgumentParser, module: str) -> None:
    """Give ``parser`` the arguments of ``module``, imported only when its command runs: the model
    commands pull in transformers, which ``demo`` and ``draw`` do not need."""
    import importlib

    command = importlib.import_module(module)
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)


def _add_demo(sub) -> argparse.ArgumentParser:
    d = sub.add_parser(
        "demo",
        help="check and run an HHST-like pattern (GPU if present)",
        description=(
            f"Build an HHST-like layer stack for a {_DEMO_HEADS}-head model (the first layers "
            "dense, the rest S2), check each S2 pattern (density, KV-efficiency, union "
            "completeness), run the Triton kernel on the last layer and compare it with the "
            "dense-mask reference; on a GPU also time it against dense SDPA. Without a GPU the "
            "command re-runs itself under the Triton interpreter, on a small shape. Exit status 1 "
            "when the kernel and the reference disagree."
        ),
    )
    d.add_argument(
        "--layers",
        metavar="N",
        type=_int_at_least(1),
        default=8,
        help="layers in the stack (default: %(default)s)",
    )
    d.add_argument(
        "--dense-layers",
        metavar="N",
        type=_int_at_least(0),
        default=2,
        help="how many of the first layers are dense; less than --layers, so that the last "
        "layer, which the kernel runs on, is S2 (default: %(default)s)",
    )
    d.add_argument(
        "--seq",
        metavar="TOKENS",
        type=_int_at_least(1),
        help="sequence length in tokens of the patterns, of the kernel check and, on a GPU, of "
        f"the timing; the GPU check runs at most {_DEMO_GPU_CHECK_SEQ} tokens "
        f"(default: {_DEMO_GPU['seq']} on a GPU, {_DEMO_CPU['seq']} on the CPU)",
    )
    d.set_defaults(func=demo)
    return d


def _add_draw(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "draw",
        help="print a local-stride pattern, head by head",
        description=(
            "Build a local-stride (S2) pattern: each query block attends a local window of KV "
            "blocks and a vertical stripe of KV blocks at a fixed stride, the stripes shifted by "
            "one block per head so that the heads together cover every block. Print its summary "
            f"and a picture of the first {_DRAW_BLOCKS} blocks of each shown head."
        ),
    )
    p.add_argument(
        "--heads",
        metavar="N",
        type=_int_at_least(1),
        default=4,
        help="attention heads (default: %(default)s)",
    )
    p.add_argument(
        "--seq",
        metavar="TOKENS",
        type=_int_at_least(1),
        default=2048,
        help="sequence length in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--block",
        metavar="TOKENS",
        type=_block_size,
        default=64,
        help="block size in tokens, a power of two >= 16 (default: %(default)s)",
    )
    p.add_argument(
        "--local-blocks",
        metavar="N",
        type=_int_at_least(1),
        default=4,
        help="local window in blocks, the query's own block included (default: %(default)s)",
    )
    p.add_argument(
        "--vert-stride",
        metavar="N",
        type=_int_at_least(1),
        default=4,
        help="distance in blocks between a head's vertical stripes (default: %(default)s)",
    )
    p.add_argument(
        "--bidirectional",
        action="store_true",
        help="no causal mask: the local window reaches both ways (default: causal)",
    )
    p.add_argument(
        "--show-heads",
        metavar="N",
        type=_int_at_least(1),
        help="how many heads to draw, from head 0; at most --heads (default: all, at most 4)",
    )
    p.set_defaults(func=draw)
    return p


# The exit status of a command whose reader went away (128 + SIGPIPE), as shells report it.
_BROKEN_PIPE = 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        # Flushed here, so that a reader gone by now raises below and not at interpreter exit.
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's own exit-time flush would fail again and print "Exception ignored": whatever
        # is still buffered goes nowhere instead.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _BROKEN_PIPE
    return code


def _main(argv: list[str] | None) -> int:
    from .training.dependencies import missing_required

    parser = argparse.ArgumentParser(
        prog="s2attn",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        title="commands",
        help="`s2attn COMMAND --help` lists its options",
    )
    demo_parser = _add_demo(sub)
    draw_parser = _add_draw(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    for name, (module, help_text) in _MODEL_COMMANDS.items():
        command = sub.add_parser(
            name, help=help_text, description=help_text[:1].upper() + help_text[1:] + "."
        )
        if argv[:1] == [name]:
            # Before the command's module is imported: it imports transformers.
            problem = missing_required(name)
            if problem is not None:
                print(f"s2attn {name}: error: {problem}", file=sys.stderr)
                return 1
            _lazy_command(command, module)
    args = parser.parse_args(argv)
    # Checks across options, after parsing, so each error still names the option at fault.
    if args.command == "demo" and args.dense_layers >= args.layers:
        demo_parser.error(
            f"argument --dense-layers: must be less than --layers ({args.layers}) so that the "
            f"last layer is S2, got {args.dense_layers}"
        )
    if args.command == "draw" and args.show_heads is not None and args.show_heads > args.heads:
        draw_parser.error(
            f"argument --show-heads: must be at most --heads ({args.heads}), got {args.show_heads}"
        )
    if args.command == "demo":
        _ensure_backend(argv)
    if args.command in _MODEL_COMMANDS:
        try:
            return args.func(args)
        except ValueError as exc:  # bad input, caught before anything was written
            print(f"s2attn {args.command}: error: {exc}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
