// silu_and_mul.hip: y[M, D] = silu(x[:, :D]) * x[:, D:] for x [M, 2D] (the SwiGLU activation).
// BF16 in and out (uint16 bits), FP32 math, silu(a) = a / (1 + expf(-a)) as vLLM.
//
// No reduction: a block covers THREADS * VEC * UNROLL columns of ROWS_PER_BLOCK rows;
// for each row a thread first issues its UNROLL vector loads of a and of b (in flight
// together), then computes and stores. At M = 1 a row is split over
// ceil(D / (THREADS * VEC * UNROLL)) blocks.
//
// Numerics: VLLM_ROUNDING=1 rounds silu(a) to BF16 before the multiply, as vLLM's csrc
// act_and_mul_kernel (ACT_FN returns scalar_t) and eager F.silu(a) * b; 0: one rounding.
//
//   tunekit_silu_and_mul(x, y, M, D, stride_xm, stride_ym)
//     grid = (ceil(D / (THREADS * VEC * UNROLL)), ceil(M / ROWS_PER_BLOCK)), block = THREADS.
// Misaligned rows (or D % VEC != 0) take scalar loads and stores (uniform per launch).
#include "tunekit_hip.h"

// ---------------------------------------------------------------- tunables
#ifndef WAVE
#define WAVE TK_DEFAULT_WAVE  // lanes per wave/warp (only checked here: no cross-lane operation)
#endif
#ifndef THREADS
#define THREADS 256  // threads per block
#endif
#ifndef VEC
#define VEC 8  // bf16 per load: 1, 2, 4 or 8 (2- to 16-byte loads)
#endif
#ifndef UNROLL
#define UNROLL 1  // vectors per thread per row (independent loads in flight)
#endif
#ifndef ROWS_PER_BLOCK
#define ROWS_PER_BLOCK 1  // rows per block (the block's columns, repeated)
#endif
#ifndef VLLM_ROUNDING
#define VLLM_ROUNDING 1
#endif

#define TK_COLS_PER_BLOCK (THREADS * VEC * UNROLL)

#if VEC == 8
typedef tk_u32x4 tk_vec_t;
#elif VEC == 4
typedef tk_u32x2 tk_vec_t;
#elif VEC == 2
typedef tk_u32 tk_vec_t;
#elif VEC != 1
#error "silu_and_mul.hip: VEC must be 1, 2, 4 or 8 (bf16 elements per load)"
#endif
#if WAVE != 32 && WAVE != 64
#error "silu_and_mul.hip: WAVE must be 32 or 64"
#endif
#if defined(TK_NV) && WAVE != 32
#error "silu_and_mul.hip: NVIDIA warps have 32 lanes (WAVE=32)"
#endif
static_assert(THREADS >= 1 && THREADS <= 1024 && THREADS % WAVE == 0, "THREADS must be whole waves, <= 1024");
static_assert(UNROLL >= 1 && UNROLL <= 16, "UNROLL must be 1..16");
static_assert(ROWS_PER_BLOCK >= 1, "ROWS_PER_BLOCK must be >= 1");

#if VEC > 1
union tk_vec_words {
    tk_vec_t v;
    tk_u32 w[VEC / 2];
};
#endif

TK_DEVICE float tk_round(float f) { return tk_bf16_to_f32(tk_f32_to_bf16(f)); }

// v[j] = p[e + j] as fp32 (0 at or past n); one vector load when aligned and whole.
TK_DEVICE void tk_load(float (&v)[VEC], const tk_u16* __restrict__ p, tk_i64 e, tk_i64 n, bool vec_ok) {
#if VEC > 1
    if (vec_ok && e + VEC <= n) {
        tk_vec_words u;
        u.v = *reinterpret_cast<const tk_vec_t*>(p + e);
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) {
            v[2 * j] = tk_bf16_lo(u.w[j]);
            v[2 * j + 1] = tk_bf16_hi(u.w[j]);
        }
        return;
    }
#endif
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = e + j < n ? tk_bf16_to_f32(p[e + j]) : 0.0f;
}

TK_DEVICE void tk_store(tk_u16* __restrict__ p, tk_i64 e, tk_i64 n, const tk_u16 (&h)[VEC], bool vec_ok) {
#if VEC > 1
    if (vec_ok && e + VEC <= n) {
        tk_vec_words u;
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) u.w[j] = (tk_u32)h[2 * j] | ((tk_u32)h[2 * j + 1] << 16);
        *reinterpret_cast<tk_vec_t*>(p + e) = u.v;
        return;
    }
#endif
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        if (e + j < n) p[e + j] = h[j];
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
tunekit_silu_and_mul(const tk_u16* __restrict__ x, tk_u16* __restrict__ y, tk_i64 M, tk_i64 D, tk_i64 stride_xm,
                     tk_i64 stride_ym) {
    const int tid = (int)threadIdx.x;
    const bool vec_ok = ((tk_u64)x % (2 * VEC)) == 0 && ((tk_u64)y % (2 * VEC)) == 0 && stride_xm % VEC == 0 &&
                        stride_ym % VEC == 0 && D % VEC == 0;
    const tk_i64 col0 = (tk_i64)blockIdx.x * TK_COLS_PER_BLOCK;
    for (int rr = 0; rr < ROWS_PER_BLOCK; ++rr) {  // not unrolled: rows share no registers
        const tk_i64 row = (tk_i64)blockIdx.y * ROWS_PER_BLOCK + rr;
        if (row >= M) return;
        const tk_u16* a = x + row * stride_xm;
        const tk_u16* b = a + D;
        float av[UNROLL][VEC];
        float bv[UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const tk_i64 e = col0 + ((tk_i64)u * THREADS + tid) * VEC;
            tk_load(av[u], a, e, D, vec_ok);
            tk_load(bv[u], b, e, D, vec_ok);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const tk_i64 e = col0 + ((tk_i64)u * THREADS + tid) * VEC;
            tk_u16 h[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float act = av[u][j] / (1.0f + expf(-av[u][j]));
#if VLLM_ROUNDING
                act = tk_round(act);
#endif
                h[j] = tk_f32_to_bf16(act * bv[u][j]);
            }
            tk_store(y + row * stride_ym, e, D, h, vec_ok);
        }
    }
}
