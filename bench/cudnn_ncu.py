#!/usr/bin/env python3
"""cuDNN's fused attention (PyTorch SDPA, CUDNN_ATTENTION) once per shape inside a profiler range,
for Nsight Compute: the peer side of a per-kernel, equal-clock comparison on a power-capped GPU.

    ncu --clock-control none --profile-from-start off -k regex:cudnn \\
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.avg,dram__bytes_read.sum \\
        python3 bench/cudnn_ncu.py [--hdims 64,128,256] [--seqlens 2048,4096,16384] [--causal 0,1] [--backward]

Shapes as ioattn_cuda_bench grid (FlashAttention's grid): bf16, batch * seqlen = --tokens, heads =
--hidden / hdim, inputs uniform in [-1, 1), [batch, seqlen, heads, hdim] memory seen as [b, h, s, d].
Order: hdim, then seqlen, then causal (0 before 1), one profiled call each after 3 warm-ups (with
--backward, forward + torch.autograd.grad with a fixed dO: every cuDNN kernel of the step). Ours:
`ncu ... -k regex:flash_fwd_sm90 --launch-skip 2 -c 1 ioattn_cuda_bench grid --hdims D --seqlens S
--dtypes bf16 --f16-hdims 0 --repeats 1 --causal C` (docs/PERF.md, session 35); compare SM cycles
(duration x SM clock), not durations, when the two run at different clocks.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="2048,4096,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backward", action="store_true", help="profile forward + backward")
    args = ap.parse_args()
    cudart = torch.cuda.cudart()
    for d in map(int, args.hdims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in map(int, args.causal.split(",")):
                b, h = max(1, args.tokens // s), args.hidden // d
                q, k, v = [torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
                           .transpose(1, 2).requires_grad_(args.backward) for _ in range(3)]
                do = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)

                def step():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
                        if args.backward:
                            torch.autograd.grad(o, (q, k, v), do)

                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                print(f"RANGE hdim {d} seqlen {s} causal {causal}", flush=True)
                cudart.cudaProfilerStart()
                step()
                torch.cuda.synchronize()
                cudart.cudaProfilerStop()
                del q, k, v, do


if __name__ == "__main__":
    main()
