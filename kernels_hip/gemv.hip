// gemv.hip: y[M,N] = x[M,K] . W[N,K]^T for decode (M = 1..MAX_M), BF16 in and
// out, FP32 accumulation, every weight element read exactly once per call.
//
// Layout: x, W, y row-major with unit stride along K (x, W) and N (y);
// stride_xm, stride_wn, stride_ym are the row strides in elements.
//
// Work split: a block covers ROWS_PER_BLOCK rows of W with
// ROWS_PER_BLOCK / ROWS_PER_THREAD row groups of THREADS_PER_ROW threads; a row
// group owns ROWS_PER_THREAD adjacent rows and walks their K range with
// VEC-wide loads (16 bytes at VEC=8), UNROLL per row in flight per thread,
// lanes interleaved so each load instruction of a row group reads one
// contiguous THREADS_PER_ROW*VEC*2-byte segment. With SPLIT_K > 1, blockIdx.y picks one of
// SPLIT_K K-chunks, the block writes FP32 partials to ws[SPLIT_K, M, N] and
// tunekit_gemv_reduce sums them in split order (deterministic, no atomics on
// outputs). FUSED_REDUCE=1 saves that launch (~2 us at small N): the last
// block of a row tile to finish, chosen by a ticket counter, sums the partials
// in the same split order (same bits) and re-arms the counter.
//
// Determinism / exact numerics: a thread accumulates its K elements in
// ascending order into one FP32 accumulator per x row, then the row group
// reduces by an xor butterfly (offsets THREADS_PER_ROW/2 .. 1; every lane ends
// with bit-identical totals). Changing ROWS_PER_BLOCK, ROWS_PER_THREAD,
// UNROLL, NONTEMPORAL, X_IN_SHARED, REDUCE_DPP or FUSED_REDUCE does not change
// the result bits; THREADS_PER_ROW, VEC and SPLIT_K do.
//
// Kernel arguments are all 8 bytes wide (pointers and tk_i64) so a host can
// pass Python ints without per-argument type tags.
//
//   tunekit_gemv(x, w, y, ws, tickets, M, N, K, stride_xm, stride_wn, stride_ym, k_chunk)
//     grid  = (ceil(N / ROWS_PER_BLOCK), SPLIT_K),
//     block = ROWS_PER_BLOCK / ROWS_PER_THREAD * THREADS_PER_ROW
//     k_chunk = K when SPLIT_K == 1, else ceil(K / SPLIT_K) rounded up to a
//     multiple of VEC*THREADS_PER_ROW; ws (fp32 [SPLIT_K, M, N]) is used when
//     SPLIT_K > 1; tickets (uint32 [ceil(N / ROWS_PER_BLOCK)], zero before the
//     first call, left zero by every call) only with FUSED_REDUCE=1.
//   tunekit_gemv_reduce(ws, y, M, N, stride_ym)
//     grid = ceil(M*N / TK_REDUCE_THREADS), block = TK_REDUCE_THREADS
//
// Misaligned inputs (a row start of W or x not VEC-aligned, e.g. K odd) are
// detected at run time (uniform over the grid) and served by a scalar path:
// slower, never wrong.
//
// MMA=1 (NVIDIA sm_80+): the products run on the tensor cores instead of FMAs,
// which frees the issue slots that M x (FMA + conversion) per weight element
// costs at M = 4..8. A row group is ROWS_PER_THREAD tiles of 16 W rows served
// by THREADS_PER_ROW threads (whole warps side by side along K); each tile is
// the 16-row side of mma.sync m16n8k16 and the x rows its 8-column side
// (tokens >= M re-read row M-1; those columns are never stored). Every lane
// loads VEC consecutive K elements straight from global memory into its
// fragment registers (no shared-memory staging of W): the K order inside one
// mma is a permutation of its k slots applied to W and x alike. Warps of a
// row group reduce through shared memory in warp order (deterministic).
// Block = ROWS_PER_BLOCK / (16*ROWS_PER_THREAD) * THREADS_PER_ROW threads;
// split-K, FUSED_REDUCE, NONTEMPORAL and X_IN_SHARED work as above. The bits
// differ from MMA=0 (another summation order); they are set by VEC,
// THREADS_PER_ROW and SPLIT_K as well.
#include "tunekit_hip.h"

