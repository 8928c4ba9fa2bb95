"""ioattn — IO-aware exact attention (FlashAttention-style) for CPUs and NVIDIA GPUs.

    import numpy as np, ioattn
    q = np.random.randn(2, 128, 8, 64).astype(np.float32)   # [batch, seqlen, heads, head_dim]
    o, lse = ioattn.attention(q, q, q, causal=True, return_lse=True)

Arrays are taken without copies from numpy, PyTorch, JAX, CuPy or any DLPack producer, on the
CPU or a CUDA device; outputs are allocated in the caller's framework (numpy for numpy and for
other CPU arrays, torch for torch tensors, CuPy for CuPy arrays). torch tensors go through the
custom op ``torch.ops.ioattn.attention`` (see ``ioattn.torch``), so autograd and torch.compile
see one opaque op.

Semantics (one definition for every backend; include/ioattn/ioattn.hpp has the full text):
  * S = scale * Q K^T (scale defaults to 1/sqrt(head_dim)); softcap c > 0: S = c tanh(S / c);
    ALiBi: S -= slope_h |i + (Sk - Sq) - j|.
  * Masks are aligned bottom-right: causal keeps j <= i + (Sk - Sq); window (left, right) keeps
    i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right, -1 meaning unbounded.
  * GQA/MQA: query head h reads KV head h // (Hq // Hkv).
  * sinks: a per-head logit in the softmax denominator with a zero value vector.
  * A row with no visible key: O = 0 and LSE = -inf (with a sink: LSE = sink).
  * O has the input dtype; LSE is float32, natural log, [batch, heads_q, seqlen_q].

Gradients: attention_backward / attention_varlen_backward (ioattn::backward, by recomputation
from the forward's O and LSE) for numpy-style arrays; torch tensors get them through autograd.

Serving: decode (split-KV against a paged or contiguous KV cache, 8-bit caches included),
append_kv (write new tokens into the cache) and merge_states (combine partial (O, LSE) states),
for every framework above.

Errors: an argument the library rejects raises ioattn.Error, a ValueError whose message names
the argument ("ioattn: argument 'k.shape[2]': expected ..., got ...") and whose ``.argument``
holds that name; an argument of the wrong Python type raises TypeError.
"""

import sys
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import _C
from ._args import Options, call_backward, check_bool, check_float, check_int, check_ndim, fail, type_name
from ._C import DecodePlan, Error

__version__: str = _C.__version__

__all__ = [
    "DecodePlan",
    "Error",
    "aligned_bytes",
    "attention",
    "attention_backward",
    "attention_fp8",
    "attention_varlen",
    "attention_varlen_backward",
    "append_kv",
    "decode",
    "explain",
    "explain_text",
    "info",
    "merge_states",
    "online_softmax_example",
    "plan_decode",
    "select",
]

Array = Any  # numpy.ndarray, torch.Tensor, jax.Array, cupy.ndarray, or any DLPack producer

# DLPack device types (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def __getattr__(name: str) -> Any:
    # `ioattn.torch` is imported on first use, so the package works without PyTorch.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'ioattn' has no attribute '{name}'")


# ---- frameworks --------------------------------------------------------------------------

def _is_torch(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _module_root(x: object) -> str:
    return type(x).__module__.split(".")[0]


def _check_array(name: str, x: object) -> None:
    if not isinstance(x, np.ndarray) and not hasattr(x, "__dlpack__"):
        raise TypeError(
            f"ioattn: argument '{name}' must be an array (numpy, torch, JAX, CuPy or any "
            f"DLPack producer), got {type_name(x)}")


def _check_writable(name: str, x: object) -> None:
    """An array the call writes in place: a read-only numpy array is an error naming it (the
    extension would otherwise refuse the whole call with a TypeError listing its signature)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        fail(name, "a writable array (the call writes it in place)", "a read-only numpy array")


class _Host:
    """Where one call's outputs are allocated (any framework but torch, which ioattn.torch
    handles): numpy for arrays on the CPU, CuPy for CuPy arrays on a CUDA device."""

    def __init__(self, q: Array, k: Array, v: Array) -> None:
        _check_array("q", q)
        _check_array("k", k)
        _check_array("v", v)
        self.cupy_device: Optional[int] = None
        if isinstance(q, np.ndarray) or not hasattr(q, "__dlpack_device__"):
            return
        dev_type, dev_id = (int(d) for d in q.__dlpack_device__())
        if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            if _module_root(q) != "cupy":
                raise TypeError(
                    f"ioattn: argument 'q': CUDA arrays are taken from torch and CuPy; wrap a "
                    f"{type_name(q)} without a copy, e.g. torch.from_dlpack(q)")
            self.cupy_device = dev_id
        # Any other device: outputs in numpy, and the extension names q's unsupported device.

    def empty(self, shape: Tuple[int, ...], like: Optional[Array],
              fill: Optional[float] = None) -> Array:
        """An output shaped `shape` with like's dtype (float32 when like is None)."""
        if self.cupy_device is not None:
            import cupy

            with cupy.cuda.Device(self.cupy_device):
                out = cupy.empty(shape, dtype=cupy.float32 if like is None else like.dtype)
                if fill is not None:
                    out.fill(fill)
            return out
        out = np.empty(shape, dtype=np.float32 if like is None else _np_dtype(like))
        if fill is not None:
            out.fill(fill)
        return out

    def asarray(self, x: Optional[Array], dtype: Any) -> Optional[Array]:
        """Lists (of ALiBi slopes, sink logits, cu_seqlens) as arrays on q's device."""
        if not isinstance(x, (list, tuple)):
            return x
        if self.cupy_device is not None:
            import cupy

            with cupy.cuda.Device(self.cupy_device):
                return cupy.asarray(x, dtype=dtype)
        return np.asarray(x, dtype=dtype)

    def stream(self) -> int:
        if self.cupy_device is not None:
            import cupy

            return int(cupy.cuda.get_current_stream().ptr)
        return 0


