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

template <class F> static void run_grid(long gx, long gy, unsigned threads, F body) {
    for (long by = 0; by < gy; ++by)
        for (long bx = 0; bx < gx; ++bx) {
            std::barrier<> block(threads);
            g_block = &block;
            g_warps.clear();
            for (unsigned w = 0; w < threads / 32; ++w) g_warps.emplace_back(new std::barrier<>(32));
            g_lanes.assign(threads, 0.f);
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
