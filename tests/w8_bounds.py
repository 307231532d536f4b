"""Error bounds and target names for the 8-bit-weight tests, on the platform this run targets
(8 CPU devices: the host backend; JAX_NVCOMM_TEST_GPU=1: the CUDA kernels, and XLA's GPU dots
where a test compares with lax).

Every product of a 16-bit activation and an 8-bit weight is exact in float32 (at most 8 + 8
significant bits); with a scale, w * s rounds once (the host; the CUDA kernel applies a
channel scale to the finished sum, a block scale to each 128-deep partial sum: one rounding
either way). A float32 sum of K terms, in any order or tree, is within (K - 1) u sum|term| of
the exact sum, u the relative error of one addition:
- host backend (C++ float arithmetic, round to nearest): u = 2^-24;
- GPU (mma.sync / wgmma with float32 accumulation, and XLA's GPU dots): the tensor cores add
  the exact products into the float32 accumulator with truncation, not round to nearest
  (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS
  2021): u = 2^-23.
The bounds below charge (terms + 2) u sum|term|: the sum, the scale's rounding and one spare
operation (split-K partial sums, a block's promotion).

silu(x) = x / (1 + exp(-x)) in float32: the host's std::exp is within an ulp; the CUDA
kernel's __expf within 2 + 1.16 |x| ulps (CUDA C Programming Guide, intrinsic functions);
the division and the add round once each.
"""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

ON_GPU = jax.devices()[0].platform == "gpu"
PLATFORM = "cuda" if ON_GPU else "cpu"
SUM_UNIT = 2.0 ** -23 if ON_GPU else 2.0 ** -24
F32_UNIT = 2.0 ** -24
_OURS = re.compile(r"custom_call @(nvc_\w+)")


def unit(dtype):
    """Unit roundoff of a float dtype (one round-to-nearest conversion into it)."""
    return float(ml_dtypes.finfo(np.dtype(jnp.dtype(dtype))).eps) / 2


def ours(text):
    """Our custom calls in a lowered program, by op name: "nvc_ragged_dot_w8" (host) and
    "nvc_cuda_ragged_dot_w8[_nograph]" (CUDA) both read "ragged_dot_w8"; a host target in a
    GPU run (or the reverse) keeps its prefix and so matches no op name."""
    prefix = "nvc_cuda_" if ON_GPU else "nvc_"
    out = []
    for t in _OURS.findall(text):
        out.append(t[len(prefix):].removesuffix("_nograph") if t.startswith(prefix) else t)
    return out


def sum_bound(mag, terms):
    """Error of a float32 sum of `terms` products whose absolute values sum to `mag`."""
    return (terms + 2) * SUM_UNIT * np.asarray(mag)


def rounded(err, ref, dtype):
    """`err` after one more rounding of the value (about `ref`) to `dtype`."""
    return err + unit(dtype) * (np.abs(ref) + err)


def silu_units(a):
    """Relative error of silu(a) * b in float32, in units of F32_UNIT: exp (an ulp is two
    units), then the add, the division and the product with b, one rounding each."""
    exp_ulps = 2 + 1.16 * np.abs(a) if ON_GPU else 1
    return 2 * exp_ulps + 3


def swiglu_bound(a, b, ea, eb):
    """Error of silu(a') * b' in float32 where |a' - a| <= ea, |b' - b| <= eb (|silu'| <= 1.1)."""
    s = a / (1 + np.exp(-a))
    return (1.1 * ea * (np.abs(b) + eb) + np.abs(s) * eb +
            silu_units(a) * F32_UNIT * np.abs(s * b))
