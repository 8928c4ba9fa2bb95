"""Float64 standard attention in numpy: the oracle for the Python tests.

Materialises S and P per (batch, head), with the semantics of include/ioattn/ioattn.hpp:
bottom-right aligned causal/window masks, softcap, ALiBi, sinks, GQA; a row with no visible key
gives O = 0 and LSE = -inf (with a sink: LSE = sink).

`attention_ref(..., emulate=dtype)` is the same computation with the intermediates (q * scale,
S, P, O) rounded to a low-precision dtype: the "naive low-precision" baseline of FlashAttention's
tolerance rule, which tests/check.hpp uses too:

    max|O - O_ref| <= 2 * max|O_naive_lowp - O_ref| + atol
"""

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in the test requirements
    ml_dtypes = None
    BF16 = None

ATOL = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-4}


def visible_mask(sq, sk, causal=False, window=(-1, -1)):
    """[sq, sk] bool: key j visible to query row i (bottom-right aligned)."""
    wl, wr = window
    if causal:
        wr = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = i + (sk - sq)
    vis = np.ones((sq, sk), dtype=bool)
    if wl >= 0:
        vis &= j >= diag - wl
    if wr >= 0:
        vis &= j <= diag + wr
    return vis


def _rounder(emulate):
    if emulate is None:
        return lambda x: x
    dt = np.dtype(emulate)
    return lambda x: np.asarray(x).astype(dt).astype(np.float64)


def attention_ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None,
                  alibi_slopes=None, sinks=None, emulate=None):
    """q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] -> (O [b, sq, hq, dv], LSE
    [b, hq, sq]) in float64."""
    rnd = _rounder(emulate)
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    if emulate is not None:
        s = rnd(np.einsum("bihd,bjhd->bhij", rnd(q * np.float32(scale)), k).astype(np.float32))
    else:
        s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = rnd(softcap * np.tanh(s / softcap))
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        s = rnd(s - slopes[None, :, None, None] * np.abs(i + (sk - sq) - j)[None, None])
    vis = visible_mask(sq, sk, causal, window)
    s = np.where(vis[None, None], s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)  # [b, hq, sq]
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[None, :, None], m.shape)
        m = np.maximum(m, sink)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe[..., None])
    denom = e.sum(axis=-1)
    if sinks is not None:
        denom = denom + np.exp(sink - m_safe)
    has = denom > 0
    lse = np.where(has, m_safe + np.log(np.where(has, denom, 1.0)), -np.inf)
    p = rnd(e / np.where(has, denom, 1.0)[..., None])
    o = rnd(np.einsum("bhij,bjhd->bihd", p, v))
    return o, lse


def attention_varlen_ref(q, k, v, cu_q, cu_k, **kw):
    """Packed q [total_q, hq, d] etc. -> (O [total_q, hq, dv], LSE [hq, total_q]); rows past
    cu_q[-1] are 0 / -inf."""
    total_q, hq, _ = q.shape
    dv = v.shape[2]
    o = np.zeros((total_q, hq, dv))
    lse = np.full((hq, total_q), -np.inf)
    for bi in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[bi], cu_q[bi + 1], cu_k[bi], cu_k[bi + 1]
        if q1 == q0:
            continue
        ob, lb = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kw)
        o[q0:q1] = ob[0]
        lse[:, q0:q1] = lb[0]
    return o, lse


def attention_backward_ref(dout, q, k, v, causal=False, window=(-1, -1), softcap=0.0,
                           scale=None, alibi_slopes=None, sinks=None):
    """Float64 gradients (dq, dk, dv, dsinks or None) of attention_ref for output gradient
    dout [b, sq, hq, dv]. GQA: dk, dv summed over each group's query heads."""
    q, k, v, dout = (np.asarray(x).astype(np.float64) for x in (q, k, v, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    kr = np.repeat(k, group, axis=2)
    vr = np.repeat(v, group, axis=2)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    raw = np.einsum("bihd,bjhd->bhij", q, kr) * scale
    s = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        s = s - slopes[None, :, None, None] * np.abs(i + (sk - sq) - j)[None, None]
    vis = visible_mask(sq, sk, causal, window)[None, None]
    s = np.where(vis, s, -np.inf)
    o, lse = attention_ref(q, k, v, causal, window, softcap, scale, alibi_slopes, sinks)
    finite = np.isfinite(lse)
    p = np.where(vis & finite[..., None], np.exp(s - np.where(finite, lse, 0.0)[..., None]), 0.0)
    dv_full = np.einsum("bhij,bihd->bjhd", p, dout)
    dp = np.einsum("bihd,bjhd->bhij", dout, vr)
    delta = np.einsum("bihd,bihd->bhi", dout, o)  # rowsum(dO * O)
    ds = p * (dp - delta[..., None])
    if softcap > 0:
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq = np.einsum("bhij,bjhd->bihd", ds, kr) * scale
    dk_full = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    dk = dk_full.reshape(b, sk, hkv, group, d).sum(axis=3)
    dv = dv_full.reshape(b, sk, hkv, group, v.shape[3]).sum(axis=3)
    dsinks = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[None, :, None]
        p_sink = np.where(finite, np.exp(sink - np.where(finite, lse, 0.0)), 0.0)
        dsinks = -(p_sink * delta).sum(axis=(0, 2))
    return dq, dk, dv, dsinks


def max_err(got, want):
    """max |got - want| in float64, with matching -inf entries counted as equal."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    both_ninf = np.isneginf(got) & np.isneginf(want)
    with np.errstate(invalid="ignore"):
        diff = np.where(both_ninf, 0.0, np.abs(got - want))
    if np.isnan(diff).any():
        return np.inf
    return float(diff.max(initial=0.0))


def check_close(o, lse, o_ref, lse_ref, o_lowp, lse_lowp, dtype_name, what=""):
    """FlashAttention's rule for O and LSE (lse may be None)."""
    atol = ATOL[dtype_name]
    err_o, base_o = max_err(o, o_ref), max_err(o_lowp, o_ref)
    assert err_o <= 2 * base_o + atol, (
        f"{what}: O error {err_o:.3g} vs float64 reference exceeds 2 * {base_o:.3g} + {atol}")
    if lse is not None:
        err_l, base_l = max_err(lse, lse_ref), max_err(lse_lowp, lse_ref)
        assert err_l <= 2 * base_l + 10 * atol, (
            f"{what}: LSE error {err_l:.3g} exceeds 2 * {base_l:.3g} + {10 * atol}")
        # -inf exactly where the reference has no visible key
        assert np.array_equal(np.isneginf(np.asarray(lse, dtype=np.float64)),
                              np.isneginf(lse_ref)), f"{what}: LSE -inf pattern differs"
