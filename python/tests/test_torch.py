"""ioattn with PyTorch: the custom ops, autograd wiring, torch.compile, CPU and CUDA.

Skipped as a whole where torch is not installed; the CUDA tests also need a GPU and a CUDA
build of ioattn.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import ioattn  # noqa: E402
import ioattn.torch as iot  # noqa: E402
from _reference import attention_ref, attention_varlen_ref, max_err  # noqa: E402

CUDA = torch.cuda.is_available() and ioattn.info()["cuda_compiled"]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of ioattn")

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def bottom_right_mask(sq, sk, causal=False, window=(-1, -1), device="cpu"):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + (sk - sq)
    wl, wr = window
    if causal:
        wr = 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if wl >= 0:
        keep &= j >= diag - wl
    if wr >= 0:
        keep &= j <= diag + wr
    return keep


def sdpa_ref(q, k, v, causal=False, window=(-1, -1), scale=None):
    """SDPA's math in float64 on [b, s, h, d] inputs, bottom-right masks, GQA by repetition.
    Returns (O [b, sq, hq, dv], LSE [b, hq, sq]); rows with no visible key: O = 0, LSE = -inf."""
    q, k, v = (x.detach().double().transpose(1, 2) for x in (q, k, v))  # [b, h, s, d]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keep = bottom_right_mask(q.shape[2], k.shape[2], causal, window, q.device)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    empty = ~keep.any(dim=-1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | empty[:, None], scale=scale)
    o = o.masked_fill(empty[:, None], 0.0)
    return o.transpose(1, 2), lse


def randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


# (name, b, sq, sk, hq, hkv, d, kwargs)
CASES = [
    ("plain", 2, 17, 17, 4, 4, 32, {}),
    ("causal_q<k", 1, 17, 113, 4, 2, 64, {"causal": True}),
    ("causal_q>k", 1, 113, 17, 2, 2, 32, {"causal": True}),
    ("window", 2, 40, 40, 2, 1, 16, {"window": (8, 2)}),
    ("gqa_scale", 1, 23, 31, 8, 2, 32, {"scale": 0.3}),
    ("one", 1, 1, 1, 1, 1, 8, {}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_forward_matches_sdpa_float64(case, dtype):
    name, b, sq, sk, hq, hkv, d, kw = case
    q = randn(b, sq, hq, d, dtype=dtype, seed=1)
    k = randn(b, sk, hkv, d, dtype=dtype, seed=2)
    v = randn(b, sk, hkv, d, dtype=dtype, seed=3)
    o, lse = ioattn.attention(q, k, v, return_lse=True, **kw)
    assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    o_ref, lse_ref = sdpa_ref(q, k, v, **kw)
    scale = max(1.0, o_ref.abs().max().item())
    assert (o.double() - o_ref).abs().max().item() <= TOL[dtype] * scale, name
    lse_scale = max(1.0, lse_ref[lse_ref.isfinite()].abs().max().item()) if sq * sk else 1.0
    assert max_err(lse.numpy(), lse_ref.numpy()) <= 10 * TOL[dtype] * lse_scale, name


def test_cpu_features_match_numpy_reference():
    """softcap, ALiBi and sinks (SDPA has none of them) against the float64 numpy reference."""
    kw = {"causal": True, "softcap": 1.5, "alibi_slopes": [0.1, 0.2, 0.3, 0.4],
          "sinks": [0.0, 0.5, -0.5, 1.0], "window": (9, -1)}
    q, k, v = randn(2, 29, 4, 24, seed=4), randn(2, 37, 2, 24, seed=5), randn(2, 37, 2, 24, seed=6)
    o, lse = iot.attention(q, k, v, return_lse=True, **kw)
    o_ref, lse_ref = attention_ref(q.numpy(), k.numpy(), v.numpy(), **kw)
    assert max_err(o.numpy(), o_ref) < 2e-5 and max_err(lse.numpy(), lse_ref) < 2e-4
    # slopes and sinks as tensors give the same
    o2 = iot.attention(q, k, v, **{**kw, "alibi_slopes": torch.tensor(kw["alibi_slopes"]),
                                   "sinks": torch.tensor(kw["sinks"])})
    assert torch.equal(o, o2)


def test_bhsd_tensors_are_read_without_copies():
    b, h, s, d = 2, 4, 19, 16
    q_bhsd, k_bhsd, v_bhsd = (randn(b, h, s, d, seed=i) for i in range(3))
    o = iot.attention(q_bhsd.transpose(1, 2), k_bhsd.transpose(1, 2), v_bhsd.transpose(1, 2),
                      causal=True)
    ref = F.scaled_dot_product_attention(q_bhsd.double(), k_bhsd.double(), v_bhsd.double(),
                                         is_causal=True).transpose(1, 2)
    assert (o.double() - ref).abs().max().item() < 2e-5
    assert o.is_contiguous()


def test_varlen_with_empty_sequence():
    lens_q, lens_k = [5, 0, 17, 3], [7, 4, 17, 0]
    cu_q = torch.tensor([0] + list(np.cumsum(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lens_k)), dtype=torch.int32)
    q = randn(int(cu_q[-1]), 4, 16, seed=7)
    k = randn(int(cu_k[-1]), 2, 16, seed=8)
    v = randn(int(cu_k[-1]), 2, 16, seed=9)
    o, lse = ioattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                     return_lse=True)
    assert isinstance(o, torch.Tensor) and lse.shape == (4, q.shape[0])
    o_ref, lse_ref = attention_varlen_ref(q.numpy(), k.numpy(), v.numpy(), cu_q.numpy(),
                                          cu_k.numpy(), causal=True)
    assert max_err(o.numpy(), o_ref) < 2e-5 and max_err(lse.numpy(), lse_ref) < 2e-4


def test_errors_surface_as_value_error():
    q, k = randn(2, 5, 4, 8), randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"argument 'k\.shape\[0\]'") as info:
        iot.attention(q, k, k)
    assert isinstance(info.value, ioattn.Error)
    with pytest.raises(ValueError, match=r"argument 'k\.dtype'"):
        iot.attention(q, q.half(), q)
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_q\.dtype'"):
        cu = torch.tensor([0, 5], dtype=torch.int64)
        iot.attention_varlen(q[0], q[0], q[0], cu, cu)
    with pytest.raises(TypeError, match="argument 'k' must be a torch.Tensor"):
        iot.attention(q, k.numpy(), k)
    with pytest.raises(TypeError, match="argument 'causal'"):
        iot.attention(q, q, q, causal=None)


def test_select_with_torch_tensors():
    q = randn(1, 9, 4, 64).requires_grad_()  # select() detaches: no DLPack error
    choice = ioattn.select(q, q, q, causal=True)
    assert choice["kernel"].startswith("cpu/") and "causal" in choice["kernel"]


# ---- autograd ----------------------------------------------------------------------------

def grads_or_skip(loss, inputs):
    try:
        return torch.autograd.grad(loss, inputs)
    except NotImplementedError as e:
        assert "backward" in str(e)
        pytest.skip(f"backward not in this build: {e}")


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (4, 1)}],
                         ids=["plain", "causal", "window"])
def test_gradients_match_sdpa_float64(kw):
    q = randn(2, 13, 4, 16, seed=10).requires_grad_()
    k = randn(2, 21, 2, 16, seed=11).requires_grad_()
    v = randn(2, 21, 2, 16, seed=12).requires_grad_()
    o = iot.attention(q, k, v, **kw)
    assert o.requires_grad and o.grad_fn is not None
    dout = randn(*o.shape, seed=13)
    got = grads_or_skip((o * dout).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o64, _ = sdpa_ref_grad(q64, k64, v64, **kw)
    want = torch.autograd.grad((o64 * dout.double()).sum(), (q64, k64, v64))
    for g, w, name in zip(got, want, "qkv"):
        assert (g.double() - w).abs().max().item() < 1e-4, f"d{name}"


def sdpa_ref_grad(q, k, v, causal=False, window=(-1, -1)):
    """Differentiable float64 reference (no rows without keys in these cases)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    keep = bottom_right_mask(qt.shape[2], kt.shape[2], causal, window)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep).transpose(1, 2), None


