"""ioattn.decode / append_kv / merge_states from Python (numpy; torch where installed), against
the float64 reference on the cache's valid tokens."""
import numpy as np
import pytest

import ioattn
from _reference import BF16, attention_ref, max_err


def _contiguous(rng, b, max_len, hkv, d, dtype=np.float32):
    k = rng.uniform(-1, 1, (b, max_len, hkv, d)).astype(dtype)
    v = rng.uniform(-1, 1, (b, max_len, hkv, d)).astype(dtype)
    return k, v


def _reference(q, k, v, lens, **kw):
    """Per sequence: attention over its first lens[b] tokens (rows of q at the cache's end)."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, lse = attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], **kw)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def _paged(k, v, lens, page_size, rng):
    """The same tokens in a shuffled paged cache: (k_pages, v_pages, block_table)."""
    b, max_len, hkv, d = k.shape
    per_seq = (max_len + page_size - 1) // page_size
    pages = b * per_seq
    order = rng.permutation(pages).astype(np.int32)
    table = order.reshape(b, per_seq)
    kp = np.full((pages, page_size, hkv, d), np.nan, dtype=k.dtype)  # unused slots are never read
    vp = np.full((pages, page_size, hkv, d), np.nan, dtype=v.dtype)
    for s in range(b):
        for t in range(lens[s]):
            kp[table[s, t // page_size], t % page_size] = k[s, t]
            vp[table[s, t // page_size], t % page_size] = v[s, t]
    return kp, vp, table


@pytest.mark.parametrize("sq,causal", [(1, False), (4, True)])
def test_decode_contiguous_and_paged_match_reference(sq, causal):
    rng = np.random.default_rng(0)
    b, max_len, hq, hkv, d = 3, 70, 8, 2, 32
    lens = np.array([70, 0, 33], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    q = rng.uniform(-1, 1, (b, sq, hq, d)).astype(np.float32)
    o_ref, lse_ref = _reference(q, k, v, lens, causal=causal)
    o, lse = ioattn.decode(q, k, v, lens, causal=causal, return_lse=True)
    assert o.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    assert max_err(o, o_ref) < 2e-5 and max_err(lse, lse_ref) < 2e-5
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1]))  # the empty sequence
    kp, vp, table = _paged(k, v, lens, 16, rng)
    for splits in (0, 1, 3):
        o2, lse2 = ioattn.decode(q, kp, vp, lens, block_table=table, causal=causal,
                                 num_splits=splits, return_lse=True)
        assert max_err(o2, o_ref) < 2e-5 and max_err(lse2, lse_ref) < 2e-5, splits


def test_decode_gqa_window_softcap_sinks_list_args():
    rng = np.random.default_rng(1)
    b, max_len, hq, hkv, d = 2, 50, 4, 1, 16
    lens = np.array([50, 17], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    q = rng.uniform(-1, 1, (b, 2, hq, d)).astype(np.float32)
    slopes, sinks = [0.5, 0.25, 0.125, 0.0625], [0.0, 1.0, -1.0, 2.0]
    kw = dict(causal=True, window=(8, -1), softcap=3.0)
    o_ref, lse_ref = _reference(q, k, v, lens, alibi_slopes=np.array(slopes), sinks=np.array(sinks), **kw)
    o, lse = ioattn.decode(q, k, v, lens, alibi_slopes=slopes, sinks=sinks, return_lse=True, **kw)
    assert max_err(o, o_ref) < 2e-5 and max_err(lse, lse_ref) < 2e-5


def test_decode_int8_cache_with_scales():
    rng = np.random.default_rng(2)
    b, max_len, hq, hkv, d = 2, 40, 4, 2, 32
    lens = np.array([40, 9], dtype=np.int32)
    kc = rng.integers(-127, 128, (b, max_len, hkv, d), dtype=np.int8)
    vc = rng.integers(-127, 128, (b, max_len, hkv, d), dtype=np.int8)
    ks = np.array([0.01, 0.02], dtype=np.float32)
    vs = np.array([0.03, 0.005], dtype=np.float32)
    q = rng.uniform(-1, 1, (b, 1, hq, d)).astype(np.float32)
    k = kc.astype(np.float64) * ks[None, None, :, None]
    v = vc.astype(np.float64) * vs[None, None, :, None]
    o_ref, lse_ref = _reference(q, k, v, lens)
    o, lse = ioattn.decode(q, kc, vc, lens, k_scale=ks, v_scale=vs, return_lse=True)
    assert max_err(o, o_ref) < 1e-4 and max_err(lse, lse_ref) < 1e-4
    with pytest.raises(ioattn.Error) as e:
        ioattn.decode(q, kc, vc, lens)  # an 8-bit cache needs its scales
    assert "scale" in e.value.argument


def test_decode_errors_name_the_argument():
    rng = np.random.default_rng(3)
    k, v = _contiguous(rng, 2, 8, 1, 16)
    q = rng.uniform(-1, 1, (2, 1, 2, 16)).astype(np.float32)
    with pytest.raises(ioattn.Error) as e:
        ioattn.decode(q, k, v, np.array([8, 3], dtype=np.int64))
    assert e.value.argument == "cache.cache_seqlens.dtype"
    with pytest.raises(ioattn.Error) as e:
        ioattn.decode(q, k, v, np.array([9, 3], dtype=np.int32))  # longer than the cache
    assert "cache_seqlens" in e.value.argument
    with pytest.raises(TypeError):
        ioattn.decode(q, k, v, [8, 3])


def test_read_only_outputs_are_errors_naming_the_argument():
    # Arrays written in place: a read-only numpy array is an ioattn.Error naming it (it used to be
    # the extension's TypeError listing the whole signature); nothing is written.
    rng = np.random.default_rng(5)
    k, v = _contiguous(rng, 2, 8, 1, 16)
    q = rng.uniform(-1, 1, (2, 1, 2, 16)).astype(np.float32)
    lens = np.array([8, 3], dtype=np.int32)
    for kw in ({"out": np.zeros((2, 1, 2, 16), np.float32)}, {"lse_out": np.zeros((2, 2, 1), np.float32)}):
        name, arr = next(iter(kw.items()))
        arr.setflags(write=False)
        with pytest.raises(ioattn.Error, match=r"expected a writable array .*got a read-only numpy array") as e:
            ioattn.decode(q, k, v, lens, **kw)
        assert e.value.argument == name
        assert np.all(arr == 0)
    kc, vc = k.copy(), v.copy()
    kc.setflags(write=False)
    new = np.ones((1, 1, 16), np.float32)
    with pytest.raises(ioattn.Error) as e:
        ioattn.append_kv(new, new, np.array([0], np.int32), kc, vc)
    assert e.value.argument == "k_cache"
    assert np.array_equal(vc, v)


def test_append_kv_then_decode_matches_reference():
    rng = np.random.default_rng(4)
    b, hq, hkv, d, ps, per_seq = 2, 4, 2, 16, 8, 3
    lens = np.array([20, 5], dtype=np.int32)
    k, v = _contiguous(rng, b, per_seq * ps, hkv, d)
    table = np.array([[4, 0, 2], [1, 5, 3]], dtype=np.int32)
    kp = np.zeros((b * per_seq, ps, hkv, d), dtype=np.float32)
    vp = np.zeros_like(kp)
    slots, kn, vn = [], [], []
    for s in range(b):
        for t in range(lens[s]):
            slots.append(table[s, t // ps] * ps + t % ps)
            kn.append(k[s, t])
            vn.append(v[s, t])
    slots.append(-1)  # padding: skipped
    kn.append(np.full((hkv, d), 7.0, dtype=np.float32))
    vn.append(np.full((hkv, d), 7.0, dtype=np.float32))
    ioattn.append_kv(np.stack(kn), np.stack(vn), np.array(slots, dtype=np.int64), kp, vp)
    # token 3 of sequence 0 in page 4, slot 3; token 4 of sequence 1 in page 1, slot 4
    assert np.array_equal(kp[4, 3], k[0, 3]) and np.array_equal(vp[1, 4], v[1, 4])
    assert np.array_equal(kp[table[0, 2], 20 % ps - 4], k[0, 16 + 20 % ps - 4])
    assert not np.any(kp == 7.0) and not np.any(vp == 7.0)  # the padding slot wrote nothing
    q = rng.uniform(-1, 1, (b, 1, hq, d)).astype(np.float32)
    o_ref, lse_ref = _reference(q, k, v, lens)
    o, lse = ioattn.decode(q, kp, vp, lens, block_table=table, return_lse=True)
    assert max_err(o, o_ref) < 2e-5 and max_err(lse, lse_ref) < 2e-5


def test_decode_prefill_chunk_through_paged_cache_on_cpu():
    # 40 query rows (> 16): the tiled flash forward reads K / V through the block table
    rng = np.random.default_rng(7)
    b, hq, hkv, d, sq = 2, 4, 2, 32, 40
    lens = np.array([100, 40], dtype=np.int32)
    k, v = _contiguous(rng, b, 100, hkv, d)
    kp, vp, table = _paged(k, v, lens, 16, rng)
    q = rng.uniform(-1, 1, (b, sq, hq, d)).astype(np.float32)
    o, lse = ioattn.decode(q, kp, vp, lens, block_table=table, causal=True, return_lse=True)
    o_ref, lse_ref = _reference(q, k, v, lens, causal=True)
    assert max_err(o, o_ref) < 2e-5 and max_err(lse, lse_ref) < 2e-5


def test_decode_with_fused_append_equals_append_then_decode():
    rng = np.random.default_rng(6)
    b, hq, hkv, d, ps, per_seq = 3, 4, 2, 16, 8, 3
    lens = np.array([20, 0, 6], dtype=np.int32)  # after the append; sequence 1 is an empty slot
    k, v = _contiguous(rng, b, per_seq * ps, hkv, d)
    table = np.array([[4, 0, 2], [8, 7, 6], [1, 5, 3]], dtype=np.int32)
    full_k = np.zeros((b * per_seq, ps, hkv, d), dtype=np.float32)
    full_v = np.zeros_like(full_k)
    for s in range(b):
        for t in range(lens[s]):
            full_k[table[s, t // ps], t % ps] = k[s, t]
            full_v[table[s, t // ps], t % ps] = v[s, t]
    # The cache without each sequence's last 2 tokens, which come as k_new / v_new instead.
    kp, vp = full_k.copy(), full_v.copy()
    k_new = np.full((b, 2, hkv, d), 7.0, dtype=np.float32)  # 7.0 = must not land (sequence 1)
    v_new = np.full((b, 2, hkv, d), 7.0, dtype=np.float32)
    for s in range(b):
        for i in range(2):
            t = lens[s] - 2 + i
            if t >= 0:
                kp[table[s, t // ps], t % ps] = 0.0
                vp[table[s, t // ps], t % ps] = 0.0
                k_new[s, i], v_new[s, i] = k[s, t], v[s, t]
    q = rng.uniform(-1, 1, (b, 2, hq, d)).astype(np.float32)
    o, lse = ioattn.decode(q, kp, vp, lens, block_table=table, causal=True, return_lse=True,
                           k_new=k_new, v_new=v_new)
    assert np.array_equal(kp, full_k) and np.array_equal(vp, full_v)
    o_ref, lse_ref = ioattn.decode(q, full_k, full_v, lens, block_table=table, causal=True,
                                   return_lse=True)
    assert np.array_equal(o, o_ref) and np.array_equal(lse, lse_ref)
    with pytest.raises(ioattn.Error, match="cache.v_new"):
        ioattn.decode(q, kp, vp, lens, block_table=table, k_new=k_new)
    ro = kp.copy()
    ro.flags.writeable = False
    with pytest.raises(ioattn.Error, match="k_cache"):
        ioattn.decode(q, ro, vp, lens, block_table=table, k_new=k_new, v_new=v_new)


def test_merge_states_of_two_halves_is_the_whole():
    rng = np.random.default_rng(5)
    q = rng.uniform(-1, 1, (2, 3, 4, 16)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 40, 4, 16)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, 40, 4, 16)).astype(np.float32)
    oa, la = ioattn.attention(q, k[:, :25], v[:, :25], return_lse=True)
    ob, lb = ioattn.attention(q, k[:, 25:], v[:, 25:], return_lse=True)
    o, lse = ioattn.merge_states(oa, la, ob, lb)
    o_ref, lse_ref = attention_ref(q, k, v)
    assert max_err(o, o_ref) < 2e-5 and max_err(lse, lse_ref) < 2e-5
    empty = np.full_like(la, -np.inf)
    o2, lse2 = ioattn.merge_states(np.zeros_like(oa), empty, np.zeros_like(oa), empty)
    assert np.all(o2 == 0) and np.all(np.isneginf(lse2))


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes not installed")
def test_decode_bfloat16_numpy():
    rng = np.random.default_rng(6)
    b, max_len, hq, hkv, d = 2, 33, 4, 2, 64
    lens = np.array([33, 12], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    q = rng.uniform(-1, 1, (b, 1, hq, d)).astype(np.float32)
    qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
    o = ioattn.decode(qb, kb, vb, lens)
    assert o.dtype == BF16
    o_ref, _ = _reference(qb.astype(np.float64), kb.astype(np.float64), vb.astype(np.float64), lens)
    assert max_err(o, o_ref) < 2e-2


def test_decode_torch_cpu_matches_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    b, max_len, hq, hkv, d = 2, 30, 4, 2, 32
    lens = np.array([30, 4], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    q = rng.uniform(-1, 1, (b, 2, hq, d)).astype(np.float32)
    want, want_lse = ioattn.decode(q, k, v, lens, causal=True, return_lse=True)
    got, got_lse = ioattn.decode(*(torch.from_numpy(x) for x in (q, k, v, lens)), causal=True, return_lse=True)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want) and np.array_equal(got_lse.numpy(), want_lse)


def test_decode_torch_cuda_paged_bf16_and_fp8():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not ioattn.info().get("cuda_compiled", True):
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(8)
    b, max_len, hq, hkv, d, ps = 3, 96, 8, 2, 128, 16
    lens = np.array([96, 1, 50], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    q = rng.uniform(-1, 1, (b, 1, hq, d)).astype(np.float32)
    kp, vp, table = _paged(k, v, lens, ps, rng)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    dev = lambda x, dt=None: torch.from_numpy(x).to("cuda", dtype=dt)  # noqa: E731
    o_ref, lse_ref = _reference(q, k, v, lens)
    o, lse = ioattn.decode(dev(q, torch.bfloat16), dev(kp, torch.bfloat16), dev(vp, torch.bfloat16),
                           dev(lens), block_table=dev(table), return_lse=True)
    assert o.is_cuda and o.dtype == torch.bfloat16
    assert max_err(o.float().cpu().numpy(), o_ref) < 2e-2 and max_err(lse.cpu().numpy(), lse_ref) < 1e-2
    if hasattr(torch, "float8_e4m3fn"):
        ks = torch.full((hkv,), 1.0 / 64, device="cuda")
        k8 = (dev(kp) / ks[None, None, :, None]).to(torch.float8_e4m3fn)
        v8 = (dev(vp) / ks[None, None, :, None]).to(torch.float8_e4m3fn)
        o8 = ioattn.decode(dev(q, torch.bfloat16), k8, v8, dev(lens), block_table=dev(table), k_scale=ks, v_scale=ks)
        assert max_err(o8.float().cpu().numpy(), o_ref) < 0.1


def test_decode_prefill_chunk_torch_cuda_bf16_and_fp8():
    # 100 query rows (> 16) on CUDA: the flash forward's KV-cache mode reads K / V through the table
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not ioattn.info().get("cuda_compiled", True):
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(10)
    b, max_len, hq, hkv, d, ps, sq = 3, 300, 8, 2, 128, 16, 100
    lens = np.array([300, 120, 150], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    q = rng.uniform(-1, 1, (b, sq, hq, d)).astype(np.float32)
    kp, vp, table = _paged(k, v, lens, ps, rng)
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
    dev = lambda x, dt=None: torch.from_numpy(x).to("cuda", dtype=dt)  # noqa: E731
    o_ref, lse_ref = _reference(q, k, v, lens, causal=True)
    o, lse = ioattn.decode(dev(q, torch.bfloat16), dev(kp, torch.bfloat16), dev(vp, torch.bfloat16),
                           dev(lens), block_table=dev(table), causal=True, return_lse=True)
    assert o.is_cuda and o.dtype == torch.bfloat16
    assert max_err(o.float().cpu().numpy(), o_ref) < 3e-2 and max_err(lse.cpu().numpy(), lse_ref) < 1e-2
    if hasattr(torch, "float8_e4m3fn"):
        ks = torch.full((hkv,), 1.0 / 64, device="cuda")
        k8 = (dev(kp) / ks[None, None, :, None]).to(torch.float8_e4m3fn)
        v8 = (dev(vp) / ks[None, None, :, None]).to(torch.float8_e4m3fn)
        o8 = ioattn.decode(dev(q, torch.bfloat16), k8, v8, dev(lens), block_table=dev(table), k_scale=ks,
                           v_scale=ks, causal=True)
        assert max_err(o8.float().cpu().numpy(), o_ref) < 0.1


def test_decode_under_a_plan_matches_and_checks_its_shape():
    rng = np.random.default_rng(9)
    b, max_len, hq, hkv, d, ps = 3, 64, 8, 2, 32, 16
    lens = np.array([64, 7, 0], dtype=np.int32)
    k, v = _contiguous(rng, b, max_len, hkv, d)
    kp, vp, table = _paged(k, v, lens, ps, rng)
    q = rng.uniform(-1, 1, (b, 2, hq, d)).astype(np.float32)
    plan = ioattn.plan_decode(b, hq, hkv, d, max_len, seqlen_q=2, page_size=ps, num_splits=3)
    assert isinstance(plan, ioattn.DecodePlan) and plan.num_splits == 3 and plan.device == "cpu"
    assert "num_splits=3" in repr(plan)
    ws = ioattn.aligned_bytes(plan.workspace_bytes)
    assert ws.ctypes.data % 64 == 0 and ws.nbytes == max(plan.workspace_bytes, 1)
    o = np.empty((b, 2, hq, d), np.float32)
    lse = np.empty((b, hq, 2), np.float32)
    got, got_lse = ioattn.decode(q, kp, vp, lens, block_table=table, causal=True, plan=plan, workspace=ws,
                                 out=o, lse_out=lse)
    assert got is o and got_lse is lse
    want, want_lse = ioattn.decode(q, kp, vp, lens, block_table=table, causal=True, num_splits=3, return_lse=True)
    assert np.array_equal(o, want) and np.array_equal(lse, want_lse)
    o_ref, lse_ref = _reference(q, k, v, lens, causal=True)
    assert max_err(o, o_ref) < 2e-5 and max_err(lse, lse_ref) < 2e-5
    if plan.workspace_bytes > 1:
        with pytest.raises(ioattn.Error) as e:
            ioattn.decode(q, kp, vp, lens, block_table=table, plan=plan, workspace=ws[:1])
        assert e.value.argument == "workspace"
    with pytest.raises(ioattn.Error) as e:  # another batch shape than the plan's
        ioattn.decode(q[:2], kp, vp, lens[:2], block_table=table[:2], plan=plan, workspace=ws)
    assert e.value.argument == "plan"
    if plan.workspace_bytes > 0:  # misaligned
        raw = np.empty(plan.workspace_bytes + 64, dtype=np.uint8)
        off = (-raw.ctypes.data) % 64 + 1
        with pytest.raises(ioattn.Error) as e:
            ioattn.decode(q, kp, vp, lens, block_table=table, plan=plan,
                          workspace=raw[off:off + plan.workspace_bytes])
        assert e.value.argument == "workspace"
    with pytest.raises(ioattn.Error) as e:
        ioattn.decode(q, kp, vp, lens, block_table=table, plan=plan, num_splits=2)
    assert e.value.argument == "num_splits"
    # no workspace given: decode allocates an aligned one
    o3 = ioattn.decode(q, kp, vp, lens, block_table=table, causal=True, plan=plan)
    assert np.array_equal(o3, want)
    with pytest.raises(TypeError):
        ioattn.decode(q, kp, vp, lens, block_table=table, workspace=ws)
    with pytest.raises(ioattn.Error) as e:
        ioattn.plan_decode(b, hq, hkv, d, max_len, device="tpu")
    assert e.value.argument == "device"


def test_decode_plan_graph_capture_torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not ioattn.info().get("cuda_compiled", True):
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(10)
    b, max_len, hq, hkv, d = 4, 256, 8, 2, 128
    lens = torch.tensor([256, 100, 1, 17], dtype=torch.int32, device="cuda")
    k = torch.rand(b, max_len, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.rand(b, max_len, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.from_numpy(rng.uniform(-1, 1, (b, 1, hq, d)).astype(np.float32)).to("cuda", torch.bfloat16)
    plan = ioattn.plan_decode(b, hq, hkv, d, max_len, device="cuda")
    ws = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
    out = torch.empty(b, 1, hq, d, dtype=torch.bfloat16, device="cuda")
    eager = ioattn.decode(q, k, v, lens, plan=plan, workspace=ws).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ioattn.decode(q, k, v, lens, plan=plan, workspace=ws, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ioattn.decode(q, k, v, lens, plan=plan, workspace=ws, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    o_ref, _ = _reference(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(),
                          lens.cpu().numpy())
    assert max_err(out.float().cpu().numpy(), o_ref) < 2e-2