// ---------------------------------------------------------------- tunables
#ifndef WAVE
#define WAVE TK_DEFAULT_WAVE  // lanes per wave/warp: 64 on AMD gfx9/DCU, 32 on NVIDIA
#endif
#ifndef MAX_M
#define MAX_M 8  // compile-time bound of the runtime M (rows of x)
#endif
#ifndef ROWS_PER_BLOCK
#define ROWS_PER_BLOCK 8  // rows of W per block (ROWS_PER_BLOCK / ROWS_PER_THREAD row groups)
#endif
#ifndef ROWS_PER_THREAD
#define ROWS_PER_THREAD 1  // rows of W per row group (each x load serves them all)
#endif
#ifndef THREADS_PER_ROW
#define THREADS_PER_ROW 32
#endif
#ifndef VEC
#define VEC 8  // bf16 elements per load: 2, 4 or 8 (4, 8 or 16 bytes)
#endif
#ifndef UNROLL
#define UNROLL 2  // independent W loads in flight per thread
#endif
#ifndef SPLIT_K
#define SPLIT_K 1
#endif
#ifndef NONTEMPORAL
#define NONTEMPORAL 0  // 1: W through nontemporal / evict-first loads
#endif
#ifndef X_IN_SHARED
#define X_IN_SHARED 0  // 1: stage x[M, K-chunk] in shared memory
#endif
#ifndef REDUCE_DPP
#define REDUCE_DPP 0  // 1 (AMD only): DPP / ds_swizzle row reduction instead of shuffles
#endif
#ifndef FUSED_REDUCE
#define FUSED_REDUCE 0  // SPLIT_K > 1: 0 = tunekit_gemv_reduce launch, 1 = last split block sums
#endif
#ifndef MMA
#define MMA 0  // 1 (NVIDIA sm_80+): tensor-core path, see the header comment
#endif
#ifndef X_SMEM_BYTES
#define X_SMEM_BYTES 16384  // shared-memory budget for staged x (X_IN_SHARED)
#endif

// ------------------------------------------------------------ derived sizes
#if MMA
#define TK_GROUP_ROWS (16 * ROWS_PER_THREAD)  // W rows of a row group: ROWS_PER_THREAD mma tiles
#define TK_KLANES (THREADS_PER_ROW / 8)       // threads side by side along K on one row (4 per warp)
#else
#define TK_GROUP_ROWS ROWS_PER_THREAD
#define TK_KLANES THREADS_PER_ROW
#endif
#define TK_THREADS (ROWS_PER_BLOCK / TK_GROUP_ROWS * THREADS_PER_ROW)
#define TK_STEP (VEC * TK_KLANES * UNROLL)  // K elements a row group reads per main-loop step
#define TK_GROUP (THREADS_PER_ROW < WAVE ? THREADS_PER_ROW : WAVE)  // lanes reduced by shuffles
#define TK_WAVES_PER_ROW (THREADS_PER_ROW > WAVE ? THREADS_PER_ROW / WAVE : 1)
#define TK_REDUCE_THREADS 256
// Staged x chunk: a whole number of main-loop steps, at least one.
#define TK_XCHUNK_STEPS ((X_SMEM_BYTES / (2 * MAX_M * TK_STEP)) > 0 ? (X_SMEM_BYTES / (2 * MAX_M * TK_STEP)) : 1)
#define TK_XCHUNK (TK_STEP * TK_XCHUNK_STEPS)

#if VEC == 8
typedef tk_u32x4 tk_vec_t;
#elif VEC == 4
typedef tk_u32x2 tk_vec_t;
#elif VEC == 2
typedef tk_u32 tk_vec_t;
#else
#error "gemv.hip: VEC must be 2, 4 or 8 (bf16 elements per load)"
#endif

#if WAVE != 32 && WAVE != 64
#error "gemv.hip: WAVE must be 32 or 64"
#endif
#if defined(TK_NV) && WAVE != 32
#error "gemv.hip: NVIDIA warps have 32 lanes (WAVE=32)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#if WAVE > __AMDGCN_WAVEFRONT_SIZE
#error "gemv.hip: WAVE is larger than the target's wavefront (wave32 target?)"
#endif
#endif