def test_sinks_and_varlen_gradients_match_numpy_reference():
    from _reference import attention_backward_ref

    kw = {"causal": True, "softcap": 1.5, "window": (6, -1)}
    q = randn(1, 11, 2, 16, seed=20).requires_grad_()
    k = randn(1, 7, 1, 16, seed=21).requires_grad_()
    v = randn(1, 7, 1, 16, seed=22).requires_grad_()
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    o = iot.attention(q, k, v, sinks=sinks, **kw)
    dout = randn(*o.shape, seed=23)
    got = grads_or_skip((o * dout).sum(), (q, k, v, sinks))
    want = attention_backward_ref(dout.numpy(), q.detach().numpy(), k.detach().numpy(),
                                  v.detach().numpy(), sinks=[0.5, -1.0], **kw)
    for g, w, name in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert max_err(g.numpy(), w) < 1e-4, name

    # varlen: the packed gradient equals the per-sequence gradients (one sequence is empty)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cuk = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    qp, kp, vp = (x.detach()[0].clone().requires_grad_() for x in (q, k, v))
    op = iot.attention_varlen(qp, kp, vp, cu, cuk, causal=True)
    dp = randn(*op.shape, seed=24)
    got = grads_or_skip((op * dp).sum(), (qp, kp, vp))
    for b in range(3):
        q0, q1, k0, k1 = int(cu[b]), int(cu[b + 1]), int(cuk[b]), int(cuk[b + 1])
        if q1 == q0:
            continue
        want = attention_backward_ref(dp[None, q0:q1].numpy(), qp.detach()[None, q0:q1].numpy(),
                                      kp.detach()[None, k0:k1].numpy(),
                                      vp.detach()[None, k0:k1].numpy(), causal=True)
        assert max_err(got[0][q0:q1].numpy(), want[0][0]) < 1e-4
        assert max_err(got[1][k0:k1].numpy(), want[1][0]) < 1e-4
        assert max_err(got[2][k0:k1].numpy(), want[2][0]) < 1e-4


