"""ioattn.attention / attention_varlen on numpy arrays vs the float64 reference."""

import numpy as np
import pytest

import ioattn
from _reference import BF16, attention_ref, attention_varlen_ref, check_close, max_err

DTYPES = ["float32", "float16"] + (["bfloat16"] if BF16 is not None else [])


def np_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def rand(rng, shape, dtype, lo=-1.0, hi=1.0):
    return rng.uniform(lo, hi, size=shape).astype(np_dtype(dtype))


# (name, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, kwargs)
CASES = [
    ("plain", 2, 17, 17, 4, 4, 32, 32, {}),
    ("one_token", 1, 1, 1, 1, 1, 8, 8, {}),
    ("decode_row", 2, 1, 113, 4, 2, 64, 64, {"causal": True}),
    ("causal_q<k", 1, 17, 113, 4, 2, 64, 64, {"causal": True}),
    ("causal_q>k", 1, 113, 17, 2, 2, 32, 32, {"causal": True}),  # rows with no visible key
    ("odd_113x203", 1, 113, 203, 2, 1, 40, 40, {"causal": True}),
    ("window_8_0", 2, 64, 64, 2, 2, 16, 16, {"window": (8, 0)}),
    ("window_3_5_q<k", 1, 17, 40, 2, 2, 16, 16, {"window": (3, 5)}),
    ("window_left_only", 1, 33, 33, 2, 1, 16, 16, {"window": (4, -1)}),
    ("softcap", 1, 33, 47, 4, 2, 32, 32, {"softcap": 0.7, "scale": 2.0}),
    ("alibi", 1, 33, 47, 4, 2, 32, 32, {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}),
    ("sinks", 1, 40, 17, 4, 4, 16, 16, {"causal": True, "sinks": [0.3, -1.0, 2.0, 0.0]}),
    ("gqa_4", 2, 17, 29, 8, 2, 32, 32, {}),
    ("mqa", 1, 17, 29, 6, 1, 32, 32, {"causal": True}),
    ("dv_ne_d", 1, 17, 23, 2, 2, 24, 40, {}),
    ("scale", 1, 17, 17, 2, 2, 32, 32, {"scale": 0.05}),
    ("everything", 2, 29, 37, 4, 2, 24, 24,
     {"causal": True, "window": (9, -1), "softcap": 1.5, "alibi_slopes": [0.1, 0.2, 0.3, 0.4],
      "sinks": [0.0, 0.5, -0.5, 1.0]}),
]


def run_case(rng, case, dtype, backend="auto"):
    name, b, sq, sk, hq, hkv, d, dv, kw = case
    q = rand(rng, (b, sq, hq, d), dtype)
    k = rand(rng, (b, sk, hkv, d), dtype)
    v = rand(rng, (b, sk, hkv, dv), dtype)
    o, lse = ioattn.attention(q, k, v, return_lse=True, backend=backend, **kw)
    assert o.shape == (b, sq, hq, dv) and o.dtype == q.dtype and type(o) is np.ndarray
    assert lse.shape == (b, hq, sq) and lse.dtype == np.float32
    o_ref, lse_ref = attention_ref(q, k, v, **kw)
    o_low, lse_low = attention_ref(q, k, v, emulate=np_dtype(dtype), **kw)
    check_close(o, lse, o_ref, lse_ref, o_low, lse_low, dtype, f"{name} {dtype} {backend}")
    return o, lse, o_ref, lse_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_reference(case, dtype):
    run_case(np.random.default_rng(0), case, dtype)


