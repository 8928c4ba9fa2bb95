"""ioattn for PyTorch: custom ops that autograd and torch.compile understand.

    import torch, ioattn.torch
    o = ioattn.torch.attention(q, k, v, causal=True)      # q, k, v: [batch, seqlen, heads, dim]
    o, lse = torch.ops.ioattn.attention(q, k, v, True, -1, -1, 0.0, 0.0, None, None, "auto", 0,
                                        False)

Four ops are registered with torch.library (namespace ``ioattn``):

    ioattn::attention(Tensor q, Tensor k, Tensor v, bool causal, int window_left,
                      int window_right, float softcap, float scale, Tensor? alibi_slopes,
                      Tensor? sinks, str backend, int num_threads, bool deterministic)
                      -> (Tensor out, Tensor lse)
    ioattn::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q,
                      Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, ...)
                      -> (Tensor out, Tensor lse)
    ioattn::attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                      Tensor lse, <the forward's scalars>) -> (dq, dk, dv, dsinks)
    ioattn::attention_varlen_backward(...)  -> (dq, dk, dv, dsinks)

scale 0.0 means 1/sqrt(head_dim). Each op has a fake (meta) implementation, so
torch.compile(fullgraph=True) traces through it without a graph break, forward and backward.
The forward ops carry an autograd formula (register_autograd) that calls the backward op, which
calls ioattn::backward; where this build has no backward kernel for the case it raises
NotImplementedError (the forward, under torch.no_grad or not, always works).
`AttentionFunction` is the same thing as a torch.autograd.Function.

The op runs on the tensors' device: CPU tensors on the CPU backend, CUDA tensors on the CUDA
backend, on PyTorch's current stream of that device. Inputs are read in place through DLPack
(any strides with a unit last-dim stride: q.transpose(1, 2) of a [b, h, s, d] tensor costs no
copy); outputs are fresh contiguous tensors.
"""

import math
from typing import List, Optional, Tuple, Union

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised where torch is missing
    raise ImportError("ioattn.torch needs PyTorch (pip install torch); the rest of ioattn "
                      "works without it") from e

from . import _C
from ._args import Options, call_backward, check_bool, check_int, check_ndim, fail, type_name

__all__ = ["AttentionFunction", "attention", "attention_fp8", "attention_varlen"]

Tensor = torch.Tensor


# ---- running the extension ---------------------------------------------------------------

def _detach(x: Optional[Tensor]) -> Optional[Tensor]:
    # DLPack refuses tensors that require grad; the op's autograd formula owns the graph. (A
    # tensor without grad goes as it is: detach() makes a new tensor object per call.)
    return None if x is None else (x.detach() if x.requires_grad else x)


def _stream(x: Tensor) -> int:
    """PyTorch's current CUDA stream for x's device as an integer (0 for CPU tensors)."""
    if x.device.type == "cuda":
        return int(torch.cuda.current_stream(x.device).cuda_stream)
    return 0


class _DeviceGuard:
    """Makes x's CUDA device current while the extension launches kernels (no-op on CPU)."""

    def __init__(self, x: Tensor) -> None:
        self.guard = torch.cuda.device(x.device) if x.device.type == "cuda" else None

    def __enter__(self) -> None:
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.guard is not None:
            self.guard.__exit__(*exc)


def _check_tensor(name: str, x: object, optional: bool = False) -> None:
    if x is None and optional:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ioattn: argument '{name}' must be a torch.Tensor, got {type_name(x)}")


def _head_vector(x: object, q: Tensor, name: str) -> Optional[Tensor]:
    """ALiBi slopes / sink logits: lists become float32 tensors on q's device."""
    if isinstance(x, (list, tuple)):
        return torch.tensor(x, dtype=torch.float32, device=q.device)
    _check_tensor(name, x, optional=True)
    return x  # type: ignore[return-value]


# ---- ioattn::attention -------------------------------------------------------------------

