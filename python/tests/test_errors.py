"""Bad inputs: ValueError (ioattn.Error) naming the argument; wrong Python types: TypeError."""

import re

import numpy as np
import pytest

import ioattn


def arrays(b=2, sq=5, sk=7, hq=4, hkv=2, d=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


Q, K, V = arrays()
CU = np.array([0, 3, 5], dtype=np.int32)
QP, KP = Q[0], K[0]  # packed [5, 4, 8] and [7, 2, 8]

# (id, call, the argument the message must name)
BAD_VALUES = [
    ("k_batch", lambda: ioattn.attention(Q, K[:1], V), "k.shape[0]"),
    ("v_seqlen", lambda: ioattn.attention(Q, K, V[:, :3]), "v.shape[1]"),
    ("heads_not_divisible", lambda: ioattn.attention(Q[:, :, :3], K, V), "q.shape[2]"),
    ("head_dim_mismatch", lambda: ioattn.attention(Q, K[..., :4], V), "k.shape[3]"),
    ("q_rank", lambda: ioattn.attention(Q[0], K, V), "q"),
    ("v_rank", lambda: ioattn.attention(Q, K, V[0]), "v"),
    ("q_float64", lambda: ioattn.attention(Q.astype(np.float64), K, V), "q.dtype"),
    ("q_int32", lambda: ioattn.attention(Q.astype(np.int32), K, V), "q.dtype"),
    ("k_dtype_differs", lambda: ioattn.attention(Q, K.astype(np.float16), V), "k.dtype"),
    ("last_dim_stride", lambda: ioattn.attention(
        np.repeat(Q, 2, axis=3)[..., ::2], K, V), "q.stride[3]"),
    ("negative_stride", lambda: ioattn.attention(Q[:, ::-1], K, V), "q.stride[1]"),
    ("window_left", lambda: ioattn.attention(Q, K, V, window=(-2, 0)), "params.window_left"),
    ("window_right", lambda: ioattn.attention(Q, K, V, window=(0, -7)), "params.window_right"),
    ("softcap_negative", lambda: ioattn.attention(Q, K, V, softcap=-1.0), "params.softcap"),
    ("softcap_nan", lambda: ioattn.attention(Q, K, V, softcap=float("nan")), "params.softcap"),
    ("scale_zero", lambda: ioattn.attention(Q, K, V, scale=0.0), "scale"),
    ("scale_inf", lambda: ioattn.attention(Q, K, V, scale=float("inf")), "scale"),
    ("alibi_length", lambda: ioattn.attention(Q, K, V, alibi_slopes=[0.1, 0.2]),
     "params.alibi_slopes.shape[0]"),
    ("alibi_float64", lambda: ioattn.attention(Q, K, V, alibi_slopes=np.ones(4)),
     "params.alibi_slopes.dtype"),
    ("sinks_rank", lambda: ioattn.attention(Q, K, V, sinks=np.ones((2, 2), np.float32)),
     "params.sinks"),
    ("backend_name", lambda: ioattn.attention(Q, K, V, backend="fast"), "backend"),
    ("num_threads", lambda: ioattn.attention(Q, K, V, num_threads=-1), "ctx.num_threads"),
    ("head_dim_too_big", lambda: ioattn.attention(*arrays(d=513)), "q.shape[3]"),
    ("cu_int64", lambda: ioattn.attention_varlen(QP, KP, KP, CU.astype(np.int64), CU),
     "cu_seqlens_q.dtype"),
    ("cu_decreasing", lambda: ioattn.attention_varlen(QP, KP, KP, [0, 4, 2], CU),
     "cu_seqlens_q"),
    ("cu_first_nonzero", lambda: ioattn.attention_varlen(QP, KP, KP, CU, [1, 3, 5]),
     "cu_seqlens_k[0]"),
    ("cu_past_total", lambda: ioattn.attention_varlen(QP, KP, KP, [0, 3, 9], CU),
     "cu_seqlens_q[2]"),
    ("cu_batch_differs", lambda: ioattn.attention_varlen(QP, KP, KP, CU, [0, 7]),
     "cu_seqlens_k.shape[0]"),
    ("max_seqlen_q", lambda: ioattn.attention_varlen(QP, KP, KP, CU, CU, 2, 0), "max_seqlen_q"),
    ("varlen_rank", lambda: ioattn.attention_varlen(Q, K, V, CU, CU), "q"),
]


@pytest.mark.parametrize("call,argument", [c[1:] for c in BAD_VALUES],
                         ids=[c[0] for c in BAD_VALUES])
def test_bad_value_raises_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError) as info:
        call()
    err = info.value
    assert isinstance(err, ioattn.Error)
    assert err.argument == argument
    assert str(err).startswith(f"ioattn: argument '{argument}': expected ")
    assert ", got " in str(err)