@pytest.mark.parametrize("case", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_naive_backend_matches_reference(case):
    run_case(np.random.default_rng(1), case, "float32", backend="naive")


def test_rows_without_keys_are_zero_and_neg_inf():
    rng = np.random.default_rng(2)
    q = rand(rng, (1, 9, 2, 8), "float32")
    k = rand(rng, (1, 4, 2, 8), "float32")
    o, lse = ioattn.attention(q, k, k, causal=True, return_lse=True)
    # off = 4 - 9 = -5: rows 0..4 see no key.
    assert np.all(o[0, :5] == 0)
    assert np.all(np.isneginf(lse[0, :, :5]))
    assert np.all(np.isfinite(lse[0, :, 5:]))
    # With a sink the empty rows have O = 0 and LSE = sink.
    o, lse = ioattn.attention(q, k, k, causal=True, sinks=[1.5, -2.0], return_lse=True)
    assert np.all(o[0, :5] == 0)
    np.testing.assert_allclose(lse[0, :, :5], np.array([[1.5] * 5, [-2.0] * 5]), rtol=1e-6)


@pytest.mark.parametrize("backend", ["flash", "naive"])
def test_empty_tensors(backend):
    # Zero-size arrays (their strides are arbitrary): seqlen_q = 0 and batch = 0 are no-ops, seqlen_k = 0
    # leaves every row without a key (O = 0, LSE = -inf), head_dim = 0 is an error naming head_dim.
    rng = np.random.default_rng(4)
    q = rand(rng, (2, 3, 4, 16), "float32")
    k = rand(rng, (2, 5, 2, 16), "float32")
    o, lse = ioattn.attention(q[:, :0], k, k, causal=True, return_lse=True, backend=backend)
    assert o.shape == (2, 0, 4, 16) and lse.shape == (2, 4, 0)
    o = ioattn.attention(q[:0], k[:0], k[:0], backend=backend)
    assert o.shape == (0, 3, 4, 16)
    o, lse = ioattn.attention(q, k[:, :0], k[:, :0], return_lse=True, backend=backend)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    with pytest.raises(ValueError, match=r"q\.shape\[3\]"):
        ioattn.attention(q[..., :0], k[..., :0], k[..., :0], backend=backend)


def test_returns_only_o_without_return_lse():
    rng = np.random.default_rng(3)
    q = rand(rng, (1, 5, 2, 8), "float32")
    o = ioattn.attention(q, q, q)
    assert isinstance(o, np.ndarray) and o.shape == q.shape


def test_strided_views_are_read_in_place():
    """[b, h, s, d] buffers passed as transposed views, a sliced k, and a broadcast v."""
    rng = np.random.default_rng(4)
    b, h, s, d = 2, 4, 23, 16
    q_bhsd = rand(rng, (b, h, s, d), "float32")
    k_big = rand(rng, (b, 2 * s, h, d), "float32")
    v_row = rand(rng, (1, s, h, d), "float32")
    q = q_bhsd.transpose(0, 2, 1, 3)           # [b, s, h, d] view, not contiguous
    k = k_big[:, ::2]                          # stride 2 along the sequence
    v = np.broadcast_to(v_row, (b, s, h, d))   # stride 0 along batch, read-only
    assert not q.flags.c_contiguous and not v.flags.writeable
    o, lse = ioattn.attention(q, k, v, causal=True, return_lse=True)
    o_ref, lse_ref = attention_ref(q, k, v, causal=True)
    o_low, lse_low = attention_ref(q, k, v, causal=True, emulate=np.float32)
    check_close(o, lse, o_ref, lse_ref, o_low, lse_low, "float32", "strided")


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_with_empty_sequences(dtype):
    rng = np.random.default_rng(5)
    lens_q = [5, 0, 17, 3, 1]
    lens_k = [7, 4, 17, 0, 30]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    hq, hkv, d = 4, 2, 16
    q = rand(rng, (int(cu_q[-1]), hq, d), dtype)
    k = rand(rng, (int(cu_k[-1]), hkv, d), dtype)
    v = rand(rng, (int(cu_k[-1]), hkv, d), dtype)
    kw = {"causal": True, "softcap": 2.0}
    o, lse = ioattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                     return_lse=True, **kw)
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0])
    o_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    o_low, lse_low = attention_varlen_ref(q, k, v, cu_q, cu_k, emulate=np_dtype(dtype), **kw)
    check_close(o, lse, o_ref, lse_ref, o_low, lse_low, dtype, f"varlen {dtype}")
    # Sequence 3 has no keys: O = 0, LSE = -inf on its rows.
    rows = slice(cu_q[3], cu_q[4])
    assert np.all(np.asarray(o[rows], dtype=np.float64) == 0)
    assert np.all(np.isneginf(lse[:, rows]))


def test_varlen_lists_and_defaults():
    """cu_seqlens as Python lists, max_seqlen left to the library, padding rows past the end."""
    rng = np.random.default_rng(6)
    q = rand(rng, (12, 2, 8), "float32")   # rows 10, 11 belong to no sequence
    k = rand(rng, (9, 2, 8), "float32")
    o, lse = ioattn.attention_varlen(q, k, k, [0, 4, 10], [0, 3, 9], return_lse=True)
    o_ref, lse_ref = attention_varlen_ref(q, k, k, [0, 4, 10], [0, 3, 9])
    assert max_err(o, o_ref) < 1e-5 and max_err(lse, lse_ref) < 1e-4
    assert np.all(o[10:] == 0) and np.all(np.isneginf(lse[:, 10:]))


def test_every_output_element_is_written():
    """Through the extension directly, with NaN-poisoned outputs."""
    rng = np.random.default_rng(7)
    q = rand(rng, (2, 13, 4, 16), "float32")
    k = rand(rng, (2, 19, 2, 16), "float32")
    o = np.full((2, 13, 4, 16), np.nan, dtype=np.float32)
    lse = np.full((2, 4, 13), np.nan, dtype=np.float32)
    kernel, reason = ioattn._C.forward(q, k, k, o, lse, causal=True)
    assert kernel and reason
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    # Outputs may be strided too: o as a [b, h, s, d] buffer's transpose.
    o_bhsd = np.full((2, 4, 13, 16), np.nan, dtype=np.float32)
    ioattn._C.forward(q, k, k, o_bhsd.transpose(0, 2, 1, 3), None, causal=True)
    np.testing.assert_array_equal(o_bhsd.transpose(0, 2, 1, 3), o)


def test_num_threads_does_not_change_results():
    rng = np.random.default_rng(8)
    q = rand(rng, (1, 40, 2, 32), "float32")
    a = ioattn.attention(q, q, q, causal=True, num_threads=1)
    b = ioattn.attention(q, q, q, causal=True, num_threads=2)
    assert max_err(a, b) < 1e-6


def test_select_names_the_kernel():
    rng = np.random.default_rng(9)
    q = rand(rng, (1, 17, 4, 64), "float32")
    k = rand(rng, (1, 17, 2, 64), "float32")
    auto = ioattn.select(q, k, k, causal=True)
    assert set(auto) == {"kernel", "reason"}
    assert auto["kernel"].startswith("cpu/") and "hdim64" in auto["kernel"]
    assert "causal" in auto["kernel"] and "gqa2" in auto["kernel"]
    naive = ioattn.select(q, k, k, backend="naive")
    assert naive["kernel"].startswith("cpu/naive")
    with pytest.raises(ValueError, match=r"k\.shape\[0\]"):
        ioattn.select(q, k[:0], k)
