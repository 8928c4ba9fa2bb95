#!/usr/bin/env python3
"""PNG charts from the benchmark JSON (matplotlib). Every chart carries date, GPU and command.

    python3 tools/report/charts.py --outdir results/report --meta meta.json \\
        --peer peer.json --sm90 sm90.csv --peer-sm90 peer_sm90.csv --decode peer_decode.json \\
        --bench bench.jsonl --cpu-bench cpu_bench.jsonl --traffic traffic.json --ceilings ceilings.json

  tflops.png    (a) forward TFLOP/s vs seqlen, one panel per head dim, causal and not: ioattn beside
                    cuDNN and FlashAttention-2 (PyTorch SDPA) measured in the same run
                    (bench/peer_bench.py --out; else ioattn_sm90_check --csv + peer_sdpa.py --csv)
  decode.png    (b) decode K+V bytes read per second vs KV length (bench/peer_decode.py's JSON)
  memory.png    (c) extra memory vs seqlen, naive vs flash, log scale (`ioattn bench` records:
                    CUDA measured, CPU from the model), with the model beside the measurement
  roofline.png  (d) arithmetic intensity (FLOPs / measured DRAM bytes, traffic.json) vs achieved
                    TFLOP/s (`ioattn bench` time), under the measured copy and GEMM ceilings
  traffic.png   (e) measured DRAM bytes naive / flash vs the model's ~n/d, and measured vs model bytes

An input that is missing or holds no usable record skips its chart with a line saying so; the
others are still made. Exit status 0 when at least one chart was written.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_records, num, sm90_grid_rows, truthy  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"ioattn": "tab:blue", "cudnn": "tab:green", "fa2": "tab:orange", "naive": "tab:red", "flash": "tab:blue"}


class Stamp:
    """Date, GPU and command for the footer: the report's meta.json first, then the data's own."""

    def __init__(self, meta):
        self.meta = meta

    def footer(self, fig, data_meta=None, source=""):
        dm = data_meta or {}
        date = self.meta.get("date") or dm.get("date") or "date unknown"
        gpu = self.meta.get("gpu") or dm.get("device") or "GPU unknown"
        cmd = self.meta.get("command") or dm.get("command") or "command unknown"
        text = f"{date} · {gpu} · {cmd}"
        if source:
            text += f"\ndata: {source}"
        fig.text(0.01, 0.005, text, fontsize=6.5, color="0.35", ha="left", va="bottom", wrap=True)


def save(fig, outdir, name, made):
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    made.append(path)
    print(f"wrote {path}")


def seqlen_axis(ax, values):
    ax.set_xscale("log", base=2)
    vals = sorted(set(values))
    ax.set_xticks(vals)
    ax.set_xticklabels([f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in vals])
    ax.minorticks_off()


# ---- (a) forward TFLOP/s: ioattn beside cuDNN and FA2 ----------------------------------------------
def forward_series(args):
    """{(hdim, causal): {label: {seqlen: tflops}}}, meta, source (bf16 only: the peers' common dtype)."""
    series = {}

    def put(label, d, s, c, tf):
        if tf is not None:
            series.setdefault((int(d), bool(c)), {}).setdefault(label, {})[int(s)] = tf

    meta, _ = load_records(args.peer)
    if meta:
        _, ours = load_records(args.peer, "ioattn")
        _, peers = load_records(args.peer, "torch_sdpa")
        for r in ours:
            if r.get("dtype") == "bf16":
                put("ioattn", r["hdim"], r["seqlen"], truthy(r["causal"]), num(r.get("tflops")))
        names = {"torch_cudnn": "cuDNN (SDPA)", "torch_flash": "FA2 (SDPA)"}
        for r in peers:
            if r.get("dtype") == "bf16" and r.get("impl") in names:
                put(names[r["impl"]], r["hdim"], r["seqlen"], truthy(r["causal"]), num(r.get("tflops")))
        if series:
            return series, meta, f"{args.peer} (bench/peer_bench.py: ioattn_cuda_bench grid + PyTorch SDPA, same run)"
    _, ours = load_records(args.sm90)
    _, peers = load_records(args.peer_sm90)
    names = {"cudnn": "cuDNN (SDPA)", "flash": "FA2 (SDPA)"}
    for r in sm90_grid_rows(ours):
        put("ioattn", r["hdim"], r["seqlen"], truthy(r["causal"]), num(r.get("tflops")))
    for r in peers:
        if r.get("impl") in names:
            put(names[r["impl"]], r["hdim"], r["seqlen"], truthy(r["causal"]), num(r.get("tflops")))
    return series, {}, f"{args.sm90} + {args.peer_sm90} (ioattn_sm90_check --csv, peer_sdpa.py --csv)"


def chart_tflops(args, stamp, made):
    series, meta, source = forward_series(args)
    if not series:
        print("tflops.png: skipped (no forward rows in --peer, --sm90/--peer-sm90)")
        return
    hdims = sorted({d for d, _ in series})
    fig, axes = plt.subplots(2, len(hdims), figsize=(4.2 * len(hdims), 6.4), squeeze=False, sharey=True)
    style = {"ioattn": ("o-", COLORS["ioattn"]), "cuDNN (SDPA)": ("s--", COLORS["cudnn"]),
             "FA2 (SDPA)": ("^--", COLORS["fa2"])}
    for row, causal in enumerate((False, True)):
        for col, d in enumerate(hdims):
            ax = axes[row][col]
            lines = series.get((d, causal), {})
            for label, pts in sorted(lines.items()):
                xs = sorted(pts)
                mk, color = style.get(label, ("x-", None))
                ax.plot(xs, [pts[x] for x in xs], mk, color=color, label=label, ms=4)
            seqlen_axis(ax, [s for pts in lines.values() for s in pts] or [1024])
            ax.set_title(f"hdim {d}, {'causal' if causal else 'not causal'}", fontsize=10)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s (4·b·h·s²·d, ½ causal)")
            if row == 1:
                ax.set_xlabel("seqlen (batch × seqlen = 16k tokens)")
            if lines:
                ax.legend(fontsize=7)
    fig.suptitle("Attention forward, bf16: ioattn beside cuDNN and FlashAttention-2 (same run)", fontsize=11)
    stamp.footer(fig, meta, source)
    save(fig, args.outdir, "tflops.png", made)


# ---- (b) decode TB/s vs KV length -----------------------------------------------------------------
def chart_decode(args, stamp, made):
    try:
        meta, recs = load_records(args.decode)
        if args.decode and os.path.exists(args.decode) and args.decode.endswith(".json"):
            with open(args.decode) as f:
                whole = json.load(f)
            if isinstance(whole, dict) and isinstance(whole.get("rows"), list):  # peer_decode.py: info, rows, summary
                recs = [r for r in whole["rows"] if isinstance(r, dict)]
                meta = dict(meta, **{k: v for k, v in (whole.get("info") or {}).items() if not isinstance(v, (list, dict))})
    except ValueError as e:
        print(f"decode.png: skipped ({e})")
        return
    cache_key = lambda r: next((str(r[k]) for k in ("cache_dtype", "kv_dtype", "cache") if k in r), "")
    copy = [num(r["tbps"]) for r in recs if r.get("impl") == "memcpy" and num(r.get("tbps"))]
    # Graph-replay rows only (peer_decode.py also times eager calls); a peer measured in several
    # layouts keeps its best, as peer_decode.py's own table does.
    recs = [r for r in recs if num(r.get("tbps")) is not None and num(r.get("kv_len")) is not None
            and not str(r.get("impl", "")).endswith("_eager") and r.get("impl") != "memcpy"]
    if not recs:
        print(f"decode.png: skipped (no records with kv_len and tbps in {args.decode or 'no --decode given'})")
        return
    batches = sorted({int(r.get("batch", 1)) for r in recs})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.2), squeeze=False, sharey=True)
    for col, b in enumerate(batches):
        ax = axes[0][col]
        groups = {}
        for r in recs:
            if int(r.get("batch", 1)) != b:
                continue
            label = str(r.get("impl", "?"))
            if r.get("page_size") not in (None, 0, "0", ""):
                label += f" page {r['page_size']}"
            if cache_key(r):
                label += f" {cache_key(r)}"
            g = groups.setdefault(label, {})
            kv = int(num(r["kv_len"]))
            g[kv] = max(g.get(kv, 0.0), num(r["tbps"]))
        variants = sorted({label.split(" ", 1)[1] if " " in label else "" for label in groups})
        ours = sorted(l for l in groups if "ioattn" in l.split(" ", 1)[0].lower())
        blues = plt.get_cmap("Blues")
        for label, pts in sorted(groups.items()):
            xs = sorted(pts)
            impl, _, variant = label.partition(" ")
            family = next((f for f in ("ioattn", "cudnn", "fa2", "flash") if f in impl.lower()), None)
            color = COLORS.get("fa2" if family == "flash" else family, "0.4")
            if family == "ioattn" and len(ours) > 1:  # one shade per ioattn variant, dark to light
                color = blues(0.95 - 0.6 * ours.index(label) / (len(ours) - 1))
            ls = ("-", "--", ":", "-.")[variants.index(variant) % 4]
            ax.plot(xs, [pts[x] for x in xs], "o", ls=ls, ms=3, label=label, color=color)
        if copy:
            ax.axhline(max(copy), color="k", lw=0.8, ls="--", label=f"memcpy D2D {max(copy):.2f} TB/s (read + write)")
        seqlen_axis(ax, [x for pts in groups.values() for x in pts])
        ax.set_title(f"batch {b}", fontsize=10)
        ax.set_xlabel("KV length (tokens)")
        ax.grid(alpha=0.3)
        if col == 0:
            ax.set_ylabel("TB/s (K + V bytes read / time)")
        ax.legend(fontsize=6.5)
    fig.suptitle("Decode (split-KV): achieved bandwidth vs KV length", fontsize=11)
    stamp.footer(fig, meta, f"{args.decode} (bench/peer_decode.py)")
    save(fig, args.outdir, "decode.png", made)


