#!/usr/bin/env python3
"""Peer timings for the sm90 forward kernel: PyTorch SDPA with cuDNN and FlashAttention-2.

Same shapes as `ioattn_sm90_check --bench-only`: bf16, batch * seqlen = 16k tokens, hidden 2048
(heads = 2048 / hdim), hdim 64/128/256, seqlen 2k..16k, causal and not. Inputs are
[batch, heads, seqlen, hdim] (SDPA's layout), Uniform(-1, 1) as ioattn_sm90_check fills its own
(--dist normal: random normal, what this script used until session 10; the H200 is power-limited,
so the data's distribution moves the clocks: the same one on both sides). CUDA events around each
call, 3 warm-ups, median of 25. FLOPs = 4 b h s^2 d, halved when causal.

Usage: peer_sdpa.py [--ours [NAME=]ours.csv ...] [--csv peer.csv] [--dist uniform|normal]
                    [--ioattn] [--rounds N] [--warm-s S] [--fwdbwd]
With --ours (CSVs that ioattn_sm90_check --csv wrote in the same run; the first one is the one the
ratios use) it prints one table with ioattn / cuDNN / flash TFLOP/s and the ratios.

--ioattn times ioattn itself in this process (ioattn.torch.attention on [batch, seqlen, heads,
hdim] tensors holding the same values; the package must be importable) beside the peers, row by
row, in every order of the three over the grid (a cyclic rotation would keep one implementation
always after the same other one), so that all three see the same power and clock history (the H200 runs at its power cap under this load, and a program that
runs its rows back to back sees lower clocks than one with pauses between rows). --rounds N
repeats the grid N times; a row's TFLOP/s is the median over the rounds, and its ratio the median
of the per-round ratios. This is the like-for-like table; --ours compares against another
process's run. --warm-s S runs S seconds of each implementation's own calls before timing it (the
power limiter then averages over its own load). --fwdbwd times forward+backward instead
(torch.autograd.grad of the output with a fixed dO; FLOPs = 3.5x the forward's, FlashAttention's
convention).
"""
import argparse
import csv
import statistics
import sys
import itertools
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

TOKENS, HIDDEN, WARMUP, REPS = 16384, 2048, 3, 25