static_assert(MAX_M >= 1 && MAX_M <= 16, "MAX_M must be 1..16");
static_assert(THREADS_PER_ROW >= 1 && (THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0,
              "THREADS_PER_ROW must be a power of two");
static_assert(ROWS_PER_THREAD >= 1 && ROWS_PER_BLOCK % TK_GROUP_ROWS == 0,
              "ROWS_PER_BLOCK must be a multiple of ROWS_PER_THREAD (MMA=1: of 16*ROWS_PER_THREAD)");
static_assert(TK_THREADS <= 1024, "the block (ROWS_PER_BLOCK / rows per row group * THREADS_PER_ROW) exceeds 1024");
#if MMA
#if !defined(TK_NV)
#error "gemv.hip: MMA=1 is the NVIDIA mma.sync path (no AMD MFMA path is written)"
#endif
static_assert(MAX_M <= 8, "MMA=1: at most 8 rows of x (the mma's 8-column side)");
static_assert(VEC == 4 || VEC == 8, "MMA=1: VEC must be 4 or 8 (one or two k16 steps per load)");
static_assert(THREADS_PER_ROW % 32 == 0, "MMA=1: a row group is whole warps");
static_assert(REDUCE_DPP == 0, "MMA=1 has no DPP reduction");
#endif
static_assert(MMA == 0 || MMA == 1, "MMA must be 0 or 1");
// Blocks are whole 32-lane groups. On wave64 a block may end in half a wave
// (a 32-thread block: one row group of <= 32 lanes); its shuffles stay inside
// 32-lane groups (a row group of 64 lanes makes the block a multiple of 64).
static_assert(TK_THREADS % 32 == 0, "a block must be whole 32-lane groups (full-mask shuffles)");
static_assert(UNROLL >= 1 && UNROLL <= 16, "UNROLL must be 1..16");
static_assert(SPLIT_K >= 1, "SPLIT_K must be >= 1");
static_assert(FUSED_REDUCE == 0 || FUSED_REDUCE == 1, "FUSED_REDUCE must be 0 or 1");
#if X_IN_SHARED
static_assert(MAX_M * TK_XCHUNK * 2 <= 49152,
              "staged x exceeds 48 KiB of shared memory: lower VEC*THREADS_PER_ROW*UNROLL");
#endif

union tk_vec_words {
    tk_vec_t v;
    tk_u32 w[VEC / 2];
};

// ------------------------------------------------------------------ loads
TK_DEVICE tk_vec_t tk_load_w(const tk_u16* p) {
#if NONTEMPORAL
    return tk_load_nt(reinterpret_cast<const tk_vec_t*>(p));
#else
    return *reinterpret_cast<const tk_vec_t*>(p);
#endif
}

TK_DEVICE tk_u16 tk_load_w1(const tk_u16* p) {
#if NONTEMPORAL
    return tk_load_nt(p);
#else
    return *p;
#endif
}

// x is small (<= 8 rows of K) and re-read by every row group: plain cached loads.
TK_DEVICE tk_vec_t tk_load_x(const tk_u16* p) { return *reinterpret_cast<const tk_vec_t*>(p); }

TK_DEVICE void tk_dot(float& acc, const tk_vec_words& w, const tk_vec_words& x) {
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
        acc = tk_fma(tk_bf16_lo(w.w[j]), tk_bf16_lo(x.w[j]), acc);
        acc = tk_fma(tk_bf16_hi(w.w[j]), tk_bf16_hi(x.w[j]), acc);
    }
}

// ------------------------------------------------------------- accumulate
// A thread owns ROWS_PER_THREAD rows (wrow[r]) and MAX_M x rows; x_m[k] is
// xbase[xoff[m] + k] (global x or the staged shared copy). Each x load serves
// ROWS_PER_THREAD rows: at M = 8 direct x reads would otherwise move 8 bytes
// through L1 per weight byte, more than L1 delivers at full HBM rate.
#define TK_RPT ROWS_PER_THREAD
typedef float tk_acc_t[TK_RPT][MAX_M];

