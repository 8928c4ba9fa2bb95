"""ioattn._C: nanobind bindings of the ioattn C++ API (use the `ioattn` package).

Hand-written from `python -m nanobind.stubgen -m ioattn._C`, with arrays typed as `Array`:
the functions take any DLPack producer or buffer (numpy, torch, JAX, CuPy), not only numpy.
"""

from collections.abc import Sequence
from typing import Any

Array = Any  # numpy.ndarray | torch.Tensor | jax.Array | cupy.ndarray | any DLPack producer

__version__: str

class Error(ValueError):
    """An argument the ioattn C++ API rejected. A ValueError; `.argument` names the argument."""

    argument: str

def forward(q: Array, k: Array, v: Array, o: Array, lse: Array | None, *, scale: float = 0.0,
            causal: bool = False, window_left: int = -1, window_right: int = -1,
            softcap: float = 0.0, alibi_slopes: Array | None = None, sinks: Array | None = None,
            backend: str = "auto", stream: int = 0, num_threads: int = 0,
            u16_is_bf16: bool = False, q_descale: Array | None = None,
            k_descale: Array | None = None, v_descale: Array | None = None,
            u8_is_e4m3: bool = False) -> tuple[str, str]:
    """Runs ioattn::forward on q, k, v [b, s, h, d], writing o [b, sq, hq, dv] and (unless
    None) lse [b, hq, sq] float32. stream is a cudaStream_t as an integer (0 = default). With
    u16_is_bf16, uint16 arrays are read as bfloat16 bit patterns; with u8_is_e4m3, uint8 q / k /
    v as float8_e4m3fn codes (the fp8 forward: o bfloat16 or float16, descales float32
    [batch, heads_kv] or None). Returns (kernel, reason)."""

def forward_varlen(q: Array, k: Array, v: Array, o: Array, lse: Array | None,
                   cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int = 0,
                   max_seqlen_k: int = 0, *, scale: float = 0.0, causal: bool = False,
                   window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: Array | None = None, sinks: Array | None = None,
                   backend: str = "auto", stream: int = 0, num_threads: int = 0,
                   u16_is_bf16: bool = False, q_descale: Array | None = None,
                   k_descale: Array | None = None, v_descale: Array | None = None,
                   u8_is_e4m3: bool = False) -> tuple[str, str]:
    """Runs ioattn::forward_varlen on packed q [total_q, hq, d], k, v [total_k, hkv, d] with
    int32 cu_seqlens [batch + 1], writing o [total_q, hq, dv] and (unless None) lse
    [hq, total_q]. u8_is_e4m3 and the descales as for forward. Returns (kernel, reason)."""

def backward(q: Array, k: Array, v: Array, o: Array, dout: Array, lse: Array, dq: Array,
             dk: Array, dv: Array, dsinks: Array | None, *, scale: float = 0.0,
             causal: bool = False, window_left: int = -1, window_right: int = -1,
             softcap: float = 0.0, alibi_slopes: Array | None = None, sinks: Array | None = None,
             backend: str = "auto", stream: int = 0, num_threads: int = 0,
             deterministic: bool = False, u16_is_bf16: bool = False) -> tuple[str, str]:
    """Runs ioattn::backward: from the forward's q, k, v, o, lse and dout (shape of o), writes
    dq, dk, dv (shapes of q, k, v) and, unless None, dsinks float32 [heads_q] (needs sinks).
    Returns (kernel, reason)."""

def backward_varlen(q: Array, k: Array, v: Array, o: Array, dout: Array, lse: Array, dq: Array,
                    dk: Array, dv: Array, dsinks: Array | None, cu_seqlens_q: Array,
                    cu_seqlens_k: Array, max_seqlen_q: int = 0, max_seqlen_k: int = 0, *,
                    scale: float = 0.0, causal: bool = False, window_left: int = -1,
                    window_right: int = -1, softcap: float = 0.0,
                    alibi_slopes: Array | None = None, sinks: Array | None = None,
                    backend: str = "auto", stream: int = 0, num_threads: int = 0,
                    deterministic: bool = False, u16_is_bf16: bool = False) -> tuple[str, str]:
    """Runs ioattn::backward_varlen on packed tensors (lse [heads_q, total_q]).
    Returns (kernel, reason)."""

