// cast_check.cu: standalone check + timing of the bf16 -> fp32 cast (a 1:2 read:write stream)
// next to fp32 -> bf16 (2:1), fp32 -> fp32 copies and read-only / write-only / copy baselines, to
// find what the H200 allows for each mix.  Build and run: bash bench/cast_check.sh [--check |
// --bench] (needs an sm_90 GPU).  Exit status 1 on any FAIL.
//
// Variants: "v2": the in-tree flat kernel (elementwise_flat_v2 with CastF, 8 elements a thread:
// one 16-byte load, two 16-byte stores 16 bytes apart; elementwise_blocks' grid, at most 8 blocks
// per SM); "v3 LB.. U..": the in-tree cast_widen_v3 (src/cuda/elementwise.cu) with LB-byte loads
// (8: each warp store is 512 contiguous bytes), U vectors a thread loads first, cs = streaming
// stores, na = L1::no_allocate loads, on a one-wave grid (resident blocks, as the launcher) or a
// full grid (one iteration a thread); "shfl": 16-byte loads, warp shuffles so that both stores are
// contiguous 512-byte warp accesses (harness only).
// Check: every variant's output bitwise against the CPU (widening is exact; fp32 -> bf16 against
// the host's round-to-nearest-even), output poisoned (0xff) first, sizes 16x1024x768,
// 16x1024x3072 and an odd 1000003 (tails).
// Timing: cudaEvent median of 30 after 5 warm-ups per variant; GB/s on the bytes it moves (a
// cast: 2 + 4 bytes an element); %copy = a cudaMemcpyAsync D2D moving the same bytes / ours.
#define BT_ELEMENTWISE_KERNELS_ONLY 1
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../src/cuda/elementwise.cu"
// throw_cuda_error: declared by runtime.h; nothing here calls it, but keep the harness
// self-contained.
#define BT_HARNESS_THROW_STUB 1
#include "harness_common.cuh"

using namespace bt::cuda;
using bf16 = __nv_bfloat16;

static int g_fail = 0, g_sms = 0;
constexpr int kT = 256;  // threads per block (elementwise.cu's kThreads)

// ---- harness-only kernels -------------------------------------------------------------------
// bf16 -> fp32 with contiguous warp stores: lane l loads vector wb + l (8 elements); store k of the
// warp writes elements 128 k + 4 l .. + 3, which live in lane 16 k + l / 2, words 2 (l & 1) and
// 2 (l & 1) + 1.  U warp-chunks of 32 vectors per iteration, loads first.  A partial last chunk
// stores directly.
template <int U, bool kCs>
__global__ void __launch_bounds__(kT)
    widen_shfl(uint32_t n, const bf16* __restrict__ in, float* __restrict__ out) {
  const uint32_t nvec = n / 8, lane = threadIdx.x & 31;
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  const uint32_t wb0 = tid - lane;  // this warp's first vector
  const uint4* iv = reinterpret_cast<const uint4*>(in);
  for (uint32_t wb = wb0; wb < nvec; wb += U * stride) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = wb + u * stride + lane;
      if (v < nvec) r[u] = __ldg(iv + v);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t b = wb + u * stride;
      if (b >= nvec) break;  // warp-uniform
      if (b + 32 <= nvec) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int src = 16 * k + lane / 2;
          const uint32_t a0 = __shfl_sync(0xffffffffu, r[u].x, src);
          const uint32_t a1 = __shfl_sync(0xffffffffu, r[u].y, src);
          const uint32_t a2 = __shfl_sync(0xffffffffu, r[u].z, src);
          const uint32_t a3 = __shfl_sync(0xffffffffu, r[u].w, src);
          const float2 lo = widen2<bf16>(lane & 1 ? a2 : a0), hi = widen2<bf16>(lane & 1 ? a3 : a1);
          st_float4<kCs>(out + size_t(b) * 8 + 128 * k + 4 * lane,
                         make_float4(lo.x, lo.y, hi.x, hi.y));
        }
      } else if (b + lane < nvec) {
        const uint32_t w[4] = {r[u].x, r[u].y, r[u].z, r[u].w};
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const float2 a = widen2<bf16>(w[2 * q]), c = widen2<bf16>(w[2 * q + 1]);
          st_float4<kCs>(out + size_t(b + lane) * 8 + 4 * q, make_float4(a.x, a.y, c.x, c.y));
        }
      }
    }
  }
  for (uint32_t i = nvec * 8 + tid; i < n; i += stride) out[i] = __bfloat162float(in[i]);
}