def test_message_is_the_cpp_message_unchanged():
    with pytest.raises(ValueError) as info:
        ioattn.attention(Q, K[:1], V)
    assert str(info.value) == "ioattn: argument 'k.shape[0]': expected 2 (batch of q), got 1"
    assert issubclass(ioattn.Error, ValueError)
    assert ioattn.Error is ioattn._C.Error


def test_errors_from_the_extension_directly():
    o = np.empty_like(Q)
    with pytest.raises(ioattn.Error, match=re.escape("argument 'o.shape[1]'")):
        ioattn._C.forward(Q, K, V, o[:, :2], None)
    with pytest.raises(ValueError, match=re.escape("argument 'lse.dtype'")):
        ioattn._C.forward(Q, K, V, o, np.empty((2, 4, 5), np.float64))
    with pytest.raises(ValueError, match=re.escape("argument 'o.stride[0]'")):
        # an output with stride 0 in a dim of size 2 would write two rows to one address
        ioattn._C.forward(Q, K, V, np.lib.stride_tricks.as_strided(o, strides=(0,) + o.strides[1:]),
                          None)


def test_read_only_output_is_rejected():
    o = np.empty_like(Q)
    o.setflags(write=False)
    with pytest.raises(TypeError):
        ioattn._C.forward(Q, K, V, o, None)


def test_explain_errors_name_the_argument():
    with pytest.raises(ValueError, match="argument 'seqlen'"):
        ioattn.explain(seqlen=0)
    with pytest.raises(ValueError, match="argument 'attention_share'"):
        ioattn.explain(attention_share=1.5)


BAD_TYPES = [
    ("q_list", lambda: ioattn.attention(Q.tolist(), K, V)),
    ("k_none", lambda: ioattn.attention(Q, None, V)),
    ("v_str", lambda: ioattn.attention(Q, K, "v")),
    ("causal_str", lambda: ioattn.attention(Q, K, V, causal="yes")),
    ("causal_int", lambda: ioattn.attention(Q, K, V, causal=1)),
    ("window_int", lambda: ioattn.attention(Q, K, V, window=4)),
    ("window_triple", lambda: ioattn.attention(Q, K, V, window=(1, 2, 3))),
    ("window_float", lambda: ioattn.attention(Q, K, V, window=(1.5, 0))),
    ("softcap_str", lambda: ioattn.attention(Q, K, V, softcap="1")),
    ("scale_str", lambda: ioattn.attention(Q, K, V, scale="0.1")),
    ("backend_int", lambda: ioattn.attention(Q, K, V, backend=1)),
    ("num_threads_float", lambda: ioattn.attention(Q, K, V, num_threads=1.5)),
    ("return_lse_none", lambda: ioattn.attention(Q, K, V, return_lse=None)),
    ("alibi_str", lambda: ioattn.attention(Q, K, V, alibi_slopes="slopes")),
    ("unknown_kwarg", lambda: ioattn.attention(Q, K, V, casual=True)),
    ("positional_causal", lambda: ioattn.attention(Q, K, V, True)),
    ("cu_seqlens_str", lambda: ioattn.attention_varlen(QP, KP, KP, "0,3,5", CU)),
    ("max_seqlen_float", lambda: ioattn.attention_varlen(QP, KP, KP, CU, CU, 3.0)),
    ("explain_unknown", lambda: ioattn.explain(seq_len=8)),
    ("explain_str", lambda: ioattn.explain(seqlen="8")),
    ("extension_str", lambda: ioattn._C.forward("q", K, V, np.empty_like(Q), None)),
]


@pytest.mark.parametrize("call", [c[1] for c in BAD_TYPES], ids=[c[0] for c in BAD_TYPES])
def test_wrong_python_type_raises_type_error(call):
    with pytest.raises(TypeError):
        call()


def test_type_error_names_the_argument():
    with pytest.raises(TypeError, match="argument 'q' must be an array"):
        ioattn.attention([1.0], K, V)
    with pytest.raises(TypeError, match="argument 'causal' must be a bool"):
        ioattn.attention(Q, K, V, causal="yes")
    with pytest.raises(TypeError, match="argument 'window'"):
        ioattn.attention(Q, K, V, window=3)


def test_naive_out_of_memory_is_an_error_not_a_crash():
    # The naive backend materialises [seqlen_q, seqlen_k] float64 per (batch, head) and thread: at
    # 15M tokens 1.8 PB, beyond a 47-bit address space. The allocation fails inside the OpenMP loop;
    # it must come back as an error naming the backend (it used to terminate the process).
    n = 15_000_000
    q = np.zeros((1, n, 1, 1), np.float32)
    with pytest.raises(ValueError, match=r"out of memory in the naive forward: .*\[15000000, 15000000\].*use backend flash"):
        ioattn.attention(q, q, q, backend="naive")
    lse = np.zeros((1, 1, n), np.float32)
    with pytest.raises(ValueError, match=r"out of memory in the naive backward: it materialises 2 "):
        ioattn.attention_backward(q, q, q, q, q, lse, backend="naive")