def _np_dtype(x: Array) -> Any:
    """The numpy dtype for an output like x (bfloat16 via ml_dtypes when x is bfloat16)."""
    dt = getattr(x, "dtype", None)
    name = getattr(dt, "name", None) or str(dt)
    if name.startswith("jax.numpy.") or name.startswith("torch."):
        name = name.rsplit(".", 1)[1]
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("ioattn: a bfloat16 array on the CPU needs ml_dtypes for the output "
                            "(numpy has no bfloat16): pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(np.float32)  # the extension rejects the input's dtype with its name


def _is_bf16(x: Array) -> bool:
    # kind first: ml_dtypes' bfloat16 (and float8) are kind "V", and dtype.name is a slow
    # Python-level property (~3 us; a decode call asks about a dozen arrays)
    return isinstance(x, np.ndarray) and x.dtype.kind == "V" and x.dtype.name == "bfloat16"


def _pass(x: Array) -> Array:
    """The object handed to the extension: numpy bfloat16 (ml_dtypes) goes as its uint16 bits."""
    if _is_bf16(x):
        return x.view(np.uint16)
    return x


def _shape(x: Array) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


# ---- attention ---------------------------------------------------------------------------

def attention(q: Array, k: Array, v: Array, *, causal: bool = False,
              window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
              scale: Optional[float] = None, alibi_slopes: Optional[Array] = None,
              sinks: Optional[Array] = None, return_lse: bool = False, backend: str = "auto",
              num_threads: int = 0) -> Union[Array, Tuple[Array, Array]]:
    """Exact attention O = softmax(scale Q K^T [softcap] [+ alibi] [masked]) V.

    q: [batch, seqlen_q, heads_q, head_dim]; k: [batch, seqlen_k, heads_kv, head_dim];
    v: [batch, seqlen_k, heads_kv, head_dim_v]; float32, float16 or bfloat16, one device.
    Any strides with a unit last-dim stride are read in place (so a [b, h, s, d] buffer passed
    as x.transpose(1, 2) costs nothing).

    causal: bottom-right aligned causal mask. window: (left, right), -1 = unbounded.
    softcap: c > 0 applies c * tanh(s / c). scale: None = 1/sqrt(head_dim).
    alibi_slopes, sinks: float32 [heads_q] on q's device (lists accepted for numpy).
    backend: "auto", "flash" (tiled online softmax) or "naive" (materialised S and P).
    num_threads: CPU threads, 0 = all.

    Returns O [batch, seqlen_q, heads_q, head_dim_v] in q's dtype and framework, and with
    return_lse=True also LSE [batch, heads_q, seqlen_q] float32.
    """
    if _is_torch(q):
        from . import torch as _ioattn_torch

        return _ioattn_torch.attention(
            q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
            alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse, backend=backend,
            num_threads=num_threads)
    opt = Options(causal, window, softcap, scale, backend, num_threads)
    return_lse = check_bool("return_lse", return_lse)
    host = _Host(q, k, v)
    qs, vs = _shape(q), _shape(v)
    check_ndim("q", qs, 4)
    check_ndim("v", vs, 4)
    b, sq, hq, _ = qs
    o = host.empty((b, sq, hq, vs[3]), like=q)
    lse = host.empty((b, hq, sq), like=None) if return_lse else None
    _C.forward(_pass(q), _pass(k), _pass(v), _pass(o), lse,
               alibi_slopes=host.asarray(alibi_slopes, np.float32),
               sinks=host.asarray(sinks, np.float32), stream=host.stream(),
               u16_is_bf16=_is_bf16(o), **opt.kwargs())
    return (o, lse) if return_lse else o


def attention_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                     max_seqlen_q: int = 0, max_seqlen_k: int = 0, *, causal: bool = False,
                     window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     scale: Optional[float] = None, alibi_slopes: Optional[Array] = None,
                     sinks: Optional[Array] = None, return_lse: bool = False,
                     backend: str = "auto",
                     num_threads: int = 0) -> Union[Array, Tuple[Array, Array]]:
    """Attention over a packed batch of variable-length sequences.

    q: [total_q, heads_q, head_dim]; k, v: [total_k, heads_kv, head_dim(_v)]; sequence b owns
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (and likewise of k, v); cu_seqlens_* are int32
    [batch + 1] on q's device (lists accepted for numpy). max_seqlen_*: 0 = computed; otherwise
    at least the longest sequence. Masks are aligned bottom-right per sequence. Empty sequences
    are allowed.

    Returns O [total_q, heads_q, head_dim_v] and with return_lse=True LSE [heads_q, total_q]
    float32. Rows past cu_seqlens_q[-1] belong to no sequence: O = 0 and LSE = -inf there.
    """
    if _is_torch(q):
        from . import torch as _ioattn_torch

        return _ioattn_torch.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            window=window, softcap=softcap, scale=scale, alibi_slopes=alibi_slopes, sinks=sinks,
            return_lse=return_lse, backend=backend, num_threads=num_threads)
    opt = Options(causal, window, softcap, scale, backend, num_threads)
    return_lse = check_bool("return_lse", return_lse)
    max_seqlen_q = check_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k)
    host = _Host(q, k, v)
    cu_q = host.asarray(cu_seqlens_q, np.int32)
    cu_k = host.asarray(cu_seqlens_k, np.int32)
    _check_array("cu_seqlens_q", cu_q)
    _check_array("cu_seqlens_k", cu_k)
    qs, vs = _shape(q), _shape(v)
    check_ndim("q", qs, 3)
    check_ndim("v", vs, 3)
    total_q, hq, _ = qs
    o = host.empty((total_q, hq, vs[2]), like=q, fill=0)
    lse = host.empty((hq, total_q), like=None, fill=-np.inf) if return_lse else None
    _C.forward_varlen(_pass(q), _pass(k), _pass(v), _pass(o), lse, cu_q, cu_k,
                      max_seqlen_q, max_seqlen_k,
                      alibi_slopes=host.asarray(alibi_slopes, np.float32),
                      sinks=host.asarray(sinks, np.float32), stream=host.stream(),
                      u16_is_bf16=_is_bf16(o), **opt.kwargs())
    return (o, lse) if return_lse else o


