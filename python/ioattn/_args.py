"""Checks of the plain Python arguments (flags, numbers, strings) shared by ioattn and ioattn.torch.

Tensors are checked once, in C++ (src/core/api.cpp); this module only makes sure the scalars
have the right Python type (TypeError otherwise) before they reach the extension, and raises
ioattn.Error (a ValueError) in the C++ message format for the few values Python decides itself.
"""

import math
import numbers
from typing import NoReturn, Tuple

from ._C import Error

BACKENDS = ("auto", "flash", "naive")


def fail(arg: str, expected: str, got: str) -> NoReturn:
    """Raises ioattn.Error worded like the C++ validation: argument, expected, got."""
    err = Error(f"ioattn: argument '{arg}': expected {expected}, got {got}")
    err.argument = arg
    raise err


def type_name(x: object) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_bool(name: str, x: object) -> bool:
    # numpy.bool_ is not a subclass of bool, but is exactly a bool for this purpose.
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return bool(x)
    raise TypeError(f"ioattn: argument '{name}' must be a bool, got {type_name(x)}")


def check_int(name: str, x: object) -> int:
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    raise TypeError(f"ioattn: argument '{name}' must be an int, got {type_name(x)}")


def check_float(name: str, x: object) -> float:
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    raise TypeError(f"ioattn: argument '{name}' must be a float, got {type_name(x)}")


def check_window(window: object) -> Tuple[int, int]:
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            "ioattn: argument 'window' must be a pair (left, right) of ints (-1 = unbounded), "
            f"got {window!r}")
    return check_int("window[0]", window[0]), check_int("window[1]", window[1])


def check_scale(scale: object) -> float:
    """None -> 0.0, which the C++ API reads as 1/sqrt(head_dim)."""
    if scale is None:
        return 0.0
    s = check_float("scale", scale)
    if s == 0.0 or not math.isfinite(s):
        fail("scale", "a finite non-zero number, or None for 1/sqrt(head_dim)", repr(scale))
    return s


def check_backend(backend: object) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"ioattn: argument 'backend' must be a str, got {type_name(backend)}")
    if backend not in BACKENDS:
        fail("backend", "'auto', 'flash' or 'naive'", repr(backend))
    return backend


def check_ndim(name: str, shape: Tuple[int, ...], ndim: int) -> None:
    """Python allocates outputs from q's and v's shapes, so their rank is checked here first."""
    if len(shape) != ndim:
        dims = ", ".join(str(int(s)) for s in shape)
        fail(name, f"{ndim} dims", f"{len(shape)} dims [{dims}]")


def call_backward(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Calls _C.backward / backward_varlen. A build whose backward is not implemented for the
    case at hand rejects the operation itself (ioattn.Error with argument 'backward'): that is
    NotImplementedError, not a bad argument."""
    try:
        return fn(*args, **kwargs)
    except Error as e:
        if getattr(e, "argument", None) == "backward":
            raise NotImplementedError(
                f"{e} (this build of the ioattn C++ library has no backward for this case; the "
                "forward works, e.g. under torch.no_grad() or on detached inputs)") from e
        raise


class Options:
    """The scalar arguments of attention(), checked once."""

    __slots__ = ("causal", "window_left", "window_right", "softcap", "scale", "backend",
                 "num_threads", "deterministic")

    def __init__(self, causal: object, window: object, softcap: object, scale: object,
                 backend: object, num_threads: object, deterministic: object = False) -> None:
        self.causal = check_bool("causal", causal)
        self.window_left, self.window_right = check_window(window)
        self.softcap = check_float("softcap", softcap)
        self.scale = check_scale(scale)
        self.backend = check_backend(backend)
        self.num_threads = check_int("num_threads", num_threads)
        self.deterministic = check_bool("deterministic", deterministic)

    def kwargs(self) -> dict:
        """Keyword arguments for ioattn._C.forward / forward_varlen / select_forward."""
        return dict(scale=self.scale, causal=self.causal, window_left=self.window_left,
                    window_right=self.window_right, softcap=self.softcap, backend=self.backend,
                    num_threads=self.num_threads)