// fp32 -> bf16 with contiguous warp accesses both ways: 16-byte loads (4 elements), 8-byte stores.
template <int U>
__global__ void __launch_bounds__(kT)
    narrow_v3(uint32_t n, const float* __restrict__ in, bf16* __restrict__ out) {
  const uint32_t nvec = n / 4;
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  for (uint32_t v0 = tid; v0 < nvec; v0 += U * stride) {
    float4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (v0 + u * stride < nvec)
        r[u] = __ldg(reinterpret_cast<const float4*>(in) + v0 + u * stride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = v0 + u * stride;
      if (v < nvec) {
        const __nv_bfloat162 a = __floats2bfloat162_rn(r[u].x, r[u].y);
        const __nv_bfloat162 b = __floats2bfloat162_rn(r[u].z, r[u].w);
        uint2 o;
        memcpy(&o.x, &a, 4);
        memcpy(&o.y, &b, 4);
        reinterpret_cast<uint2*>(out)[v] = o;
      }
    }
  }
  for (uint32_t i = nvec * 4 + tid; i < n; i += stride) out[i] = __float2bfloat16_rn(in[i]);
}

// Baselines: write-only (a memset), read-only (a sum whose result is almost never stored), copy.
template <bool kCs>
__global__ void __launch_bounds__(kT) write_only(uint4* __restrict__ p, uint32_t nv, uint32_t val) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < nv) {
    const uint4 v = make_uint4(val, val, val, val);
    if constexpr (kCs) {
      __stcs(p + i, v);
    } else {
      p[i] = v;
    }
  }
}
__global__ void __launch_bounds__(kT)
    read_only(const uint4* __restrict__ p, uint32_t nv, uint32_t* __restrict__ sink) {
  constexpr int U = 4;
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  uint32_t acc = 0;
  for (uint32_t v0 = tid; v0 < nv; v0 += U * stride) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = v0 + u * stride < nv ? __ldg(p + v0 + u * stride) : uint4{};
#pragma unroll
    for (int u = 0; u < U; ++u) acc += r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
}
__global__ void __launch_bounds__(kT)
    copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, uint32_t nv) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < nv) b[i] = a[i];
}

// ---- grids ------------------------------------------------------------------------------------
// elementwise_blocks (backend.cpp): enough blocks for one item a thread, at most 8 per SM
static int ew_blocks(int64_t items) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div(items, kT), 8LL * g_sms)));
}
enum Grid { kEw, kWave, kFull };
template <typename K>
static int grid_for(K kern, int64_t threads_needed, Grid g) {
  if (g == kEw) return ew_blocks(threads_needed);
  const int64_t full = std::max<int64_t>(1, ceil_div(threads_needed, kT));
  if (g == kFull) return static_cast<int>(full);
  int per_sm = 0;  // one wave, as one_wave_blocks in elementwise.cu
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kT, 0));
  return static_cast<int>(std::min<int64_t>(full, int64_t(std::max(1, per_sm)) * g_sms));
}

// ---- variants -----------------------------------------------------------------------------------
using Launch = std::function<void(const void* in, void* out, uint32_t n)>;
struct Variant {
  std::string name;
  Launch fn;
};

template <int LB, int U, bool kCs, bool kNa>
static Variant widen_v3(Grid g) {
  std::string nm = "v3 LB" + std::to_string(LB) + " U" + std::to_string(U) + (kCs ? " cs" : "") +
                   (kNa ? " na" : "") +
                   (g == kWave   ? " wave"
                    : g == kFull ? " full"
                                 : " ew");
  return {nm, [g](const void* in, void* out, uint32_t n) {
            auto kern = cast_widen_v3<LB, U, kCs, kNa, bf16>;
            const int blocks = grid_for(kern, ceil_div(n / (LB / 2), U), g);
            kern<<<blocks, kT>>>(n, static_cast<const bf16*>(in), static_cast<float*>(out));
            CK(cudaGetLastError());
          }};
}
template <int U, bool kCs>
static Variant widen_shfl_v(Grid g) {
  std::string nm = "shfl U" + std::to_string(U) + (kCs ? " cs" : "") +
                   (g == kWave   ? " wave"
                    : g == kFull ? " full"
                                 : " ew");
  return {nm, [g](const void* in, void* out, uint32_t n) {
            auto kern = widen_shfl<U, kCs>;
            const int blocks = grid_for(kern, ceil_div(n / 8, U), g);
            kern<<<blocks, kT>>>(n, static_cast<const bf16*>(in), static_cast<float*>(out));
            CK(cudaGetLastError());
          }};
}