// acc += sum over k in [ks, ke), k = lane (mod THREADS_PER_ROW), scalar loads.
TK_DEVICE void tk_accumulate_scalar(tk_acc_t& acc, const tk_u16* const (&wrow)[TK_RPT],
                                    const tk_u16* __restrict__ xbase, const int (&xoff)[MAX_M], int ks, int ke,
                                    int lane) {
    for (int k = ks + lane; k < ke; k += THREADS_PER_ROW) {
        float wv[TK_RPT];
#pragma unroll
        for (int r = 0; r < TK_RPT; ++r) wv[r] = tk_bf16_to_f32(tk_load_w1(wrow[r] + k));
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) {
            const float xv = tk_bf16_to_f32(xbase[xoff[m] + k]);
#pragma unroll
            for (int r = 0; r < TK_RPT; ++r) acc[r][m] = tk_fma(wv[r], xv, acc[r][m]);
        }
    }
}

// One step of UNROLL vectors per row at k + (u*THREADS_PER_ROW + lane)*VEC;
// PRED masks vectors at or past kv_end (the last, partial step).
template <bool PRED>
TK_DEVICE void tk_step(tk_acc_t& acc, const tk_u16* const (&wrow)[TK_RPT], const tk_u16* __restrict__ xbase,
                       const int (&xoff)[MAX_M], int k, int kv_end, int lane) {
    tk_vec_words wv[UNROLL][TK_RPT];
    // All W loads first: UNROLL*ROWS_PER_THREAD independent loads in flight.
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int kk = k + (u * THREADS_PER_ROW + lane) * VEC;
        if (!PRED || kk < kv_end) {
#pragma unroll
            for (int r = 0; r < TK_RPT; ++r) wv[u][r].v = tk_load_w(wrow[r] + kk);
        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int kk = k + (u * THREADS_PER_ROW + lane) * VEC;
        if (!PRED || kk < kv_end) {
#pragma unroll
            for (int m = 0; m < MAX_M; ++m) {
                tk_vec_words xv;
                xv.v = tk_load_x(xbase + xoff[m] + kk);
#pragma unroll
                for (int r = 0; r < TK_RPT; ++r) tk_dot(acc[r][m], wv[u][r], xv);
            }
        }
    }
}

// Vector path over [ks, ke); requires ks and the row starts of W and x VEC-aligned.
TK_DEVICE void tk_accumulate_vec(tk_acc_t& acc, const tk_u16* const (&wrow)[TK_RPT],
                                 const tk_u16* __restrict__ xbase, const int (&xoff)[MAX_M], int ks, int ke,
                                 int lane) {
    const int kv_end = ks + ((ke - ks) / VEC) * VEC;  // end of the whole vectors
    int k = ks;
    for (; k + TK_STEP <= kv_end; k += TK_STEP) tk_step<false>(acc, wrow, xbase, xoff, k, kv_end, lane);
    // Last partial step keeps the same shape (predicated), so a K that is not a
    // multiple of TK_STEP (5120 = 2.5 steps of 2048) still has UNROLL loads in flight.
    if (k < kv_end) tk_step<true>(acc, wrow, xbase, xoff, k, kv_end, lane);
    // K % VEC tail (only when the range end is not VEC-aligned).
    tk_accumulate_scalar(acc, wrow, xbase, xoff, kv_end, ke, lane);
}

TK_DEVICE void tk_accumulate(bool vec_ok, tk_acc_t& acc, const tk_u16* const (&wrow)[TK_RPT],
                             const tk_u16* __restrict__ xbase, const int (&xoff)[MAX_M], int ks, int ke,
                             int lane) {
    if (vec_ok)
        tk_accumulate_vec(acc, wrow, xbase, xoff, ks, ke, lane);
    else
        tk_accumulate_scalar(acc, wrow, xbase, xoff, ks, ke, lane);
}

#if MMA
// ------------------------------------------------------- tensor-core path
// Lane 4g+t of a warp holds, per tile r, rows g and g+8 (wrow[r][0..1]) and
// x row g (xrow); fragment accumulators c[r][i]: outputs (row g + 8*(i/2),
// token 2t + i%2) of the tile.
typedef float tk_cfrag_t[TK_RPT][4];