def test_backward_raises_not_implemented_or_runs():
    """Until ioattn::backward has kernels the error is NotImplementedError with a clear
    message; the forward with requires_grad inputs works either way."""
    q = randn(1, 7, 2, 8).requires_grad_()
    o = iot.attention(q, q, q)
    try:
        o.sum().backward()
    except NotImplementedError as e:
        assert "backward" in str(e) and "forward works" in str(e)
    else:
        assert q.grad is not None and q.grad.shape == q.shape


def test_deterministic_follows_torch_switch():
    """deterministic=None follows torch.use_deterministic_algorithms: with it on, the CPU
    backward of an MQA case (one kv head, fewer (batch, kv head) pairs than threads, where the
    default may split a head's keys over threads) gives the same gradient bits for any thread
    count; an explicit deterministic=True does the same with the switch off."""
    q0 = randn(1, 150, 4, 32, seed=21)
    k0, v0 = randn(1, 300, 1, 32, seed=22), randn(1, 300, 1, 32, seed=23)

    def grads(threads, **kw):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        iot.attention(q, k, v, causal=True, num_threads=threads, **kw).square().sum().backward()
        return q.grad, k.grad, v.grad

    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        ref = grads(1)
        for threads in (2, 3):
            assert all(torch.equal(a, b) for a, b in zip(ref, grads(threads))), threads
    finally:
        torch.use_deterministic_algorithms(before)
    if not before:
        assert all(torch.equal(a, b) for a, b in zip(ref, grads(3, deterministic=True)))


def test_forward_under_no_grad_and_inference_mode():
    q = randn(1, 7, 2, 8).requires_grad_()
    with torch.no_grad():
        o = iot.attention(q, q, q)
    assert not o.requires_grad
    with torch.inference_mode():
        o2 = iot.attention(q, q, q)
    assert torch.equal(o, o2)


def test_autograd_function_matches_the_op():
    q = randn(1, 9, 2, 16, seed=14)
    out, lse = iot.AttentionFunction.apply(q, q, q, True, -1, -1, 0.0, 0.0, None, None, "auto",
                                           0, False)
    o2, lse2 = iot.attention(q, q, q, causal=True, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, lse2)


def test_opcheck_with_autograd():
    """opcheck with inputs that require grad also checks the backward ops' schemas, fake
    implementations and the autograd registration (it runs the backward)."""
    q = randn(1, 9, 4, 16, seed=25).requires_grad_()
    k = randn(1, 11, 2, 16, seed=26).requires_grad_()
    sinks = torch.tensor([0.1, 0.2, 0.3, 0.4], requires_grad=True)
    try:
        torch.library.opcheck(torch.ops.ioattn.attention.default,
                              (q, k, k, True, -1, -1, 0.0, 0.0, None, sinks, "auto", 0, False))
    except NotImplementedError:
        pytest.skip("backward not in this build")