class _Named:
    """An object whose dtype is only a name (host.empty(like=...) of a dtype q does not have)."""

    def __init__(self, name: str) -> None:
        self.dtype = name


def _e4m3_codes(name: str, x: Array) -> Array:
    """An fp8 input as the extension takes it: ml_dtypes float8_e4m3fn as its uint8 codes; uint8
    arrays are taken as codes already; anything else is rejected with its dtype."""
    if isinstance(x, np.ndarray) and x.dtype.kind == "V" and x.dtype.name == "float8_e4m3fn":
        return x.view(np.uint8)
    if str(getattr(x, "dtype", "")) == "uint8":
        return x
    fail(f"{name}.dtype", "a torch or numpy (ml_dtypes) float8_e4m3fn array, or uint8 codes",
         f"{getattr(x, 'dtype', type_name(x))} ({type_name(x)})")


def attention_fp8(q: Array, k: Array, v: Array, *, q_descale: Optional[Array] = None,
                  k_descale: Optional[Array] = None, v_descale: Optional[Array] = None,
                  out_dtype: str = "bfloat16", cu_seqlens_q: Optional[Array] = None,
                  cu_seqlens_k: Optional[Array] = None, max_seqlen_q: int = 0,
                  max_seqlen_k: int = 0, causal: bool = False,
                  window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  scale: Optional[float] = None, alibi_slopes: Optional[Array] = None,
                  sinks: Optional[Array] = None, return_lse: bool = False, backend: str = "auto",
                  num_threads: int = 0) -> Union[Array, Tuple[Array, Array]]:
    """FP8 attention (forward only): q, k, v float8_e4m3fn (torch, or numpy through ml_dtypes;
    uint8 arrays are read as e4m3 codes), each element worth code x its descale.

    q_descale, k_descale, v_descale: float32 [batch, heads_kv] (lists accepted for numpy), None =
    1. out_dtype: "bfloat16" (default) or "float16". Fixed length as attention() ([batch, seqlen,
    heads, head_dim]); with cu_seqlens_q / cu_seqlens_k packed sequences as attention_varlen()
    ([total, heads, head_dim], LSE [heads_q, total_q]). Masks and modifiers as attention().
    On CUDA the Hopper fp8 kernel (head_dim 64, 128 or 256, fixed length or packed); the CPU
    backends take every shape.
    Returns O in out_dtype, and with return_lse=True also the float32 LSE.
    """
    if _is_torch(q):
        from . import torch as _ioattn_torch

        return _ioattn_torch.attention_fp8(
            q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            out_dtype=out_dtype, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, window=window,
            softcap=softcap, scale=scale, alibi_slopes=alibi_slopes, sinks=sinks,
            return_lse=return_lse, backend=backend, num_threads=num_threads)
    opt = Options(causal, window, softcap, scale, backend, num_threads)
    return_lse = check_bool("return_lse", return_lse)
    if out_dtype not in ("bfloat16", "float16"):
        fail("out_dtype", "'bfloat16' or 'float16'", repr(out_dtype))
    host = _Host(q, k, v)
    codes = [_e4m3_codes(n, x) for n, x in (("q", q), ("k", k), ("v", v))]
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    qs, vs = _shape(q), _shape(v)
    check_ndim("q", qs, 3 if varlen else 4)
    check_ndim("v", vs, 3 if varlen else 4)
    if out_dtype == "bfloat16" and host.cupy_device is not None:
        fail("out_dtype", "'float16' for CuPy arrays (CuPy has no bfloat16)", "'bfloat16'")
    # (the dtype of an output like this one: _np_dtype maps "bfloat16" to ml_dtypes')
    like = np.empty(0, dtype=np.float16) if out_dtype == "float16" else _Named("bfloat16")
    descales = {n: host.asarray(x, np.float32) for n, x in
                (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))}
    common = dict(alibi_slopes=host.asarray(alibi_slopes, np.float32),
                  sinks=host.asarray(sinks, np.float32), stream=host.stream(), u8_is_e4m3=True,
                  **descales, **opt.kwargs())
    if varlen:
        cu_q = host.asarray(cu_seqlens_q, np.int32)
        cu_k = host.asarray(cu_seqlens_k, np.int32)
        _check_array("cu_seqlens_q", cu_q)
        _check_array("cu_seqlens_k", cu_k)
        total_q, hq, _ = qs
        o = host.empty((total_q, hq, vs[2]), like=like, fill=0)
        lse = host.empty((hq, total_q), like=None, fill=-np.inf) if return_lse else None
        _C.forward_varlen(*codes, _pass(o), lse, cu_q, cu_k, check_int("max_seqlen_q", max_seqlen_q),
                          check_int("max_seqlen_k", max_seqlen_k), u16_is_bf16=_is_bf16(o), **common)
    else:
        b, sq, hq, _ = qs
        o = host.empty((b, sq, hq, vs[3]), like=like)
        lse = host.empty((b, hq, sq), like=None) if return_lse else None
        _C.forward(*codes, _pass(o), lse, u16_is_bf16=_is_bf16(o), **common)
    return (o, lse) if return_lse else o


