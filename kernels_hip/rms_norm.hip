// rms_norm.hip: y[M, N] = x / rms(x) * w (GEMMA=0) or * (1 + w) (GEMMA=1),
// rms(x) = sqrt(mean(x^2) + eps) per row. BF16 in and out (uint16 bits), FP32 math.
//
// Layout: x, y row-major with unit stride along N; stride_xm, stride_ym are
// row strides in elements; w[N] contiguous. N is the compile-time N_COLS (the
// backend compiles per problem), so every loop over a row is fully unrolled.
//
// Work split: a block holds ROWS_PER_BLOCK rows, THREADS_PER_ROW threads per
// row; lane l of a row reads VEC-element vectors at (i * THREADS_PER_ROW + l)
// * VEC for i < TK_ITERS (each load instruction of a row is one contiguous
// THREADS_PER_ROW * VEC * 2-byte segment). A thread keeps its row elements in
// registers (TK_ITERS * VEC <= MAX_CACHED): x is read once. Longer rows per
// thread re-read x in the normalise pass (L1/L2 hits).
// The sum of squares: per thread in element order (fma), then an xor
// butterfly over min(THREADS_PER_ROW, WAVE) lanes, then (rows wider than a
// wave) wave totals added in wave order through shared memory: deterministic,
// never a hard-coded wave width.
//
// Numerics: VLLM_ROUNDING=1 (plain weight) rounds x * rstd to BF16 before the
// weight multiply, as vLLM's csrc rms_norm_kernel; GEMMA rounds once at the
// output (vLLM GemmaRMSNorm), as does VLLM_ROUNDING=0. All roundings are to
// nearest even (tk_f32_to_bf16).
//
//   tunekit_rms_norm(x, w, y, M, stride_xm, stride_ym, eps_bits)
//     grid = ceil(M / ROWS_PER_BLOCK), block = ROWS_PER_BLOCK * THREADS_PER_ROW;
//     eps_bits: the IEEE bits of the fp32 epsilon (every argument is 8 bytes).
// Misaligned rows (a start or stride not VEC-aligned) take scalar loads and
// stores, decided once per launch (uniform): slower, never wrong.
#include "tunekit_hip.h"

// ---------------------------------------------------------------- tunables
#ifndef WAVE
#define WAVE TK_DEFAULT_WAVE  // lanes per wave/warp: 64 on AMD gfx9/DCU, 32 on NVIDIA
#endif
#ifndef N_COLS
#define N_COLS 4096  // row length N (set by the backend)
#endif
#ifndef THREADS_PER_ROW
#define THREADS_PER_ROW 256
#endif
#ifndef ROWS_PER_BLOCK
#define ROWS_PER_BLOCK 1
#endif
#ifndef VEC
#define VEC 8  // bf16 per load: 1, 2, 4 or 8 (2- to 16-byte loads)
#endif
#ifndef GEMMA
#define GEMMA 0  // 1: y = x / rms * (1 + w) (set by the backend from the op)
#endif
#ifndef VLLM_ROUNDING
#define VLLM_ROUNDING 1  // 1: round x * rstd before * w (plain weight), as vLLM
#endif
#ifndef MAX_CACHED
#define MAX_CACHED 64  // row values a thread keeps in registers
#endif

// ------------------------------------------------------------ derived sizes
#define TK_THREADS (ROWS_PER_BLOCK * THREADS_PER_ROW)
#define TK_ITERS ((N_COLS + THREADS_PER_ROW * VEC - 1) / (THREADS_PER_ROW * VEC))
#define TK_CACHE (TK_ITERS * VEC <= MAX_CACHED)
// Row loops: fully unrolled when the row lives in registers (the arrays need constant
// indices); otherwise unrolled 4x, which keeps loads in flight without the code
// growth (and compile time) of unrolling thousands of elements.
#if TK_CACHE
#define TK_ROW_LOOP _Pragma("unroll")
#else
#define TK_ROW_LOOP _Pragma("unroll 4")
#endif
#define TK_GROUP (THREADS_PER_ROW < WAVE ? THREADS_PER_ROW : WAVE)
#define TK_WAVES_PER_ROW (THREADS_PER_ROW > WAVE ? THREADS_PER_ROW / WAVE : 1)

#if VEC == 8
typedef tk_u32x4 tk_vec_t;
#elif VEC == 4
typedef tk_u32x2 tk_vec_t;
#elif VEC == 2
typedef tk_u32 tk_vec_t;
#elif VEC != 1
#error "rms_norm.hip: VEC must be 1, 2, 4 or 8 (bf16 elements per load)"
#endif

#if WAVE != 32 && WAVE != 64
#error "rms_norm.hip: WAVE must be 32 or 64"
#endif
#if defined(TK_NV) && WAVE != 32
#error "rms_norm.hip: NVIDIA warps have 32 lanes (WAVE=32)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#if WAVE > __AMDGCN_WAVEFRONT_SIZE
#error "rms_norm.hip: WAVE is larger than the target's wavefront (wave32 target?)"
#endif
#endif

