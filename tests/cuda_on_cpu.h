// The CUDA subset the kernels of kernels_hip use, on the CPU: one std::thread per
// GPU thread of a block, blocks one after another, __shared__ = function-static.
// Shared by the g++ emulation tests (test_hip_compile.py, test_elementwise_hip.py).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct tk_dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local tk_dim3 threadIdx, blockIdx;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
#define __CUDACC__ 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)
template <class T> inline T __ldcs(const T* p) { return *p; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }

static std::barrier<>* g_block;
static std::vector<std::unique_ptr<std::barrier<>>> g_warps;
static std::vector<float> g_lanes;
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int) {
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    g_lanes[tid] = v;
    g_warps[warp]->arrive_and_wait();
    const float r = g_lanes[warp * 32 + (lane ^ lane_mask)];
    g_warps[warp]->arrive_and_wait();
    return r;
}

// mma.sync m16n8k16 (bf16 in, fp32 accumulate) as a warp-wide exchange: every
// lane scatters its fragments into the warp's A (16x16) and B (16x8), then
// computes its four outputs in ascending k with fp32 FMAs (the tensor core's
// own summation order is unspecified; the tests compare against fp64).
#define TK_HOST_MMA 1
static std::vector<float> g_mma_a, g_mma_b;
inline void tk_mma_bf16_16x8x16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                unsigned b1) {
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    float* A = &g_mma_a[warp * 256];
    float* B = &g_mma_b[warp * 128];
    const unsigned a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    for (int q = 0; q < 4; ++q) {
        const int row = g + 8 * (q & 1), col = 2 * t + 8 * (q >> 1);
        A[row * 16 + col] = __uint_as_float(a[q] << 16);
        A[row * 16 + col + 1] = __uint_as_float(a[q] & 0xffff0000u);
    }
    for (int q = 0; q < 2; ++q) {
        const int k = 2 * t + 8 * q;
        B[k * 8 + g] = __uint_as_float(b[q] << 16);
        B[(k + 1) * 8 + g] = __uint_as_float(b[q] & 0xffff0000u);
    }
    g_warps[warp]->arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float s = c[i];
        for (int k = 0; k < 16; ++k) s = std::fma(A[row * 16 + k], B[k * 8 + col], s);
        c[i] = s;
    }
    g_warps[warp]->arrive_and_wait();
}

template <class F> static void run_grid(long gx, long gy, unsigned threads, F body) {
    for (long by = 0; by < gy; ++by)
        for (long bx = 0; bx < gx; ++bx) {
            std::barrier<> block(threads);
            g_block = &block;
            g_warps.clear();
            for (unsigned w = 0; w < threads / 32; ++w) g_warps.emplace_back(new std::barrier<>(32));
            g_lanes.assign(threads, 0.f);
            g_mma_a.assign(threads / 32 * 256, 0.f);
            g_mma_b.assign(threads / 32 * 128, 0.f);
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; ++t)
                ts.emplace_back([=] { threadIdx.x = t; blockIdx.x = (unsigned)bx; blockIdx.y = (unsigned)by; body(); });
            for (auto& t : ts) t.join();
        }
}

// BF16 arrays as raw uint16 files: how the g++ tests pass tensors to and from Python.
static std::vector<unsigned short> read_u16(const char* dir, const char* file) {
    char path[1024]; std::snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE* f = std::fopen(path, "rb"); std::fseek(f, 0, SEEK_END); long n = std::ftell(f) / 2;
    std::fseek(f, 0, SEEK_SET); std::vector<unsigned short> v(n);
    if (std::fread(v.data(), 2, n, f) != (size_t)n) std::exit(2);
    std::fclose(f); return v;
}
static void write_u16(const char* dir, const char* file, const std::vector<unsigned short>& v) {
    char path[1024]; std::snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE* f = std::fopen(path, "wb"); std::fwrite(v.data(), 2, v.size(), f); std::fclose(f);
}
