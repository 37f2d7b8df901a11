// fused_add_rms_norm.hip: s = x + residual; y = s / rms(s) * w (GEMMA=0) or * (1 + w) (GEMMA=1);
// the updated residual s is stored too (r_out). BF16 in and out (uint16 bits), FP32 math.
//
// Layout and work split as rms_norm.hip (N = N_COLS at compile time, THREADS_PER_ROW
// threads per row, ROWS_PER_BLOCK rows per block, VEC-element vectors, the row kept in
// registers when TK_ITERS * VEC <= MAX_CACHED).
//
// Numerics: VLLM_ROUNDING=1 rounds the sum to BF16 *before* the variance, as vLLM's
// csrc fused_add_rms_norm_kernel (``z += residual`` in scalar_t) and GemmaRMSNorm (a
// BF16 add): y is the norm of exactly the residual that is stored; with the plain
// weight it also rounds s * rstd before * w, as the CUDA kernel. VLLM_ROUNDING=0: the
// variance of the fp32 sum, one rounding of y. All roundings to nearest even.
//
// In place (vLLM's fused_add_rms_norm(input, residual)): pass r_out = residual and
// y = x. Safe when the row is cached (every element of a thread is read before it
// is written, and threads own disjoint elements) or with VLLM_ROUNDING=1 (the
// normalise pass re-reads r_out, this thread's own stores); not with an uncached
// row and VLLM_ROUNDING=0, which re-reads x and residual.
//
//   tunekit_fused_add_rms_norm(x, r, w, y, r_out, M, stride_xm, stride_rm, stride_ym,
//                              stride_om, eps_bits)
//     grid = ceil(M / ROWS_PER_BLOCK), block = ROWS_PER_BLOCK * THREADS_PER_ROW;
//     eps_bits: the IEEE bits of the fp32 epsilon (every argument is 8 bytes).
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
#define VLLM_ROUNDING 1  // 1: round the sum before the variance (and s * rstd, plain w), as vLLM
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
#error "fused_add_rms_norm.hip: VEC must be 1, 2, 4 or 8 (bf16 elements per load)"
#endif

#if WAVE != 32 && WAVE != 64
#error "fused_add_rms_norm.hip: WAVE must be 32 or 64"
#endif
#if defined(TK_NV) && WAVE != 32
#error "fused_add_rms_norm.hip: NVIDIA warps have 32 lanes (WAVE=32)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#if WAVE > __AMDGCN_WAVEFRONT_SIZE
#error "fused_add_rms_norm.hip: WAVE is larger than the target's wavefront (wave32 target?)"
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

// s[j] = x[e + j] + r[e + j] (rounded to BF16 under VLLM_ROUNDING); 0 past N_COLS.
TK_DEVICE void tk_sum(float (&s)[VEC], const tk_u16* __restrict__ xr, const tk_u16* __restrict__ rr, int e,
                      bool vec_ok) {
    float rv[VEC];
    tk_load(s, xr, e, vec_ok);
    tk_load(rv, rr, e, vec_ok);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        s[j] += rv[j];
#if VLLM_ROUNDING
        s[j] = tk_round(s[j]);
#endif
    }
}

extern "C" __global__ void __launch_bounds__(TK_THREADS)
tunekit_fused_add_rms_norm(const tk_u16* x, const tk_u16* r, const tk_u16* __restrict__ w, tk_u16* y,
                           tk_u16* r_out, tk_i64 M, tk_i64 stride_xm, tk_i64 stride_rm, tk_i64 stride_ym,
                           tk_i64 stride_om, tk_i64 eps_bits) {
    // No __restrict__ on x, r, y, r_out: the in-place call aliases them.
    __shared__ float red[ROWS_PER_BLOCK][TK_WAVES_PER_ROW];
    const int tid = (int)threadIdx.x;
    const int group = tid / THREADS_PER_ROW;
    const int lane = tid % THREADS_PER_ROW;
    const tk_i64 row = (tk_i64)blockIdx.x * ROWS_PER_BLOCK + group;
    const bool row_ok = row < M;  // rows past M stay for the reduction
    const float eps = __uint_as_float((tk_u32)eps_bits);
    const bool vec_ok = ((tk_u64)x % (2 * VEC)) == 0 && ((tk_u64)r % (2 * VEC)) == 0 &&
                        ((tk_u64)y % (2 * VEC)) == 0 && ((tk_u64)r_out % (2 * VEC)) == 0 &&
                        ((tk_u64)w % (2 * VEC)) == 0 && stride_xm % VEC == 0 && stride_rm % VEC == 0 &&
                        stride_ym % VEC == 0 && stride_om % VEC == 0;
    const tk_i64 safe = row_ok ? row : 0;
    const tk_u16* xr = x + safe * stride_xm;
    const tk_u16* rr = r + safe * stride_rm;
    tk_u16* orow = r_out + safe * stride_om;

    float ss = 0.0f;
#if TK_CACHE
    float sv[TK_ITERS][VEC];
#endif
    TK_ROW_LOOP
    for (int i = 0; i < TK_ITERS; ++i) {
        const int e = (i * THREADS_PER_ROW + lane) * VEC;
        float s[VEC];
        if (row_ok) {
            tk_sum(s, xr, rr, e, vec_ok);
            tk_u16 h[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) h[j] = tk_f32_to_bf16(s[j]);
            tk_store(orow, e, h, vec_ok);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) s[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            ss = tk_fma(s[j], s[j], ss);
#if TK_CACHE
            sv[i][j] = s[j];
#endif
        }
    }
    const float rstd = rsqrtf(tk_row_sum(ss, red, group, lane) / (float)N_COLS + eps);
    if (!row_ok) return;  // no collective operation follows

    tk_u16* yr = y + row * stride_ym;
    TK_ROW_LOOP
    for (int i = 0; i < TK_ITERS; ++i) {
        const int e = (i * THREADS_PER_ROW + lane) * VEC;
        float s[VEC];
#if TK_CACHE
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[j] = sv[i][j];
#elif VLLM_ROUNDING
        tk_load(s, orow, e, vec_ok);  // the rounded sum this thread stored in pass 1
#else
        tk_sum(s, xr, rr, e, vec_ok);  // the fp32 sum is not in r_out: recompute
#endif
        float wv[VEC];
        tk_load(wv, w, e, vec_ok);
        tk_u16 h[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) h[j] = tk_f32_to_bf16(tk_weighted(s[j] * rstd, wv[j]));
        tk_store(yr, e, h, vec_ok);
    }
}