# ---- (c) extra memory vs seqlen ---------------------------------------------------------------------
def chart_memory(args, stamp, made):
    panels = []
    for path in (args.bench, args.cpu_bench):
        try:
            meta, recs = load_records(path)
        except ValueError as e:
            print(f"memory.png: {path} skipped ({e})")
            continue
        recs = [r for r in recs if not r.get("error") and not truthy(r.get("causal")) and num(r.get("extra_bytes")) is not None]
        if recs:
            panels.append((path, meta, recs))
    if not panels:
        print("memory.png: skipped (no non-causal records with extra_bytes in --bench / --cpu-bench)")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.4), squeeze=False)
    floor = 1e3  # bytes: where a measured 0 is drawn (log scale)
    sources = []
    for col, (path, meta, recs) in enumerate(panels):
        ax = axes[0][col]
        dev = recs[0].get("device", "?")
        measured = recs[0].get("extra_bytes_source") == "measured"
        d = max(int(r["hdim"]) for r in recs)  # one head dim: extra memory hardly depends on it
        zero_flash = False
        for be in ("naive", "flash"):
            pts = {int(r["seqlen"]): r for r in recs if r["backend"] == be and int(r["hdim"]) == d and r.get("dtype") == recs[0].get("dtype")}
            if not pts:
                continue
            xs = sorted(pts)
            ys = [num(pts[x]["extra_bytes"]) for x in xs]
            zero_flash |= be == "flash" and all(y == 0 for y in ys)
            ax.plot(xs, [max(y, floor) for y in ys], "o-", color=COLORS[be],
                    label=f"{be} ({'measured' if measured else 'model'})")
            if measured:
                ax.plot(xs, [max(num(pts[x]["extra_bytes_model"]), floor) for x in xs], ":", color=COLORS[be],
                        label=f"{be} (model)")
        if zero_flash:
            ax.annotate("flash: 0 B extra measured (drawn at 1 kB)", (0.02, 0.04), xycoords="axes fraction", fontsize=7)
        seqlen_axis(ax, [int(r["seqlen"]) for r in recs])
        ax.set_yscale("log")
        b_h = sorted({(int(r["batch"]), int(r["heads"])) for r in recs if int(r["hdim"]) == d})
        shape = ", ".join(f"{b}x{h}" for b, h in b_h[:4]) + ("…" if len(b_h) > 4 else "")
        ax.set_title(f"{dev}: {recs[0].get('dtype')} hdim {d}, batch x heads {shape}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("extra memory (bytes)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        sources.append(path)
    fig.suptitle("Extra memory beyond inputs and outputs: naive (n×n S and P) vs flash (tiles)", fontsize=11)
    stamp.footer(fig, panels[0][1], " + ".join(sources) + " (ioattn bench; CUDA: device memory in use, CPU: model)")
    save(fig, args.outdir, "memory.png", made)


# ---- (d) roofline ---------------------------------------------------------------------------------
def load_ceilings(args, traffic_meta_full):
    c = {}
    if args.ceilings and os.path.exists(args.ceilings):
        with open(args.ceilings) as f:
            c = json.load(f)
    elif isinstance(traffic_meta_full.get("ceilings"), dict):
        c = traffic_meta_full["ceilings"]
    return c if num(c.get("copy_tbps")) and num(c.get("gemm_tflops")) else {}


def chart_roofline(args, stamp, made):
    if not args.traffic or not os.path.exists(args.traffic):
        print("roofline.png: skipped (no --traffic)")
        return
    with open(args.traffic) as f:
        traffic = json.load(f)
    ceil = load_ceilings(args, traffic)
    _, bench = load_records(args.bench)
    times = {}
    for r in bench:
        if not r.get("error") and not truthy(r.get("causal")) and num(r.get("time_ms")):
            times[(r["backend"], int(r["hdim"]), int(r["seqlen"]), int(r["batch"]), int(r["heads"]), r["dtype"])] = num(r["time_ms"])
    pts = []
    for p in traffic.get("points", []):
        if "dram_bytes" not in p:
            continue
        t = times.get((p["backend"], p["hdim"], p["seqlen"], p["batch"], p["heads"], p["dtype"]))
        if t:
            pts.append((p, p["flops"] / (t * 1e-3) / 1e12))
    if not pts:
        print("roofline.png: skipped (no traffic point with a matching `ioattn bench` time in --bench)")
        return
    fig, ax = plt.subplots(figsize=(7.2, 5.2))
    ais = [p["flops"] / p["dram_bytes"] for p, _ in pts] + [p["flops"] / p["model_bytes"] for p, _ in pts]
    lo, hi = min(ais) / 2, max(ais) * 2
    if ceil:
        bw, peak = num(ceil["copy_tbps"]), num(ceil["gemm_tflops"])
        lo, hi = min(lo, peak / bw / 8), max(hi, peak / bw * 8)
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(peak, x * bw) for x in xs], "k-", lw=1.2,
                label=f"ceiling: copy {bw:.2f} TB/s, bf16 GEMM {peak:.0f} TFLOP/s (measured)")
        ax.axvline(peak / bw, color="0.6", ls=":", lw=0.8)
    for be in ("naive", "flash"):
        mine = [(p, tf) for p, tf in pts if p["backend"] == be]
        for d, marker in ((64, "o"), (128, "s"), (256, "^")):
            sel = [(p, tf) for p, tf in mine if p["hdim"] == d]
            if not sel:
                continue
            ax.scatter([p["flops"] / p["dram_bytes"] for p, _ in sel], [tf for _, tf in sel], marker=marker,
                       color=COLORS[be], label=f"{be} hdim {d} (measured bytes)", zorder=3)
            ax.scatter([p["flops"] / p["model_bytes"] for p, _ in sel], [tf for _, tf in sel], marker=marker,
                       facecolors="none", edgecolors=COLORS[be], alpha=0.6, label=f"{be} hdim {d} (model bytes)")
            for p, tf in sel:
                ax.annotate(f"{p['seqlen'] // 1024}k", (p["flops"] / p["dram_bytes"], tf), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP / DRAM byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5, loc="lower right")
    g = traffic.get("grid", {})
    ax.set_title(f"Roofline: attention forward {g.get('dtype', '')}, not causal, "
                 f"batch×seqlen={g.get('tokens', '?')}, hidden {g.get('hidden', '?')}", fontsize=10)
    stamp.footer(fig, traffic, f"{args.traffic} (ncu dram__bytes_read/write.sum) + {args.bench} (time) + "
                               f"{args.ceilings or 'traffic.json ceilings'}")
    save(fig, args.outdir, "roofline.png", made)


