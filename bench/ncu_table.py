#!/usr/bin/env python3
"""Join Nsight Compute logs of ours and cuDNN's attention kernels into an equal-clock table.

    python3 bench/ncu_table.py OURS.log CUDNN.log

OURS.log: `=== hdim D seqlen S causal C` header lines, each followed by one `ncu --metrics
gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second[,dram__bytes_read.sum]` report of our
kernel (tools/gpu-check.sh stage ncupeer writes it). CUDNN.log: the same metrics from
`bench/cudnn_ncu.py` under `ncu --profile-from-start off -k regex:cudnn`: its kernels in the order
of the shapes, one per shape for the forward (--backward: several per shape; this table takes the
forward only). Prints per shape both durations, SM clocks and DRAM reads, and cuDNN's SM cycles over
ours (> 1: ours takes fewer cycles), the ratio that a power-capped card's clocks do not move.
"""
import re
import sys

METRIC = re.compile(r"\s+(gpu__time_duration\.sum|sm__cycles_elapsed\.avg\.per_second|dram__bytes_read\.sum)"
                    r"\s+(\S+)\s+([\d.,]+)$")
KERNEL = re.compile(r"\s+\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
         "hz": 1e-9, "Khz": 1e-6, "Mhz": 1e-3, "Ghz": 1.0}


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
        t, g = "gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second"
        if t not in a or g not in a or t not in b or g not in b:
            print(f"| {shape} | missing | | | |")
            continue
        dr = "dram__bytes_read.sum"
        dram = f"{a.get(dr, 0):.0f} / {b.get(dr, 0):.0f}" if dr in a else ""
        print(f"| {shape} | {a[t]:.1f} @ {a[g]:.2f} | {b[t]:.1f} @ {b[g]:.2f} | {dram} | "
              f"{b[t] * b[g] / (a[t] * a[g]):.3f} |")


if __name__ == "__main__":
    main()