def test_example_transformer_block_runs():
    import os
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "transformer_block.py")
    r = subprocess.run([sys.executable, example, "--device", "cpu", "--seqlen", "24"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")


def test_opcheck():
    q, k = randn(1, 9, 4, 16, seed=15), randn(1, 11, 2, 16, seed=16)
    torch.library.opcheck(torch.ops.ioattn.attention.default,
                          (q, k, k, True, -1, -1, 0.0, 0.0, None, None, "auto", 0, False))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cuk = torch.tensor([0, 5, 11], dtype=torch.int32)
    torch.library.opcheck(torch.ops.ioattn.attention_varlen.default,
                          (q[0], k[0], k[0], cu, cuk, 0, 0, True, -1, -1, 0.0, 0.0, None, None,
                           "auto", 0, False))


# ---- torch.compile -----------------------------------------------------------------------

class Block(torch.nn.Module):
    """Projections around ioattn: what a compiled model would contain."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, entry):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        return self.o(entry(q, k, v, causal=True).reshape(b, s, -1))


@pytest.mark.parametrize("entry", [iot.attention, ioattn.attention],
                         ids=["ioattn.torch.attention", "ioattn.attention"])
def test_compile_fullgraph_without_graph_breaks(entry):
    torch._dynamo.reset()
    block = Block().eval()
    x = randn(2, 10, 32, seed=17)
    with torch.no_grad():
        eager = block(x, entry)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        out = compiled(x, entry)
    assert torch.allclose(out, eager, atol=1e-6)
    explanation = torch._dynamo.explain(block)(x, entry)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compile_fullgraph_with_autograd():
    """The backward op has a fake implementation too, so AOTAutograd traces the backward graph;
    running it needs the C++ backward."""
    torch._dynamo.reset()
    block = Block()
    x = randn(2, 10, 32, seed=18)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, iot.attention)
    assert torch.allclose(out, block(x, iot.attention), atol=1e-6)
    try:
        out.sum().backward()
    except NotImplementedError:
        pytest.skip("backward not in this build")
    assert all(p.grad is not None for p in block.parameters())


# ---- CUDA --------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_forward_matches_sdpa_float64(case, dtype):
    name, b, sq, sk, hq, hkv, d, kw = case
    q = randn(b, sq, hq, d, dtype=dtype, device="cuda", seed=1)
    k = randn(b, sk, hkv, d, dtype=dtype, device="cuda", seed=2)
    v = randn(b, sk, hkv, d, dtype=dtype, device="cuda", seed=3)
    o, lse = iot.attention(q, k, v, return_lse=True, **kw)
    assert o.device == q.device and lse.device == q.device
    o_ref, lse_ref = sdpa_ref(q, k, v, **kw)
    scale = max(1.0, o_ref.abs().max().item())
    assert (o.double() - o_ref).abs().max().item() <= TOL[dtype] * scale, name


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    q = randn(2, 256, 8, 64, dtype=torch.float16, device="cuda")
    side = torch.cuda.Stream()
    ref = iot.attention(q, q, q, causal=True)
    with torch.cuda.stream(side):
        q2 = q * 1.0  # produced on the side stream; ioattn must run after it, on that stream
        o = iot.attention(q2, q2, q2, causal=True)
    side.synchronize()
    assert torch.equal(o, ref)


@needs_cuda
def test_cuda_naive_backend_and_select():
    q = randn(1, 33, 4, 64, dtype=torch.float16, device="cuda")
    o = iot.attention(q, q, q, backend="naive")
    ref, _ = sdpa_ref(q, q, q)
    # The tolerance rule: 2x the error of unfused attention computed in fp16 (SDPA's math
    # backend on fp16 tensors), plus a small atol.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        lowp = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, q, q))).transpose(1, 2)
    bound = 2 * (lowp.double() - ref).abs().max().item() + 1e-3
    assert (o.double() - ref).abs().max().item() <= bound
    assert ioattn.select(q, q, q, backend="naive")["kernel"].startswith("cuda/naive")


@needs_cuda
def test_cuda_and_cpu_mixed_is_an_error():
    q = randn(1, 5, 2, 8, device="cuda")
    with pytest.raises(ValueError, match=r"argument 'k\.device'"):
        iot.attention(q, q.cpu(), q.cpu())