# ---- (e) measured traffic vs the model ---------------------------------------------------------------
def chart_traffic(args, stamp, made):
    if not args.traffic or not os.path.exists(args.traffic):
        print("traffic.png: skipped (no --traffic)")
        return
    with open(args.traffic) as f:
        traffic = json.load(f)
    ratios = traffic.get("ratios", [])
    points = [p for p in traffic.get("points", []) if "dram_bytes" in p]
    if not points:
        print("traffic.png: skipped (no measured point in --traffic)")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for d, marker in ((64, "o"), (128, "s"), (256, "^")):
        rs = sorted((r for r in ratios if r["hdim"] == d), key=lambda r: r["seqlen"])
        if rs:
            a1.plot([r["seqlen"] for r in rs], [r["measured_ratio"] for r in rs], marker + "-", label=f"measured, hdim {d}")
            a1.plot([r["seqlen"] for r in rs], [r["model_ratio"] for r in rs], marker + ":", color="0.5",
                    label=f"model (explain) = n/d, hdim {d}")
        for be in ("naive", "flash"):
            ps = sorted((p for p in points if p["hdim"] == d and p["backend"] == be), key=lambda p: p["seqlen"])
            if ps:
                a2.plot([p["seqlen"] for p in ps], [p["dram_bytes"] for p in ps], marker + "-", color=COLORS[be],
                        label=f"{be} measured, hdim {d}")
                a2.plot([p["seqlen"] for p in ps], [p["model_bytes"] for p in ps], marker + ":", color=COLORS[be],
                        alpha=0.5, label=f"{be} model, hdim {d}")
    for ax in (a1, a2):
        seqlen_axis(ax, [p["seqlen"] for p in points])
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5)
    a1.set_ylabel("DRAM bytes naive / flash")
    a1.set_title("naive / flash traffic: measured vs ~n/d", fontsize=10)
    a2.set_ylabel("DRAM bytes (read + write), one forward")
    a2.set_title("bytes per forward: measured (ncu) vs model", fontsize=10)
    fig.suptitle("Measured HBM traffic (Nsight Compute, --clock-control none) beside `ioattn explain`", fontsize=11)
    stamp.footer(fig, traffic, f"{args.traffic} ({traffic.get('command', 'traffic.py')})")
    save(fig, args.outdir, "traffic.png", made)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--meta", help="JSON with date, gpu, command for the footers (report.sh writes it)")
    ap.add_argument("--peer", help="bench/peer_bench.py --out JSON")
    ap.add_argument("--sm90", help="ioattn_sm90_check --csv")
    ap.add_argument("--peer-sm90", help="src/cuda/hopper/peer_sdpa.py --csv")
    ap.add_argument("--decode", help="bench/peer_decode.py JSON")
    ap.add_argument("--bench", help="`ioattn bench --device cuda` JSON lines")
    ap.add_argument("--cpu-bench", help="`ioattn bench --device cpu` JSON lines")
    ap.add_argument("--traffic", help="traffic.py --out JSON")
    ap.add_argument("--ceilings", help="ceilings.py --out JSON")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    meta = {}
    if args.meta and os.path.exists(args.meta):
        with open(args.meta) as f:
            meta = json.load(f)
    stamp = Stamp(meta)
    made = []
    for chart in (chart_tflops, chart_decode, chart_memory, chart_roofline, chart_traffic):
        try:
            chart(args, stamp, made)
        except Exception as e:  # one bad input must not cost the other charts
            print(f"{chart.__name__}: FAILED: {type(e).__name__}: {e}")
            plt.close("all")
    print(f"{len(made)} chart(s) in {args.outdir}")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