def _grads(host: _Host, q: Array, k: Array, v: Array, sinks: Optional[Array]
           ) -> Tuple[Array, Array, Array, Optional[Array]]:
    dq = host.empty(_shape(q), like=q)
    dk = host.empty(_shape(k), like=q)
    dv = host.empty(_shape(v), like=q)
    dsinks = None if sinks is None else host.empty((len(sinks),), like=None)
    return dq, dk, dv, dsinks


def attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
                       causal: bool = False, window: Tuple[int, int] = (-1, -1),
                       softcap: float = 0.0, scale: Optional[float] = None,
                       alibi_slopes: Optional[Array] = None, sinks: Optional[Array] = None,
                       backend: str = "auto", num_threads: int = 0,
                       deterministic: bool = False) -> Tuple[Array, ...]:
    """Gradients of attention() by recomputation (ioattn::backward).

    dout is the gradient of O; out and lse are attention()'s outputs for the same q, k, v and
    keyword arguments (lse from return_lse=True). Returns (dq, dk, dv) in q's dtype (GQA: dk, dv
    summed over each group's query heads), and dsinks (float32 [heads_q]) as a fourth element
    when sinks is given. deterministic=True asks for bitwise-reproducible accumulation.
    NotImplementedError when this build has no backward for the case.
    """
    if _is_torch(q):
        raise TypeError("ioattn: attention_backward takes numpy/DLPack arrays; for torch tensors "
                        "use autograd (ioattn.torch.attention is differentiable)")
    opt = Options(causal, window, softcap, scale, backend, num_threads, deterministic)
    host = _Host(q, k, v)
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        _check_array(name, x)
    alibi_slopes = host.asarray(alibi_slopes, np.float32)
    sinks = host.asarray(sinks, np.float32)
    dq, dk, dv, dsinks = _grads(host, q, k, v, sinks)
    call_backward(_C.backward, _pass(q), _pass(k), _pass(v), _pass(out), _pass(dout), lse,
                  _pass(dq), _pass(dk), _pass(dv), dsinks, alibi_slopes=alibi_slopes, sinks=sinks,
                  stream=host.stream(), deterministic=opt.deterministic,
                  u16_is_bf16=_is_bf16(dq), **opt.kwargs())
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def attention_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int = 0,
                              max_seqlen_k: int = 0, *, causal: bool = False,
                              window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              scale: Optional[float] = None,
                              alibi_slopes: Optional[Array] = None,
                              sinks: Optional[Array] = None, backend: str = "auto",
                              num_threads: int = 0,
                              deterministic: bool = False) -> Tuple[Array, ...]:
    """Gradients of attention_varlen() (ioattn::backward_varlen); lse is [heads_q, total_q].
    Returns (dq, dk, dv) and dsinks when sinks is given, as attention_backward()."""
    if _is_torch(q):
        raise TypeError("ioattn: attention_varlen_backward takes numpy/DLPack arrays; for torch "
                        "tensors use autograd (ioattn.torch.attention_varlen is differentiable)")
    opt = Options(causal, window, softcap, scale, backend, num_threads, deterministic)
    host = _Host(q, k, v)
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        _check_array(name, x)
    cu_q = host.asarray(cu_seqlens_q, np.int32)
    cu_k = host.asarray(cu_seqlens_k, np.int32)
    _check_array("cu_seqlens_q", cu_q)
    _check_array("cu_seqlens_k", cu_k)
    alibi_slopes = host.asarray(alibi_slopes, np.float32)
    sinks = host.asarray(sinks, np.float32)
    dq, dk, dv, dsinks = _grads(host, q, k, v, sinks)
    # Rows of q, k, v past the last sequence belong to none: their gradient is 0.
    for g in (dq, dk, dv):
        g.fill(0)
    call_backward(_C.backward_varlen, _pass(q), _pass(k), _pass(v), _pass(out), _pass(dout),
                  lse, _pass(dq), _pass(dk), _pass(dv), dsinks, cu_q, cu_k,
                  check_int("max_seqlen_q", max_seqlen_q), check_int("max_seqlen_k", max_seqlen_k),
                  alibi_slopes=alibi_slopes, sinks=sinks, stream=host.stream(),
                  deterministic=opt.deterministic, u16_is_bf16=_is_bf16(dq), **opt.kwargs())
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def select(q: Array, k: Array, v: Array, *, causal: bool = False,
           window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
           scale: Optional[float] = None, alibi_slopes: Optional[Array] = None,
           sinks: Optional[Array] = None, backend: str = "auto",
           num_threads: int = 0) -> Dict[str, str]:
    """Which kernel attention() would run for these arguments, without running it.

    Validates exactly as attention() does (same errors) and returns
    {"kernel": "cpu/flash avx3 f32 hdim128 causal tile 48x64", "reason": "..."}.
    """
    opt = Options(causal, window, softcap, scale, backend, num_threads)
    if _is_torch(q):
        from . import torch as _ioattn_torch

        args = [_ioattn_torch._detach(x) for x in (q, k, v, alibi_slopes, sinks)]
        stream = _ioattn_torch._stream(q)
        u16 = False
    else:
        host = _Host(q, k, v)
        args = [_pass(q), _pass(k), _pass(v), host.asarray(alibi_slopes, np.float32),
                host.asarray(sinks, np.float32)]
        stream = host.stream()
        u16 = _is_bf16(q)
    kernel, reason = _C.select_forward(args[0], args[1], args[2], alibi_slopes=args[3],
                                       sinks=args[4], stream=stream, u16_is_bf16=u16,
                                       **opt.kwargs())
    return {"kernel": kernel, "reason": reason}