def select_forward(q: Array, k: Array, v: Array, *, scale: float = 0.0, causal: bool = False,
                   window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: Array | None = None, sinks: Array | None = None,
                   backend: str = "auto", stream: int = 0, num_threads: int = 0,
                   u16_is_bf16: bool = False) -> tuple[str, str]:
    """Validates like forward() and returns (kernel, reason) for the kernel it would run."""

def decode(q: Array, k_cache: Array, v_cache: Array, cache_seqlens: Array, o: Array,
           lse: Array | None, *, block_table: Array | None = None, k_scale: Array | None = None,
           v_scale: Array | None = None, scale: float = 0.0, causal: bool = False,
           window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
           alibi_slopes: Array | None = None, sinks: Array | None = None, num_splits: int = 0,
           stream: int = 0, num_threads: int = 0, u16_is_bf16: bool = False,
           u8_is_e4m3: bool = False, k_new: Array | None = None,
           v_new: Array | None = None) -> tuple[str, str]:
    """Runs ioattn::decode against a paged (block_table) or contiguous KV cache; writes o and
    (unless None) lse; k_new / v_new are appended first. Returns (kernel, reason)."""

class DecodePlan:
    """Split counts and work partition fixed for one batch shape (ioattn::DecodePlan)."""
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    seqlen_q: int
    max_seqlen_k: int
    page_size: int
    num_splits: int
    workspace_bytes: int
    device: str

def plan_decode(batch: int, heads_q: int, heads_kv: int, head_dim: int, head_dim_v: int,
                seqlen_q: int, max_seqlen_k: int, page_size: int, device: str,
                device_index: int = 0, num_splits: int = 0, cache_dtype: str = "bf16") -> DecodePlan:
    """Runs ioattn::plan_decode and returns the DecodePlan."""

def decode_planned(q: Array, k_cache: Array, v_cache: Array, cache_seqlens: Array, o: Array,
                   lse: Array | None, plan: DecodePlan, workspace: Array, *,
                   block_table: Array | None = None, k_scale: Array | None = None,
                   v_scale: Array | None = None, scale: float = 0.0, causal: bool = False,
                   window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: Array | None = None, sinks: Array | None = None, stream: int = 0,
                   num_threads: int = 0, u16_is_bf16: bool = False,
                   u8_is_e4m3: bool = False, k_new: Array | None = None,
                   v_new: Array | None = None) -> tuple[str, str]:
    """Runs ioattn::decode under a plan with a caller-owned workspace (no allocation)."""

def append_kv(k_new: Array, v_new: Array, slot_mapping: Array, k_cache: Array, v_cache: Array, *,
              k_scale: Array | None = None, v_scale: Array | None = None, stream: int = 0,
              u16_is_bf16: bool = False, u8_is_e4m3: bool = False) -> tuple[str, str]:
    """Runs ioattn::append_kv (negative slots skipped). Returns (kernel, reason)."""

def merge_states(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array, o_out: Array, lse_out: Array,
                 *, stream: int = 0, u16_is_bf16: bool = False) -> tuple[str, str]:
    """Runs ioattn::merge_states (the outputs may alias an input). Returns (kernel, reason)."""

def build_info() -> dict[str, Any]:
    """What this build contains (ioattn::BuildInfo) as a dict."""

def explain(*, seqlen: int = 8192, head_dim: int = 128, heads: int = 64, layers: int = 80,
            dtype_bytes: int = 2, naive_passes: int = 4, bandwidth_Bps: float = 3e12,
            flops_per_s: float = 500e12, attention_share: float = 0.0,
            kernel_speedup: float = 1.0) -> dict[str, float]:
    """The memory-traffic arithmetic (ioattn::explain) as a dict of ExplainReport fields."""

def explain_text(*, seqlen: int = 8192, head_dim: int = 128, heads: int = 64, layers: int = 80,
                 dtype_bytes: int = 2, naive_passes: int = 4, bandwidth_Bps: float = 3e12,
                 flops_per_s: float = 500e12, attention_share: float = 0.0,
                 kernel_speedup: float = 1.0) -> str:
    """The same arithmetic as the text `ioattn explain` prints."""

def online_softmax_example(scores: Sequence[float], values: Sequence[float],
                           block_size: int) -> dict[str, Any]:
    """The online softmax over key blocks, step by step (ioattn::online_softmax_example)."""
