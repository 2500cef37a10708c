"""One-token matrix-vector products on the packed blocks of engine/cpu/layout.py, int16 activations, numba.

numba alone leaves the integer dot products in scalar int64 arithmetic or gathers across groups (about 40% of
llama.cpp's speed a core, shared/reference/cpu-kernels.md); here each 32-value group of a row is one vector step:
the quants are widened to 16 bits, multiplied with the activation's int16 values and summed in pairs (on x86 with
AVX2 `vpmaddwd`; elsewhere plain vector code that LLVM lowers for the host, NEON included), the 8 lanes become
floats and one multiply-add per group adds them, scaled, into a float accumulator that is summed once per row.
The weight stream is prefetched PREFETCH_BYTES ahead: this host's hardware prefetcher stops following rows longer
than about 2 KB.

The CPU backend rounds the activation to int16 per 32 values (a step of 1/32767 of the group's largest value), not
to int8 as llama.cpp's CPU kernels do: int8 (`vpmaddubsw`) ran 10-25% faster here but moved SmolLM2's logits by up to
2% of their range (0.67 of 34), enough to change greedy answers; int16 moves them by about 1e-4 of it. The experts
the GPU backend keeps in RAM take int8 activations, as its own kernels do: on a CPU with VNNI (AVX-512 VNNI or
AVX-VNNI) one `vpdpbusd` multiplies a group's 32 unsigned quants by its 32 int8 values and sums them in fours, on
AVX2 alone `vpmaddubsw` and a `vpmaddwd` by ones do (but for IQ4's levels, which would overflow its int16 pairs);
elsewhere int8 values are widened to int16 and take the int16 path. The kernels see which from the activation's
dtype. Measured and not kept: 2 or 4 rows a pass sharing each activation load (no faster on one Zen 5 core, where
the loop is bound by its vector instructions, not by loads).

The row kernels sit in this file with the vector code they inline: numba's cache is keyed on the source file of
a kernel, so a change here recompiles them.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.cpu.ops import glu
from engine.quants_iq import IQ4NL_VALUES

PREFETCH_BYTES = 4096

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
# Reordered and fused float steps, but NaN and inf kept: a damaged model's NaN must reach the logits.
_FAST = ("reassoc", "contract")
# STRATA_CPU_PORTABLE=1 compiles the plain vector code on x86 too (tests/test_cpu_kernels.py checks it there), without
# numba's cache, which does not know this switch.
_PORTABLE = os.environ.get("STRATA_CPU_PORTABLE") == "1"
_FEATURES = binding.get_host_cpu_features()
_AVX2 = bool(_FEATURES.get("avx2")) and not _PORTABLE
_VNNI = bool(_FEATURES.get("avxvnni") or (_FEATURES.get("avx512vnni") and _FEATURES.get("avx512vl"))) and not _PORTABLE


def _vec(t, n):
    return ir.VectorType(t, n)


def _const(t, values):
    return ir.Constant(_vec(t, len(values)), list(values))


def _function(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load(builder, base, offset, n):
    pointer = builder.bitcast(builder.gep(base, [offset]), _vec(_I8, n).as_pointer())
    return builder.load(pointer, align=1)


def _prefetch(builder, base, offset):
    pointer = builder.gep(base, [builder.add(offset, _I64(PREFETCH_BYTES))])
    prefetch = _function(builder, "llvm.prefetch.p0i8", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
    builder.call(prefetch, [pointer, _I32(0), _I32(3), _I32(1)])


def _shuffle(builder, a, b, indices):
    return builder.shuffle_vector(a, b, _const(_I32, list(indices)))


def _concat(builder, a, b):
    return _shuffle(builder, a, b, range(a.type.count + b.type.count))


def _pair_sums(builder, w, x):
    """<16 x i16> w times <16 x i16> x, summed in pairs: <8 x i32>."""
    if _AVX2:
        return builder.call(_function(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2), [w, x])
    p = builder.mul(builder.sext(w, _vec(_I32, 16)), builder.sext(x, _vec(_I32, 16)))
    return builder.add(_shuffle(builder, p, p, range(0, 16, 2)), _shuffle(builder, p, p, range(1, 16, 2)))


def _halves(builder, w, x, signed):
    """<32 x i8> quants w (signed or not) times <32 x i16> x: (values 0-15, values 16-31), each <8 x i32>."""
    wide = (builder.sext if signed else builder.zext)(w, _vec(_I16, 32))
    return tuple(_pair_sums(builder, _shuffle(builder, wide, wide, range(h, h + 16)), _shuffle(builder, x, x, range(h, h + 16)))
                 for h in (0, 16))


def _nibbles(builder, lo):
    """16 bytes -> <32 x u8>: the low nibbles are values 0-15, the high ones 16-31."""
    return _concat(builder, builder.and_(lo, _const(_I8, [15] * 16)), builder.lshr(lo, _const(_I8, [4] * 16)))


def _bit_values(builder, hi, value):
    """4 bytes, bit i of their little-endian word a bit of value i -> <32 x u8> of 0 or `value` (that bit's)."""
    spread = _shuffle(builder, hi, hi, [i // 8 for i in range(32)])
    bits = builder.and_(spread, _const(_I8, [1 << (i % 8) for i in range(32)]))
    return builder.select(builder.icmp_unsigned("!=", bits, _const(_I8, [0] * 32)),
                          _const(_I8, [value] * 32), _const(_I8, [0] * 32))


def _two_bit_values(builder, b):
    """8 bytes, bits 2s..2s+1 of byte t two bits of value t + 8 s -> <32 x u8> of those two bits."""
    parts = [builder.lshr(b, _const(_I8, [2 * s] * 8)) for s in range(4)]
    spread = _concat(builder, _concat(builder, parts[0], parts[1]), _concat(builder, parts[2], parts[3]))
    return builder.and_(spread, _const(_I8, [3] * 32))


def _splat(builder, value, n=8):
    """<n x float> holding the float `value` in every lane."""
    v = builder.insert_element(ir.Constant(_vec(_F32, 1), None), value, _I32(0))
    return _shuffle(builder, v, v, [0] * n)


# family: (bytes a group in lo, bytes a group in hi, signed quants).
FAMILIES = {"nibble": (16, 0, False), "nibble5": (16, 4, False), "q8": (32, 0, True), "iq4": (16, 0, False), "q2k": (16, 0, False),
            "nibble_k": (16, 0, False), "nibble5_k": (16, 4, False), "q6k": (16, 8, False), "q3k": (8, 4, False)}
K_FAMILIES = ("nibble_k", "nibble5_k", "q6k", "q3k", "iq4", "q2k")
# What the families with a signed scale store their quants plus (the IQ4 levels read plus 128).
STORED_PLUS = {"q6k": 32.0, "q3k": 4.0, "iq4": 128.0}
# IQ4_XS's 16 levels (engine/quants_iq.py IQ4NL_VALUES) plus 128: what a nibble of the "iq4" family stands for.
_IQ4_LEVELS = [int(v) + 128 for v in IQ4NL_VALUES]


def _group_quants(builder, family, lo_p, hi_p, group):
    """A group's 32 quants, <32 x i8> (signed for "q8", else unsigned)."""
    lo_bytes, hi_bytes, signed = FAMILIES[family]
    lo_at = builder.mul(group, _I64(lo_bytes))
    _prefetch(builder, lo_p, lo_at)
    lo = _load(builder, lo_p, lo_at, lo_bytes)
    if signed:
        return lo
    hi = _load(builder, hi_p, builder.mul(group, _I64(hi_bytes)), hi_bytes) if hi_bytes else None
    if family == "q3k":  # two low bits a value as q6k keeps its top ones, and the third bit a bit a value
        return builder.or_(_two_bit_values(builder, lo), _bit_values(builder, hi, 4))
    u = _nibbles(builder, lo)
    if family == "iq4":
        return _levels(builder, u)
    if hi_bytes == 4:
        u = builder.or_(u, _bit_values(builder, hi, 16))
    elif hi_bytes:
        u = builder.or_(u, builder.shl(_two_bit_values(builder, hi), _const(_I8, [4] * 32)))
    return u


def _levels(builder, index):
    """<32 x u8> nibbles -> the IQ4 levels they pick (plus 128): one byte shuffle on x86, a select per level
    elsewhere."""
    if _AVX2:
        table = _const(_I8, [v - 256 if v > 127 else v for v in _IQ4_LEVELS] * 2)  # each 128-bit lane its own copy
        shuffle = _function(builder, "llvm.x86.avx2.pshuf.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
        return builder.call(shuffle, [table, index])
    out = _const(_I8, [0] * 32)
    for i, level in enumerate(_IQ4_LEVELS):
        out = builder.select(builder.icmp_unsigned("==", index, _const(_I8, [i] * 32)), _const(_I8, [level] * 32), out)
    return out


def _quad_sums(builder, u, x):
    """<32 x u8> quants times <32 x i8> values, summed in fours: lanes 0-3 cover values 0-15, lanes 4-7 values
    16-31. With VNNI one vpdpbusd; on AVX2 alone vpmaddubsw (pairs, into int16: a quant below 128 times a value of
    at most 127 in size cannot saturate them, which quad_sums_fit says per family) then vpmaddwd by ones."""
    if _VNNI:
        words = [builder.bitcast(v, _vec(_I32, 8)) for v in (u, x)]
        dot = _function(builder, "llvm.x86.avx512.vpdpbusd.256", _vec(_I32, 8), [_vec(_I32, 8)] * 3)
        return builder.call(dot, [ir.Constant(_vec(_I32, 8), [0] * 8), *words])
    pairs = builder.call(_function(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2), [u, x])
    return _pair_sums(builder, pairs, _const(_I16, [1] * 16))


def quad_sums_fit(family: str) -> bool:
    """Whether int8 activations take _quad_sums for this family here: unsigned quants on a CPU with VNNI, or below
    128 on one with AVX2 (the IQ4 levels are stored plus 128, up to 241: two such products overflow int16)."""
    if FAMILIES[family][2]:
        return False
    return _VNNI or (_AVX2 and family != "iq4")


def _floats(builder, base, index, n):
    """<n x float> from base[index]."""
    return builder.load(builder.bitcast(builder.gep(base, [index]), _vec(_F32, n).as_pointer()), align=4)


def _add_group(builder, family, lo_p, hi_p, x_p, group, b, scales, total, x_bits):
    """total + group `group`'s (activation group b's) integer sums, each half times its float scale; the
    activation's values are int8 or int16 (x_bits)."""
    x_type = _I8 if x_bits == 8 else _I16
    x = builder.load(builder.bitcast(builder.gep(x_p, [builder.mul(b, _I64(4 * x_bits))]), _vec(x_type, 32).as_pointer()),
                     align=1)
    quants, signed = _group_quants(builder, family, lo_p, hi_p, group), FAMILIES[family][2]
    if x_bits == 8 and quad_sums_fit(family):
        sums = builder.sitofp(_quad_sums(builder, quants, x), _vec(_F32, 8))
        pair = builder.insert_element(_splat(builder, scales[0], 2), scales[-1], _I32(1))  # one scale, or a half's
        scale = _shuffle(builder, pair, pair, [0] * 4 + [1] * 4)
        return builder.fadd(total, builder.fmul(sums, scale, flags=_FAST), flags=_FAST)
    if x_bits == 8:
        x = builder.sext(x, _vec(_I16, 32))
    first, second = _halves(builder, quants, x, signed)
    parts = [(builder.add(first, second), scales[0])] if len(scales) == 1 else [(first, scales[0]), (second, scales[1])]
    for sums, scale in parts:
        scaled = builder.fmul(builder.sitofp(sums, _vec(_F32, 8)), _splat(builder, scale), flags=_FAST)
        total = builder.fadd(total, scaled, flags=_FAST)
    return total


def _reduce(builder, v):
    n = v.type.count
    reduce = _function(builder, f"llvm.vector.reduce.fadd.v{n}f32", _F32, [_F32, _vec(_F32, n)])
    return builder.call(reduce, [_F32(0.0), v], fastmath=_FAST)


def _row_codegen(family):
    """Groups with a float32 scale each (nibble, q8), times the activation's, a group at a time."""

    def codegen(context, builder, sig, args):
        lo_p, hi_p, d_p, x_p, dx_p = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args[:5], args[:5]))
        d_p = builder.bitcast(d_p, _F32.as_pointer())  # family_rows compiles every family's branch for any planes
        row, groups, x_bits = args[5], args[6], sig.args[3].dtype.bitwidth
        acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 8), [0.0] * 8))
        x_p = builder.bitcast(x_p, _I8.as_pointer())
        with cgutils.for_range(builder, groups) as loop:
            b = loop.index
            group = builder.add(builder.mul(row, groups), b)
            d = builder.fmul(builder.load(builder.gep(d_p, [group])), builder.load(builder.gep(dx_p, [b])), flags=_FAST)
            builder.store(_add_group(builder, family, lo_p, hi_p, x_p, group, b, [d], builder.load(acc), x_bits), acc)
        return _reduce(builder, builder.load(acc))

    return codegen