@torch.library.custom_op("ioattn::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, window_left: int,
                  window_right: int, softcap: float, scale: float,
                  alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], backend: str,
                  num_threads: int, deterministic: bool) -> Tuple[Tensor, Tensor]:
    check_ndim("q", tuple(q.shape), 4)
    check_ndim("v", tuple(v.shape), 4)
    b, sq, hq, _ = q.shape
    out = torch.empty((b, sq, hq, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    with _DeviceGuard(q):
        _C.forward(_detach(q), _detach(k), _detach(v), out, lse, scale=scale, causal=causal,
                   window_left=window_left, window_right=window_right, softcap=softcap,
                   alibi_slopes=_detach(alibi_slopes), sinks=_detach(sinks), backend=backend,
                   stream=_stream(q), num_threads=num_threads)
    return out, lse


@_attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, causal: bool, window_left: int,
                    window_right: int, softcap: float, scale: float,
                    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], backend: str,
                    num_threads: int, deterministic: bool) -> Tuple[Tensor, Tensor]:
    check_ndim("q", tuple(q.shape), 4)
    check_ndim("v", tuple(v.shape), 4)
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[3]))
    lse = q.new_empty((b, hq, sq), dtype=torch.float32)
    return out, lse


# ---- ioattn::attention_varlen ------------------------------------------------------------