static std::vector<Variant> widen_variants() {
  std::vector<Variant> v;
  // the in-tree flat kernel as launch_elementwise runs it (vec_width<float, bf16>() = 8)
  v.push_back({"v2 (in-tree flat)", [](const void* in, void* out, uint32_t n) {
                 elementwise_flat_v2<8, uint32_t, CastF<bf16, float>, float, bf16>
                     <<<ew_blocks(ceil_div(n, 8)), kT>>>(n, CastF<bf16, float>{},
                                                         static_cast<float*>(out),
                                                         static_cast<const bf16*>(in));
                 CK(cudaGetLastError());
               }});
  v.push_back(widen_v3<16, 1, false, false>(kFull));
  v.push_back(widen_v3<16, 1, false, false>(kEw));
  v.push_back(widen_v3<16, 2, false, false>(kWave));
  v.push_back(widen_v3<16, 4, false, false>(kWave));
  v.push_back(widen_v3<16, 1, true, false>(kFull));
  v.push_back(widen_v3<16, 1, false, true>(kFull));
  v.push_back(widen_v3<16, 2, true, true>(kWave));
  v.push_back(widen_v3<8, 1, false, false>(kFull));
  v.push_back(widen_v3<8, 2, false, false>(kFull));
  v.push_back(widen_v3<8, 2, false, false>(kWave));
  v.push_back(widen_v3<kWidenLoadBytes, kWidenUnroll, kWidenStreamStores, kWidenNoAllocate>(
      kWave));  // BT_CUDA_CAST_VERSION=3
  v.back().name += " (BT_CUDA_CAST_VERSION=3)";
  v.push_back(widen_v3<8, 4, true, false>(kWave));
  v.push_back(widen_v3<8, 4, false, true>(kWave));
  v.push_back(widen_v3<8, 4, true, true>(kWave));
  v.push_back(widen_v3<8, 4, false, false>(kEw));
  v.push_back(widen_shfl_v<1, false>(kFull));
  v.push_back(widen_shfl_v<2, false>(kWave));
  v.push_back(widen_shfl_v<2, true>(kWave));
  return v;
}

static std::vector<Variant> narrow_variants() {
  std::vector<Variant> v;
  v.push_back({"v2 (in-tree flat)", [](const void* in, void* out, uint32_t n) {
                 elementwise_flat_v2<8, uint32_t, CastF<float, bf16>, bf16, float>
                     <<<ew_blocks(ceil_div(n, 8)), kT>>>(n, CastF<float, bf16>{},
                                                         static_cast<bf16*>(out),
                                                         static_cast<const float*>(in));
                 CK(cudaGetLastError());
               }});
  auto nv = [](int U, Grid g) {
    return Variant{"LD16 ST8 U" + std::to_string(U) + (g == kWave ? " wave" : " full"),
                   [U, g](const void* in, void* out, uint32_t n) {
                     auto run = [&](auto kern, int u) {
                       kern<<<grid_for(kern, ceil_div(n / 4, u), g), kT>>>(
                           n, static_cast<const float*>(in), static_cast<bf16*>(out));
                     };
                     if (U == 1) {
                       run(narrow_v3<1>, 1);
                     } else {
                       run(narrow_v3<4>, 4);
                     }
                     CK(cudaGetLastError());
                   }};
  };
  v.push_back(nv(1, kFull));
  v.push_back(nv(4, kWave));
  return v;
}

