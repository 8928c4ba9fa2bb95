#!/usr/bin/env python3
"""The machine's measured ceilings for the roofline: copy bandwidth and bf16 GEMM rate (torch, CUDA).

    python3 tools/report/ceilings.py --out results/ceilings.json

copy: device-to-device copy of a 2 GiB buffer (far beyond L2), bytes read + written per second.
gemm: 8192^3 bf16 matmul, 2 n^3 FLOP per call. Both: CUDA events, warm-up, median of 20 calls.
Clocks vary from run to run: take the ceilings from the same run as the points on the chart.
"""
import argparse
import json
import statistics
import sys
import time


def _median_ms(torch, fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def probe(copy_bytes=2 << 30, gemm_n=8192):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch")
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy_ms = _median_ms(torch, lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device="cuda")
    gemm_ms = _median_ms(torch, lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                copy_bytes=copy_bytes, copy_ms=copy_ms, copy_tbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e12,
                gemm_n=gemm_n, gemm_ms=gemm_ms, gemm_tflops=2.0 * gemm_n ** 3 / (gemm_ms * 1e-3) / 1e12,
                method="CUDA events, 3 warm-ups, median of 20; copy counts bytes read + written")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ceilings.json")
    args = ap.parse_args()
    c = probe()
    with open(args.out, "w") as f:
        json.dump(c, f, indent=1)
    print(f"{c['device']}: copy {c['copy_tbps']:.2f} TB/s (read + write), bf16 GEMM {c['gemm_n']}^3 "
          f"{c['gemm_tflops']:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