// VEC elements at p[kk..]: one vector load, or (GUARD) element by element with
// zeros at or past ke (a range tail, or a misaligned row start).
template <bool GUARD, bool IS_W>
TK_DEVICE void tk_load_frag(tk_vec_words& v, const tk_u16* p, int kk, int ke) {
    if (!GUARD) {
        v.v = IS_W ? tk_load_w(p + kk) : tk_load_x(p + kk);
        return;
    }
#pragma unroll
    for (int j = 0; j < VEC / 2; ++j) {
        const tk_u32 lo = kk + 2 * j < ke ? (IS_W ? tk_load_w1(p + kk + 2 * j) : p[kk + 2 * j]) : 0;
        const tk_u32 hi = kk + 2 * j + 1 < ke ? (IS_W ? tk_load_w1(p + kk + 2 * j + 1) : p[kk + 2 * j + 1]) : 0;
        v.w[j] = lo | (hi << 16);
    }
}

// One step: UNROLL loads per row and of x in flight, then VEC/4 mmas per load.
// Word 2j of a load feeds k slots 2t..2t+1 of mma j, word 2j+1 slots 2t+8..2t+9,
// for W and x alike.
template <bool GUARD>
TK_DEVICE void tk_mma_step(tk_cfrag_t& c, const tk_u16* const (&wrow)[TK_RPT][2], const tk_u16* xrow, int k,
                           int ke, int klane) {
    tk_vec_words a[UNROLL][TK_RPT][2];
    tk_vec_words b[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int kk = k + (u * TK_KLANES + klane) * VEC;
#pragma unroll
        for (int r = 0; r < TK_RPT; ++r) {
            tk_load_frag<GUARD, true>(a[u][r][0], wrow[r][0], kk, ke);
            tk_load_frag<GUARD, true>(a[u][r][1], wrow[r][1], kk, ke);
        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) tk_load_frag<GUARD, false>(b[u], xrow, k + (u * TK_KLANES + klane) * VEC, ke);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int j = 0; j < VEC / 4; ++j) {
#pragma unroll
            for (int r = 0; r < TK_RPT; ++r)
                tk_mma_bf16_16x8x16(c[r], a[u][r][0].w[2 * j], a[u][r][1].w[2 * j], a[u][r][0].w[2 * j + 1],
                                    a[u][r][1].w[2 * j + 1], b[u].w[2 * j], b[u].w[2 * j + 1]);
        }
    }
}

// c += the products over [ks, ke): whole steps of vector loads while vec_ok,
// then guarded steps for the rest (every step when the rows are misaligned).
TK_DEVICE void tk_mma_accumulate(bool vec_ok, tk_cfrag_t& c, const tk_u16* const (&wrow)[TK_RPT][2],
                                 const tk_u16* xrow, int ks, int ke, int klane) {
    int k = ks;
    if (vec_ok)
        for (; k + TK_STEP <= ke; k += TK_STEP) tk_mma_step<false>(c, wrow, xrow, k, ke, klane);
    for (; k < ke; k += TK_STEP) tk_mma_step<true>(c, wrow, xrow, k, ke, klane);
}
#endif  // MMA

// -------------------------------------------------------------- reduction
#if defined(TK_AMD) && REDUCE_DPP
// DPP controls must be compile-time constants, hence the templates.
template <int CTRL>
TK_DEVICE float tk_dpp(float v) {
    return __int_as_float(__builtin_amdgcn_update_dpp(0, __float_as_int(v), CTRL, 0xf, 0xf, false));
}
template <int PATTERN>
TK_DEVICE float tk_swizzle(float v) {
    return __int_as_float(__builtin_amdgcn_ds_swizzle(__float_as_int(v), PATTERN));
}
// ds_swizzle bit mode (offset bit 15 = 0): and_mask 0x1f, xor_mask in bits 14:10;
// exchanges with lane ^ x inside 32-lane halves.
#define TK_SWZ_XOR(x) (0x1f | ((x) << 10))
#endif

