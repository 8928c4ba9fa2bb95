#!/usr/bin/env python3
"""ioattn's CPU forward and forward+backward vs PyTorch's CPU SDPA in the same process.

    python3 bench/peer_cpu_torch.py [--threads 2] [--seqlens 1024,4096] [--hdims 64,128]
                                    [--heads 8] [--dtypes float32,bfloat16] [--repeats 5]
                                    [--no-backward] [--deterministic]

Both run on the same torch CPU tensors ([batch, seq, heads, d] memory; SDPA sees the
[batch, heads, seq, d] transpose view, ioattn reads the memory in place): ioattn through
ioattn.torch.attention (its autograd backward is ioattn::backward), PyTorch through
torch.nn.functional.scaled_dot_product_attention (on the CPU its fused flash-attention kernel for
these shapes). Forward: GFLOP/s = 4 b h s^2 d (halved when causal); forward+backward: 3.5x that
(the backward counted as 2.5x the forward, FlashAttention's convention), timed as one forward +
torch.autograd.grad with a fixed dO. Medians of --repeats timings; the implementations alternate
inside every repeat. Each row also prints max |O_ioattn - O_torch|. Needs torch and ioattn
(pip install . with the CPU build) in the same environment.
"""
import argparse
import json
import statistics
import time

import torch

import ioattn
import ioattn.torch  # noqa: F401  (registers the op)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--deterministic", action="store_true",
                    help="ioattn's backward with Context::deterministic (no thread-count-dependent split; "
                         "the fused pass where the (batch, kv head) tasks fill the threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    F = torch.nn.functional
    for dt_name in args.dtypes.split(","):
        dt = getattr(torch, dt_name)
        for s in map(int, args.seqlens.split(",")):
            for d in map(int, args.hdims.split(",")):
                for causal in map(int, args.causal.split(",")):
                    b, h = 1, args.heads
                    q, k, v, do = [(torch.rand(b, s, h, d) * 2 - 1).to(dt) for _ in range(4)]
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

                    def fwd_ioattn():
                        return ioattn.attention(q, k, v, causal=bool(causal), num_threads=args.threads)

                    def fwd_torch():
                        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                              v.transpose(1, 2), is_causal=bool(causal))

                    def fb_ioattn():
                        if args.deterministic:  # (the torch op's keyword; ioattn.attention has none)
                            o = ioattn.torch.attention(*leaves, causal=bool(causal), num_threads=args.threads,
                                                       deterministic=True)
                        else:
                            o = ioattn.attention(*leaves, causal=bool(causal), num_threads=args.threads)
                        return torch.autograd.grad(o, leaves, do)

                    def fb_torch():
                        o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves),
                                                           is_causal=bool(causal))
                        return torch.autograd.grad(o, leaves, do.transpose(1, 2))

                    diff = (fwd_ioattn().float() - fwd_torch().transpose(1, 2).float()).abs().max().item()
                    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                    modes = [("forward", 1.0, fwd_ioattn, fwd_torch)]
                    if not args.no_backward:
                        modes.append(("fwd+bwd", 3.5, fb_ioattn, fb_torch))
                        g_i, g_t = fb_ioattn(), fb_torch()
                        gdiff = max((a.float() - c.float()).abs().max().item() for a, c in zip(g_i, g_t))
                    for mode, mult, f_i, f_t in modes:
                        f_i(), f_t()
                        t_i, t_t = [], []
                        for _ in range(args.repeats):
                            t_i.append(timed(f_i))
                            t_t.append(timed(f_t))
                        row = dict(mode=mode, dtype=dt_name, batch=b, heads=h, seqlen=s, head_dim=d,
                                   causal=causal, threads=args.threads, deterministic=args.deterministic,
                                   ioattn_gflops=round(mult * flops / statistics.median(t_i) / 1e9, 1),
                                   torch_gflops=round(mult * flops / statistics.median(t_t) / 1e9, 1),
                                   max_diff=diff if mode == "forward" else gdiff)
                        row["ratio"] = round(row["ioattn_gflops"] / row["torch_gflops"], 2)
                        print(json.dumps(row), flush=True)
    print(json.dumps(dict(torch=torch.__version__, ioattn=ioattn.info().get("version", "?"),
                          torch_threads=torch.get_num_threads())))


if __name__ == "__main__":
    main()
