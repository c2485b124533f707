"""End-to-end check: train a tiny transformer on a copy task with S2 attention and with dense SDPA.

The model: token embedding, two pre-norm blocks (rotary attention + MLP), a causal LM head. The
task: ``L`` random tokens, a separator, the same ``L`` tokens again; the loss counts only the
copy half, so every prediction needs the token exactly ``L`` positions back. With the default
sequence of 1024 (``L`` = 512) and a local window of 4 blocks of 64 (256 tokens), no query reaches
its source through the local window: only the vertical stripes do, and only in the heads whose
stripes hit the right block. The heads together cover every block (union completeness), so the
S2 model can learn the task; its loss curve should track the dense one.

Both runs use the same seed, the same initial weights and the same batches. The script prints a
progress line every ``--log-every`` steps and writes both loss curves (PNG and JSON, with the
device, library versions and date) to ``--out-dir``.

    python benchmarks/train_copy_task.py                      # GPU, bf16, 300 steps
    TRITON_INTERPRET=1 python benchmarks/train_copy_task.py --steps 3 --seq 256 \\
        --out-dir /tmp/copy_task         # CPU smoke run: the interpreter, fp32, batch 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import nn

import s2attn
from s2attn.stack import S2Settings

RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------- the model
def rotary_tables(
    seq: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq, 1, head_dim // 2) for rotary position embeddings."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.arange(seq, device=device).float()[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim), rotated in its own dtype (so bf16 stays bf16)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention on (batch, seq, heads, head_dim) tensors."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return out.transpose(1, 2)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, attention: nn.Module | None):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attention = attention  # None: dense SDPA

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = sdpa_attention if self.attention is None else self.attention
        x = x + self.proj(attn(q, k, v).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class CopyModel(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, attention: nn.Module | None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        head_dim = x.shape[-1] // self.blocks[0].heads
        cos, sin = rotary_tables(tokens.shape[1], head_dim, tokens.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------- the task
def copy_batch(
    batch: int, seq: int, vocab: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``seq`` tokens each: [x_1..x_L, SEP, x_1..x_L] shifted by one, with
    L = seq // 2; targets outside the copy half are -100 (ignored by the loss)."""
    half = seq // 2
    sep = vocab - 1
    data = torch.randint(0, vocab - 1, (batch, half), generator=gen)
    full = torch.cat([data, torch.full((batch, 1), sep), data], dim=1)[:, : seq + 1]
    inputs, targets = full[:, :-1].clone(), full[:, 1:].clone()
    targets[:, :half] = -100  # predictions before the separator's successor are not scored
    return inputs.to(device), targets.to(device)