# ---- serving: decode against a (paged) KV cache, append_kv, merge_states ----------------

class _Call:
    """One serving call's frameworks: outputs allocated like q (numpy, CuPy or torch), arrays
    passed as the extension takes them (bfloat16 / float8_e4m3fn on numpy and float8_e4m3fn on
    torch as their bit patterns), and the stream to run on."""

    def __init__(self, first: Array, *arrays: Array) -> None:
        self.torch = _is_torch(first)
        self.host: Optional[_Host] = None
        if self.torch:
            from . import torch as _ioattn_torch

            self._t = _ioattn_torch
            self.guard = _ioattn_torch._DeviceGuard(first)
            self.stream = _ioattn_torch._stream(first)
        else:
            self.host = _Host(first, *(arrays + (first, first))[:2])
            self.stream = self.host.stream()
        self.first = first

    def empty(self, shape: Tuple[int, ...], like: Optional[Array]) -> Array:
        if self.torch:
            import torch

            dtype = torch.float32 if like is None else like.dtype
            return torch.empty(shape, dtype=dtype, device=self.first.device)
        assert self.host is not None
        return self.host.empty(shape, like=like)

    def empty_bytes(self, n: int) -> Array:
        """A uint8 workspace of n bytes (at least 1), 64-byte aligned (plan workspaces must be), on
        the device of the call's first array."""
        if self.torch:
            import torch

            return torch.empty(max(n, 1), dtype=torch.uint8, device=self.first.device)
        assert self.host is not None
        if self.host.cupy_device is not None:
            import cupy

            with cupy.cuda.Device(self.host.cupy_device):
                return cupy.empty(max(n, 1), dtype=cupy.uint8)
        return aligned_bytes(n)

    def asarray(self, x: Optional[Array], dtype: Any) -> Optional[Array]:
        if x is None:
            return None
        if self.torch:
            import torch

            if isinstance(x, (list, tuple)):
                return torch.tensor(x, dtype=torch.float32 if dtype == np.float32 else torch.int32,
                                    device=self.first.device)
            return self._t._detach(x)
        assert self.host is not None
        return self.host.asarray(x, dtype)

    def arr(self, x: Optional[Array]) -> Optional[Array]:
        """x as the extension takes it (bit patterns for the dtypes DLPack cannot carry)."""
        if x is None:
            return None
        if self.torch:
            import torch

            x = self._t._detach(x)
            return x.view(torch.uint8) if x.dtype == getattr(torch, "float8_e4m3fn", None) else x
        if isinstance(x, np.ndarray) and x.dtype.kind == "V" and x.dtype.name == "float8_e4m3fn":
            return x.view(np.uint8)
        return _pass(x)

    def with_guard(self):  # type: ignore[no-untyped-def]
        if self.torch:
            return self.guard
        import contextlib

        return contextlib.nullcontext()