static std::vector<Variant> copy_variants() {
  std::vector<Variant> v;
  v.push_back({"v2 (in-tree flat CopyF)", [](const void* in, void* out, uint32_t n) {
                 elementwise_flat_v2<4, uint32_t, CopyF<float>, float, float>
                     <<<ew_blocks(ceil_div(n, 4)), kT>>>(n, CopyF<float>{},
                                                         static_cast<float*>(out),
                                                         static_cast<const float*>(in));
                 CK(cudaGetLastError());
               }});
  v.push_back({"copy kernel (16 B, full grid)", [](const void* in, void* out, uint32_t n) {
                 const uint32_t nv = n / 4;  // sizes here are multiples of 4
                 copy_kernel<<<static_cast<unsigned>(ceil_div(nv, kT)), kT>>>(
                     static_cast<const uint4*>(in), static_cast<uint4*>(out), nv);
                 CK(cudaGetLastError());
               }});
  return v;
}

// ---- check ------------------------------------------------------------------------------------
static uint16_t bf16_bits_rne(float f) {  // host round-to-nearest-even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// kind 0: bf16 -> fp32, 1: fp32 -> bf16, 2: fp32 -> fp32
static void check_kind(int kind, const std::vector<Variant>& vs, const char* what) {
  for (uint32_t n : {16u * 1024 * 768, 16u * 1024 * 3072, 1000003u}) {
    std::mt19937 rng(n);
    std::normal_distribution<float> nd(0.f, 3.f);
    const size_t ib = kind == 0 ? 2 : 4, ob = kind == 1 ? 2 : 4;
    std::vector<uint8_t> hin(n * ib), want(n * ob);
    for (uint32_t i = 0; i < n; ++i) {
      const float f = nd(rng);
      if (kind == 0) {
        const uint16_t b = bf16_bits_rne(f);
        const uint32_t w = uint32_t(b) << 16;
        std::memcpy(&hin[i * 2], &b, 2);
        std::memcpy(&want[i * 4], &w, 4);
      } else {
        std::memcpy(&hin[i * 4], &f, 4);
        if (kind == 1) {
          const uint16_t b = bf16_bits_rne(f);
          std::memcpy(&want[i * 2], &b, 2);
        } else {
          std::memcpy(&want[i * 4], &f, 4);
        }
      }
    }
    uint8_t* din = dcopy(hin, 0);
    uint8_t* dout = dmalloc<uint8_t>(want.size(), 0);
    for (const auto& v : vs) {
      poison(dout, want.size());
      v.fn(din, dout, n);
      CK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = hcopy(dout, want.size());
      size_t bad = 0;
      for (size_t i = 0; i < got.size(); i += ob) bad += std::memcmp(&got[i], &want[i], ob) != 0;
      if (bad) {
        std::printf("FAIL %-8s %-40s n=%u: %zu elements differ\n", what, v.name.c_str(), n, bad);
        ++g_fail;
      }
    }
    CK(cudaFree(din));
    CK(cudaFree(dout));
  }
  std::printf("check %-8s %zu variants x 3 sizes done\n", what, vs.size());
}

// ---- timing -----------------------------------------------------------------------------------
template <typename F>
static float median_ms(F&& f) {  // median of 30 after 5 warm-ups
  return time_ms(f, 5, 30);
}

static void row(const std::string& name, double bytes, float ms, float copy_ms) {
  std::printf("  %-46s %9.4f ms %7.0f GB/s %6.1f%%\n", name.c_str(), ms, bytes / ms / 1e6,
              100.0 * copy_ms / ms);
}

static void bench_size(uint32_t n) {
  void *a, *b;
  uint32_t* sink;
  CK(cudaMalloc(&a, size_t(n) * 4));
  CK(cudaMalloc(&b, size_t(n) * 4));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(a, 0, size_t(n) * 4));  // zeros: a valid bf16 / fp32 input for every kind
  const double cast_b = 6.0 * n, copy32_b = 8.0 * n;
  auto memcpy_ms = [&](double moved) {  // a D2D copy moving `moved` bytes (reads + writes)
    const size_t sz = static_cast<size_t>(moved / 2);
    return median_ms([&] { CK(cudaMemcpyAsync(b, a, sz, cudaMemcpyDeviceToDevice)); });
  };
  const float c6 = memcpy_ms(cast_b), c8 = memcpy_ms(copy32_b);
  std::printf("\nbench n = %u (16x1024x%u)  [%%: memcpy moving the same bytes / ours]\n", n,
              n / (16 * 1024));
  std::printf(" baselines\n");
  row("memcpy D2D moving 6n B (copies 3n B)", cast_b, c6, c6);
  row("memcpy D2D moving 8n B (copies 4n B)", copy32_b, c8, c8);
  const uint32_t nv3 = static_cast<uint32_t>(3ull * n / 16);
  row("copy kernel moving 6n B", cast_b, median_ms([&] {
        copy_kernel<<<static_cast<unsigned>(ceil_div(nv3, kT)), kT>>>(static_cast<const uint4*>(a),
                                                                      static_cast<uint4*>(b), nv3);
      }),
      c6);
  const uint32_t nw4 = n / 4;  // 4n bytes of uint4
  const float w4 = median_ms([&] {
    write_only<false>
        <<<static_cast<unsigned>(ceil_div(nw4, kT)), kT>>>(static_cast<uint4*>(b), nw4, 0u);
  });
  row("write-only kernel 4n B (fp32 output alone)", 4.0 * n, w4, c6);
  row("write-only kernel 4n B, __stcs", 4.0 * n, median_ms([&] {
        write_only<true>
            <<<static_cast<unsigned>(ceil_div(nw4, kT)), kT>>>(static_cast<uint4*>(b), nw4, 0u);
      }),
      c6);
  row("cudaMemsetAsync 4n B", 4.0 * n, median_ms([&] { CK(cudaMemsetAsync(b, 0, size_t(n) * 4)); }),
      c6);
  const uint32_t nw6 = static_cast<uint32_t>(6ull * n / 16 / 2);  // 3n bytes within b (4n)
  row("write-only kernel 3n B", 3.0 * n, median_ms([&] {
        write_only<false>
            <<<static_cast<unsigned>(ceil_div(nw6, kT)), kT>>>(static_cast<uint4*>(b), nw6, 0u);
      }),
      c6);
  const uint32_t nr2 = n / 8;  // 2n bytes
  const float r2 = median_ms([&] {
    read_only<<<ew_blocks(ceil_div(nr2, 4)), kT>>>(static_cast<const uint4*>(a), nr2, sink);
  });
  row("read-only sum 2n B (bf16 input alone)", 2.0 * n, r2, c6);
  const uint32_t nr4 = n / 4;  // 4n bytes
  row("read-only sum 4n B", 4.0 * n, median_ms([&] {
        read_only<<<ew_blocks(ceil_div(nr4, 4)), kT>>>(static_cast<const uint4*>(a), nr4, sink);
      }),
      c6);
  std::printf("  (read 2n + write 4n run one after the other: %.4f ms = %.1f%% of the 6n copy)\n",
              r2 + w4, 100.0 * c6 / (r2 + w4));
  std::printf(" bf16 -> fp32 (6n B moved)\n");
  for (const auto& v : widen_variants()) row(v.name, cast_b, median_ms([&] { v.fn(a, b, n); }), c6);
  std::printf(" fp32 -> bf16 (6n B moved)\n");
  for (const auto& v : narrow_variants()) {
    row(v.name, cast_b, median_ms([&] { v.fn(a, b, n); }), c6);
  }
  std::printf(" fp32 -> fp32 (8n B moved)\n");
  for (const auto& v : copy_variants()) {
    row(v.name, copy32_b, median_ms([&] { v.fn(a, b, n); }), c8);
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(sink));
}

int main(int argc, char** argv) {
  const bool do_check = argc < 2 || std::string(argv[1]) != "--bench";
  const bool do_bench = argc < 2 || std::string(argv[1]) != "--check";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, g_sms, prop.l2CacheSize >> 20);
  if (do_check) {
    check_kind(0, widen_variants(), "bf16>f32");
    check_kind(1, narrow_variants(), "f32>bf16");
    check_kind(2, copy_variants(), "f32>f32");
  }
  if (do_bench) {
    bench_size(16u * 1024 * 768);
    bench_size(16u * 1024 * 3072);
  }
  std::printf(g_fail ? "cast_check: %d FAIL\n" : "cast_check: all PASS\n", g_fail);
  return g_fail ? 1 : 0;
}
