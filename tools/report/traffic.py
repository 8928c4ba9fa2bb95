#!/usr/bin/env python3
"""Measured DRAM traffic of one attention forward, naive vs flash, beside the model of `ioattn explain`.

    python3 tools/report/traffic.py --ioattn build-gpu/ioattn --out results/traffic.json

For each point (backend naive / flash, head dim, seqlen; bf16, not causal, FlashAttention's grid:
batch x seqlen = --tokens, heads x hdim = --hidden) it runs, under Nsight Compute,

    ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv \\
        ioattn bench --device cuda ... --repeats 0 --warmup 0 --no-check

so the profiled process makes exactly one forward call (the inputs are filled on the host and
copied, no kernels), and sums every kernel it launched: the naive path's two cuBLAS GEMMs and its
softmax, or the flash kernel. One process per point: ncu replays each kernel, which is slow, and
a point's kernels must not mix with another's. ncu flushes the caches before each kernel, so the
bytes are what the kernel itself moves between L2 and HBM.

The model comes from `ioattn explain --json` for the same shape (every (batch, head) one head,
one layer): naive = 4 passes over the n x n matrix in the input dtype, flash = read Q, K, V and
write O once; their ratio is ~n/d. traffic.json holds both per point and, per (hdim, seqlen), the
measured naive/flash ratio beside the model's. The last section prints a table.

With --ceilings it also probes the machine's ceilings with torch (ceilings.py) into the same
JSON, for the roofline chart.
"""
import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpu_name, now  # noqa: E402

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
# ncu prints scaled units unless --print-units base is honoured; accept both.
UNIT = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
        "kibyte": 1024, "mibyte": 1024 ** 2, "gibyte": 1024 ** 3, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def parse_ncu_csv(text):
    """Per-kernel {metric: bytes} from ncu --csv output (one row per kernel and metric)."""
    start = text.find('"ID"')
    if start < 0:
        return []
    kernels = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        metric = row.get("Metric Name")
        if metric not in METRICS:
            continue
        value = float(row["Metric Value"].replace(",", ""))
        scale = UNIT.get(row.get("Metric Unit", "byte").strip().lower())
        if scale is None:
            raise ValueError(f"unknown unit {row.get('Metric Unit')!r} for {metric}")
        k = kernels.setdefault(row["ID"], {"name": row.get("Kernel Name", "?")[:120]})
        k[metric] = value * scale
    return [kernels[i] for i in sorted(kernels, key=int)]