// Every lane of a TK_GROUP-lane group ends with the group's total: an xor
// butterfly, offsets TK_GROUP/2 .. 1 (never a hard-coded wave width).
#if defined(TK_AMD) && REDUCE_DPP
// One butterfly step v + v(lane ^ OFF) through DPP / ds_swizzle. The partner
// values equal the xor shuffle's, so REDUCE_DPP=0/1 give identical bits:
//  OFF 1, 2: quad_perm [1,0,3,2] / [2,3,0,1] are exact xors;
//  OFF 8:    row_ror:8 inside a 16-lane row is exactly lane ^ 8;
//  OFF 4:    row_ror:4 reaches lane ^ 4 or lane ^ 4 ^ 8, which hold equal
//            values after the OFF-8 step (so only when TK_GROUP >= 16; else
//            ds_swizzle xor 4);
//  OFF 16:   ds_swizzle xor 16; OFF 32 crosses 32-lane halves: shuffle.
// Steps are template-unrolled: the DPP builtins need constant operands, and
// clang does not unroll a loop over these convergent calls.
template <int OFF>
TK_DEVICE float tk_xor_step(float v) {
    if (OFF == 1) return v + tk_dpp<0xb1>(v);
    if (OFF == 2) return v + tk_dpp<0x4e>(v);
    if (OFF == 4) return v + (TK_GROUP >= 16 ? tk_dpp<0x124>(v) : tk_swizzle<TK_SWZ_XOR(4)>(v));
    if (OFF == 8) return v + tk_dpp<0x128>(v);
    if (OFF == 16) return v + tk_swizzle<TK_SWZ_XOR(16)>(v);
    return v + tk_shfl_xor(v, OFF, WAVE);
}
template <int OFF>
struct tk_butterfly {
    static TK_DEVICE float run(float v) { return tk_butterfly<OFF / 2>::run(tk_xor_step<OFF>(v)); }
};
template <>
struct tk_butterfly<0> {
    static TK_DEVICE float run(float v) { return v; }
};
TK_DEVICE float tk_group_sum(float v) { return tk_butterfly<TK_GROUP / 2>::run(v); }
#else
TK_DEVICE float tk_group_sum(float v) {
#pragma unroll
    for (int off = TK_GROUP / 2; off > 0; off >>= 1) v += tk_shfl_xor(v, off, WAVE);
    return v;
}
#endif

// ------------------------------------------------------------------ stores
TK_DEVICE void tk_store(tk_u16* __restrict__ y, float* __restrict__ ws, int split, int m, int n, int M, int N,
                        tk_i64 stride_ym, float v) {
#if SPLIT_K > 1
    ws[((tk_i64)split * M + m) * N + n] = v;
#else
    y[(tk_i64)m * stride_ym + n] = tk_f32_to_bf16(v);
#endif
}

// ------------------------------------------------------------------ kernels
extern "C" __global__ void __launch_bounds__(TK_THREADS)
tunekit_gemv(const tk_u16* __restrict__ x, const tk_u16* __restrict__ w, tk_u16* __restrict__ y,
             float* __restrict__ ws, tk_u32* __restrict__ tickets, tk_i64 M_, tk_i64 N_, tk_i64 K_,
             tk_i64 stride_xm, tk_i64 stride_wn, tk_i64 stride_ym, tk_i64 k_chunk) {
    const int M = (int)M_;
    const int N = (int)N_;
    const int K = (int)K_;
    const int tid = (int)threadIdx.x;
    const int group = tid / THREADS_PER_ROW;
    const int lane = tid % THREADS_PER_ROW;
    const int n0 = (int)blockIdx.x * ROWS_PER_BLOCK + group * TK_GROUP_ROWS;  // first row of this row group
    // Groups past N skip the loads but stay for the reductions (full-mask shuffles).
    // (A row group is whole waves whenever MMA=1, so the skip never splits a warp.)
    const bool group_ok = n0 < N;
#if SPLIT_K > 1
    const int split = (int)blockIdx.y;
    const tk_i64 kb64 = (tk_i64)split * k_chunk;
    const int kb = (int)(kb64 < K ? kb64 : K);
    const int ke = (int)(kb + k_chunk < K ? kb + k_chunk : K);
#else
    const int split = 0;
    const int kb = 0;
    const int ke = K;
#endif
    // Rows past N re-read row N-1 (discarded) instead of predicating every load.
#if MMA
    const int g = (tid % 32) >> 2;             // fragment row (W) / column (x row) of this lane
    const int klane = (lane / 32) * 4 + (tid & 3);  // position along K among the row group's TK_KLANES
    const int token = g < M ? g : M - 1;       // x rows >= M re-read row M-1 (never stored)
    const tk_u16* wrow[TK_RPT][2];
#pragma unroll
    for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int nr = n0 + 16 * r + 8 * h + g;
            wrow[r][h] = w + (tk_i64)(nr < N ? nr : N - 1) * stride_wn;
        }
    }
#else
    const tk_u16* wrow[TK_RPT];
