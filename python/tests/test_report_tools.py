"""tools/report: the readers every chart relies on, and charts.py on the sample JSON.

The chart test needs matplotlib (on the GPU machine; `pip install matplotlib` elsewhere) and
skips without it. The sample under tools/report/sample/ is synthetic: it exercises the code, it
measures nothing.
"""
import json
import subprocess
import sys

import pytest
from _scripts import ROOT, load_script

REPORT = ROOT / "tools" / "report"
SAMPLE = REPORT / "sample"


def _module(name):
    return load_script("tools/report", name)


def test_load_records_reads_every_shape(tmp_path):
    common = _module("common")
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"seqlen": 1024, "tflops": 1.5}\n\n{"seqlen": 2048, "tflops": null}\n')
    assert common.load_records(str(lines)) == ({}, [{"seqlen": 1024, "tflops": 1.5}, {"seqlen": 2048, "tflops": None}])
    d = tmp_path / "p.json"
    d.write_text(json.dumps({"device": "X", "ioattn": [{"a": 1}], "torch_sdpa": [{"a": 2}], "grid": {"t": 1}}))
    meta, recs = common.load_records(str(d))
    assert meta == {"device": "X"} and recs == [{"a": 1}, {"a": 2}]
    assert common.load_records(str(d), "torch_sdpa")[1] == [{"a": 2}]
    c = tmp_path / "s.csv"
    c.write_text("impl,hdim,seqlen,causal,tflops\ncudnn,128,4096,1,500.5\n")
    assert common.load_records(str(c))[1] == [{"impl": "cudnn", "hdim": "128", "seqlen": "4096", "causal": "1",
                                                "tflops": "500.5"}]
    assert common.load_records(str(tmp_path / "missing.json")) == ({}, [])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        common.load_records(str(bad))
    assert common.truthy("1") and common.truthy(True) and not common.truthy("false") and not common.truthy(0)
    assert common.num("null") is None and common.num("2.5") == 2.5


def test_parse_ncu_csv_sums_units_and_thousands_separators():
    traffic = _module("traffic")
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    row = '"{id}","1","ioattn","h","{k}","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","m","{m}","{u}","{v}"\n'
    text = ("==PROF== Connected to process 1\n" + head +
            row.format(id=0, k="gemm", m="dram__bytes_read.sum", u="byte", v="1,048,576") +
            row.format(id=0, k="gemm", m="dram__bytes_write.sum", u="Mbyte", v="2.5") +
            row.format(id=1, k="softmax", m="dram__bytes_read.sum", u="byte", v="1000") +
            row.format(id=1, k="softmax", m="sm__cycles_elapsed.avg", u="cycle", v="7") +
            row.format(id=1, k="softmax", m="dram__bytes_write.sum", u="Kbyte", v="3"))
    ks = traffic.parse_ncu_csv(text)
    assert [k["name"] for k in ks] == ["gemm", "softmax"]
    assert ks[0]["dram__bytes_read.sum"] == 1048576 and ks[0]["dram__bytes_write.sum"] == 2.5e6
    assert ks[1]["dram__bytes_read.sum"] == 1000 and ks[1]["dram__bytes_write.sum"] == 3000
    assert traffic.parse_ncu_csv("==ERROR== no kernels were profiled\n") == []
    pts = [dict(backend="naive", hdim=64, seqlen=1024, dram_bytes=640.0, model_traffic_ratio=16.0,
                model_naive_bytes=8.0, model_flash_bytes=1.0),
           dict(backend="flash", hdim=64, seqlen=1024, dram_bytes=20.0, model_traffic_ratio=16.0,
                model_naive_bytes=8.0, model_flash_bytes=1.0),
           dict(backend="naive", hdim=64, seqlen=2048, error="ncu failed")]
    (r,) = traffic.ratios(pts)
    assert (r["measured_ratio"], r["model_ratio"], r["n_over_d"]) == (32.0, 16.0, 16.0)


def test_sm90_csv_rows_are_the_bf16_grid_only(tmp_path):
    common = _module("common")
    c = tmp_path / "sm90.csv"
    c.write_text("impl,hdim,seqlen,causal,batch,heads,ms,tflops\n"
                 "ioattn_sm90,128,4096,0,4,16,0.81,650\n"
                 "ioattn_sm90_bf16_vs_fp8,256,4096,0,4,8,0.74,744\n"
                 "ioattn_sm90_fp8,256,4096,0,4,8,0.59,931\n"
                 "ioattn_sm90_fp8_prepass,256,4096,0,4,8,0.04,0\n")
    rows = common.sm90_grid_rows(common.load_records(str(c))[1])
    assert [(r["impl"], r["hdim"], r["tflops"]) for r in rows] == [("ioattn_sm90", "128", "650")]


def test_charts_from_the_sample(tmp_path):
    pytest.importorskip("matplotlib")
    s = SAMPLE
    res = subprocess.run([sys.executable, str(REPORT / "charts.py"), "--outdir", str(tmp_path), "--meta", str(s / "meta.json"),
                          "--peer", str(s / "peer.json"), "--decode", str(s / "peer_decode.json"),
                          "--bench", str(s / "bench_cuda.jsonl"), "--cpu-bench", str(s / "cpu_bench.jsonl"),
                          "--traffic", str(s / "traffic.json"), "--ceilings", str(s / "ceilings.json")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("tflops", "decode", "memory", "roofline", "traffic"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 20_000, name  # axes, lines and text, not an empty canvas
    # A missing input skips its chart and keeps the others.
    res = subprocess.run([sys.executable, str(REPORT / "charts.py"), "--outdir", str(tmp_path / "part"),
                          "--cpu-bench", str(s / "cpu_bench.jsonl"), "--decode", str(tmp_path / "absent.json")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "decode.png: skipped" in res.stdout and (tmp_path / "part" / "memory.png").exists()
