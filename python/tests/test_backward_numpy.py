"""ioattn.attention_backward on numpy arrays vs float64 gradients (skipped while the C++
backward of this build is not implemented: it raises NotImplementedError)."""

import numpy as np
import pytest

import ioattn
from _reference import ATOL, attention_backward_ref, attention_ref, max_err

CASES = [
    ("plain", 1, 17, 17, 2, 2, 16, {}),
    ("causal_gqa", 2, 13, 29, 4, 2, 32, {"causal": True}),
    ("causal_q>k", 1, 29, 13, 2, 1, 16, {"causal": True}),
    ("window_softcap_alibi", 1, 23, 31, 2, 2, 16,
     {"window": (5, 2), "softcap": 1.5, "alibi_slopes": [0.25, 0.5]}),
    ("sinks", 1, 19, 11, 2, 2, 16, {"causal": True, "sinks": [0.5, -1.0]}),
]


def backward_or_skip(*args, **kwargs):
    try:
        return ioattn.attention_backward(*args, **kwargs)
    except NotImplementedError as e:
        assert "backward" in str(e)
        pytest.skip(f"backward not in this build: {e}")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_matches_float64_gradients(case):
    name, b, sq, sk, hq, hkv, d, kw = case
    rng = np.random.default_rng(0)
    q = rng.uniform(-1, 1, (b, sq, hq, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (b, sk, hkv, d)).astype(np.float32)
    v = rng.uniform(-1, 1, (b, sk, hkv, d)).astype(np.float32)
    dout = rng.uniform(-1, 1, (b, sq, hq, d)).astype(np.float32)
    o, lse = ioattn.attention(q, k, v, return_lse=True, **kw)
    grads = backward_or_skip(dout, q, k, v, o, lse, **kw)
    ref = attention_backward_ref(dout, q, k, v, **kw)
    assert len(grads) == (4 if "sinks" in kw else 3)
    for got, want, what in zip(grads, ref, ("dq", "dk", "dv", "dsinks")):
        assert got.shape == want.shape, what
        scale = max(1.0, float(np.abs(want).max()))
        assert max_err(got, want) <= 100 * ATOL["float32"] * scale, f"{name}: {what}"


def test_varlen_backward_matches_per_sequence_gradients():
    rng = np.random.default_rng(2)
    cu_q, cu_k = [0, 5, 5, 12], [0, 3, 9, 9]  # sequence 1 has no queries, sequence 2 no keys
    q = rng.uniform(-1, 1, (13, 4, 16)).astype(np.float32)  # row 12 belongs to no sequence
    k = rng.uniform(-1, 1, (9, 2, 16)).astype(np.float32)
    v = rng.uniform(-1, 1, (9, 2, 16)).astype(np.float32)
    dout = rng.uniform(-1, 1, q.shape).astype(np.float32)
    o, lse = ioattn.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    try:
        dq, dk, dv = ioattn.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k,
                                                      causal=True)
    except NotImplementedError:
        pytest.skip("backward not in this build")
    want_dq, want_dk, want_dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(3):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        g = attention_backward_ref(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1],
                                   v[None, k0:k1], causal=True)
        want_dq[q0:q1], want_dk[k0:k1], want_dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    for got, want, what in ((dq, want_dq, "dq"), (dk, want_dk, "dk"), (dv, want_dv, "dv")):
        assert max_err(got, want) < 1e-4, what


def test_reference_gradients_are_right():
    """The float64 reference backward agrees with finite differences of the reference forward."""
    rng = np.random.default_rng(1)
    kw = {"causal": True, "softcap": 1.2, "alibi_slopes": [0.3, 0.1], "sinks": [0.2, -0.4]}
    q = rng.standard_normal((1, 5, 2, 4))
    k = rng.standard_normal((1, 7, 1, 4))
    v = rng.standard_normal((1, 7, 1, 4))
    dout = rng.standard_normal((1, 5, 2, 4))
    dq, dk, dv, dsinks = attention_backward_ref(dout, q, k, v, **kw)

    def loss(q_, k_, v_, sinks_):
        return float((attention_ref(q_, k_, v_, **{**kw, "sinks": sinks_})[0] * dout).sum())

    eps = 1e-6
    sinks = np.array(kw["sinks"])
    for x, g in ((q, dq), (k, dk), (v, dv), (sinks, dsinks)):
        idx = tuple(rng.integers(0, s) for s in x.shape)
        x[idx] += eps
        up = loss(q, k, v, sinks)
        x[idx] -= 2 * eps
        down = loss(q, k, v, sinks)
        x[idx] += eps
        assert (up - down) / (2 * eps) == pytest.approx(g[idx], rel=1e-5, abs=1e-7)


def test_backward_bad_input_names_the_argument():
    q = np.zeros((1, 4, 2, 8), np.float32)
    o, lse = ioattn.attention(q, q, q, return_lse=True)
    try:
        ioattn.attention_backward(q, q, q, q, o, lse[:, :1])
    except NotImplementedError:
        pytest.skip("backward not in this build")
    except ValueError as e:
        assert "argument 'lse.shape[1]'" in str(e)
    else:
        pytest.fail("a wrong lse shape was accepted")