#pragma unroll
    for (int r = 0; r < TK_RPT; ++r) {
        const int nr = n0 + r < N ? n0 + r : N - 1;
        wrow[r] = w + (tk_i64)nr * stride_wn;
    }
#endif
    // Vector loads need VEC-aligned row and split starts: checked once, uniform over the grid.
    const bool split_ok = SPLIT_K == 1 || k_chunk % VEC == 0;
    const bool w_vec_ok = split_ok && ((tk_u64)w % (2 * VEC)) == 0 && stride_wn % VEC == 0;
    const bool x_vec_ok = split_ok && ((tk_u64)x % (2 * VEC)) == 0 && stride_xm % VEC == 0;

#if MMA
    tk_cfrag_t acc;
#pragma unroll
    for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][i] = 0.0f;
    }
#else
    float acc[TK_RPT][MAX_M];
#pragma unroll
    for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) acc[r][m] = 0.0f;
    }
#endif

    // x rows m >= M read row M-1 instead of branching: their sums are never stored.
#if X_IN_SHARED
    __shared__ TK_ALIGN(16) tk_u16 xs[MAX_M * TK_XCHUNK];
    for (int kc = kb; kc < ke; kc += TK_XCHUNK) {
        const int len = (ke - kc < TK_XCHUNK) ? ke - kc : TK_XCHUNK;
        __syncthreads();  // previous chunk fully consumed
        if (x_vec_ok) {
            const int nv = len / VEC;
            for (int i = tid; i < M * nv; i += TK_THREADS) {
                const int m = i / nv;
                const int v = i - m * nv;
                *reinterpret_cast<tk_vec_t*>(xs + m * TK_XCHUNK + v * VEC) =
                    tk_load_x(x + (tk_i64)m * stride_xm + kc + v * VEC);
            }
            const int tail = len - nv * VEC;
            for (int i = tid; i < M * tail; i += TK_THREADS) {
                const int m = i / tail;
                const int j = nv * VEC + (i - m * tail);
                xs[m * TK_XCHUNK + j] = x[(tk_i64)m * stride_xm + kc + j];
            }
        } else {
            for (int i = tid; i < M * len; i += TK_THREADS) {
                const int m = i / len;
                const int j = i - m * len;
                xs[m * TK_XCHUNK + j] = x[(tk_i64)m * stride_xm + kc + j];
            }
        }
        __syncthreads();
#if MMA
        if (group_ok) tk_mma_accumulate(w_vec_ok, acc, wrow, xs + token * TK_XCHUNK - kc, kc, kc + len, klane);
#else
        int xoff[MAX_M];
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) xoff[m] = (m < M ? m : M - 1) * TK_XCHUNK - kc;
        if (group_ok) tk_accumulate(w_vec_ok, acc, wrow, xs, xoff, kc, kc + len, lane);
#endif
    }
#elif MMA
    if (group_ok) tk_mma_accumulate(w_vec_ok && x_vec_ok, acc, wrow, x + (tk_i64)token * stride_xm, kb, ke, klane);
#else
    int xoff[MAX_M];
#pragma unroll
    for (int m = 0; m < MAX_M; ++m) xoff[m] = (m < M ? m : M - 1) * (int)stride_xm;
    if (group_ok) tk_accumulate(w_vec_ok && x_vec_ok, acc, wrow, x, xoff, kb, ke, lane);
#endif

#if MMA
    // Warps side by side along K meet in shared memory, added in warp order.
    const int kwarp = lane / 32;
#if THREADS_PER_ROW > 32
    __shared__ float red_mma[ROWS_PER_BLOCK / TK_GROUP_ROWS][THREADS_PER_ROW / 32 - 1][TK_RPT * 4][32];
    if (kwarp > 0) {
#pragma unroll
        for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
            for (int i = 0; i < 4; ++i) red_mma[group][kwarp - 1][r * 4 + i][tid % 32] = acc[r][i];
        }
    }
    __syncthreads();
    if (kwarp == 0) {
        for (int j = 0; j < THREADS_PER_ROW / 32 - 1; ++j) {
#pragma unroll
            for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][i] += red_mma[group][j][r * 4 + i][tid % 32];
            }
        }
    }