# ------------------------------------------------------------------------------ one training
def train(
    name: str, attention: nn.Module | None, args: argparse.Namespace, device: torch.device
) -> dict:
    torch.manual_seed(args.seed)  # same initial weights for every run
    model = CopyModel(args.vocab, args.dim, args.heads, args.layers, attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    gen = torch.Generator().manual_seed(args.seed)  # same batches for every run
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]

    def loss_of(inputs, targets):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()), logits

    losses: list[torch.Tensor] = []
    bar = _progress(args.steps, name)
    start = time.perf_counter()
    first_step = 0.0
    for step in range(1, args.steps + 1):
        inputs, targets = copy_batch(args.batch, args.seq, args.vocab, gen, device)
        loss, _ = loss_of(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
        if step == 1:  # the first step compiles the kernels: timed apart
            loss.item()  # waits for the device
            first_step = time.perf_counter() - start
        if step % args.log_every == 0 or step == args.steps:
            bar(step, loss.item(), time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    # Held-out batch: next-token accuracy on the copy half (teacher forcing).
    model.eval()
    with torch.no_grad():
        inputs, targets = copy_batch(args.batch, args.seq, args.vocab, gen, device)
        eval_loss, logits = loss_of(inputs, targets)
        scored = targets != -100
        accuracy = (logits.argmax(-1)[scored] == targets[scored]).float().mean().item()
    curve = torch.stack(losses).float().cpu().tolist()
    tail = curve[-max(1, len(curve) // 10) :]
    print(
        f"[{name}] done in {seconds:.1f} s: final loss {sum(tail) / len(tail):.4f} (mean of the "
        f"last {len(tail)} steps), held-out loss {eval_loss.item():.4f}, copy accuracy "
        f"{accuracy:.3f}",
        flush=True,
    )
    return {
        "losses": curve,
        "seconds": seconds,
        "first_step_seconds": first_step,
        "final_loss": sum(tail) / len(tail),
        "eval_loss": eval_loss.item(),
        "copy_accuracy": accuracy,
    }


def _progress(total: int, name: str):
    """A callback (step, loss, seconds): a tqdm bar when tqdm is installed, else printed lines."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda step, loss, sec: print(
            f"[{name}] step {step:5d}/{total} loss {loss:.4f} ({sec:.1f} s)", flush=True
        )
    bar = tqdm(total=total, desc=name)

    def update(step, loss, sec):
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.4f}")
        if step == total:
            bar.close()

    return update


# ------------------------------------------------------------------------------------- main
def _device_slug(device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        return "cpu", "cpu"
    name = torch.cuda.get_device_name(device)
    words = re.sub(r"[^a-z0-9]+", " ", name.lower().replace("nvidia", "")).split()
    return name, words[0] if words else "cuda"


def _plot(path: Path, runs: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss on the copy half")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (even)")
    ap.add_argument("--batch", type=int, default=None, help="32 on cuda, 2 on cpu")
    ap.add_argument("--vocab", type=int, default=64, help="data tokens + the separator")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--local-blocks", type=int, default=4)
    ap.add_argument("--vert-stride", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="autocast dtype; bf16 on cuda, fp32 on cpu (the interpreter's bf16 dot is wrong)",
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.batch = args.batch or (32 if device.type == "cuda" else 2)
    if args.seq % 2:
        ap.error(f"--seq must be even, got {args.seq}")

    s2 = S2Settings(
        block_size=args.block_size,
        local_blocks=args.local_blocks,
        vert_stride=args.vert_stride,
        dense_layers=(),
    )
    pattern = s2.pattern(args.heads, max_seq_len=args.seq)
    window = args.local_blocks * args.block_size
    if window >= args.seq // 2:
        print(
            f"warning: the local window ({window} tokens) reaches the copy source "
            f"({args.seq // 2} tokens back); the stripes are not needed",
            flush=True,
        )
    if not pattern.is_union_complete():
        ap.error("the pattern is not union-complete: some blocks are reached by no head")
    device_name, slug = _device_slug(device)
    print(
        f"{device_name} | {args.dtype} | seq {args.seq} batch {args.batch} dim {args.dim} "
        f"heads {args.heads} layers {args.layers} | {pattern} | union complete, local window "
        f"{window} tokens, copy distance {args.seq // 2}",
        flush=True,
    )

    runs = {
        "s2attn": train("s2attn", s2attn.SparseAttention(pattern), args, device),
        "sdpa dense": train("sdpa dense", None, args, device),
    }

    args.out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = args.out_dir / f"{date}_{slug}_copy_task"
    title = (
        f"copy task, seq {args.seq}: S2 (block {args.block_size}, local {args.local_blocks}, "
        f"stride {args.vert_stride}, density {pattern.density(args.seq):.3f}) vs dense SDPA | "
        f"{device_name}, {args.dtype}, {date}"
    )
    _plot(stem.with_suffix(".png"), runs, title)
    record = {
        "date": date,
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "s2attn": s2attn.__version__,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "pattern": {
            "repr": repr(pattern),
            "density": pattern.density(args.seq),
            "union_complete": True,
            "kv_efficient": pattern.is_kv_efficient(),
        },
        "runs": runs,
    }
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(f"wrote {stem}.png and {stem}.json", flush=True)
    for name, run in runs.items():
        print(
            f"{name:>10}: final loss {run['final_loss']:.4f}, held-out loss "
            f"{run['eval_loss']:.4f}, copy accuracy {run['copy_accuracy']:.3f}, "
            f"{run['seconds']:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
