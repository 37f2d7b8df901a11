// bias_gelu.hip: y[M, N] = gelu_tanh(x[M, N] + b[N]), BF16 in and out (uint16 bits), FP32 math.
// gelu_tanh(v) = 0.5 v (1 + tanh(c (v + 0.044715 v^3))) computed as
// v / (1 + expf(-2c (v + 0.044715 v^3))): the same function without the cancellation
// of 1 + tanh for negative v (as kernels_triton/bias_gelu.py).
//
// No built-in model runs bias + GELU; the op is tuned through ad-hoc problems.
// Work split as silu_and_mul.hip: a block covers THREADS * VEC * UNROLL columns of
// ROWS_PER_BLOCK rows; the bias vectors are loaded once per block.
//
// Numerics: VLLM_ROUNDING=1 rounds v = x + b to BF16 before the GELU, as eager
// F.gelu(x + b, approximate="tanh") (a BF16 add; vLLM has no kernel for it); 0: fp32.
//
//   tunekit_bias_gelu(x, b, y, M, N, stride_xm, stride_ym)
//     grid = (ceil(N / (THREADS * VEC * UNROLL)), ceil(M / ROWS_PER_BLOCK)), block = THREADS.
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
#error "bias_gelu.hip: VEC must be 1, 2, 4 or 8 (bf16 elements per load)"
#endif
#if WAVE != 32 && WAVE != 64
#error "bias_gelu.hip: WAVE must be 32 or 64"
#endif
#if defined(TK_NV) && WAVE != 32
#error "bias_gelu.hip: NVIDIA warps have 32 lanes (WAVE=32)"
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

#define TK_GELU_2C 1.5957691216057308f  // 2 * sqrt(2 / pi)
#define TK_GELU_A 0.044715f

extern "C" __global__ void __launch_bounds__(THREADS)
tunekit_bias_gelu(const tk_u16* __restrict__ x, const tk_u16* __restrict__ b, tk_u16* __restrict__ y, tk_i64 M,
                  tk_i64 N, tk_i64 stride_xm, tk_i64 stride_ym) {
    const int tid = (int)threadIdx.x;
    const bool vec_ok = ((tk_u64)x % (2 * VEC)) == 0 && ((tk_u64)y % (2 * VEC)) == 0 &&
                        ((tk_u64)b % (2 * VEC)) == 0 && stride_xm % VEC == 0 && stride_ym % VEC == 0;
    const tk_i64 col0 = (tk_i64)blockIdx.x * TK_COLS_PER_BLOCK;
    float bv[UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) tk_load(bv[u], b, col0 + ((tk_i64)u * THREADS + tid) * VEC, N, vec_ok);
    for (int rr = 0; rr < ROWS_PER_BLOCK; ++rr) {  // not unrolled: rows share no registers
        const tk_i64 row = (tk_i64)blockIdx.y * ROWS_PER_BLOCK + rr;
        if (row >= M) return;
        const tk_u16* xr = x + row * stride_xm;
        float xv[UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) tk_load(xv[u], xr, col0 + ((tk_i64)u * THREADS + tid) * VEC, N, vec_ok);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const tk_i64 e = col0 + ((tk_i64)u * THREADS + tid) * VEC;
            tk_u16 h[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                float v = xv[u][j] + bv[u][j];
#if VLLM_ROUNDING
                v = tk_round(v);
#endif
                h[j] = tk_f32_to_bf16(v / (1.0f + expf(-TK_GELU_2C * (v + TK_GELU_A * v * v * v))));
            }
            tk_store(y + row * stride_ym, e, N, h, vec_ok);
        }
    }
}