def _k_row_codegen(family):
    """The K-quants, a super-block of 8 groups at a time: their 8-bit scales (and mins) become float vectors there,
    times the super-block's float32 scale and the activation's, and their offsets are summed in the same pass. (An
    integer-to-float step and two loads in every group's step made that loop 25% slower on one Zen core, bound by
    its instructions.)"""
    int8_halves, iq4, q2k = family in ("q6k", "q3k"), family == "iq4", family == "q2k"  # an int8 scale a half
    halves = int8_halves or q2k  # a scale (and a min) for each 16 values

    def codegen(context, builder, sig, args):
        lo_p, hi_p, d_p, sup_p, x_p, dx_p, xs_p = (context.make_array(t)(context, builder, a).data
                                                   for t, a in zip(sig.args[:7], args[:7]))
        d_p, sup_p = builder.bitcast(d_p, _I8.as_pointer()), builder.bitcast(sup_p, _F32.as_pointer())
        row, groups, x_bits = args[7], args[8], sig.args[4].dtype.bitwidth
        acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 8), [0.0] * 8))
        lanes = 16 if halves else 8
        offsets = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, lanes), [0.0] * lanes))
        x_p = builder.bitcast(x_p, _I8.as_pointer())
        supers = builder.lshr(groups, _I64(3))
        with cgutils.for_range(builder, supers) as loop:
            s = loop.index
            first_b = builder.mul(s, _I64(8))
            first_group = builder.add(builder.mul(row, groups), first_b)
            bytes16 = _load(builder, d_p, builder.mul(first_group, _I64(1 if iq4 else 2)), 8 if iq4 else 16)
            dx = _floats(builder, dx_p, first_b, 8)
            sup_at = builder.add(builder.mul(row, supers), s)
            if iq4:  # a signed scale a group; offsets: scale times the group's activation sum
                scale = builder.fmul(builder.sitofp(bytes16, _vec(_F32, 8)),
                                     _splat(builder, builder.load(builder.gep(sup_p, [sup_at]))), flags=_FAST)
                offset = builder.fmul(scale, _floats(builder, xs_p, first_b, 8), flags=_FAST)
                scale = builder.fmul(scale, dx, flags=_FAST)
            elif halves:  # 16 scales, one a half group, offsets over the half group's activation sums: Q6_K's
                # scale times them, Q2_K's min (the byte's high nibble) times dmin times them
                sums = _shuffle(builder, _floats(builder, xs_p, first_b, 8),
                                _floats(builder, xs_p, builder.add(groups, first_b), 8),
                                [i // 2 + 8 * (i % 2) for i in range(16)])
                if int8_halves:
                    scale = builder.fmul(builder.sitofp(bytes16, _vec(_F32, 16)),
                                         _splat(builder, builder.load(builder.gep(sup_p, [sup_at])), 16), flags=_FAST)
                    offset = builder.fmul(scale, sums, flags=_FAST)
                else:
                    sup_d, sup_min = (builder.load(builder.gep(sup_p, [builder.add(builder.mul(sup_at, _I64(2)), _I64(i))]))
                                      for i in (0, 1))
                    low = builder.uitofp(builder.and_(bytes16, _const(_I8, [15] * 16)), _vec(_F32, 16))
                    high = builder.uitofp(builder.lshr(bytes16, _const(_I8, [4] * 16)), _vec(_F32, 16))
                    scale = builder.fmul(low, _splat(builder, sup_d, 16), flags=_FAST)
                    offset = builder.fmul(builder.fmul(high, _splat(builder, sup_min, 16), flags=_FAST), sums, flags=_FAST)
                scale = builder.fmul(scale, _shuffle(builder, dx, dx, [i // 2 for i in range(16)]), flags=_FAST)
            else:  # the group's scale and min, interleaved, times the super-block's d and dmin
                at = builder.mul(sup_at, _I64(2))
                sup_d, sup_min = (builder.load(builder.gep(sup_p, [builder.add(at, _I64(i))])) for i in (0, 1))
                six_bit = [builder.uitofp(_shuffle(builder, bytes16, bytes16, range(i, 16, 2)), _vec(_F32, 8)) for i in (0, 1)]
                scale = builder.fmul(builder.fmul(six_bit[0], _splat(builder, sup_d), flags=_FAST), dx, flags=_FAST)
                offset = builder.fmul(builder.fmul(six_bit[1], _splat(builder, sup_min), flags=_FAST),
                                      _floats(builder, xs_p, first_b, 8), flags=_FAST)
            builder.store(builder.fadd(builder.load(offsets), offset, flags=_FAST), offsets)
            total = builder.load(acc)
            for g in range(8):
                picked = [builder.extract_element(scale, _I32(g * (2 if halves else 1) + h)) for h in range(2 if halves else 1)]
                total = _add_group(builder, family, lo_p, hi_p, x_p, builder.add(first_group, _I64(g)),
                                   builder.add(first_b, _I64(g)), picked, total, x_bits)
            builder.store(total, acc)
        offset = _reduce(builder, builder.load(offsets))
        if family in STORED_PLUS:
            offset = builder.fmul(offset, _F32(STORED_PLUS[family]), flags=_FAST)
        return builder.fsub(_reduce(builder, builder.load(acc)), offset, flags=_FAST)

    return codegen


def _row_intrinsic(family):
    if family in K_FAMILIES:
        @intrinsic
        def k_row_dot(typingctx, lo, hi, d, sup, xq, dx, xs, row, groups):
            """Row `row` . x, offsets included; xs: the activation's group sums (nibble_k) or half-group sums (q6k)."""
            return types.float32(lo, hi, d, sup, xq, dx, xs, types.int64, types.int64), _k_row_codegen(family)

        return k_row_dot

    @intrinsic
    def row_dot(typingctx, lo, hi, d, xq, dx, row, groups):
        """Row `row`'s scaled group products, summed (the groups' offsets excluded)."""
        return types.float32(lo, hi, d, xq, dx, types.int64, types.int64), _row_codegen(family)

    return row_dot


_NIBBLE, _NIBBLE5, _NIBBLE_K, _NIBBLE5_K, _Q8, _Q6K, _Q3K, _IQ4, _Q2K = (
    _row_intrinsic(family) for family in ("nibble", "nibble5", "nibble_k", "nibble5_k", "q8", "q6k", "q3k", "iq4", "q2k"))


_JIT = dict(nogil=True, fastmath=set(_FAST), cache=not _PORTABLE, error_model="numpy", boundscheck=False)
_F = np.float32


@njit(**_JIT)
def quantize_activations(x, q, limit):
    """x (n, k) float32 -> per row: values into q (n, k) (int16 with limit 32767, or int8 with 127), each 32-value
    group's scale (n, groups), and the sums of each group's and each half group's values (n, groups), (n, 2, groups)
    as the integer values times the scale (what the groups' offsets multiply)."""
    n, groups = x.shape[0], x.shape[1] // 32
    scale = np.empty((n, groups), _F)
    sums = np.empty((n, groups), _F)
    halves = np.empty((n, 2, groups), _F)
    for i in range(n):
        for b in range(groups):
            top = _F(0)
            for j in range(32):
                a = abs(x[i, b * 32 + j])
                if a > top or a != a:  # a NaN stays: a NaN scale, NaN products
                    top = a
            d = top / _F(limit)
            inverse = _F(limit) / top if top > 0 else _F(0)
            h0 = np.int32(0)
            h1 = np.int32(0)
            for j in range(32):
                v = np.int32(np.rint(x[i, b * 32 + j] * inverse))
                q[i, b * 32 + j] = v
                if j < 16:
                    h0 += v
                else:
                    h1 += v
            scale[i, b] = d
            halves[i, 0, b] = d * _F(h0)
            halves[i, 1, b] = d * _F(h1)
            sums[i, b] = d * _F(h0 + h1)
    return scale, sums, halves


@njit(**_JIT)
def nibble_rows(lo, hi, d, m, xq, dx, xs, out, r0, r1):
    """out[r - r0] = row r . x for r in [r0, r1): value = d (nibble | fifth bit << 4) + m."""
    groups = dx.shape[0]
    five = hi.shape[1] > 0
    for r in range(r0, r1):
        offset = _F(0)
        for b in range(groups):
            offset += m[r, b] * xs[b]
        if five:
            out[r - r0] = _NIBBLE5(lo, hi, d, xq, dx, r, groups) + offset
        else:
            out[r - r0] = _NIBBLE(lo, hi, d, xq, dx, r, groups) + offset


@njit(**_JIT)
def nibble_k_rows(lo, hi, d, sup, xq, dx, xs, out, r0, r1):
    """value = (sup d) scale (nibble | fifth bit << 4) - (sup dmin) min, d (rows, 2 groups) a group's 6-bit scale
    and min, sup (rows, groups / 8, 2) a super-block's d and dmin."""
    groups = dx.shape[0]
    five = hi.shape[1] > 0
    for r in range(r0, r1):
        if five:
            out[r - r0] = _NIBBLE5_K(lo, hi, d, sup, xq, dx, xs, r, groups)
        else:
            out[r - r0] = _NIBBLE_K(lo, hi, d, sup, xq, dx, xs, r, groups)


@njit(**_JIT)
def q8_rows(q, d, xq, dx, out, r0, r1):
    """value = d q, q int8."""
    for r in range(r0, r1):
        out[r - r0] = _Q8(q, q, d, xq, dx, r, dx.shape[0])


@njit(**_JIT)
def q2k_rows(lo, d, sup, xq, dx, halves, out, r0, r1):
    """value = (sup d) (d & 15) q - (sup dmin) (d >> 4), d (rows, 2 groups) a byte for each 16 values, sup
    (rows, groups / 8, 2)."""
    for r in range(r0, r1):
        out[r - r0] = _Q2K(lo, lo, d, sup, xq, dx, halves, r, dx.shape[0])


@njit(**_JIT)
def iq4_rows(lo, d, sup, xq, dx, xs, out, r0, r1):
    """value = (sup d) IQ4NL_VALUES[nibble]; d (rows, groups) int8, sup (rows, groups / 8)."""
    for r in range(r0, r1):
        out[r - r0] = _IQ4(lo, lo, d, sup, xq, dx, xs, r, dx.shape[0])


@njit(**_JIT)
def q6k_rows(lo, hi, d, sup, xq, dx, halves, out, r0, r1):
    """value = sup d[half] ((nibble | two high bits << 4) - 32); d (rows, 2 groups) int8, a scale per 16 values,
    sup (rows, groups / 8) a super-block's d."""
    for r in range(r0, r1):
        out[r - r0] = _Q6K(lo, hi, d, sup, xq, dx, halves, r, dx.shape[0])


@njit(**_JIT)
def q3k_rows(lo, hi, d, sup, xq, dx, halves, out, r0, r1):
    """value = sup d[half] ((two low bits | third bit << 2) - 4); d and sup as q6k_rows'."""
    for r in range(r0, r1):
        out[r - r0] = _Q3K(lo, hi, d, sup, xq, dx, halves, r, dx.shape[0])


# Row blocks of one product run on numba's thread pool, which must take calls from any Python thread (the MCP tools
# and the HTTP endpoint answer on threads of their own): OpenMP or TBB, not numba's default workqueue.
numba.config.THREADING_LAYER = "threadsafe"

# The kernels below take a matrix as its planes (lo, hi, d, m, sup: layout.Planes.arrays()) with its family's code,
# and an activation as (q, scale, sums, half_sums): one compiled kernel serves every family.
FAMILY_CODES = {"nibble": 0, "nibble_k": 1, "q8": 2, "q6k": 3, "iq4": 4, "q2k": 5, "q3k": 6}


@njit(**_JIT)
def family_rows(family, w, x, a, out, r0, r1):
    """out[r - r0] = row r . activation row a, for r in [r0, r1)."""
    lo, hi, d, m, sup = w
    xq, dx, xs, hs = x[0][a], x[1][a], x[2][a], x[3][a]
    if family == 0:
        nibble_rows(lo, hi, d, m, xq, dx, xs, out, r0, r1)
    elif family == 1:
        nibble_k_rows(lo, hi, d, sup, xq, dx, xs, out, r0, r1)
    elif family == 2:
        q8_rows(lo, d, xq, dx, out, r0, r1)
    elif family == 3:
        q6k_rows(lo, hi, d, sup, xq, dx, hs, out, r0, r1)
    elif family == 4:
        iq4_rows(lo, d, sup, xq, dx, xs, out, r0, r1)
    elif family == 5:
        q2k_rows(lo, d, sup, xq, dx, hs, out, r0, r1)
    else:
        q3k_rows(lo, hi, d, sup, xq, dx, hs, out, r0, r1)


# A range (r0, r1, o, a) computes rows [r0, r1) of a matrix with activation row a into out[o : o + r1 - r0]: one
# range set serves a matrix split over threads and the gate/up slabs of a mixture's chosen experts; the down
# projection's ranges (mix_range) are runs of output rows over every chosen expert. Each kernel's step is a function
# of its own, which a machine without a thread-safe threading layer calls range by range.


@njit(**_JIT)
def glu_range(gate_family, gate, up_family, up, x, hidden, up_out, r, gelu):
    """hidden[o : o + n] = act(gate rows [r0, r1) . x) * (up rows . x), n = r1 - r0 (up_out: scratch)."""
    r0, r1, o, a = r[0], r[1], r[2], r[3]
    h, u = hidden[o : o + r1 - r0], up_out[o : o + r1 - r0]
    family_rows(gate_family, gate, x, a, h, r0, r1)
    family_rows(up_family, up, x, a, u, r0, r1)
    glu(h, u, gelu)


@njit(**_JIT)
def mix_range(family, w, x, ids, weights, rows_each, out, r):
    """out[r0 : r1] = sum over slots j of weights[j] (rows ids[j] rows_each + [r0, r1)) . activation row j, the slots
    summed in order."""
    r0, r1 = r[0], r[1]
    part = np.empty(r1 - r0, _F)
    out[r0:r1] = 0
    for j in range(ids.shape[0]):
        base = ids[j] * rows_each
        family_rows(family, w, x, j, part, base + r0, base + r1)
        for i in range(r1 - r0):
            out[r0 + i] += weights[j] * part[i]


@njit(parallel=True, **_JIT)
def row_ranges(family, w, x, out, ranges):
    for i in prange(ranges.shape[0]):
        r0, r1, o, a = ranges[i, 0], ranges[i, 1], ranges[i, 2], ranges[i, 3]
        family_rows(family, w, x, a, out[o : o + r1 - r0], r0, r1)


@njit(parallel=True, **_JIT)
def glu_ranges(gate_family, gate, up_family, up, x, hidden, up_out, ranges, gelu):
    for i in prange(ranges.shape[0]):
        glu_range(gate_family, gate, up_family, up, x, hidden, up_out, ranges[i], gelu)


@njit(parallel=True, **_JIT)
def mix_ranges(family, w, x, ids, weights, rows_each, out, ranges):
    for i in prange(ranges.shape[0]):
        mix_range(family, w, x, ids, weights, rows_each, out, ranges[i])