static_assert(N_COLS >= 1, "N_COLS must be positive");
static_assert(THREADS_PER_ROW >= 1 && (THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0,
              "THREADS_PER_ROW must be a power of two");
static_assert(ROWS_PER_BLOCK >= 1, "ROWS_PER_BLOCK must be >= 1");
static_assert(TK_THREADS <= 1024, "ROWS_PER_BLOCK * THREADS_PER_ROW must be <= 1024");
static_assert(TK_THREADS % WAVE == 0, "a block must be whole waves (full-mask shuffles)");

#if VEC > 1
union tk_vec_words {
    tk_vec_t v;
    tk_u32 w[VEC / 2];
};
#endif

TK_DEVICE float tk_round(float f) { return tk_bf16_to_f32(tk_f32_to_bf16(f)); }

// v[j] = p[e + j] as fp32 (0 past N_COLS); one vector load when aligned and whole.
TK_DEVICE void tk_load(float (&v)[VEC], const tk_u16* __restrict__ p, int e, bool vec_ok) {
#if VEC > 1
    if (vec_ok && e + VEC <= N_COLS) {
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
    for (int j = 0; j < VEC; ++j) v[j] = e + j < N_COLS ? tk_bf16_to_f32(p[e + j]) : 0.0f;
}

// p[e + j] = h[j] for the elements inside the row.
TK_DEVICE void tk_store(tk_u16* __restrict__ p, int e, const tk_u16 (&h)[VEC], bool vec_ok) {
#if VEC > 1
    if (vec_ok && e + VEC <= N_COLS) {
        tk_vec_words u;
#pragma unroll
        for (int j = 0; j < VEC / 2; ++j) u.w[j] = (tk_u32)h[2 * j] | ((tk_u32)h[2 * j + 1] << 16);
        *reinterpret_cast<tk_vec_t*>(p + e) = u.v;
        return;
    }
#endif
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        if (e + j < N_COLS) p[e + j] = h[j];
    }
}

// Sum of v over the THREADS_PER_ROW lanes of a row; every lane gets the total.
TK_DEVICE float tk_row_sum(float v, float (*red)[TK_WAVES_PER_ROW], int group, int lane) {
#pragma unroll
    for (int off = TK_GROUP / 2; off > 0; off >>= 1) v += tk_shfl_xor(v, off, WAVE);
#if THREADS_PER_ROW > WAVE
    if (lane % WAVE == 0) red[group][lane / WAVE] = v;
    __syncthreads();
    v = red[group][0];
#pragma unroll
    for (int j = 1; j < TK_WAVES_PER_ROW; ++j) v += red[group][j];
#endif
    return v;
}

TK_DEVICE float tk_weighted(float normed, float wv) {
#if GEMMA
    return normed * (1.0f + wv);
#else
#if VLLM_ROUNDING
    normed = tk_round(normed);
#endif
    return normed * wv;
#endif
}

extern "C" __global__ void __launch_bounds__(TK_THREADS)
tunekit_rms_norm(const tk_u16* __restrict__ x, const tk_u16* __restrict__ w, tk_u16* __restrict__ y, tk_i64 M,
                 tk_i64 stride_xm, tk_i64 stride_ym, tk_i64 eps_bits) {
    __shared__ float red[ROWS_PER_BLOCK][TK_WAVES_PER_ROW];
    const int tid = (int)threadIdx.x;
    const int group = tid / THREADS_PER_ROW;
    const int lane = tid % THREADS_PER_ROW;
    const tk_i64 row = (tk_i64)blockIdx.x * ROWS_PER_BLOCK + group;
    // Rows past M load nothing but stay for the reduction (full-mask shuffles, barriers).
    const bool row_ok = row < M;
    const float eps = __uint_as_float((tk_u32)eps_bits);
    const bool vec_ok = ((tk_u64)x % (2 * VEC)) == 0 && ((tk_u64)y % (2 * VEC)) == 0 &&
                        ((tk_u64)w % (2 * VEC)) == 0 && stride_xm % VEC == 0 && stride_ym % VEC == 0;
    const tk_u16* xr = x + (row_ok ? row : 0) * stride_xm;

    float ss = 0.0f;
#if TK_CACHE
    float xv[TK_ITERS][VEC];
#endif
    TK_ROW_LOOP
    for (int i = 0; i < TK_ITERS; ++i) {
        const int e = (i * THREADS_PER_ROW + lane) * VEC;
        float v[VEC];
        if (row_ok) {
            tk_load(v, xr, e, vec_ok);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            ss = tk_fma(v[j], v[j], ss);
#if TK_CACHE
            xv[i][j] = v[j];
#endif
        }
    }
    const float rstd = rsqrtf(tk_row_sum(ss, red, group, lane) / (float)N_COLS + eps);
    if (!row_ok) return;  // no collective operation follows

    tk_u16* yr = y + row * stride_ym;
    TK_ROW_LOOP
    for (int i = 0; i < TK_ITERS; ++i) {
        const int e = (i * THREADS_PER_ROW + lane) * VEC;
        float v[VEC];
#if TK_CACHE
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = xv[i][j];
#else
        tk_load(v, xr, e, vec_ok);
#endif
        float wv[VEC];
        tk_load(wv, w, e, vec_ok);
        tk_u16 h[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) h[j] = tk_f32_to_bf16(tk_weighted(v[j] * rstd, wv[j]));
        tk_store(yr, e, h, vec_ok);
    }
}