def time_ms(fn, warm_s=0.0):
    """Median ms of REPS calls after WARMUP calls, or after warm_s seconds of back-to-back calls
    (then the power limiter's averaging window holds this kernel's own load, not its predecessor's)."""
    for _ in range(WARMUP):
        fn()
    if warm_s > 0:
        torch.cuda.synchronize()
        t_end = time.time() + warm_s
        while time.time() < t_end:
            for _ in range(8):
                fn()
            torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for a, b in zip(starts, stops):
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, stops))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", action="append", default=[], help="[NAME=]CSV from ioattn_sm90_check --csv")
    ap.add_argument("--csv", help="write peer rows here")
    ap.add_argument("--dist", choices=("uniform", "normal"), default="uniform",
                    help="input distribution (uniform: U(-1, 1), as ioattn_sm90_check)")
    ap.add_argument("--ioattn", action="store_true",
                    help="also time ioattn.torch.attention in this process, interleaved with the peers")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the grid (changing the order)")
    ap.add_argument("--warm-s", type=float, default=0.0,
                    help="seconds of back-to-back calls before each timing (sustained state under the power cap)")
    ap.add_argument("--fwdbwd", action="store_true",
                    help="time forward+backward (torch.autograd.grad with a fixed dO; FLOPs = 3.5x the forward's)")
    ap.add_argument("--hdims", default="64,128,256", help="head dims of the grid, comma-separated")
    args = ap.parse_args()
    impls = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    if args.ioattn:
        import ioattn.torch as iot
        impls.insert(0, ("ioattn", None))
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"inputs {'N(0, 1)' if args.dist == 'normal' else 'U(-1, 1)'}")
    rows = []
    grid = [(d, s, c) for d in (int(x) for x in args.hdims.split(",")) for s in (2048, 4096, 8192, 16384) for c in (False, True)]
    for rnd in range(args.rounds):
        for i, (d, s, causal) in enumerate(grid):
            b, h = TOKENS // s, HIDDEN // d
            if args.dist == "normal":
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            else:
                q, k, v = (torch.rand(b, h, s, d, device="cuda", dtype=torch.bfloat16) * 2 - 1 for _ in range(3))
            # ioattn's own layout [b, s, h, d], same values
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v)) if args.ioattn else (None,) * 3
            flops = 4.0 * b * h * s * s * d / (2.0 if causal else 1.0)
            if args.fwdbwd:
                flops *= 3.5
                for x in (q, k, v, qt, kt, vt):
                    if x is not None:
                        x.requires_grad_()
                dout = torch.rand_like(q) * 2 - 1
                dout_t = dout.transpose(1, 2).contiguous()

            def run(fn, leaves, do):  # forward, or forward+backward with a fixed dO
                if not args.fwdbwd:
                    return fn
                return lambda: torch.autograd.grad(fn(), leaves, do)
            orders = list(itertools.permutations(impls))  # every order, so no impl always follows another
            for name, backend in orders[(rnd * 5 + i) % len(orders)]:
                try:
                    t_start = time.time()
                    if backend is None:
                        ms = time_ms(run(lambda: iot.attention(qt, kt, vt, causal=causal), (qt, kt, vt),
                                         dout_t if args.fwdbwd else None), args.warm_s)
                    else:
                        with sdpa_kernel(backend):
                            ms = time_ms(run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v),
                                             dout if args.fwdbwd else None), args.warm_s)
                    rows.append((name, d, s, int(causal), b, h, ms, flops / (ms * 1e-3) / 1e12, rnd,
                                 f"{t_start:.3f}", f"{time.time():.3f}"))
                except RuntimeError as e:  # backend refuses the shape (e.g. flash hdim > 256)
                    if rnd == 0:
                        print(f"{name} d{d} s{s} causal={causal}: unavailable ({str(e).splitlines()[0][:80]})")
            del q, k, v, qt, kt, vt
            if args.fwdbwd:
                del dout, dout_t
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["impl", "hdim", "seqlen", "causal", "batch", "heads", "ms", "tflops", "round", "t_start", "t_end"])
            w.writerows(rows)
    med = lambda xs: statistics.median(xs) if xs else None
    by = {}  # (impl, hdim, seqlen, causal) -> {round: tflops}
    for r in rows:
        by.setdefault(r[:4], {})[r[8]] = r[7]
    peer = {key: med(list(t.values())) for key, t in by.items()}
    ours = []  # (name, {(hdim, seqlen, causal): tflops})
    if args.ioattn:
        ours.append(("ioattn", {key[1:]: val for key, val in peer.items() if key[0] == "ioattn"}))
    for spec in args.ours:
        name, _, path = spec.rpartition("=")
        table = {}
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["impl"] != "ioattn_sm90":  # the fp8 comparison rows (--fp8 bench) are not this grid
                    continue
                table[(int(r["hdim"]), int(r["seqlen"]), int(r["causal"]))] = float(r["tflops"])
        ours.append((name or "ioattn", table))
    fmt = lambda x: f"{x:7.1f}" if x else "      -"
    ratio = lambda a, b: f"{a / b:8.2f}" if a and b else "       -"
    head = " ".join(f"{n[:7]:>7}" for n, _ in ours)
    print(f"\n{'hdim':>4} {'seqlen':>6} {'causal':>6} | {head} {'cudnn':>7} {'flash':>7} | "
          f"{'vs cudnn':>8} {'vs flash':>8}   (TFLOP/s{', forward+backward' if args.fwdbwd else ''}, bf16, same run; ratios of the first column)")
    for d in (64, 128, 256):
        for s in (2048, 4096, 8192, 16384):
            for c in (0, 1):
                vals = [t.get((d, s, c)) for _, t in ours]
                cu = peer.get(("cudnn", d, s, c))
                fl = peer.get(("flash", d, s, c))
                o = vals[0] if vals else None
                if args.ioattn:  # median of the per-round ratios
                    rr = lambda p: med([t / by[(p, d, s, c)][k] for k, t in by.get(("ioattn", d, s, c), {}).items()
                                        if k in by.get((p, d, s, c), {})])
                    rc, rf = rr("cudnn"), rr("flash")
                    rat = (f"{rc:8.2f}" if rc else "       -") + " " + (f"{rf:8.2f}" if rf else "       -")
                else:
                    rat = f"{ratio(o, cu)} {ratio(o, fl)}"
                print(f"{d:>4} {s:>6} {'yes' if c else 'no':>6} | {' '.join(fmt(v) for v in vals)} {fmt(cu)} {fmt(fl)} | {rat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
