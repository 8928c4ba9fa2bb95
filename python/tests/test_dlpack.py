"""Arrays from other frameworks: any DLPack producer on the CPU, JAX, CuPy (where installed)."""

import numpy as np
import pytest

import ioattn
from _reference import BF16, attention_ref, max_err


class Producer:
    """A minimal foreign array: only the DLPack protocol, shape and dtype (like a framework
    ioattn has never heard of)."""

    def __init__(self, a):
        self._a = a
        self.shape = a.shape
        self.dtype = a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def data(dtype=np.float32, b=2, sq=11, sk=13, hq=4, hkv=2, d=16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def test_generic_dlpack_producer_on_cpu():
    q, k, v = data()
    o, lse = ioattn.attention(Producer(q), Producer(k), Producer(v), causal=True,
                              return_lse=True)
    assert type(o) is np.ndarray and type(lse) is np.ndarray  # CPU outputs come back in numpy
    o_ref, lse_ref = attention_ref(q, k, v, causal=True)
    assert max_err(o, o_ref) < 1e-5 and max_err(lse, lse_ref) < 1e-4
    kernel = ioattn.select(Producer(q), Producer(k), Producer(v))["kernel"]
    assert kernel.startswith("cpu/")


def test_mixed_numpy_and_producer():
    q, k, v = data(dtype=np.float16)
    o = ioattn.attention(q, Producer(k), v)
    assert o.dtype == np.float16
    assert max_err(o, attention_ref(q, k, v)[0]) < 2e-3


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes not installed")
def test_numpy_bfloat16_via_ml_dtypes():
    q, k, v = data(dtype=BF16)
    o, lse = ioattn.attention(q, k, v, return_lse=True)
    assert o.dtype == BF16
    assert max_err(o, attention_ref(q, k, v)[0]) < 2e-2
    # a uint16 array is not silently taken as bfloat16
    with pytest.raises(ValueError, match=r"q\.dtype"):
        ioattn.attention(q.view(np.uint16), k.view(np.uint16), v.view(np.uint16))


def test_jax_arrays():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    q, k, v = data()
    # Host arrays (on a GPU machine JAX defaults to the GPU, which ioattn takes via torch/CuPy).
    with jax.default_device(jax.devices("cpu")[0]):
        o, lse = ioattn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                                  return_lse=True)
    o_ref, lse_ref = attention_ref(q, k, v, causal=True)
    assert max_err(np.asarray(o), o_ref) < 1e-5 and max_err(np.asarray(lse), lse_ref) < 1e-4
    if BF16 is not None:  # JAX bfloat16 arrives through DLPack's bfloat code
        with jax.default_device(jax.devices("cpu")[0]):
            qb, kb, vb = (jnp.asarray(x, dtype=jnp.bfloat16) for x in (q, k, v))
            o = ioattn.attention(qb, kb, vb, causal=True)
        assert o.dtype == BF16
        want = attention_ref(np.asarray(qb), np.asarray(kb), np.asarray(vb), causal=True)[0]
        assert max_err(o, want) < 2e-2


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() == 0 or not ioattn.info()["cuda_compiled"]:
        pytest.skip("no CUDA device or a CPU-only build")
    q, k, v = data(dtype=np.float16)
    o, lse = ioattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True,
                              return_lse=True)
    assert isinstance(o, cupy.ndarray)
    o_ref, _ = attention_ref(q, k, v, causal=True)
    assert max_err(cupy.asnumpy(o), o_ref) < 2e-3
