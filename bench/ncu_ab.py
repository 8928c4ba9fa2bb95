#!/usr/bin/env python3
"""A/B of builds of one kernel at equal clocks: Nsight Compute's SM cycles per variant and shape.

    python3 bench/ncu_ab.py --kernel REGEX --variant A=build-cuda/ioattn_cuda_bench \\
        --variant B=/tmp/v/ioattn_cuda_bench \\
        --shape "grid --hdims 128 --seqlens 2048 --dtypes bf16 --f16-hdims 0 --causal 0" \\
        [--shape ...] [--reps 2] [--skip 2] [--log ab.log]
    python3 bench/ncu_ab.py --parse ab.log        # the table again from a log

For each repetition, shape and variant (in that order, so the variants alternate) it runs
`ncu --clock-control none --metrics ... -k regex:REGEX --launch-skip SKIP -c 1 BINARY SHAPE` (one
launch after SKIP warm-ups) and appends the report to the log under a `=== variant | shape | rep`
header. The table gives per shape each variant's SM cycles (sm__cycles_elapsed.avg, every
repetition) and the mean's ratio to the first variant (< 1: fewer cycles than it). On a power-capped
card the clocks differ from run to run, the cycles much less: the method of sessions 35-36
(src/cuda/hopper/NOTES.md). The binaries are ioattn_cuda_bench (or any program that launches the
kernel), built e.g. by tools/gpu-variant.sh.
"""
import argparse
import collections
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_table import CYCLES, TIME, parse, cycles  # noqa: E402

METRICS = "gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.avg,dram__bytes_read.sum"


def table(log):
    """Rows of `variant | shape | rep` headers -> one line per shape: cycles per variant and ratios."""
    by_shape = collections.OrderedDict()
    for header, _, m in parse(log, True):
        parts = [x.strip() for x in header.split("|")]
        if len(parts) < 2:
            continue
        variant, shape = parts[0], parts[1]
        by = by_shape.setdefault(shape, collections.OrderedDict())
        by.setdefault(variant, [])
        if TIME in m or CYCLES in m:
            try:
                by[variant].append(cycles(m))
            except KeyError:
                pass
    lines = []
    for shape, by in by_shape.items():
        base = by[next(iter(by))]
        ref = sum(base) / len(base) if base else 0.0
        cells = []
        for variant, c in by.items():
            if not c:
                cells.append(f"{variant} missing")
                continue
            mean = sum(c) / len(c)
            ratio = f"{mean / ref:.4f}" if ref else "n/a"
            cells.append(f"{variant} {'/'.join(f'{x / 1e3:.1f}' for x in c)} kcyc {ratio}")
        lines.append(f"{shape} | " + " | ".join(cells))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", help="kernel name regex (ncu -k regex:...)")
    ap.add_argument("--variant", action="append", default=[], help="NAME=BINARY (the first is the baseline)")
    ap.add_argument("--shape", action="append", default=[], help="the binary's arguments for one shape")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2, help="launches of the kernel to skip first (warm-ups)")
    ap.add_argument("--log", default="ncu_ab.log")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per ncu run")
    ap.add_argument("--parse", metavar="LOG", help="only print the table of an existing log")
    a = ap.parse_args()
    if a.parse:
        print("\n".join(table(a.parse)))
        return 0
    if not a.kernel or not a.variant or not a.shape:
        ap.error("--kernel, --variant and --shape are needed (or --parse LOG)")
    variants = [v.split("=", 1) for v in a.variant]
    if any(len(v) != 2 for v in variants):
        ap.error("--variant takes NAME=BINARY")
    with open(a.log, "w") as log:
        for rep in range(a.reps):
            for shape in a.shape:
                for name, binary in variants:
                    log.write(f"=== {name} | {shape} | {rep}\n")
                    log.flush()
                    cmd = ["ncu", "--clock-control", "none", "--metrics", METRICS, "-k", "regex:" + a.kernel,
                           "--launch-skip", str(a.skip), "-c", "1", binary] + shape.split()
                    try:
                        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout, check=False)
                    except subprocess.TimeoutExpired:
                        log.write("ncu_ab: timed out\n")
                    log.flush()
    print("\n".join(table(a.log)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
