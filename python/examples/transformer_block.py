"""Swap ioattn into a small transformer block and check it against PyTorch's SDPA.

    python python/examples/transformer_block.py                 # CPU (or CUDA when available)
    python python/examples/transformer_block.py --device cuda --dtype bf16 --compile

The block is a pre-norm decoder layer (grouped-query causal attention + MLP) whose attention is
a plug: `sdpa` calls torch.nn.functional.scaled_dot_product_attention on [b, h, s, d] tensors,
`ioattn` calls ioattn.torch.attention on the same tensors viewed as [b, s, h, d] (a transpose
of strides, no copy). The script runs both on the same weights and inputs, prints the largest
difference of the outputs and, where this build of ioattn has a backward, of the gradients.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import ioattn
import ioattn.torch


def sdpa_attention(q, k, v, causal):
    """q, k, v: [b, h, s, d] -> [b, h, s, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ioattn_attention(q, k, v, causal):
    """The same contract on ioattn: [b, h, s, d] viewed as [b, s, h, d] without a copy; GQA
    natively (no repeat of K and V)."""
    o = ioattn.torch.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               causal=causal)
    return o.transpose(1, 2)


class Block(torch.nn.Module):
    def __init__(self, dim=256, heads=8, kv_heads=2, mlp_ratio=4):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, mlp_ratio * dim), torch.nn.GELU(),
                                       torch.nn.Linear(mlp_ratio * dim, dim))
        self.attention = sdpa_attention

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)      # [b, h, s, d]
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        a = self.attention(q, k, v, causal=True)                       # [b, h, s, d]
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def run(block, x, attention, compile_model):
    block.attention = attention
    model = torch.compile(block, fullgraph=True) if compile_model else block
    x = x.detach().clone().requires_grad_()
    with torch.no_grad():
        model(x)  # warm-up: compilation, and torch's one-time custom-op setup
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = model(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    grads = None
    try:
        y.float().square().mean().backward()
        grads = [x.grad] + [p.grad for p in block.parameters()]
    except NotImplementedError as e:
        print(f"  gradients: not compared ({str(e).splitlines()[0]})")
    for p in block.parameters():
        p.grad = None
    return y.detach(), grads, seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True)")
    args = ap.parse_args()
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    block = Block().to(device=args.device, dtype=dtype)
    x = torch.randn(args.batch, args.seqlen, 256, device=args.device, dtype=dtype)

    print(f"ioattn {ioattn.__version__}, torch {torch.__version__}, {args.device} {args.dtype}, "
          f"batch {args.batch} seqlen {args.seqlen}, compile={args.compile}")
    y_ref, g_ref, t_ref = run(block, x, sdpa_attention, args.compile)
    y, g, t = run(block, x, ioattn_attention, args.compile)
    q = torch.empty(args.batch, args.seqlen, block.heads, block.head_dim, device=args.device,
                    dtype=dtype)
    kv = q[:, :, :block.kv_heads]
    print(f"  ioattn kernel: {ioattn.select(q, kv, kv, causal=True)['kernel']}")
    out_err = (y.float() - y_ref.float()).abs().max().item()
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    print(f"  output: max |ioattn - sdpa| = {out_err:.3g} (tolerance {tol:g}); "
          f"block forward {t * 1e3:.1f} ms vs {t_ref * 1e3:.1f} ms")
    ok = out_err <= tol
    if g is not None and g_ref is not None:
        grad_err = max((a.float() - b.float()).abs().max().item()
                       / max(b.float().abs().max().item(), 1e-30) for a, b in zip(g, g_ref))
        print(f"  gradients (input and {len(g) - 1} parameters): "
              f"max |ioattn - sdpa| / max |sdpa| = {grad_err:.3g}")
        ok = ok and grad_err <= 10 * tol
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
