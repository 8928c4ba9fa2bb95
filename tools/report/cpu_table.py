#!/usr/bin/env python3
"""On the CPU: the traffic model of `ioattn explain` beside measured time, naive vs flash.

    ioattn bench --device cpu --backend naive,flash --out cpu_bench.jsonl ...
    python3 tools/report/cpu_table.py cpu_bench.jsonl [--markdown]

Per shape: the model's bytes (naive: 4 passes over the n x n matrix in the input dtype; flash:
Q, K, V read and O written once) and their ratio (~n/d), the measured median times and their
ratio, and the bandwidth each time implies for its model bytes. The CPU naive backend is the
float64 reference (S materialised in double, one matrix per thread: its extra memory is the
model's `extra_bytes`), so its time also carries float64 arithmetic: read the time ratio as an
upper bound of what the traffic alone costs.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_records, num, truthy  # noqa: E402


def rows(records):
    by = {}
    for r in records:
        if r.get("error") or num(r.get("time_ms")) is None:
            continue
        key = (r["dtype"], int(r["hdim"]), int(r["seqlen"]), truthy(r["causal"]), int(r["batch"]), int(r["heads"]))
        by.setdefault(key, {})[r["backend"]] = r
    out = []
    for key in sorted(by):
        n, f = by[key].get("naive"), by[key].get("flash")
        if not n or not f:
            continue
        dt, d, s, causal, b, h = key
        out.append(dict(dtype=dt, hdim=d, seqlen=s, causal=causal, batch=b, heads=h, threads=n.get("threads"),
                        model_naive_mb=num(n["model_naive_bytes"]) / 1e6, model_flash_mb=num(n["model_flash_bytes"]) / 1e6,
                        model_ratio=num(n["model_traffic_ratio"]), naive_ms=num(n["time_ms"]), flash_ms=num(f["time_ms"]),
                        naive_gbps=num(n["bandwidth_tbps"]) * 1e3, flash_gbps=num(f["bandwidth_tbps"]) * 1e3,
                        naive_extra_mb=num(n["extra_bytes"]) / 1e6, flash_extra_mb=num(f["extra_bytes"]) / 1e6,
                        naive_pass=n.get("pass"), flash_pass=f.get("pass")))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", help="JSON lines from `ioattn bench --device cpu`")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table (for docs/PERF.md)")
    args = ap.parse_args()
    _, records = load_records(args.bench)
    table = rows(records)
    if not table:
        print(f"cpu_table: no naive/flash pairs in {args.bench}", file=sys.stderr)
        return 1
    head = ["dtype", "hdim", "seqlen", "causal", "b x h", "model naive MB", "model flash MB", "model ratio",
            "naive ms", "flash ms", "time ratio", "naive GB/s", "flash GB/s", "naive extra MB", "flash extra MB"]
    lines = []
    for r in table:
        lines.append([r["dtype"], str(r["hdim"]), str(r["seqlen"]), "yes" if r["causal"] else "no",
                      f"{r['batch']}x{r['heads']}", f"{r['model_naive_mb']:.1f}", f"{r['model_flash_mb']:.2f}",
                      f"{r['model_ratio']:.0f}", f"{r['naive_ms']:.2f}", f"{r['flash_ms']:.2f}",
                      f"{r['naive_ms'] / r['flash_ms']:.1f}", f"{r['naive_gbps']:.1f}", f"{r['flash_gbps']:.1f}",
                      f"{r['naive_extra_mb']:.1f}", f"{r['flash_extra_mb']:.2f}"])
    threads = {r["threads"] for r in table}
    print(f"CPU, {'/'.join(str(t) for t in sorted(threads, key=str))} threads: the traffic model of `ioattn explain` "
          f"beside measured time (naive = the float64 reference; GB/s = model bytes / measured time; "
          f"extra memory from the model)")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for l in lines:
            print("| " + " | ".join(l) + " |")
    else:
        w = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w[i]) for i, h in enumerate(head)))
        for l in lines:
            print("  ".join(x.rjust(w[i]) for i, x in enumerate(l)))
    bad = [r for r in table if r["naive_pass"] is False or r["flash_pass"] is False]
    if bad:
        print(f"CHECK FAILED at {len(bad)} shape(s) (see the bench records)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
