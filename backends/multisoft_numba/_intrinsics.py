"""What numba's Python cannot say, written as LLVM IR through numba's intrinsic API:
vector loads and stores (up to 16 bytes per access), float16 bit conversions, a
two-instruction exponential, and (compute capability 8.0 and newer) a NaN-propagating max, of
floats and of two 16-bit values in a word at once, and two-at-a-time rounding to float16 /
bfloat16, one instruction each.

numba reads arrays one element at a time; a row of float32 then costs an address
computation and a load per element, which made the kernels instruction-bound. One
16-byte access moves 4 float32 or 8 16-bit values. Under the CUDA simulator the same
functions are plain Python.
"""

import functools

import numpy

from ._launch import SIMULATOR

LOG2E = 1.4426950408889634

if SIMULATOR:
    @functools.cache
    def vector_access(words):
        """(load(array, i, dst), store(array, i, src)): words [i * words, (i + 1) * words) of a
        1-D array to or from dst[0:words] / src[0:words] (local arrays of the array's dtype)."""
        def load(array, i, dst):
            for j in range(words):
                dst[j] = array[i * words + j]

        def store(array, i, src):
            for j in range(words):
                array[i * words + j] = src[j]

        return load, store

    def half_bits_to_float(bits):
        """The float32 value of the float16 whose bits are the low 16 bits of `bits`."""
        return numpy.float32(numpy.uint16(int(bits) & 0xFFFF).view(numpy.float16))

    def float_to_half_bits(v):
        """v rounded to float16 (to nearest even), its bits in the low half of an int32."""
        with numpy.errstate(all="ignore"):
            return numpy.int32(numpy.float16(numpy.float32(v)).view(numpy.uint16))

    def fast_exp(v):
        """exp(v) in float32 (numpy's: Python's math raises where the GPU gives inf)."""
        with numpy.errstate(all="ignore"):
            return numpy.exp(numpy.float32(v))

    def fast_exp2(v):
        """2**v in float32."""
        with numpy.errstate(all="ignore"):
            return numpy.exp2(numpy.float32(v))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _F32 = ir.FloatType()

    def _asm(result, operands, text, constraints):
        return ir.InlineAsm(ir.FunctionType(result, operands), text, constraints)

    def _vector_pointer(context, builder, array_type, array, index_type, index, words):
        """Pointer to words [index * words, ...) of a 1-D contiguous array, typed as a vector."""
        data = context.make_array(array_type)(context, builder, value=array).data
        first = builder.mul(context.cast(builder, index, index_type, types.uint64), ir.Constant(_I64, words))
        vector = ir.VectorType(context.get_value_type(array_type.dtype), words)
        alignment = words * context.get_abi_sizeof(vector.element)
        return builder.bitcast(builder.gep(data, [first]), vector.as_pointer()), vector, alignment

    def _local_slot(context, builder, local_type, local, j):
        data = context.make_array(local_type)(context, builder, value=local).data
        return builder.gep(data, [ir.Constant(_I64, j)])

    @functools.cache
    def vector_access(words):
        """(load(array, i, dst), store(array, i, src)): words [i * words, (i + 1) * words) of a
        1-D array to or from dst[0:words] / src[0:words] (local arrays of the array's dtype),
        as one access. The caller guarantees that the array's data is aligned to words x the
        word size (the host checks it before choosing `words`)."""

        @intrinsic
        def load(typingctx, array, index, dst):
            def codegen(context, builder, sig, args):
                pointer, _, alignment = _vector_pointer(context, builder, sig.args[0], args[0],
                                                        sig.args[1], args[1], words)
                loaded = builder.load(pointer, align=alignment)
                for j in range(words):
                    builder.store(builder.extract_element(loaded, ir.Constant(_I32, j)),
                                  _local_slot(context, builder, sig.args[2], args[2], j))
                return context.get_dummy_value()
            return types.none(array, index, dst), codegen

        @intrinsic
        def store(typingctx, array, index, src):
            def codegen(context, builder, sig, args):
                pointer, vector, alignment = _vector_pointer(context, builder, sig.args[0], args[0],
                                                             sig.args[1], args[1], words)
                value = ir.Constant(vector, ir.Undefined)
                for j in range(words):
                    word = builder.load(_local_slot(context, builder, sig.args[2], args[2], j))
                    value = builder.insert_element(value, word, ir.Constant(_I32, j))
                builder.store(value, pointer, align=alignment)
                return context.get_dummy_value()
            return types.none(array, index, src), codegen

        return load, store

    @intrinsic
    def half_bits_to_float(typingctx, bits):
        """The float32 value of the float16 whose bits are the low 16 bits of `bits` (exact)."""
        def codegen(context, builder, sig, args):
            half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
            return builder.fpext(half, ir.FloatType())
        return types.float32(bits), codegen

    @intrinsic
    def float_to_half_bits(typingctx, v):
        """v rounded to float16 (to nearest even), its bits in the low half of an int32."""
        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.float32)
            half = builder.fptrunc(value, ir.HalfType())
            return builder.zext(builder.bitcast(half, ir.IntType(16)), _I32)
        return types.int32(v), codegen

    def _ex2(context, builder, sig, args, factor=None):
        """ex2.approx.ftz of the float32 args[0], times `factor` first if given."""
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        if factor is not None:
            value = builder.fmul(value, ir.Constant(_F32, factor))
        return builder.call(_asm(_F32, [_F32], "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [value])

    @intrinsic
    def fast_exp(typingctx, v):
        """exp(v) as ex2.approx.ftz(v * log2(e)): two instructions, within 2 ulp, results below
        2**-126 flushed to zero. libdevice's __expf without flush-to-zero (numba's default)
        adds a denormal range fix-up of three more instructions per element."""
        def codegen(context, builder, sig, args):
            return _ex2(context, builder, sig, args, LOG2E)
        return types.float32(v), codegen

    @intrinsic
    def fast_exp2(typingctx, v):
        """2**v as one ex2.approx.ftz (fast_exp without its multiply by log2(e))."""
        return types.float32(v), _ex2

    def _max_pairs(instruction):
        @intrinsic
        def max_pairs(typingctx, a, b):
            def codegen(context, builder, sig, args):
                return builder.call(_asm(_I32, [_I32, _I32], f"{instruction} $0, $1, $2;", "=r,r,r"), args)
            return types.int32(types.int32, types.int32), codegen
        return max_pairs

    # The larger 16-bit value of each half of two words, NaN where either is NaN (sm_80 and newer).
    max_pairs_bf16 = _max_pairs("max.NaN.bf16x2")
    max_pairs_f16 = _max_pairs("max.NaN.f16x2")

    @intrinsic
    def max_propagating_nan(typingctx, a, b):
        """max(a, b), NaN if either is NaN (max.NaN.f32: sm_80 and newer)."""
        def codegen(context, builder, sig, args):
            return builder.call(_asm(_F32, [_F32, _F32], "max.NaN.f32 $0, $1, $2;", "=f,f,f"), args)
        return types.float32(types.float32, types.float32), codegen

    def _pack_two(instruction):
        @intrinsic
        def pack(typingctx, low, high):
            def codegen(context, builder, sig, args):
                # cvt.rn.*x2.f32 d, a, b puts a in the upper half.
                return builder.call(_asm(_I32, [_F32, _F32], f"{instruction} $0, $1, $2;", "=r,f,f"),
                                    [args[1], args[0]])
            return types.int32(types.float32, types.float32), codegen
        return pack

    pack_bf16x2 = _pack_two("cvt.rn.bf16x2.f32")   # sm_80 and newer
    pack_f16x2 = _pack_two("cvt.rn.f16x2.f32")     # sm_80 and newer
