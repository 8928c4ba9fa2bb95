#!/usr/bin/env python3
"""Join Nsight Compute logs of ours and cuDNN's attention kernels into an equal-clock table.

    python3 bench/ncu_table.py OURS.log CUDNN.log

OURS.log: `=== hdim D seqlen S causal C` header lines, each followed by one `ncu --metrics
gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second[,sm__cycles_elapsed.avg][,dram__bytes_read.sum]` report of our
kernel (tools/gpu-check.sh stage ncupeer writes it). CUDNN.log: the same metrics from
`bench/cudnn_ncu.py` under `ncu --profile-from-start off -k regex:cudnn`: its kernels in the order
of the shapes, one per shape for the forward (--backward: several per shape; this table takes the
forward only). Prints per shape both durations, SM clocks and DRAM reads, and cuDNN's SM cycles over
ours (> 1: ours takes fewer cycles), the ratio that a power-capped card's clocks do not move. The
cycles are sm__cycles_elapsed.avg where both logs have it (ncu prints it as a whole number), else
duration x SM clock (ncu prints those to 3 significant digits: ~0.3-0.6% of quantisation each).
"""
import re
import sys

METRIC = re.compile(r"\s+(gpu__time_duration\.sum|sm__cycles_elapsed\.avg\.per_second|sm__cycles_elapsed\.avg|"
                    r"dram__bytes_read\.sum)\s+(\S+)\s+([\d.,]+)$")
KERNEL = re.compile(r"\s+\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
# To us, MB, GHz and cycles; both unit spellings of Nsight Compute versions (ms / msecond, Ghz / cycle/nsecond).
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
         "hz": 1e-9, "Khz": 1e-6, "Mhz": 1e-3, "Ghz": 1.0, "cycle/second": 1e-9, "cycle/usecond": 1e-3,
         "cycle/nsecond": 1.0, "cycle": 1.0, "Kcycle": 1e3, "Mcycle": 1e6, "Gcycle": 1e9}
TIME, CLOCK, CYCLES = "gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "sm__cycles_elapsed.avg"


def cycles(a, exact=True):
    """SM cycles of one report: the counted ones when present (and exact), else duration x clock."""
    if exact and CYCLES in a:
        return a[CYCLES]
    return a[TIME] * a[CLOCK] * 1e3  # us x GHz


def parse(path, by_header):
    rows = []
    for line in open(path, errors="replace"):
        if by_header and line.startswith("==="):
            rows.append([line[3:].strip(), None, {}])
            continue
        if KERNEL.match(line):
            if not by_header:
                rows.append([None, None, {}])
            if rows and rows[-1][1] is None:
                rows[-1][1] = line.strip().split("(")[0][:70]
            continue
        m = METRIC.match(line)
        if m and rows:
            rows[-1][2][m.group(1)] = float(m.group(3).replace(",", "")) * SCALE.get(m.group(2), 1.0)
    return rows


def main():
    ours, cudnn = parse(sys.argv[1], True), parse(sys.argv[2], False)
    print("| shape | ours us @ GHz | cuDNN us @ GHz | DRAM MB ours / cuDNN | cuDNN cycles / ours |")
    print("|---|---|---|---|---|")
    for i, (shape, _, a) in enumerate(ours):
        b = cudnn[i][2] if i < len(cudnn) else {}
        t, g = TIME, CLOCK
        if t not in a or g not in a or t not in b or g not in b:
            print(f"| {shape} | missing | | | |")
            continue
        dr = "dram__bytes_read.sum"
        dram = f"{a.get(dr, 0):.0f} / {b.get(dr, 0):.0f}" if dr in a else ""
        exact = CYCLES in a and CYCLES in b
        print(f"| {shape} | {a[t]:.1f} @ {a[g]:.2f} | {b[t]:.1f} @ {b[g]:.2f} | {dram} | "
              f"{cycles(b, exact) / cycles(a, exact):.3f} |")


if __name__ == "__main__":
    main()
