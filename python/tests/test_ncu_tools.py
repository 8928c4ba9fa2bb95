"""bench/ncu_table.py and bench/ncu_ab.py: the Nsight Compute readers of the equal-clock tables.

The logs below copy the layout of real `ncu --metrics ...` reports (session 36, H100); the values
are made up so that the expected ratios are exact.
"""
import sys

from _scripts import load_script


def _module(name):
    return load_script("bench", name)


def _report(time, time_unit, clock, cycles=None, dram="409.79"):
    rows = [f"    dram__bytes_read.sum                    Mbyte       {dram}",
            f"    gpu__time_duration.sum                     {time_unit}         {time}",
            f"    sm__cycles_elapsed.avg.per_second         Ghz         {clock}"]
    if cycles is not None:
        rows.append(f"    sm__cycles_elapsed.avg                    cycle   {cycles}")
    return "\n".join([
        "==PROF== Profiling \"flash_bwd_sm90_kernel\": 0%....50%....100% - 1 pass",
        "  void flash_bwd_sm90_kernel<__nv_bfloat16, 128>(BwdParams) (2048, 1, 1)x(256, 1, 1), Context 1, "
        "Stream 7, Device 0, CC 9.0",
        "    Section: Command line profiler metrics",
        "    --------------------------------- ----------- ------------",
        "    Metric Name                       Metric Unit Metric Value",
        "    --------------------------------- ----------- ------------",
        *rows,
        "    --------------------------------- ----------- ------------",
        "",
    ])


def test_ab_table_uses_counted_cycles_and_falls_back_to_time_times_clock(tmp_path):
    ab = _module("ncu_ab")
    log = tmp_path / "ab.log"
    log.write_text("\n".join([
        "=== A | bwd --hdims 128 --seqlens 2048 | 0", _report("1.43", "ms", "1.78", "2,500,000"),
        "=== B | bwd --hdims 128 --seqlens 2048 | 0", _report("1.37", "ms", "1.79", "2,400,000"),
        "=== A | bwd --hdims 128 --seqlens 2048 | 1", _report("1.43", "ms", "1.78", "2,500,000"),
        "=== B | bwd --hdims 128 --seqlens 2048 | 1", _report("1.37", "ms", "1.79", "2,300,000"),
        # no counted cycles: duration x clock (us x GHz -> cycles)
        "=== A | grid --seqlens 4096 | 0", _report("800.00", "us", "1.50"),
        "=== B | grid --seqlens 4096 | 0", _report("600.00", "us", "1.80"),
        # a run that printed nothing (timed out): reported as missing, not as zero
        "=== A | grid --seqlens 16384 | 0", "ncu_ab: timed out",
        "=== B | grid --seqlens 16384 | 0", _report("3.00", "ms", "1.70"),
    ]))
    lines = ab.table(str(log))
    assert lines[0] == ("bwd --hdims 128 --seqlens 2048 | A 2500.0/2500.0 kcyc 1.0000 | "
                        "B 2400.0/2300.0 kcyc 0.9400")
    assert lines[1] == "grid --seqlens 4096 | A 1200.0 kcyc 1.0000 | B 1080.0 kcyc 0.9000"
    assert lines[2].startswith("grid --seqlens 16384 | A missing | B 5100.0 kcyc")


def test_peer_table_joins_ours_and_cudnn_by_order(tmp_path, capsys):
    nt = _module("ncu_table")
    ours, cudnn = tmp_path / "ours.log", tmp_path / "cudnn.log"
    ours.write_text("\n".join(["=== hdim 128 seqlen 2048 causal 0", _report("400.00", "us", "1.70", "680,000")]))
    cudnn.write_text(_report("420.00", "us", "1.70", "714,000", dram="201.0"))
    sys.argv = ["ncu_table.py", str(ours), str(cudnn)]
    nt.main()
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| hdim 128 seqlen 2048 causal 0 | 400.0 @ 1.70 | 420.0 @ 1.70 | 410 / 201 | 1.050 |"