def aligned_bytes(n: int) -> np.ndarray:
    """A numpy uint8 array of n bytes (at least 1) starting at a 64-byte boundary, as decode()
    under a plan needs its workspace (numpy's own allocations are only 16-byte aligned)."""
    n = max(check_int("n", n), 1)
    buf = np.empty(n + 64, dtype=np.uint8)
    off = (-buf.ctypes.data) % 64
    return buf[off:off + n]


def _is_e4m3(x: Array) -> bool:
    dt = getattr(x, "dtype", None)
    if isinstance(dt, np.dtype) and dt.kind != "V":  # (the common case, without dtype.name)
        return False
    return (getattr(dt, "name", None) or str(dt).rsplit(".", 1)[-1]) == "float8_e4m3fn"


def _is_bf16_any(*xs: Array) -> bool:
    return any(_is_bf16(x) for x in xs if x is not None)


def plan_decode(batch: int, heads_q: int, heads_kv: int, head_dim: int, max_seqlen_k: int, *,
                head_dim_v: Optional[int] = None, seqlen_q: int = 1, page_size: int = 0,
                device: str = "cpu", device_index: int = 0, num_splits: int = 0,
                cache_dtype: str = "bf16") -> Any:
    """Fixes the split counts and work partition of decode() for one batch shape
    (ioattn::plan_decode). Returns a DecodePlan (batch, ..., num_splits, workspace_bytes, device);
    pass it with a workspace of at least plan.workspace_bytes bytes (any dtype, contiguous,
    64-byte aligned — torch and CuPy allocations are; for numpy use aligned_bytes() — on the
    device of q) to decode(plan=..., workspace=...): that call allocates nothing, so a CUDA graph
    can capture it, and it fails loudly on arguments of another shape. page_size 0: a contiguous
    cache; max_seqlen_k: an upper bound of cache_seqlens; cache_dtype ('bf16', 'f16', 'f32',
    'f8e4m3', 'i8'): a hint for the CUDA split heuristic."""
    ints = {name: check_int(name, x) for name, x in (
        ("batch", batch), ("heads_q", heads_q), ("heads_kv", heads_kv), ("head_dim", head_dim),
        ("max_seqlen_k", max_seqlen_k), ("seqlen_q", seqlen_q), ("page_size", page_size),
        ("device_index", device_index), ("num_splits", num_splits))}
    dv = ints["head_dim"] if head_dim_v is None else check_int("head_dim_v", head_dim_v)
    if not isinstance(device, str) or not isinstance(cache_dtype, str):
        raise TypeError("ioattn: arguments 'device' and 'cache_dtype' must be str")
    return _C.plan_decode(ints["batch"], ints["heads_q"], ints["heads_kv"], ints["head_dim"], dv,
                          ints["seqlen_q"], ints["max_seqlen_k"], ints["page_size"], device,
                          ints["device_index"], ints["num_splits"], cache_dtype)