@torch.library.custom_op("ioattn::attention_varlen", mutates_args=())
def _attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool, window_left: int, window_right: int, softcap: float,
                         scale: float, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                         backend: str, num_threads: int,
                         deterministic: bool) -> Tuple[Tensor, Tensor]:
    check_ndim("q", tuple(q.shape), 3)
    check_ndim("v", tuple(v.shape), 3)
    total_q, hq, _ = q.shape
    # Rows past cu_seqlens_q[-1] belong to no sequence and are not written by the kernel.
    out = torch.zeros((total_q, hq, v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
    with _DeviceGuard(q):
        _C.forward_varlen(_detach(q), _detach(k), _detach(v), out, lse, _detach(cu_seqlens_q),
                          _detach(cu_seqlens_k), max_seqlen_q, max_seqlen_k, scale=scale,
                          causal=causal, window_left=window_left, window_right=window_right,
                          softcap=softcap, alibi_slopes=_detach(alibi_slopes),
                          sinks=_detach(sinks), backend=backend, stream=_stream(q),
                          num_threads=num_threads)
    return out, lse


@_attention_varlen_op.register_fake
def _attention_varlen_fake(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool, window_left: int, window_right: int, softcap: float,
                           scale: float, alibi_slopes: Optional[Tensor],
                           sinks: Optional[Tensor], backend: str, num_threads: int,
                           deterministic: bool) -> Tuple[Tensor, Tensor]:
    check_ndim("q", tuple(q.shape), 3)
    check_ndim("v", tuple(v.shape), 3)
    total_q, hq, _ = q.shape
    out = q.new_empty((total_q, hq, v.shape[2]))
    lse = q.new_empty((hq, total_q), dtype=torch.float32)
    return out, lse


# ---- backward ops ------------------------------------------------------------------------
#
# The backward is an op of its own (with a fake implementation) so that AOTAutograd can trace
# the backward graph of a compiled model too. It returns dsinks always (zeros [0] without sinks):
# custom ops cannot return an optional tensor.

def _grad_out(g: Tensor) -> Tensor:
    # autograd may hand in an expanded gradient (stride 0 everywhere, e.g. from out.sum());
    # the C++ API needs a unit stride on the last dim.
    return g if g.stride(-1) == 1 or g.shape[-1] <= 1 else g.contiguous()


@torch.library.custom_op("ioattn::attention_backward", mutates_args=())
def _attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                           lse: Tensor, causal: bool, window_left: int, window_right: int,
                           softcap: float, scale: float, alibi_slopes: Optional[Tensor],
                           sinks: Optional[Tensor], backend: str, num_threads: int,
                           deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    hq = q.shape[-2]
    dsinks = torch.zeros((hq if sinks is not None else 0,), dtype=torch.float32, device=q.device)
    with _DeviceGuard(q):
        call_backward(_C.backward, _detach(q), _detach(k), _detach(v), _detach(out),
                      _detach(_grad_out(dout)), _detach(lse), dq, dk, dv,
                      dsinks if sinks is not None else None, scale=scale, causal=causal,
                      window_left=window_left, window_right=window_right, softcap=softcap,
                      alibi_slopes=_detach(alibi_slopes), sinks=_detach(sinks), backend=backend,
                      stream=_stream(q), num_threads=num_threads, deterministic=deterministic)
    return dq, dk, dv, dsinks


@_attention_backward_op.register_fake
def _attention_backward_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, causal: bool, window_left: int, window_right: int,
                             softcap: float, scale: float, alibi_slopes: Optional[Tensor],
                             sinks: Optional[Tensor], backend: str, num_threads: int,
                             deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    hq = q.shape[-2]
    dsinks = q.new_empty((hq if sinks is not None else 0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


@torch.library.custom_op("ioattn::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                  lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                  max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                  window_left: int, window_right: int, softcap: float,
                                  scale: float, alibi_slopes: Optional[Tensor],
                                  sinks: Optional[Tensor], backend: str, num_threads: int,
                                  deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # Rows past the last sequence belong to none: their gradient is 0.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hq = q.shape[-2]
    dsinks = torch.zeros((hq if sinks is not None else 0,), dtype=torch.float32, device=q.device)
    with _DeviceGuard(q):
        call_backward(_C.backward_varlen, _detach(q), _detach(k), _detach(v), _detach(out),
                      _detach(_grad_out(dout)), _detach(lse), dq, dk, dv,
                      dsinks if sinks is not None else None, _detach(cu_seqlens_q),
                      _detach(cu_seqlens_k), max_seqlen_q, max_seqlen_k, scale=scale,
                      causal=causal, window_left=window_left, window_right=window_right,
                      softcap=softcap, alibi_slopes=_detach(alibi_slopes), sinks=_detach(sinks),
                      backend=backend, stream=_stream(q), num_threads=num_threads,
                      deterministic=deterministic)
    return dq, dk, dv, dsinks


@_attention_varlen_backward_op.register_fake
def _attention_varlen_backward_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                    lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                                    window_left: int, window_right: int, softcap: float,
                                    scale: float, alibi_slopes: Optional[Tensor],
                                    sinks: Optional[Tensor], backend: str, num_threads: int,
                                    deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    hq = q.shape[-2]
    dsinks = q.new_empty((hq if sinks is not None else 0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


# ---- autograd ----------------------------------------------------------------------------
#
# The forward saves what a FlashAttention backward needs: q, k, v, out, lse and the scalar
# arguments (no n x n matrix). LSE is an output for callers (e.g. merging partial attention
# states) but not differentiable.

# Forward-op arguments after q, k, v (after cu_seqlens and max_seqlens for varlen).
_PARAM_NAMES = ("causal", "window_left", "window_right", "softcap", "scale", "alibi_slopes",
                "sinks", "backend", "num_threads", "deterministic")


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = inputs[3:]
    ctx.sinks_grad = inputs[3 + _PARAM_NAMES.index("sinks")] is not None
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):  # type: ignore[no-untyped-def]
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.ioattn.attention_backward(grad_out, q, k, v, out, lse,
                                                             *ctx.params)
    grads = [None] * len(_PARAM_NAMES)
    if ctx.sinks_grad:
        grads[_PARAM_NAMES.index("sinks")] = dsinks
    return (dq, dk, dv, *grads)


def _setup_context_varlen(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cu_q, cu_k = inputs[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_seqlens = inputs[5:7]
    ctx.params = inputs[7:]
    ctx.sinks_grad = inputs[7 + _PARAM_NAMES.index("sinks")] is not None
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):  # type: ignore[no-untyped-def]
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.ioattn.attention_varlen_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, *ctx.params)
    grads = [None] * len(_PARAM_NAMES)
    if ctx.sinks_grad:
        grads[_PARAM_NAMES.index("sinks")] = dsinks
    return (dq, dk, dv, None, None, None, None, *grads)


torch.library.register_autograd("ioattn::attention", _backward, setup_context=_setup_context)
torch.library.register_autograd("ioattn::attention_varlen", _backward_varlen,
                                setup_context=_setup_context_varlen)


class AttentionFunction(torch.autograd.Function):
    """ioattn attention as a torch.autograd.Function (the op above, with the same backward).

    AttentionFunction.apply(q, k, v, causal, window_left, window_right, softcap, scale,
                            alibi_slopes, sinks, backend, num_threads, deterministic)
    -> (out, lse), with scale 0.0 meaning 1/sqrt(head_dim). Prefer ioattn.torch.attention().
    """

    @staticmethod
    def forward(q, k, v, causal, window_left, window_right, softcap, scale,  # type: ignore[override]
                alibi_slopes, sinks, backend, num_threads, deterministic):
        return torch.ops.ioattn.attention(q, k, v, causal, window_left, window_right, softcap,
                                          scale, alibi_slopes, sinks, backend, num_threads,
                                          deterministic)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        return _backward(ctx, grad_out, grad_lse)


# ---- public functions --------------------------------------------------------------------

def _deterministic(flag: Optional[bool]) -> object:
    """None: torch's global switch (torch.use_deterministic_algorithms); else the caller's value
    (checked as a bool by Options)."""
    return torch.are_deterministic_algorithms_enabled() if flag is None else flag


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
              scale: Optional[float] = None,
              alibi_slopes: Optional[Union[Tensor, List[float]]] = None,
              sinks: Optional[Union[Tensor, List[float]]] = None, return_lse: bool = False,
              backend: str = "auto", num_threads: int = 0,
              deterministic: Optional[bool] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """ioattn.attention for torch tensors ([batch, seqlen, heads, head_dim]) through the custom
    op torch.ops.ioattn.attention: differentiable in q, k, v (and sinks), traceable by
    torch.compile. See ioattn.attention for the arguments; deterministic=True asks the backward
    for bitwise-reproducible accumulation, and None (the default) follows
    torch.use_deterministic_algorithms (torch.are_deterministic_algorithms_enabled())."""
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    opt = Options(causal, window, softcap, scale, backend, num_threads, _deterministic(deterministic))
    return_lse = check_bool("return_lse", return_lse)
    out, lse = torch.ops.ioattn.attention(
        q, k, v, opt.causal, opt.window_left, opt.window_right, opt.softcap, opt.scale,
        _head_vector(alibi_slopes, q, "alibi_slopes"), _head_vector(sinks, q, "sinks"),
        opt.backend, opt.num_threads, opt.deterministic)
    return (out, lse) if return_lse else out


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int = 0, max_seqlen_k: int = 0, *,
                     causal: bool = False, window: Tuple[int, int] = (-1, -1),
                     softcap: float = 0.0, scale: Optional[float] = None,
                     alibi_slopes: Optional[Union[Tensor, List[float]]] = None,
                     sinks: Optional[Union[Tensor, List[float]]] = None,
                     return_lse: bool = False, backend: str = "auto", num_threads: int = 0,
                     deterministic: Optional[bool] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """ioattn.attention_varlen for torch tensors (packed [total, heads, head_dim], int32
    cu_seqlens on q's device) through torch.ops.ioattn.attention_varlen; deterministic as for
    attention."""
    _check_tensor("q", q)
    _check_tensor("k", k)
    _check_tensor("v", v)
    _check_tensor("cu_seqlens_q", cu_seqlens_q)
    _check_tensor("cu_seqlens_k", cu_seqlens_k)
    opt = Options(causal, window, softcap, scale, backend, num_threads, _deterministic(deterministic))
    return_lse = check_bool("return_lse", return_lse)
    out, lse = torch.ops.ioattn.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, check_int("max_seqlen_q", max_seqlen_q),
        check_int("max_seqlen_k", max_seqlen_k), opt.causal, opt.window_left, opt.window_right,
        opt.softcap, opt.scale, _head_vector(alibi_slopes, q, "alibi_slopes"),
        _head_vector(sinks, q, "sinks"), opt.backend, opt.num_threads, opt.deterministic)
    return (out, lse) if return_lse else out


def _descale(x: object, q: Tensor, name: str) -> Optional[Tensor]:
    """A descale [batch, heads_kv]: nested lists become a float32 tensor on q's device."""
    if isinstance(x, (list, tuple)):
        return torch.tensor(x, dtype=torch.float32, device=q.device)
    _check_tensor(name, x, optional=True)
    return _detach(x)  # type: ignore[arg-type]


def attention_fp8(q: Tensor, k: Tensor, v: Tensor, *, q_descale: object = None,
                  k_descale: object = None, v_descale: object = None,
                  out_dtype: object = "bfloat16", cu_seqlens_q: Optional[Tensor] = None,
                  cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0,
                  max_seqlen_k: int = 0, causal: bool = False,
                  window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  scale: Optional[float] = None,
                  alibi_slopes: Optional[Union[Tensor, List[float]]] = None,
                  sinks: Optional[Union[Tensor, List[float]]] = None, return_lse: bool = False,
                  backend: str = "auto", num_threads: int = 0) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """ioattn.attention_fp8 for torch.float8_e4m3fn tensors (uint8 tensors are read as e4m3
    codes): forward only, no autograd. out_dtype "bfloat16" / "float16" (or the torch dtype)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
        if x.dtype not in (getattr(torch, "float8_e4m3fn", None), torch.uint8):
            fail(f"{name}.dtype", "torch.float8_e4m3fn (or uint8 codes)", str(x.dtype))
    out_t = None
    for name, t in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        if isinstance(out_dtype, (str, torch.dtype)) and out_dtype in (name, t):
            out_t = t
    if out_t is None:
        fail("out_dtype", "'bfloat16' or 'float16'", repr(out_dtype))
    opt = Options(causal, window, softcap, scale, backend, num_threads)
    return_lse = check_bool("return_lse", return_lse)
    codes = [_detach(x).view(torch.uint8) for x in (q, k, v)]  # type: ignore[union-attr]
    common = dict(alibi_slopes=_detach(_head_vector(alibi_slopes, q, "alibi_slopes")),
                  sinks=_detach(_head_vector(sinks, q, "sinks")), stream=_stream(q), u8_is_e4m3=True,
                  q_descale=_descale(q_descale, q, "q_descale"), k_descale=_descale(k_descale, q, "k_descale"),
                  v_descale=_descale(v_descale, q, "v_descale"), **opt.kwargs())
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    check_ndim("q", tuple(q.shape), 3 if varlen else 4)
    check_ndim("v", tuple(v.shape), 3 if varlen else 4)
    with _DeviceGuard(q):
        if varlen:
            _check_tensor("cu_seqlens_q", cu_seqlens_q)
            _check_tensor("cu_seqlens_k", cu_seqlens_k)
            total_q, hq, _ = q.shape
            out = torch.zeros((total_q, hq, v.shape[2]), dtype=out_t, device=q.device)
            lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
            _C.forward_varlen(*codes, out, lse, _detach(cu_seqlens_q), _detach(cu_seqlens_k),
                              check_int("max_seqlen_q", max_seqlen_q), check_int("max_seqlen_k", max_seqlen_k),
                              **common)
        else:
            b, sq, hq, _ = q.shape
            out = torch.empty((b, sq, hq, v.shape[3]), dtype=out_t, device=q.device)
            lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
            _C.forward(*codes, out, lse, **common)
    return (out, lse) if return_lse else out