#endif
    if (kwarp == 0) {
        const int t = tid & 3;
#pragma unroll
        for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = 2 * t + (i & 1);
                const int n = n0 + 16 * r + 8 * (i >> 1) + g;
                if (m < M && n < N) tk_store(y, ws, split, m, n, M, N, stride_ym, acc[r][i]);
            }
        }
    }
#else  // MMA
#if THREADS_PER_ROW > 1
#pragma unroll
    for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) acc[r][m] = tk_group_sum(acc[r][m]);
    }
#endif

#if THREADS_PER_ROW <= WAVE
    // Every lane of the row group holds the totals: output (r, m) is stored by
    // lane (r*MAX_M + m) % THREADS_PER_ROW, spreading the stores over lanes.
#pragma unroll
    for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) {
            if (m < M && n0 + r < N && ((r * MAX_M + m) % THREADS_PER_ROW) == lane)
                tk_store(y, ws, split, m, n0 + r, M, N, stride_ym, acc[r][m]);
        }
    }
#else
    // The row group spans several waves: wave totals meet in shared memory and
    // are added in wave order (fixed, so deterministic).
    __shared__ float red[ROWS_PER_BLOCK / TK_RPT][TK_WAVES_PER_ROW][TK_RPT * MAX_M];
    const int wave_in_row = lane / WAVE;
    if (lane % WAVE == 0) {
#pragma unroll
        for (int r = 0; r < TK_RPT; ++r) {
#pragma unroll
            for (int m = 0; m < MAX_M; ++m) red[group][wave_in_row][r * MAX_M + m] = acc[r][m];
        }
    }
    __syncthreads();
    for (int i = lane; i < TK_RPT * MAX_M; i += THREADS_PER_ROW) {
        const int r = i / MAX_M;
        const int m = i - r * MAX_M;
        if (m < M && n0 + r < N) {
            float s = red[group][0][i];
#pragma unroll
            for (int j = 1; j < TK_WAVES_PER_ROW; ++j) s += red[group][j][i];
            tk_store(y, ws, split, m, n0 + r, M, N, stride_ym, s);
        }
    }
#endif
#endif  // MMA

#if SPLIT_K > 1 && FUSED_REDUCE
    // Threadfence-reduction pattern: publish this block's partials, take a
    // ticket; the block holding the last ticket sees every split's partials.
    __shared__ tk_u32 ticket;
    __threadfence();
    __syncthreads();
    if (tid == 0) ticket = atomicAdd(tickets + blockIdx.x, 1u);
    __syncthreads();
    if (ticket == SPLIT_K - 1) {
        __threadfence();
        // volatile: read the other blocks' partials from L2, not a stale L1 line.
        const volatile float* vws = ws;
        const tk_i64 mn = (tk_i64)M * N;
        for (int i = tid; i < M * ROWS_PER_BLOCK; i += TK_THREADS) {
            const int m = i / ROWS_PER_BLOCK;
            const int nn = (int)blockIdx.x * ROWS_PER_BLOCK + (i - m * ROWS_PER_BLOCK);
            if (nn < N) {
                const tk_i64 at = (tk_i64)m * N + nn;
                float s = vws[at];
#pragma unroll
                for (int p = 1; p < SPLIT_K; ++p) s += vws[(tk_i64)p * mn + at];
                y[(tk_i64)m * stride_ym + nn] = tk_f32_to_bf16(s);
            }
        }
        if (tid == 0) atomicExch(tickets + blockIdx.x, 0u);  // re-arm for the next call / graph replay
    }
#endif
}

// Sum the SPLIT_K partials of every output in split order and round to bf16.
extern "C" __global__ void __launch_bounds__(TK_REDUCE_THREADS)
tunekit_gemv_reduce(const float* __restrict__ ws, tk_u16* __restrict__ y, tk_i64 M_, tk_i64 N_, tk_i64 stride_ym) {
    const tk_i64 mn = M_ * N_;
    const tk_i64 i = (tk_i64)blockIdx.x * TK_REDUCE_THREADS + threadIdx.x;
    if (i >= mn) return;
    float s = ws[i];
#pragma unroll
    for (int p = 1; p < SPLIT_K; ++p) s += ws[(tk_i64)p * mn + i];
    const tk_i64 m = i / N_;
    const tk_i64 n = i - m * N_;
    y[m * stride_ym + n] = tk_f32_to_bf16(s);
}
