#!/usr/bin/env python3
"""ioattn CUDA decode vs PyTorch SDPA (cudnn, flash; enable_gqa=True) on the same shapes, same run.

    python3 bench/peer_decode.py --bench build/ioattn_cuda_decode_bench --out results/decode.json

1. Runs `ioattn_cuda_decode_bench` (ioattn's public C++ API: plan_decode + decode under a plan,
   timed as CUDA-graph replays; also eager) and reads its JSON lines: contiguous and paged caches
   (page 16, 64), bf16 and f8e4m3 KV.
2. Times torch.nn.functional.scaled_dot_product_attention with the CUDNN_ATTENTION and
   FLASH_ATTENTION backends on the same shapes (q length 1, GQA via enable_gqa=True, bf16), the
   KV in ioattn's cache memory order [b, s, h_kv, d] viewed as [b, h_kv, s, d] and in contiguous
   [b, h_kv, s, d] (the faster of the two is reported; both are in --out), timed the same way:
   `inner` calls captured in a CUDA graph, rotating over copies when a cache is below 256 MiB so
   the bytes come from HBM, median of repeats; and eagerly (back-to-back calls).
3. Prints a table (TB/s = K+V bytes read / s) with the ratios, writes everything to --out.

Default grid (issue 6): GQA 32/8, hdim 128, bf16, batch 1/16/64 x KV 4k/32k/128k (cells that do
not fit in memory are skipped). Targets: ioattn >= 1.0x cuDNN on every cell, >= 1.5x at b1 x 4k;
paged within 5% of contiguous.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time


def run_ioattn(bench, args):
    cmd = [bench, "--batch", args.batch, "--kv", args.kv, "--heads-q", str(args.heads_q),
           "--heads-kv", str(args.heads_kv), "--head-dim", str(args.head_dim), "--pages", args.pages,
           "--caches", args.caches, "--repeats", str(args.repeats), "--mem-gb", str(args.mem_gb)]
    if args.splits:
        cmd += ["--splits", str(args.splits)]
    if args.kernels:
        cmd += ["--kernels", args.kernels]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    rows = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    print(f"# {' '.join(cmd)}: {len(rows)} rows in {time.time() - t0:.1f} s", flush=True)
    return rows


def kv_bytes(b, kv, hkv, d, esize=2):
    return float(b) * kv * hkv * 2 * d * esize


def time_graph(torch, make_fn, copies, repeats):
    """Median ms per call of `inner` calls captured in one CUDA graph (call i uses copy i % copies)."""
    fns = [make_fn(i) for i in range(copies)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm-up outside the capture (workspace allocation, autotuning)
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fns[0]()
    b.record()
    b.synchronize()
    one = a.elapsed_time(b)
    inner = max(copies, min(64, max(4, int(4.0 / max(one, 1e-3)))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            fns[i % copies]()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    del g
    return times[len(times) // 2]


def time_eager(torch, make_fn, copies, repeats):
    fns = [make_fn(i) for i in range(copies)]
    for f in fns:
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    inner = max(copies, 16)
    times = []
    for _ in range(repeats):
        a.record()
        for i in range(inner):
            fns[i % copies]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    return times[len(times) // 2]


def torch_rows(torch, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backends = {"torch_cudnn": SDPBackend.CUDNN_ATTENTION, "torch_flash": SDPBackend.FLASH_ATTENTION}
    iod = None
    if args.ioattn_python:  # ioattn.decode in this process, on the bshd tensors (its cache layout)
        import ioattn
        iod = ioattn.decode
    hq, hkv, d = args.heads_q, args.heads_kv, args.head_dim
    rows = []
    for kv in [int(x) for x in args.kv.split(",")]:
        for b in [int(x) for x in args.batch.split(",")]:
            nbytes = kv_bytes(b, kv, hkv, d)
            copies = max(1, min(8, math.ceil(256 * 2**20 / nbytes)))
            free, _ = torch.cuda.mem_get_info()
            if nbytes * copies * 1.1 > min(free, args.mem_gb * 1e9):
                print(f"# torch: skip b{b} kv{kv}: {nbytes * copies / 1e9:.1f} GB does not fit", flush=True)
                continue
            for layout in ("bshd", "bhsd"):
                qs, ks, vs = [], [], []
                for _ in range(copies):
                    q = torch.rand(b, 1, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    if layout == "bshd":  # ioattn's cache memory order, viewed as [b, h, s, d]
                        k = torch.rand(b, kv, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                        v = torch.rand(b, kv, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    else:
                        k = torch.rand(b, hkv, kv, d, device="cuda", dtype=torch.bfloat16)
                        v = torch.rand(b, hkv, kv, d, device="cuda", dtype=torch.bfloat16)
                    qs.append(q), ks.append(k), vs.append(v)
                impls = list(backends.items())
                if iod is not None and layout == "bshd":
                    try:  # under a plan, workspace and outputs allocated once: graph-capturable
                        lens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
                        plan = ioattn.plan_decode(b, hq, hkv, d, kv, device="cuda")
                        ws = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
                        outs = [torch.empty(b, 1, hq, d, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
                        impls.append(("ioattn_py", None))
                    except Exception as e:  # an extension without plan_decode, say: the SDPA rows still run
                        print(f"# ioattn_py b{b} kv{kv}: {str(e).splitlines()[0][:200]}", flush=True)
                for name, be in impls:
                    row = dict(impl=name, layout=layout, batch=b, heads_q=hq, heads_kv=hkv, head_dim=d, kv_len=kv,
                               page_size=0, cache="bf16")

                    def make_fn(i, be=be):
                        if be is None:  # ioattn.decode: q [b, 1, hq, d], contiguous cache [b, kv, hkv, d]
                            qi, ki, vi = (x.transpose(1, 2) for x in (qs[i], ks[i], vs[i]))
                            return lambda: iod(qi, ki, vi, lens, plan=plan, workspace=ws, out=outs[i])

                        def fn():
                            with sdpa_kernel([be]):
                                return F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True)
                        return fn

                    try:
                        ms = time_graph(torch, make_fn, copies, args.repeats)
                        row.update(ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12)
                    except Exception as e:  # a backend that refuses a shape is a row, not a crash
                        row.update(ms=None, tbps=None, error=str(e).splitlines()[0][:200] if str(e) else repr(e))
                    rows.append(row)
                    if (row.get("ms") is not None or be is None) and args.eager:
                        erow = dict(row, impl=name + "_eager")
                        try:
                            ms = time_eager(torch, make_fn, copies, args.repeats)
                            erow.update(ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12)
                        except Exception as e:
                            erow.update(ms=None, tbps=None, error=str(e).splitlines()[0][:200])
                        rows.append(erow)
                del qs, ks, vs
                torch.cuda.empty_cache()
            print(f"# torch b{b} kv{kv} done", flush=True)
    return rows


def best_torch(rows, impl, b, kv):
    cands = [r for r in rows if r["impl"] == impl and r["batch"] == b and r["kv_len"] == kv and r.get("ms")]
    return min(cands, key=lambda r: r["ms"]) if cands else None


def find(rows, impl, b, kv, page, cache):
    for r in rows:
        if (r.get("impl") == impl and r.get("batch") == b and r.get("kv_len") == kv and r.get("page_size") == page
                and r.get("cache") == cache):
            return r
    return None


def fmt(x, spec="{:6.2f}"):
    return spec.format(x) if x is not None else "   -  "


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/ioattn_cuda_decode_bench")
    ap.add_argument("--out", default="decode_peer.json")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--kv", default="4096,32768,131072")
    ap.add_argument("--pages", default="0,16,64")
    ap.add_argument("--caches", default="bf16,f8e4m3")
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--splits", type=int, default=0)
    ap.add_argument("--kernels", default="auto,fma", help="ioattn kernels: auto (dispatcher), fma, mma")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--mem-gb", type=float, default=100)
    ap.add_argument("--eager", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ioattn-python", action="store_true",
                    help="also time ioattn.decode (the Python package must be importable) beside SDPA in this process")
    args = ap.parse_args()

    rows = run_ioattn(args.bench, args)
    info = {}
    if not args.no_torch:
        import torch
        info = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    device=torch.cuda.get_device_name())
        rows += torch_rows(torch, args)

    copy = next((r for r in rows if r.get("impl") == "memcpy"), None)
    print()
    if copy:
        print(f"memcpy D2D: {copy['tbps']:.2f} TB/s (read + write)")
    print(f"GQA {args.heads_q}/{args.heads_kv}, hdim {args.head_dim}, q len 1; TB/s = K+V bytes / s (graph replay)")
    hdr = ("batch", "kv", "ioattn", "fma", "page16", "page64", "fp8", "cudnn", "flash", "x cudnn", "x flash", "p16/c",
           "p64/c", "fp8 speedup")
    print("{:>5} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8} {:>6} {:>6} {:>11}".format(*hdr))
    summary = []
    for kv in [int(x) for x in args.kv.split(",")]:
        for b in [int(x) for x in args.batch.split(",")]:
            c = find(rows, "ioattn", b, kv, 0, "bf16")
            p16 = find(rows, "ioattn", b, kv, 16, "bf16")
            p64 = find(rows, "ioattn", b, kv, 64, "bf16")
            f8 = find(rows, "ioattn", b, kv, 0, "f8e4m3")
            fm = find(rows, "ioattn_fma", b, kv, 0, "bf16")
            cu = best_torch(rows, "torch_cudnn", b, kv)
            fl = best_torch(rows, "torch_flash", b, kv)
            if not c:
                continue
            t = lambda r: r["tbps"] if r else None
            ratio = lambda a, z: (z["ms"] / a["ms"]) if (a and z) else None  # > 1: a is faster
            line = dict(batch=b, kv_len=kv, ioattn_tbps=t(c), fma_tbps=t(fm), page16_tbps=t(p16), page64_tbps=t(p64),
                        fp8_tbps=t(f8), cudnn_tbps=t(cu), flash_tbps=t(fl), x_cudnn=ratio(c, cu),
                        x_flash=ratio(c, fl), paged16_vs_contig=ratio(p16, c) and 1 / ratio(p16, c),
                        paged64_vs_contig=ratio(p64, c) and 1 / ratio(p64, c), fp8_speedup=ratio(f8, c))
            summary.append(line)
            print("{:>5} {:>7} {} {} {} {} {} {} {} {:>8} {:>8} {:>6} {:>6} {:>11}".format(
                b, kv, fmt(t(c), "{:7.2f}"), fmt(t(fm), "{:7.2f}"), fmt(t(p16), "{:7.2f}"), fmt(t(p64), "{:7.2f}"), fmt(t(f8), "{:7.2f}"),
                fmt(t(cu), "{:7.2f}"), fmt(t(fl), "{:7.2f}"), fmt(line["x_cudnn"], "{:8.2f}"),
                fmt(line["x_flash"], "{:8.2f}"), fmt(line["paged16_vs_contig"], "{:6.2f}"),
                fmt(line["paged64_vs_contig"], "{:6.2f}"), fmt(line["fp8_speedup"], "{:11.2f}")))
    if args.ioattn_python:  # the same process: ioattn.decode beside SDPA, both through PyTorch
        print("\nsame process (ioattn.decode through its Python package under a plan, contiguous bf16, cache "
              "layout [b, s, hkv, d]; SDPA on the same tensors); TB/s, graph replay / eager")
        print("{:>5} {:>7} {:>15} {:>15} {:>9} {:>9}".format("batch", "kv", "ioattn_py", "cudnn (bshd)",
                                                           "x graph", "x eager"))
        for kv in [int(x) for x in args.kv.split(",")]:
            for b in [int(x) for x in args.batch.split(",")]:
                get = lambda impl: next((r for r in rows if r["impl"] == impl and r.get("layout") == "bshd"
                                         and r["batch"] == b and r["kv_len"] == kv and r.get("ms")), None)
                ig, ie, cg, ce = get("ioattn_py"), get("ioattn_py_eager"), get("torch_cudnn"), get("torch_cudnn_eager")
                if not (ig or ie):
                    continue
                t = lambda r: r["tbps"] if r else None
                x = lambda a, z: z["ms"] / a["ms"] if (a and z) else None
                print("{:>5} {:>7} {} / {} {} / {} {} {}".format(
                    b, kv, fmt(t(ig)), fmt(t(ie)), fmt(t(cg)), fmt(t(ce)), fmt(x(ig, cg), "{:9.2f}"),
                    fmt(x(ie, ce), "{:9.2f}")))
    print("ioattn: the dispatcher's kernel (mma for these shapes); fma: IOATTN_DECODE_KERNEL=fma, contiguous bf16")
    print("x cudnn / x flash: their time / ioattn's (> 1 = ioattn faster); pN/c: paged time / contiguous "
          "time (<= 1.05 is the target); fp8 speedup: bf16 time / fp8 time (fp8 reads half the bytes)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(info=info, args=vars(args), rows=rows, summary=summary), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
