"""ioattn.attention_fp8: e4m3 q / k / v with descales, bf16 / f16 O (numpy through ml_dtypes, and
torch.float8_e4m3fn), fixed length and packed, against the float64 reference of the dequantised
inputs (code x descale). O is rounded once to its 16-bit dtype (the kernels accumulate in fp32 on
exact e4m3 values), so each element is within that rounding (half a bf16 ulp: 2^-8 relative) plus
fp32 sums (atol 2e-3) of the reference."""

import numpy as np
import pytest

import ioattn
from _reference import attention_ref

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
O_RTOL, O_ATOL, LSE_ATOL = 2.0 ** -8, 2e-3, 1e-3


def _o_close(o, ref):
    """Every element of o within half a bf16 ulp of the float64 reference, plus O_ATOL."""
    err = np.abs(o.astype(np.float64) - ref)
    return bool(np.all(err <= O_RTOL * np.abs(ref) + O_ATOL)), float(err.max())


def _codes(rng, shape):
    return rng.uniform(-3, 3, size=shape).astype(E4M3)


def _deq(x, ds):
    """x [b, s, h, d] e4m3 times ds [b, h] -> float64."""
    return x.astype(np.float64) * ds[:, None, :, None]


@pytest.mark.parametrize("backend", ["naive", "flash"])
@pytest.mark.parametrize("causal,hq,hkv,out", [(False, 4, 2, "bfloat16"), (True, 2, 1, "float16")])
def test_fixed_length_matches_reference(backend, causal, hq, hkv, out):
    rng = np.random.default_rng(3)
    b, sq, sk, d = 2, 17, 40, 64
    q, k, v = _codes(rng, (b, sq, hq, d)), _codes(rng, (b, sk, hkv, d)), _codes(rng, (b, sk, hkv, d))
    qd, kd, vd = (rng.uniform(0.25, 1.5, size=(b, hkv)).astype(np.float32) for _ in range(3))
    o, lse = ioattn.attention_fp8(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out,
                                  causal=causal, return_lse=True, backend=backend)
    assert o.dtype.name == out and o.shape == (b, sq, hq, d)
    group = hq // hkv
    qdq = np.repeat(qd, group, axis=1)  # q's descale is per kv head: its group's heads share it
    ro, rl = attention_ref(_deq(q, qdq), _deq(k, kd), _deq(v, vd), causal=causal, scale=d ** -0.5)
    ok, err = _o_close(o, ro)
    assert ok, err
    assert np.max(np.abs(lse - rl)) <= LSE_ATOL
    # the descales act: without them the output moves
    o1 = ioattn.attention_fp8(q, k, v, out_dtype=out, causal=causal, backend=backend)
    assert np.max(np.abs(o1.astype(np.float64) - o.astype(np.float64))) > 0.05


def test_varlen_matches_reference_per_sequence():
    rng = np.random.default_rng(5)
    lens_q, lens_k, hq, hkv, d = [5, 0, 33], [9, 4, 33], 4, 2, 32
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = _codes(rng, (cu_q[-1], hq, d)), _codes(rng, (cu_k[-1], hkv, d)), _codes(rng, (cu_k[-1], hkv, d))
    ds = rng.uniform(0.5, 1.5, size=(3, len(lens_q), hkv)).astype(np.float32)
    o, lse = ioattn.attention_fp8(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)
    assert o.shape == (cu_q[-1], hq, d) and lse.shape == (hq, cu_q[-1])
    for i in range(len(lens_q)):
        if lens_q[i] == 0:
            continue
        sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qdq = np.repeat(ds[0][i:i + 1], hq // hkv, axis=1)
        ro, rl = attention_ref(_deq(q[None, sl_q], qdq), _deq(k[None, sl_k], ds[1][i:i + 1]),
                               _deq(v[None, sl_k], ds[2][i:i + 1]), causal=True, scale=d ** -0.5)
        ok, err = _o_close(o[sl_q], ro[0])
        assert ok, (i, err)
        assert np.max(np.abs(lse[:, sl_q] - rl[0])) <= LSE_ATOL


def test_uint8_codes_equal_float8_arrays():
    rng = np.random.default_rng(7)
    q, k, v = (_codes(rng, (1, 9, 2, 32)) for _ in range(3))
    a = ioattn.attention_fp8(q, k, v)
    b = ioattn.attention_fp8(q.view(np.uint8), k.view(np.uint8), v.view(np.uint8))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_errors_name_the_argument():
    rng = np.random.default_rng(9)
    q, k, v = (_codes(rng, (1, 8, 2, 32)) for _ in range(3))
    with pytest.raises(ioattn.Error) as e:
        ioattn.attention_fp8(q.astype(np.float32), k, v)
    assert e.value.argument == "q.dtype"
    with pytest.raises(ioattn.Error) as e:
        ioattn.attention_fp8(q, k, v, out_dtype="float32")
    assert e.value.argument == "out_dtype"
    with pytest.raises(ioattn.Error) as e:  # descale of [batch, heads_q]: heads_kv is 2, not 3
        ioattn.attention_fp8(q, k, v, k_descale=np.ones((1, 3), np.float32))
    assert e.value.argument == "params.k_descale.shape[1]"
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    with pytest.raises(ioattn.Error) as e:  # descales with 16-/32-bit inputs are an error
        ioattn._C.forward(*f32, np.empty((1, 8, 2, 32), np.float32), None, q_descale=np.ones((1, 2), np.float32))
    assert e.value.argument == "params.q_descale"


def test_torch_float8_matches_numpy():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    import ioattn.torch as it

    rng = np.random.default_rng(11)
    q, k, v = (_codes(rng, (2, 21, 2, 64)) for _ in range(3))
    ds = rng.uniform(0.5, 1.5, size=(3, 2, 2)).astype(np.float32)
    ref, ref_lse = ioattn.attention_fp8(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                        causal=True, return_lse=True)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn) for x in (q, k, v))
    o, lse = it.attention_fp8(tq, tk, tv, q_descale=torch.from_numpy(ds[0]), k_descale=torch.from_numpy(ds[1]),
                              v_descale=[list(map(float, r)) for r in ds[2]], causal=True, return_lse=True)
    assert o.dtype == torch.bfloat16
    assert np.array_equal(o.view(torch.uint16).numpy() if hasattr(torch, "uint16") else
                          o.view(torch.int16).numpy().view(np.uint16), ref.view(np.uint16))
    assert np.array_equal(lse.numpy(), ref_lse)
    # ioattn.attention_fp8 hands torch tensors to ioattn.torch
    o2 = ioattn.attention_fp8(tq, tk, tv, q_descale=torch.from_numpy(ds[0]), k_descale=torch.from_numpy(ds[1]),
                              v_descale=torch.from_numpy(ds[2]), causal=True, out_dtype="float16")
    assert o2.dtype == torch.float16
    ref16 = ioattn.attention_fp8(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], causal=True,
                                 out_dtype="float16")
    assert np.array_equal(o2.numpy(), ref16)
    with pytest.raises(ioattn.Error) as e:
        it.attention_fp8(tq, tk, tv, out_dtype=[1])
    assert e.value.argument == "out_dtype"
