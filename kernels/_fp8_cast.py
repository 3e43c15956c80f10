"""fp32 -> float8_e4m3fn inside a kernel, exact under the Triton interpreter too.

On a GPU `x.to(tl.float8e4nv)` is one rounding instruction (round to nearest even). Triton
3.5's interpreter gets the values that round *up across a power of two* wrong: 124..128
becomes 64 instead of 128 (the mantissa carry is lost), in every binade. Under the
interpreter the value is therefore first rounded to e4m3's grid in fp32 arithmetic, after
which the conversion is exact: Veltkamp's split (multiply by 2**20 + 1) keeps the 4
significant bits of a normal e4m3 number, and adding and subtracting 1.5 * 2**14 rounds a
subnormal (|x| < 2**-6) to its spacing of 2**-9. Only the tests' path pays for it.
"""

import triton
import triton.language as tl


@triton.jit
def to_e4m3(x, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):
    """`x` fp32, already within ±448, as `out_ty` (tl.float8e4nv)."""
    if INTERPRETED:
        # On the magnitude, so that a tiny negative value rounds to -0 as the cast does.
        a = tl.abs(x)
        c = a * 1048577.0  # 2**20 + 1: hi keeps 24 - 20 = 4 significant bits
        normal = c - (c - a)
        subnormal = (a + 24576.0) - 24576.0  # 1.5 * 2**14: an ulp of 2**-9
        rounded = tl.where(a < 0.015625, subnormal, normal)
        x = tl.where(x < 0, -rounded, rounded)
    return x.to(out_ty)
