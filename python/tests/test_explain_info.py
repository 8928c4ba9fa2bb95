"""ioattn.explain / explain_text / online_softmax_example / info."""

import importlib.metadata
import math

import pytest

import ioattn


def test_explain_defaults_n8192_fp16():
    r = ioattn.explain(seqlen=8192, head_dim=128, dtype_bytes=2, attention_share=0.3,
                       kernel_speedup=2.0)
    assert r["score_bytes_per_head"] == 134_217_728          # 8192^2 * 2 B
    assert r["naive_bytes_per_head"] == 4 * 134_217_728      # write S, read S, write P, read P
    assert round(r["naive_bytes_per_head"] / 1e6) == 537     # "537 MB per head"
    assert r["flash_bytes_per_head"] == 4 * 8192 * 128 * 2   # read Q, K, V, write O
    assert round(r["flash_bytes_per_head"] / 1e6, 1) == 8.4  # "8.4 MB per head"
    assert r["traffic_ratio"] == 64
    assert r["flops_per_head"] == 4 * 8192**2 * 128
    assert round(r["flops_per_model"] / 1e12) == 176         # 64 heads x 80 layers: 176 TFLOP
    assert round(r["end_to_end_speedup"], 2) == 1.18         # 1 / (0.7 + 0.3 / 2)
    assert math.isclose(r["end_to_end_speedup"], 1 / (0.7 + 0.15))
    assert r["naive_traffic_seconds"] == pytest.approx(r["naive_bytes_per_model"] / 3e12)
    assert r["math_seconds"] == pytest.approx(r["flops_per_model"] / 500e12)


def test_explain_keys_and_no_share():
    r = ioattn.explain()
    assert set(r) == {
        "score_bytes_per_head", "naive_bytes_per_head", "naive_bytes_per_layer",
        "naive_bytes_per_model", "flash_bytes_per_head", "traffic_ratio", "flops_per_head",
        "flops_per_model", "naive_traffic_seconds", "flash_traffic_seconds", "math_seconds",
        "end_to_end_speedup"}
    assert r["end_to_end_speedup"] == 1.0
    assert ioattn.explain(seqlen=1024, head_dim=64)["traffic_ratio"] == 4 * 1024 / (4 * 64)


def test_explain_text():
    text = ioattn.explain_text(seqlen=8192)
    assert isinstance(text, str) and "8192" in text


def test_online_softmax_example():
    ex = ioattn.online_softmax_example([1.0, 3.0, 2.0, 5.0, 0.5], [1.0, 2.0, 3.0, 4.0, 5.0], 2)
    assert len(ex["steps"]) == 3
    assert ex["steps"][0]["block_scores"] == [1.0, 3.0]
    assert ex["steps"][1]["max_after"] == 5.0
    assert sum(ex["probabilities"]) == pytest.approx(1.0)
    assert ex["output"] == pytest.approx(ex["output_direct"])
    with pytest.raises(ValueError, match="argument 'values'"):
        ioattn.online_softmax_example([1.0, 2.0], [1.0], 1)


def test_info():
    info = ioattn.info()
    assert info["version"] == ioattn.__version__ == importlib.metadata.version("ioattn")
    assert isinstance(info["cpu_targets"], list) and info["cpu_targets"]
    assert isinstance(info["cpu_best_target"], str)
    assert info["cpu_threads"] >= 1
    assert isinstance(info["cuda_compiled"], bool)
    assert info["cuda_devices"] == len(info["cuda_device_names"])
    if not info["cuda_compiled"]:
        assert info["cuda_devices"] == 0 and info["cuda_kernels"] == []


def test_explain_arguments_are_checked_by_name_and_type():
    with pytest.raises(TypeError, match=r"explain\(\) has no argument 'speedup'; it takes .*kernel_speedup"):
        ioattn.explain(attention_share=0.3, speedup=2.0)
    with pytest.raises(TypeError, match=r"argument 'seqlen' must be an int, got str"):
        ioattn.explain_text(seqlen="8k")
    assert ioattn.explain(seqlen=4096, bandwidth_Bps=4.8e12)["score_bytes_per_head"] == 4096 * 4096 * 2


def test_online_softmax_example_masked_keys_and_bad_scores():
    ninf = float("-inf")
    ex = ioattn.online_softmax_example([ninf, ninf, ninf], [1.0, 2.0, 3.0])
    assert ex["output"] == 0.0 and ex["output_direct"] == 0.0  # no visible key: 0, not NaN
    with pytest.raises(ValueError, match=r"argument 'scores\[0\]': expected a finite score or -inf"):
        ioattn.online_softmax_example([float("nan"), 1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"argument 'scores': expected at least one score"):
        ioattn.online_softmax_example([], [])
