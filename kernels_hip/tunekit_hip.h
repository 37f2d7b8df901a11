// tunekit_hip.h: the portability layer of kernels_hip.
//
// The .hip files are real HIP C++. This header lets the same text build with
//   * hipcc / hipRTC for AMD (ROCm 5.x+, DCU gfx9 wave64, RDNA wave32), and
//   * NVRTC (or nvcc) for NVIDIA, where no system header is reachable.
// It therefore includes nothing on NVIDIA and defines its own fixed-width
// types (tk_u16 ...), instead of relying on <stdint.h> or hip_bf16.h (ROCm 5.x
// has no hip_bf16.h; cuda_bf16.h is not shipped with the NVRTC wheel).
//
// What it maps (the only intrinsics the kernels use):
//   tk_shfl_xor(v, lane_mask, width)  __shfl_xor / __shfl_xor_sync(full mask)
//   tk_load_nt(p)                     __builtin_nontemporal_load / __ldcs (ld.global.cs)
//   tk_fma(a, b, c)                   a single-rounding FMA on both vendors
//   tk_bf16_lo/hi, tk_f32_to_bf16     explicit bf16 <-> fp32 (round to nearest even)
//   tk_mma_bf16_16x8x16(c, a.., b..)  NVIDIA only: one warp-wide mma.sync m16n8k16
//   TK_DEVICE, TK_ALIGN(n), TK_AMD / TK_NV
// The wave size is never assumed here: kernels pass it (their WAVE define).
// Under hipRTC and NVRTC the sources reach the compiler with this header
// inlined (tunekit.rtc does it), so no include path is needed there.
#ifndef TUNEKIT_HIP_H
#define TUNEKIT_HIP_H

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__) || defined(__AMDGCN__)
#define TK_AMD 1
// hipRTC pre-defines the HIP device API and can include only headers handed
// to it, so the runtime header is included for hipcc alone.
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TK_NV 1
#else
#error "tunekit_hip.h: compile with hipcc/hipRTC (AMD) or NVRTC/nvcc (NVIDIA)"
#endif

typedef unsigned short tk_u16;
typedef unsigned int tk_u32;
typedef long long tk_i64;
typedef unsigned long long tk_u64;

#if defined(TK_AMD)
#define TK_DEVICE __device__ inline __attribute__((always_inline))
#define TK_ALIGN(n) __attribute__((aligned(n)))
// Clang extended vectors: plain dereference gives global_load_dwordx4/x2,
// and __builtin_nontemporal_load accepts them (it rejects HIP's uint4 class).
typedef tk_u32 tk_u32x4 __attribute__((ext_vector_type(4)));
typedef tk_u32 tk_u32x2 __attribute__((ext_vector_type(2)));
#define TK_DEFAULT_WAVE 64
#else
#define TK_DEVICE __device__ __forceinline__
#define TK_ALIGN(n) __align__(n)
typedef uint4 tk_u32x4;
typedef uint2 tk_u32x2;
#define TK_DEFAULT_WAVE 32
#endif

// ---------------------------------------------------------------- cross-lane
// Butterfly exchange with the lane `lane_mask` away, inside groups of `width`
// lanes (width <= the hardware wave). On NVIDIA every lane of the warp must
// call it (full mask): kernels keep all lanes alive through their reductions.
TK_DEVICE float tk_shfl_xor(float v, int lane_mask, int width) {
#if defined(TK_AMD)
    return __shfl_xor(v, lane_mask, width);
#else
    return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
#endif
}

// ------------------------------------------------------------ global loads
// Streaming (read-once) loads: bypass/evict-first in the caches so the
// weights do not push x and the output out of L2.
#if defined(TK_AMD)
TK_DEVICE tk_u32x4 tk_load_nt(const tk_u32x4* p) { return __builtin_nontemporal_load(p); }
TK_DEVICE tk_u32x2 tk_load_nt(const tk_u32x2* p) { return __builtin_nontemporal_load(p); }
TK_DEVICE tk_u32 tk_load_nt(const tk_u32* p) { return __builtin_nontemporal_load(p); }
TK_DEVICE tk_u16 tk_load_nt(const tk_u16* p) { return __builtin_nontemporal_load(p); }
#else
TK_DEVICE tk_u32x4 tk_load_nt(const tk_u32x4* p) { return __ldcs(p); }
TK_DEVICE tk_u32x2 tk_load_nt(const tk_u32x2* p) { return __ldcs(p); }
TK_DEVICE tk_u32 tk_load_nt(const tk_u32* p) { return __ldcs(p); }
TK_DEVICE tk_u16 tk_load_nt(const tk_u16* p) { return __ldcs(p); }
#endif

// --------------------------------------------------------------- arithmetic
TK_DEVICE float tk_fma(float a, float b, float c) {
#if defined(TK_AMD)
    return __builtin_fmaf(a, b, c);
#else
    return __fmaf_rn(a, b, c);
#endif
}

// ------------------------------------------------------------ tensor cores
// NVIDIA sm_80+: D = A . B + C with A 16x16 (row-major), B 16x8 (column-major),
// bf16 inputs and fp32 accumulation, one warp-wide mma.sync. Fragment layout
// (PTX ISA, "mma.m16n8k16"), lane = 4*g + t:
//   a0: A[g][2t..2t+1]  a1: A[g+8][2t..2t+1]  a2: A[g][2t+8..2t+9]  a3: A[g+8][2t+8..2t+9]
//   b0: B[2t..2t+1][g]  b1: B[2t+8..2t+9][g]
//   c:  C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]
// (each 32-bit a/b word: the lower k in the low half). All 32 lanes must
// execute it. The g++ CPU tests of kernels_hip supply their own warp-level
// version (TK_HOST_MMA), since they have no tensor cores to call.
#if defined(TK_NV) && !defined(TK_HOST_MMA)
TK_DEVICE void tk_mma_bf16_16x8x16(float (&c)[4], tk_u32 a0, tk_u32 a1, tk_u32 a2, tk_u32 a3, tk_u32 b0,
                                   tk_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

// ---------------------------------------------------------------- bf16
// A bf16 is the high half of an fp32, so widening is a shift. Two bf16 packed
// in one 32-bit word (element k in the low half, k+1 in the high half, as
// little-endian memory lays them out) widen without any unpacking.
TK_DEVICE float tk_bf16_to_f32(tk_u16 h) { return __uint_as_float(((tk_u32)h) << 16); }
TK_DEVICE float tk_bf16_lo(tk_u32 w) { return __uint_as_float(w << 16); }
TK_DEVICE float tk_bf16_hi(tk_u32 w) { return __uint_as_float(w & 0xffff0000u); }

// fp32 -> bf16, round to nearest, ties to even; NaN stays a (quiet) NaN and
// +-inf stay infinite (0x7f800000 + 0x7fff does not carry into the exponent).
TK_DEVICE tk_u16 tk_f32_to_bf16(float f) {
    tk_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (tk_u16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (tk_u16)(u >> 16);
}

#endif  // TUNEKIT_HIP_H