def decode(q: Array, k_cache: Array, v_cache: Array, cache_seqlens: Array, *,
           block_table: Optional[Array] = None, k_scale: Optional[Array] = None,
           v_scale: Optional[Array] = None, causal: bool = False,
           window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
           scale: Optional[float] = None, alibi_slopes: Optional[Array] = None,
           sinks: Optional[Array] = None, num_splits: int = 0, return_lse: bool = False,
           num_threads: int = 0, plan: Any = None, workspace: Optional[Array] = None,
           out: Optional[Array] = None, lse_out: Optional[Array] = None,
           k_new: Optional[Array] = None, v_new: Optional[Array] = None
           ) -> Union[Array, Tuple[Array, Array]]:
    """Attention of a few new query tokens per sequence against a (paged) KV cache: split-KV
    (Flash-Decoding) with an exact log-sum-exp merge (ioattn::decode).

    q: [batch, seqlen_q, heads_q, head_dim], any seqlen_q: 1..16 run the split-KV decode, more
    than 16 (a prefill chunk against the cache) the tiled flash forward over the cache's layout
    (CUDA: f16 / bf16 q, head_dim == head_dim_v <= 256); query row i
    of sequence b sits at position cache_seqlens[b] - seqlen_q + i (causal masks are bottom-right
    aligned).
    k_cache, v_cache: [pages, page_size, heads_kv, head_dim(_v)] with block_table int32
    [batch, pages_per_seq] (sequence b's token t at page block_table[b, t // page_size], slot
    t % page_size), or without a block table contiguous [batch, max_seqlen, heads_kv, head_dim].
    cache_seqlens: int32 [batch], the valid tokens per sequence. Caches in q's dtype, or 8-bit
    (int8, or float8_e4m3fn from torch / ml_dtypes) with k_scale / v_scale float32 [heads_kv]
    (value = stored * scale). num_splits: KV chunks per sequence and kv head, 0 = heuristic.

    Returns O [batch, seqlen_q, heads_q, head_dim_v] in q's dtype and framework, and with
    return_lse=True also LSE [batch, heads_q, seqlen_q] float32. A sequence with no key gives
    O = 0 and LSE = -inf.

    k_new, v_new: [batch, seqlen_new, heads_kv, head_dim(_v)] in q's dtype, appended to the cache
    (in place) before the attention: token i of sequence b at position cache_seqlens[b] -
    seqlen_new + i, so cache_seqlens counts them (as append_kv with those slots, then decode). A
    sequence of length 0 appends nothing.

    plan / workspace (plan_decode): decode under a fixed plan with a caller-owned workspace;
    num_splits then comes from the plan. out / lse_out: write into these arrays (shapes and
    dtypes as returned) instead of new ones; with a plan, a workspace and out (and lse_out) the
    call allocates nothing (CUDA-graph capture).
    """
    opt = Options(causal, window, softcap, scale, "auto", num_threads)
    return_lse = check_bool("return_lse", return_lse)
    num_splits = check_int("num_splits", num_splits)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        _check_array(name, x)
    for name, x in (("out", out), ("lse_out", lse_out), ("workspace", workspace)):
        _check_writable(name, x)
    if k_new is not None or v_new is not None:  # the fused append writes the caches
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if x is not None:
                _check_array(name, x)
        _check_writable("k_cache", k_cache)
        _check_writable("v_cache", v_cache)
    call = _Call(q, k_cache, v_cache)
    qs, vs = _shape(q), _shape(v_cache)
    check_ndim("q", qs, 4)
    check_ndim("cache.v_cache", vs, 4)
    b, sq, hq, _ = qs
    o = call.empty((b, sq, hq, vs[3]), like=q) if out is None else out
    lse = lse_out if lse_out is not None else (call.empty((b, hq, sq), like=None) if return_lse else None)
    kw = opt.kwargs()
    del kw["backend"]
    args = (call.arr(q), call.arr(k_cache), call.arr(v_cache), call.arr(cache_seqlens), call.arr(o), call.arr(lse))
    common = dict(block_table=call.arr(block_table), k_scale=call.arr(k_scale), v_scale=call.arr(v_scale),
                  alibi_slopes=call.asarray(alibi_slopes, np.float32), sinks=call.asarray(sinks, np.float32),
                  stream=call.stream, u16_is_bf16=_is_bf16_any(q, k_cache, o), u8_is_e4m3=_is_e4m3(k_cache),
                  k_new=call.arr(k_new), v_new=call.arr(v_new), **kw)
    with call.with_guard():
        if plan is None:
            if workspace is not None:
                raise TypeError("ioattn: argument 'workspace' goes with a plan (plan_decode)")
            _C.decode(*args, num_splits=num_splits, **common)
        else:
            if not isinstance(plan, _C.DecodePlan):
                raise TypeError(f"ioattn: argument 'plan' must be an ioattn.DecodePlan, got {type_name(plan)}")
            if num_splits not in (0, plan.num_splits):
                fail("num_splits", f"0 or the plan's {plan.num_splits} (a plan fixes the splits)", str(num_splits))
            if workspace is None:
                workspace = call.empty_bytes(plan.workspace_bytes)
            _C.decode_planned(*args, plan, call.arr(workspace), **common)
    return (o, lse) if (return_lse or lse_out is not None) else o


