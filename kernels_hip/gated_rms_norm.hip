// gated_rms_norm.hip: y = x / rms_group(x) * w * silu(z) per group of N_COLS elements
// (vLLM RMSNormGated, norm_before_gate=True; Gated DeltaNet's output norm).
// BF16 in and out (uint16 bits), FP32 math, the output rounded once (as vLLM's
// Triton kernel: there is no other rounding to match).
//
// Layout: x, z, y [M, G * N_COLS] row-major, unit stride along the row; w[N_COLS]
// shared by the G groups. The M * G groups are the rows of the work split of
// rms_norm.hip: THREADS_PER_ROW threads per group, ROWS_PER_BLOCK groups per block,
// VEC-element vectors; a group (64-256 elements) stays in registers. Group q is
// (m, g) = (q / G, q % G).
//
//   tunekit_gated_rms_norm(x, z, w, y, Q, G, stride_xm, stride_zm, stride_ym, eps_bits)
//     Q = M * G groups; grid = ceil(Q / ROWS_PER_BLOCK),
//     block = ROWS_PER_BLOCK * THREADS_PER_ROW.
#include "tunekit_hip.h"

// ---------------------------------------------------------------- tunables
#ifndef WAVE
#define WAVE TK_DEFAULT_WAVE  // lanes per wave/warp: 64 on AMD gfx9/DCU, 32 on NVIDIA
#endif
#ifndef N_COLS
#define N_COLS 128  // group size K (set by the backend)
#endif
#ifndef THREADS_PER_ROW
#define THREADS_PER_ROW 32
#endif
#ifndef ROWS_PER_BLOCK
#define ROWS_PER_BLOCK 8
#endif
#ifndef VEC
#define VEC 4  // bf16 per load: 1, 2, 4 or 8 (2- to 16-byte loads)
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
#error "gated_rms_norm.hip: VEC must be 1, 2, 4 or 8 (bf16 elements per load)"
#endif

#if WAVE != 32 && WAVE != 64
#error "gated_rms_norm.hip: WAVE must be 32 or 64"
#endif
#if defined(TK_NV) && WAVE != 32
#error "gated_rms_norm.hip: NVIDIA warps have 32 lanes (WAVE=32)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#if WAVE > __AMDGCN_WAVEFRONT_SIZE
#error "gated_rms_norm.hip: WAVE is larger than the target's wavefront (wave32 target?)"
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

extern "C" __global__ void __launch_bounds__(TK_THREADS)
tunekit_gated_rms_norm(const tk_u16* __restrict__ x, const tk_u16* __restrict__ z, const tk_u16* __restrict__ w,
                       tk_u16* __restrict__ y, tk_i64 Q, tk_i64 G, tk_i64 stride_xm, tk_i64 stride_zm,
                       tk_i64 stride_ym, tk_i64 eps_bits) {
    __shared__ float red[ROWS_PER_BLOCK][TK_WAVES_PER_ROW];
    const int tid = (int)threadIdx.x;
    const int group = tid / THREADS_PER_ROW;
    const int lane = tid % THREADS_PER_ROW;
    const tk_i64 q = (tk_i64)blockIdx.x * ROWS_PER_BLOCK + group;
    const bool row_ok = q < Q;  // groups past Q stay for the reduction
    const tk_i64 m = row_ok ? q / G : 0;
    const tk_i64 start = row_ok ? (q - m * G) * N_COLS : 0;
    const float eps = __uint_as_float((tk_u32)eps_bits);
    const bool vec_ok = ((tk_u64)x % (2 * VEC)) == 0 && ((tk_u64)z % (2 * VEC)) == 0 &&
                        ((tk_u64)y % (2 * VEC)) == 0 && ((tk_u64)w % (2 * VEC)) == 0 &&
                        stride_xm % VEC == 0 && stride_zm % VEC == 0 && stride_ym % VEC == 0 && N_COLS % VEC == 0;
    const tk_u16* xr = x + m * stride_xm + start;

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

    const tk_u16* zr = z + m * stride_zm + start;
    tk_u16* yr = y + m * stride_ym + start;
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
        float zv[VEC];
        tk_load(wv, w, e, vec_ok);
        tk_load(zv, zr, e, vec_ok);
        tk_u16 h[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float gate = zv[j] / (1.0f + expf(-zv[j]));  // silu(z), as vLLM's z * sigmoid(z)
            h[j] = tk_f32_to_bf16(v[j] * rstd * wv[j] * gate);
        }
        tk_store(yr, e, h, vec_ok);
    }
}