def explain_model(cli, s, d, heads, dtype):
    out = subprocess.run([cli, "explain", "--json", "--seqlen", str(s), "--head-dim", str(d), "--heads", str(heads),
                          "--layers", "1", "--dtype", dtype], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def profile_point(args, backend, d, s, tmp):
    batch, heads = max(1, args.tokens // s), max(1, args.hidden // d)
    log = os.path.join(tmp, f"{backend}_{d}_{s}.csv")
    rec_path = os.path.join(tmp, f"{backend}_{d}_{s}.jsonl")
    bench = [args.ioattn, "bench", "--device", "cuda", "--seqlen", str(s), "--hdim", str(d), "--causal", "0",
             "--dtype", args.dtype, "--backend", backend, "--batch", str(batch), "--heads", str(heads),
             "--repeats", "0", "--warmup", "0", "--no-check", "--quiet", "--out", rec_path]
    ncu = [args.ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
           "--launch-count", str(args.launch_count), "--log-file", log]
    point = dict(backend=backend, hdim=d, seqlen=s, batch=batch, heads=heads, dtype=args.dtype, causal=False,
                 command=" ".join(ncu + bench))
    t0 = time.time()
    res = subprocess.run(ncu + bench, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0 and "print-units" in res.stderr + res.stdout:  # an ncu without the option
        ncu.remove("--print-units")
        ncu.remove("base")
        point["command"] = " ".join(ncu + bench)
        res = subprocess.run(ncu + bench, capture_output=True, text=True, timeout=args.timeout)
    point["seconds"] = round(time.time() - t0, 1)
    text = open(log).read() if os.path.exists(log) else ""
    kernels = parse_ncu_csv(text)
    if res.returncode != 0 or not kernels:
        tail = (res.stderr + res.stdout + text)[-600:]
        point["error"] = f"rc {res.returncode}, {len(kernels)} kernels profiled: {tail}"
        return point
    if len(kernels) >= args.launch_count:
        point["warning"] = f"--launch-count {args.launch_count} reached: later kernels of the call are missing"
    point["kernels"] = [dict(name=k["name"], read=k.get(METRICS[0]), write=k.get(METRICS[1])) for k in kernels]
    point["dram_read_bytes"] = sum(k.get(METRICS[0], 0.0) for k in kernels)
    point["dram_write_bytes"] = sum(k.get(METRICS[1], 0.0) for k in kernels)
    point["dram_bytes"] = point["dram_read_bytes"] + point["dram_write_bytes"]
    point["flops"] = 4.0 * batch * heads * s * s * d
    model = explain_model(args.ioattn, s, d, batch * heads, args.dtype)
    point["model_naive_bytes"] = model["naive_bytes_per_layer"]
    point["model_flash_bytes"] = model["flash_bytes_per_head"] * batch * heads
    point["model_bytes"] = point["model_naive_bytes" if backend == "naive" else "model_flash_bytes"]
    point["model_traffic_ratio"] = model["traffic_ratio"]
    point["measured_over_model"] = point["dram_bytes"] / point["model_bytes"]
    point["arithmetic_intensity"] = point["flops"] / point["dram_bytes"]  # FLOP per DRAM byte
    try:
        with open(rec_path) as f:
            rec = json.loads(f.readline())
        point["kernel"] = rec.get("kernel")
        if rec.get("error"):
            point["error"] = rec["error"]
    except (OSError, ValueError):
        pass
    return point


def ratios(points):
    """Per (hdim, seqlen): measured naive/flash DRAM bytes beside the model's ratio and n/d."""
    by = {(p["backend"], p["hdim"], p["seqlen"]): p for p in points if "dram_bytes" in p}
    out = []
    for (be, d, s), p in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        f = by.get(("flash", d, s))
        if be != "naive" or f is None:
            continue
        out.append(dict(hdim=d, seqlen=s, naive_dram_bytes=p["dram_bytes"], flash_dram_bytes=f["dram_bytes"],
                        measured_ratio=p["dram_bytes"] / f["dram_bytes"], model_ratio=p["model_traffic_ratio"],
                        n_over_d=s / d, model_naive_bytes=p["model_naive_bytes"],
                        model_flash_bytes=f["model_flash_bytes"]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ioattn", required=True, help="the ioattn CLI of a CUDA build")
    ap.add_argument("--out", default="traffic.json")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--backends", default="naive,flash")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    ap.add_argument("--hidden", type=int, default=2048, help="heads x hdim")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--launch-count", type=int, default=64, help="ncu --launch-count: kernels per point at most")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per point")
    ap.add_argument("--budget-s", type=float, default=240, help="start no new point after this many seconds")
    ap.add_argument("--ceilings", action="store_true", help="also probe copy bandwidth and GEMM rate (torch)")
    args = ap.parse_args()

    seqlens = [int(x) for x in args.seqlens.split(",")]
    hdims = [int(x) for x in args.hdims.split(",")]
    backends = args.backends.split(",")
    # The 8k hdim-128 pair first: it is the figure the issue asks for, whatever the budget cuts.
    order = sorted(((d, s) for d in hdims for s in seqlens), key=lambda ds: (ds != (128, 8192), ds[0], ds[1]))
    t_start = time.time()
    points = []
    with tempfile.TemporaryDirectory(prefix="ioattn_traffic_") as tmp:
        for d, s in order:
            for be in backends:
                if time.time() - t_start > args.budget_s:
                    points.append(dict(backend=be, hdim=d, seqlen=s, skipped=f"past --budget-s {args.budget_s:.0f}"))
                    print(f"{be:5} hdim {d:3} seqlen {s:5}: skipped (time budget)", flush=True)
                    continue
                try:
                    p = profile_point(args, be, d, s, tmp)
                except (subprocess.SubprocessError, OSError, ValueError, KeyError) as e:
                    p = dict(backend=be, hdim=d, seqlen=s, error=f"{type(e).__name__}: {e}")
                points.append(p)
                if "dram_bytes" in p:
                    print(f"{be:5} hdim {d:3} seqlen {s:5}: {len(p['kernels'])} kernels, DRAM read "
                          f"{p['dram_read_bytes'] / 1e6:10.1f} MB, write {p['dram_write_bytes'] / 1e6:10.1f} MB, "
                          f"model {p['model_bytes'] / 1e6:10.1f} MB ({p['seconds']} s)", flush=True)
                else:
                    print(f"{be:5} hdim {d:3} seqlen {s:5}: ERROR {p.get('error', '')[:400]}", flush=True)

    out = dict(date=now(), device=gpu_name(args.ioattn), command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
               metrics=list(METRICS), grid=dict(tokens=args.tokens, hidden=args.hidden, dtype=args.dtype, causal=False),
               points=points, ratios=ratios(points))
    try:
        out["ncu_version"] = subprocess.run([args.ncu, "--version"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        out["ncu_version"] = f"unavailable: {e}"
    if args.ceilings:
        from ceilings import probe  # torch is only needed here
        try:
            out["ceilings"] = probe()
        except Exception as e:  # a failed probe must not lose the traffic points
            out["ceilings"] = dict(error=f"{type(e).__name__}: {e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

    print(f"\n## measured DRAM traffic on {out['device']} ({args.dtype}, batch x seqlen = {args.tokens}, "
          f"hidden {args.hidden}, not causal): naive / flash vs the model (~n/d)")
    print(f"{'hdim':>4} {'seqlen':>6} | {'naive GB':>9} {'model':>9} | {'flash MB':>9} {'model':>9} | "
          f"{'ratio':>7} {'model':>7} {'n/d':>5}")
    for r in out["ratios"]:
        print(f"{r['hdim']:>4} {r['seqlen']:>6} | {r['naive_dram_bytes'] / 1e9:>9.2f} {r['model_naive_bytes'] / 1e9:>9.2f} | "
              f"{r['flash_dram_bytes'] / 1e6:>9.1f} {r['model_flash_bytes'] / 1e6:>9.1f} | "
              f"{r['measured_ratio']:>7.1f} {r['model_ratio']:>7.1f} {r['n_over_d']:>5.0f}")
    if "ceilings" in out:
        print(f"ceilings: {json.dumps(out['ceilings'])}")
    failed = [p for p in points if "error" in p]
    return 1 if failed or not out["ratios"] else 0


if __name__ == "__main__":
    sys.exit(main())
