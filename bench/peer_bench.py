#!/usr/bin/env python3
"""ioattn CUDA forward vs PyTorch SDPA (flash = FlashAttention-2, cudnn) in the same run.

    python3 bench/peer_bench.py --bench build/ioattn_cuda_bench --out results/peer.json

1. Runs `ioattn_cuda_bench grid` (and `naive`) — ioattn through its public C++ API, timed with
   CUDA events (warm-up, median of repeats) — and reads its JSON lines.
2. Times torch.nn.functional.scaled_dot_product_attention with the FLASH_ATTENTION and
   CUDNN_ATTENTION backends on the same shapes, same layout ([b, s, h, d] memory viewed as
   [b, h, s, d]), same method, in this process, right after.
3. For the naive rows, times PyTorch's unfused standard attention (matmul, softmax, matmul) and
   its peak extra memory.
4. Writes everything to --out (JSON) and prints a table with ratios last.

Grid (FlashAttention's): batch·seqlen = 16k tokens, hidden 2048 (heads = 2048 / hdim), hdim
64/128/256, seqlen 512..16k, causal and not, bf16 (f16 for hdim 128). FLOPs = 4·b·h·s²·d, halved
when causal.

--bwd runs the forward+backward comparison instead of the forward grid: `ioattn_cuda_bench bwd`
on --bwd-hdims (bf16; --deterministic for the atomic-free dQ), and PyTorch SDPA flash / cudnn
forward+backward (torch.autograd.grad of the output with a fixed dO) on the same shapes in the
same run; FLOPs = 3.5x the forward's (backward = 2.5x, FlashAttention's convention). The table
also shows the backward alone.

    python3 bench/peer_bench.py --bench build/ioattn_cuda_bench --bwd --out results/bwd.json
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time


def run_ioattn(bench, mode, extra):
    cmd = [bench, mode] + extra
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    rows = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    print(f"# {' '.join(cmd)}: {len(rows)} rows in {time.time() - t0:.1f} s", flush=True)
    return rows


def time_ms(torch, fn, repeats=15, warmup=2):
    """Median ms per call; batches of back-to-back calls of about 2 ms each, like the C++ side."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    one = a.elapsed_time(b)
    inner = max(1, min(50, int(2.0 / max(one, 1e-3))))
    times = []
    for _ in range(repeats):
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    return times[len(times) // 2]


def flops(b, h, s, d, causal):
    return 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)