def append_kv(k_new: Array, v_new: Array, slot_mapping: Array, k_cache: Array, v_cache: Array, *,
              k_scale: Optional[Array] = None, v_scale: Optional[Array] = None) -> None:
    """Writes new tokens into a KV cache in place (ioattn::append_kv).

    k_new, v_new: [tokens, heads_kv, head_dim(_v)] in the compute dtype; slot_mapping: int32 or
    int64 [tokens], slot = page * page_size + offset (contiguous cache: batch * max_seqlen +
    position); a negative slot is padding and is skipped. 8-bit caches quantise with k_scale /
    v_scale (float32 [heads_kv]).
    """
    for name, x in (("k_new", k_new), ("v_new", v_new), ("slot_mapping", slot_mapping),
                    ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_array(name, x)
    _check_writable("k_cache", k_cache)
    _check_writable("v_cache", v_cache)
    call = _Call(k_new, v_new, k_cache)
    with call.with_guard():
        _C.append_kv(call.arr(k_new), call.arr(v_new), call.arr(slot_mapping), call.arr(k_cache),
                     call.arr(v_cache), k_scale=call.arr(k_scale), v_scale=call.arr(v_scale),
                     stream=call.stream, u16_is_bf16=_is_bf16_any(k_new, k_cache),
                     u8_is_e4m3=_is_e4m3(k_cache))


def merge_states(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> Tuple[Array, Array]:
    """Merges two partial attention states over disjoint key sets (ioattn::merge_states):
    lse = log(exp(lse_a) + exp(lse_b)), o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).
    o_*: [batch, seqlen, heads, head_dim], lse_*: float32 [batch, heads, seqlen]; rows empty in
    both (-inf, -inf) give o = 0 and lse = -inf. Returns (o, lse), new arrays like o_a / lse_a."""
    for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        _check_array(name, x)
    call = _Call(o_a, o_b, lse_a)
    o = call.empty(_shape(o_a), like=o_a)
    lse = call.empty(_shape(lse_a), like=None)
    with call.with_guard():
        _C.merge_states(call.arr(o_a), call.arr(lse_a), call.arr(o_b), call.arr(lse_b), call.arr(o),
                        lse, stream=call.stream, u16_is_bf16=_is_bf16_any(o_a, o_b))
    return o, lse


# ---- build and arithmetic ----------------------------------------------------------------

def info() -> Dict[str, Any]:
    """What this build contains (ioattn::BuildInfo): version, CPU SIMD targets compiled and the
    one chosen on this machine, CPU threads, whether CUDA was compiled, CUDA devices and the
    CUDA kernels compiled in."""
    return _C.build_info()


def explain(**kwargs: Any) -> Dict[str, float]:
    """The memory-traffic arithmetic of IO-aware attention (ioattn::explain) as a dict.

    Keyword arguments (defaults in parentheses): seqlen (8192), head_dim (128), heads (64),
    layers (80), dtype_bytes (2), naive_passes (4), bandwidth_Bps (3e12), flops_per_s (500e12),
    attention_share (0: skip the end-to-end estimate), kernel_speedup (1).

    Returns score_bytes_per_head, naive_bytes_per_{head,layer,model}, flash_bytes_per_head,
    traffic_ratio, flops_per_head, flops_per_model, naive_traffic_seconds,
    flash_traffic_seconds, math_seconds and end_to_end_speedup.
    """
    return _C.explain(**_explain_kwargs(kwargs))


def explain_text(**kwargs: Any) -> str:
    """The same arithmetic as text, as `ioattn explain` prints it (same keyword arguments)."""
    return _C.explain_text(**_explain_kwargs(kwargs))


_EXPLAIN_INTS = ("seqlen", "head_dim", "heads", "layers", "dtype_bytes", "naive_passes")
_EXPLAIN_FLOATS = ("bandwidth_Bps", "flops_per_s", "attention_share", "kernel_speedup")


def _explain_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """explain()'s keyword arguments by name and Python type (TypeError naming the argument,
    instead of the extension's listing of its whole signature)."""
    out: Dict[str, Any] = {}
    for name, x in kwargs.items():
        if name in _EXPLAIN_INTS:
            out[name] = check_int(name, x)
        elif name in _EXPLAIN_FLOATS:
            out[name] = check_float(name, x)
        else:
            raise TypeError(f"ioattn: explain() has no argument '{name}'; it takes "
                            f"{', '.join(_EXPLAIN_INTS + _EXPLAIN_FLOATS)}")
    return out


def online_softmax_example(scores: Sequence[float], values: Sequence[float],
                           block_size: int = 2) -> Dict[str, Any]:
    """The online softmax over key blocks, one step per block: the running max before and
    after, the rescale factor exp(m_old - m_new), the running sum and output; then the final
    probabilities and output next to the two-pass softmax's output."""
    return _C.online_softmax_example(list(scores), list(values), block_size)