def torch_sdpa_rows(torch, configs, repeats):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backends = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for (dtype, d, s, b, h) in configs:
        dt = torch.bfloat16 if dtype == "bf16" else torch.float16
        # [b, s, h, d] memory, as ioattn reads it, viewed as SDPA's [b, h, s, d].
        q = (torch.rand(b, s, h, d, device="cuda", dtype=dt) * 2 - 1).transpose(1, 2)
        k = (torch.rand(b, s, h, d, device="cuda", dtype=dt) * 2 - 1).transpose(1, 2)
        v = (torch.rand(b, s, h, d, device="cuda", dtype=dt) * 2 - 1).transpose(1, 2)
        for causal in (False, True):
            for name, be in backends.items():
                row = dict(impl=name, dtype=dtype, hdim=d, seqlen=s, batch=b, heads=h, causal=causal)
                try:
                    with sdpa_kernel([be]):
                        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        ms = time_ms(torch, fn, repeats)
                    row.update(ms=ms, tflops=flops(b, h, s, d, causal) / (ms * 1e-3) / 1e12)
                except Exception as e:  # a backend that refuses a shape is a row, not a crash
                    row.update(ms=None, tflops=None, error=str(e).splitlines()[0][:160])
                rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def torch_bwd_rows(torch, configs, repeats):
    """Forward+backward (and backward alone) of SDPA flash / cudnn: torch.autograd.grad with a fixed
    dO, so nothing accumulates into .grad between calls."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backends = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for (dtype, d, s, b, h) in configs:
        dt = torch.bfloat16 if dtype == "bf16" else torch.float16
        leaves = [(torch.rand(b, s, h, d, device="cuda", dtype=dt) * 2 - 1).requires_grad_() for _ in range(3)]
        q, k, v = (x.transpose(1, 2) for x in leaves)  # [b, s, h, d] memory as [b, h, s, d]
        dout = (torch.rand(b, s, h, d, device="cuda", dtype=dt) * 2 - 1).transpose(1, 2)
        for causal in (False, True):
            for name, be in backends.items():
                row = dict(impl=name + "_fwdbwd", dtype=dtype, hdim=d, seqlen=s, batch=b, heads=h, causal=causal)
                try:
                    with sdpa_kernel([be]):
                        def fwd_bwd():
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            return torch.autograd.grad(o, leaves, dout)
                        ms = time_ms(torch, fwd_bwd, repeats)
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        ms_bwd = time_ms(torch, lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True),
                                         repeats)
                        del o
                    f = flops(b, h, s, d, causal)
                    row.update(ms=ms, tflops=3.5 * f / (ms * 1e-3) / 1e12, bwd_ms=ms_bwd,
                               bwd_tflops=2.5 * f / (ms_bwd * 1e-3) / 1e12)
                except Exception as e:  # a backend that refuses a shape is a row, not a crash
                    row.update(ms=None, tflops=None, error=str(e).splitlines()[0][:160])
                rows.append(row)
        del q, k, v, dout, leaves
        torch.cuda.empty_cache()
    return rows


def torch_naive_rows(torch, seqlens, heads, d, repeats):
    """Unfused standard attention in PyTorch: S and P materialised (bf16), fp32 softmax inside."""
    rows = []
    for s in seqlens:
        for causal in (False, True):
            q = torch.rand(1, heads, s, d, device="cuda", dtype=torch.bfloat16) * 2 - 1
            k = torch.rand_like(q) * 2 - 1
            v = torch.rand_like(q) * 2 - 1
            mask = torch.ones(s, s, device="cuda", dtype=torch.bool).tril() if causal else None
            scale = 1.0 / math.sqrt(d)

            def naive():
                sc = (q @ k.transpose(-1, -2)) * scale
                if mask is not None:
                    sc = sc.masked_fill(~mask, float("-inf"))
                return torch.softmax(sc, dim=-1) @ v

            row = dict(impl="torch_naive", dtype="bf16", hdim=d, seqlen=s, batch=1, heads=heads, causal=causal)
            try:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                naive()
                torch.cuda.synchronize()
                row["extra_bytes"] = torch.cuda.max_memory_allocated() - base
                row["ms"] = time_ms(torch, naive, repeats, warmup=1)
            except Exception as e:
                row.update(ms=None, error=str(e).splitlines()[0][:160])
            rows.append(row)
            del q, k, v, mask
            torch.cuda.empty_cache()
    return rows


def fmt(x, spec="{:.0f}"):
    return "-" if x is None else spec.format(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/ioattn_cuda_bench")
    ap.add_argument("--out", default="peer.json")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--f16-hdims", default="128")
    ap.add_argument("--naive-seqlens", default="4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--bwd", action="store_true",
                    help="forward+backward vs SDPA flash/cudnn instead of the forward grid")
    ap.add_argument("--bwd-hdims", default="64,128,256")
    ap.add_argument("--deterministic", action="store_true", help="ioattn backward in deterministic mode")
    args = ap.parse_args()
    if args.bwd:
        args.no_naive = True

    ours = [] if args.bwd else run_ioattn(
        args.bench, "grid", ["--hdims", args.hdims, "--seqlens", args.seqlens, "--f16-hdims", args.f16_hdims,
                             "--repeats", str(args.repeats)])
    naive = [] if args.no_naive else run_ioattn(args.bench, "naive", ["--seqlens", args.naive_seqlens])
    ours_bwd = [] if not args.bwd else run_ioattn(
        args.bench, "bwd", ["--hdims", args.bwd_hdims, "--seqlens", args.seqlens, "--repeats", str(args.repeats),
                            "--deterministic", "1" if args.deterministic else "0"])

    import torch

    dev = torch.cuda.get_device_name()
    configs = sorted({(r["dtype"], r["hdim"], r["seqlen"], r["batch"], r["heads"]) for r in ours},
                     key=lambda c: (c[1], c[0], c[2]))
    t0 = time.time()
    peers = torch_sdpa_rows(torch, configs, args.repeats)
    print(f"# torch sdpa: {len(peers)} rows in {time.time() - t0:.1f} s", flush=True)
    tnaive = [] if args.no_naive else torch_naive_rows(torch, [int(x) for x in args.naive_seqlens.split(",")], 16, 128, 3)
    bwd_configs = sorted({(r["dtype"], r["hdim"], r["seqlen"], r["batch"], r["heads"]) for r in ours_bwd},
                         key=lambda c: (c[1], c[0], c[2]))
    t0 = time.time()
    peers_bwd = torch_bwd_rows(torch, bwd_configs, args.repeats) if ours_bwd else []
    if ours_bwd:
        print(f"# torch sdpa fwd+bwd: {len(peers_bwd)} rows in {time.time() - t0:.1f} s", flush=True)

    out = dict(device=dev, torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"),
               ioattn=ours, ioattn_naive=naive, torch_sdpa=peers, torch_naive=tnaive,
               ioattn_fwdbwd=ours_bwd, torch_sdpa_fwdbwd=peers_bwd)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

    peer = {(r["impl"], r["dtype"], r["hdim"], r["seqlen"], r["causal"]): r for r in peers}
    if ours_bwd:
        pb = {(r["impl"], r["dtype"], r["hdim"], r["seqlen"], r["causal"]): r for r in peers_bwd}
        det = " (deterministic)" if args.deterministic else ""
        print(f"\n## forward+backward TFLOP/s{det} on {dev} (FLOPs = 3.5x forward; ratio = ioattn / peer; "
              "bwd = backward alone)")
        print(f"{'dtype':5} {'hdim':>4} {'seqlen':>6} {'causal':>6} | {'ioattn':>6} {'flash':>6} {'cudnn':>6} | "
              f"{'x flash':>7} {'x cudnn':>7} | {'bwd':>5} {'fl bwd':>6} {'cu bwd':>6}")
        for r in sorted(ours_bwd, key=lambda r: (r["dtype"], r["hdim"], r["causal"], r["seqlen"])):
            key = (r["dtype"], r["hdim"], r["seqlen"], r["causal"])
            fl = pb.get(("torch_flash_fwdbwd",) + key, {})
            cu = pb.get(("torch_cudnn_fwdbwd",) + key, {})
            flt, cut = fl.get("tflops"), cu.get("tflops")
            print(f"{r['dtype']:5} {r['hdim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} | {r['tflops']:>6.0f} "
                  f"{fmt(flt):>6} {fmt(cut):>6} | {fmt(flt and r['tflops'] / flt, '{:.2f}'):>7} "
                  f"{fmt(cut and r['tflops'] / cut, '{:.2f}'):>7} | {r['bwd_tflops']:>5.0f} "
                  f"{fmt(fl.get('bwd_tflops')):>6} {fmt(cu.get('bwd_tflops')):>6}")
    if not ours:
        return
    print(f"\n## forward TFLOP/s on {dev}, torch {torch.__version__} (ratio = ioattn / peer)")
    print(f"{'dtype':5} {'hdim':>4} {'seqlen':>6} {'causal':>6} | {'ioattn':>6} {'flash':>6} {'cudnn':>6} | "
          f"{'x flash':>7} {'x cudnn':>7}")
    for r in sorted(ours, key=lambda r: (r["dtype"], r["hdim"], r["causal"], r["seqlen"])):
        key = (r["dtype"], r["hdim"], r["seqlen"], r["causal"])
        fl = peer.get(("torch_flash",) + key, {}).get("tflops")
        cu = peer.get(("torch_cudnn",) + key, {}).get("tflops")
        print(f"{r['dtype']:5} {r['hdim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} | {r['tflops']:>6.0f} "
              f"{fmt(fl):>6} {fmt(cu):>6} | {fmt(fl and r['tflops'] / fl, '{:.2f}'):>7} "
              f"{fmt(cu and r['tflops'] / cu, '{:.2f}'):>7}")
    if naive:
        tn = {(r["seqlen"], r["causal"]): r for r in tnaive}
        print("\n## standard (naive) vs flash, 16 heads, hdim 128, bf16, batch 1")
        print(f"{'seqlen':>6} {'causal':>6} | {'naive ms':>8} {'flash ms':>8} {'speedup':>7} {'naive GB':>8} | "
              f"{'torch naive ms':>14} {'torch GB':>8} | {'max|dO|':>8}")
        for r in naive:
            t = tn.get((r["seqlen"], r["causal"]), {})
            print(f"{r['seqlen']:>6} {str(r['causal']):>6} | {r['naive_ms']:>8.2f} {r['flash_ms']:>8.2f} "
                  f"{r['naive_ms'] / r['flash_ms']:>7.1f} {r['naive_extra_bytes'] / 1e9:>8.2f} | "
                  f"{fmt(t.get('ms'), '{:.2f}'):>14} {fmt(t.get('extra_bytes') and t['extra_bytes'] / 1e9, '{:.2f}'):>8} | "
                  f"{r['max_abs_diff']:>8.4f}")


if __name__ == "__main__":
    main()
