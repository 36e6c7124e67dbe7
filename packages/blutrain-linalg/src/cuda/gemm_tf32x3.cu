// float32 GEMM on TF32 tensor cores with the 3xTF32 split: fp32 GEMMs on sm_80+ (Note [3xTF32]).
//
// Note [3xTF32]
// Each operand element x is split into hi (x rounded to TF32's 10-bit mantissa) and
// lo = x - hi (exact in fp32; the MMA reads its top 10 bits). A product is then
//     a b ~= a_lo b_hi + a_hi b_lo + a_hi b_hi
// (a_lo b_lo, about 2^-22 of a b, is dropped), small terms first, by mma.sync m16n8k8.
// Accuracy: the tensor cores add into their fp32 accumulator without round-to-nearest, so a
// long k on one accumulator loses bits (error ~10x cuBLAS SGEMM's at k = 768 in
// bench/gemm_tf32x3_check.cu). Each 32-k tile is therefore summed into a zeroed partial that is
// then added to the running sum with an ordinary fp32 add ("promotion"): the measured error
// against float64 is then about half SGEMM's (GPT-2 shapes: max 6e-8 vs 2e-7 of sum |a b|).
// hi comes from integer rounding ((bits + 0x1000) & ~0x1fff: half away from zero), two integer
// ops; timed 5-8% faster than cvt.rna.tf32 (which rounds half to even).
// Non-finite operands: NaN stays NaN (lo = NaN); an infinite operand gives NaN, not +-inf, in the
// outputs it reaches (inf - inf in lo), as does a finite |x| within 2^-11 of FLT_MAX (hi rounds
// to inf).
//
// Tiles. A block computes a 128 x 128 tile of D with 8 warps (2 along m x 4 along n, each 64 x 32:
// 4 x 4 MMA tiles). K advances 32 at a time through a 4-stage cp.async ring. Operands are copied
// as they are laid out (row-major op(A) is "K-contiguous" when transa = N, "M-contiguous" when T;
// op(B) is "N-contiguous" when transb = N, "K-contiguous" when T), so all four combinations run
// without transposing copies; only the shared-memory reads differ. A 64 x 64 warp tile runs
// ~15% faster but has no registers left for the promotion.
//
// Note [k order in a k8 step]
// An m16n8k8 MMA wants thread t's A elements at k = t and t + 4 (and B's likewise). The sum over
// k does not care which 8 k's are which, so thread t takes the k's stored at 2t and 2t + 1
// instead, in A and B alike: for K-contiguous tiles that is one 8-byte shared load per row.
//
// Split-K. Few output tiles over a long k (weight gradients: 768 x 768 over k = 16384) would
// leave most SMs idle; those calls split k into S slices that write fp32 partials to a
// workspace, and a second kernel sums them in a fixed order (deterministic) and applies
// alpha / beta.
//
// Requirements (gemm_tf32x3_supported): A and B 16-byte aligned, their ld and batch strides
// multiples of 4 elements (cp.async moves 16 bytes), k < 2^30; sm_80 or newer. C and D have
// none: the epilogue stores pairs only where D's alignment allows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace blutrain::linalg::kern {

namespace {

// ---- kernels ----------------------------------------------------------------------------------
// A tile shape: BM x BN of D per block, WM x WN warps, BK = 32 k's per pipeline stage.
template <int BM_, int BN_, int WM_, int WN_, int STAGES_, bool PROMOTE_ = false,
          bool INT_SPLIT_ = false>
struct Cfg {
  static constexpr int BM = BM_, BN = BN_, BK = 32, WM = WM_, WN = WN_, STAGES = STAGES_;
  static constexpr bool PROMOTE = PROMOTE_, INT_SPLIT = INT_SPLIT_;
  static constexpr int kThreads = 32 * WM * WN;
  static constexpr int MI = BM / WM / 16;  // m16 MMA tiles per warp
  static constexpr int NI = BN / WN / 8;   // n8 MMA tiles per warp
  // Row strides in floats. K-contiguous tiles hold rows of 32 k's, M/N-contiguous tiles 32 rows
  // of BM (BN); the pads make each warp's fragment reads hit 32 distinct banks.
  static constexpr int kLdK = BK + 8;
  static constexpr int kLdA = BM + 4, kLdB = BN + 4;
  static constexpr int kTileA = (BM * kLdK > BK * kLdA) ? BM * kLdK : BK * kLdA;
  static constexpr int kTileB = (BN * kLdK > BK * kLdB) ? BN * kLdK : BK * kLdB;
  static constexpr int kStageFloats = kTileA + kTileB;
  static constexpr size_t kSmemBytes = size_t(STAGES) * kStageFloats * sizeof(float);
};
// The library's tile: 128 x 128, 8 warps of 64 x 32, 4 stages (160 KiB of shared memory),
// promoted once per k tile, hi by integer rounding (Note [3xTF32]).
using Tile128 = Cfg<128, 128, 2, 4, 4, true, true>;
constexpr int kBK = 32;

struct Args {
  const float* a;
  const float* b;
  const float* c;
  float* d;  // the output, or the split-K workspace
  int64_t lda, ldb, ldc, ldd;
  int64_t bsa, bsb, bsc, bsd;  // batch strides (elements)
  int64_t m, n, k;
  int64_t k_per_split;  // multiple of kBK
  int splits;
  float alpha, beta;  // applied here only when splits == 1
};

__device__ __forceinline__ void cp_async16(float* smem, const float* gmem, int bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Bytes of a 16-byte chunk that lie in range, given the elements left in its row.
__device__ __forceinline__ int clamp_bytes(int64_t left) {
  return left <= 0 ? 0 : left >= 4 ? 16 : int(left) * 4;
}

// Loads of one ROWS x 32 operand tile per stage (rows along m or n). kKContig: ROWS rows of 32
// k's (ld LDK); else 32 rows of ROWS (ld LDMN). Thread tid's chunks differ only by a fixed row
// step, so a thread keeps one global pointer and its range limits, and a stage costs a pointer
// step, a compare and a cp.async per chunk. Out-of-range bytes are zero-filled (cp.async's
// source size).
template <bool kKContig, int ROWS, int LDK, int LDMN, int THREADS>
struct TileLoader {
  static constexpr int kChunks = ROWS * 8 / THREADS;  // 16-byte chunks per thread
  static_assert(ROWS * 8 % THREADS == 0, "tile chunks must split evenly over the threads");
  // K-contiguous: chunk i is row (tid / 8) + i * THREADS / 8, k's (tid % 8) * 4 .. + 3.
  // M/N-contiguous: chunk i is k row tid / (ROWS / 4) + i * THREADS / (ROWS / 4), columns
  // (tid % (ROWS / 4)) * 4 .. + 3.
  static constexpr int kPerRowK = 8, kPerRowMN = ROWS / 4;
  static constexpr int kStepK = THREADS / kPerRowK, kStepMN = THREADS / kPerRowMN;
  const float* g;     // this thread's first chunk at the current k tile
  const float* base;  // a valid address for chunks that read nothing
  int64_t step;       // elements between its chunks
  int64_t advance;    // elements per k tile
  int smem_off;       // floats
  int k_first;        // k offset of its first chunk within a k tile
  int fixed;          // K-contig: rows left below its first row; else: its columns' bytes (0..16)
  __device__ __forceinline__ void init(const float* base, int64_t ld, int64_t r0, int64_t rows,
                                       int64_t k0) {
    const int tid = int(threadIdx.x);
    this->base = base;
    if (kKContig) {
      const int r = tid / kPerRowK, kc = (tid % kPerRowK) * 4;
      g = base + (r0 + r) * ld + k0 + kc;
      step = int64_t(kStepK) * ld;
      advance = 32;
      smem_off = r * LDK + kc;
      k_first = kc;
      const int64_t left = rows - r0 - r;
      fixed = left > (int64_t(1) << 30) ? (1 << 30) : int(left);
    } else {
      const int kr = tid / kPerRowMN, c = (tid % kPerRowMN) * 4;
      g = base + (k0 + kr) * ld + r0 + c;
      step = int64_t(kStepMN) * ld;
      advance = 32 * ld;
      smem_off = kr * LDMN + c;
      k_first = kr;
      fixed = clamp_bytes(rows - r0 - c);
    }
  }
  // k_left: k's left from the start of this k tile (may exceed 32).
  __device__ __forceinline__ void load(float* tile, int k_left) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      int bytes;
      if (kKContig)
        bytes = i * kStepK < fixed ? clamp_bytes(k_left - k_first) : 0;
      else
        bytes = k_first + i * kStepMN < k_left ? fixed : 0;
      const float* src = g + i * step;
      cp_async16(tile + smem_off + i * (kKContig ? kStepK * LDK : kStepMN * LDMN),
                 bytes ? src : base, bytes);
    }
    g += advance;
  }
};

// Elements (row, k) and (row, k + 1) of a tile (Note [k order in a k8 step]).
template <bool kKContig, int LDK, int LDMN>
__device__ __forceinline__ float2 ld_pair(const float* tile, int row, int k) {
  if (kKContig) return *reinterpret_cast<const float2*>(tile + row * LDK + k);
  return make_float2(tile[k * LDMN + row], tile[(k + 1) * LDMN + row]);
}

template <bool kInt>
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  if (kInt) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  } else {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
  }
  lo = __float_as_uint(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float (&acc)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// kAK: A K-contiguous (transa = N); kBKc: B K-contiguous (transb = T).
template <class T, bool kAK, bool kBKc>
__global__ void __launch_bounds__(T::kThreads, 1) gemm_tf32x3_k(Args p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // mma tf32, cp.async: sm_80+
  constexpr int MI = T::MI, NI = T::NI, BK = T::BK;
  extern __shared__ __align__(16) float smem[];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / T::WN, wn = warp % T::WN;
  const int64_t m0 = int64_t(blockIdx.y) * T::BM, n0 = int64_t(blockIdx.x) * T::BN;
  const int bz = int(blockIdx.z) / p.splits, slice = int(blockIdx.z) % p.splits;
  const float* A = p.a + bz * p.bsa;
  const float* B = p.b + bz * p.bsb;
  const int64_t kb = slice * p.k_per_split;
  const int64_t ke = min(p.k, kb + p.k_per_split);
  const int ktiles = int((ke - kb + BK - 1) / BK);

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  TileLoader<kAK, T::BM, T::kLdK, T::kLdA, T::kThreads> load_a;
  TileLoader<kBKc, T::BN, T::kLdK, T::kLdB, T::kThreads> load_b;
  load_a.init(A, p.lda, m0, p.m, kb);
  load_b.init(B, p.ldb, n0, p.n, kb);
  const int k_len = ke > kb ? int(ke - kb) : 0;
  auto load_stage = [&](int kt) {  // called for kt = 0, 1, 2, ... in order
    float* st = smem + (kt % T::STAGES) * T::kStageFloats;
    load_a.load(st, k_len - kt * BK);
    load_b.load(st + T::kTileA, k_len - kt * BK);
  };
#pragma unroll
  for (int s = 0; s < T::STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<T::STAGES - 2>();
    __syncthreads();  // stage kt landed for all; stage kt - 1 is free for everyone
    if (kt + T::STAGES - 1 < ktiles) load_stage(kt + T::STAGES - 1);
    cp_async_commit();
    const float* sa = smem + (kt % T::STAGES) * T::kStageFloats;
    const float* sb = sa + T::kTileA;
    float part[T::PROMOTE ? MI : 1][T::PROMOTE ? NI : 1][4];
    if (T::PROMOTE) {
#pragma unroll
      for (int i = 0; i < (T::PROMOTE ? MI : 1); ++i)
#pragma unroll
        for (int j = 0; j < (T::PROMOTE ? NI : 1); ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[i][j][e] = 0.f;
    }
    auto tgt = [&](int i, int j) -> float (&)[4] {
      if constexpr (T::PROMOTE)
        return part[i][j];
      else
        return acc[i][j];
    };
#pragma unroll
    for (int k8 = 0; k8 < BK; k8 += 8) {
      uint32_t ahi[MI][4], alo[MI][4], bhi[NI][2], blo[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int r = wm * (MI * 16) + i * 16 + g;
        const float2 top = ld_pair<kAK, T::kLdK, T::kLdA>(sa, r, k8 + 2 * t);      // (a0, a2)
        const float2 bot = ld_pair<kAK, T::kLdK, T::kLdA>(sa, r + 8, k8 + 2 * t);  // (a1, a3)
        split<T::INT_SPLIT>(top.x, ahi[i][0], alo[i][0]);
        split<T::INT_SPLIT>(bot.x, ahi[i][1], alo[i][1]);
        split<T::INT_SPLIT>(top.y, ahi[i][2], alo[i][2]);
        split<T::INT_SPLIT>(bot.y, ahi[i][3], alo[i][3]);
      }
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const float2 v = ld_pair<kBKc, T::kLdK, T::kLdB>(sb, wn * (NI * 8) + j * 8 + g, k8 + 2 * t);
        split<T::INT_SPLIT>(v.x, bhi[j][0], blo[j][0]);
        split<T::INT_SPLIT>(v.y, bhi[j][1], blo[j][1]);
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_tf32(tgt(i, j), alo[i], bhi[j]);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_tf32(tgt(i, j), ahi[i], blo[j]);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) mma_tf32(tgt(i, j), ahi[i], bhi[j]);
    }
    if constexpr (T::PROMOTE) {
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[i][j][e] += part[i % (T::PROMOTE ? MI : 1)][j % (T::PROMOTE ? NI : 1)][e];
    }
  }
  cp_async_wait<0>();

  // Epilogue: D = alpha acc + beta C, or the raw partial into the slice's workspace.
  const bool direct = p.splits == 1;
  float* D = p.d + (direct ? bz * p.bsd : int64_t(blockIdx.z) * p.m * p.n);
  const int64_t ldd = direct ? p.ldd : p.n;
  const float* C = p.c + bz * p.bsc;
  const bool pairs = (ldd % 2 == 0) && (reinterpret_cast<uintptr_t>(D) % 8 == 0);
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m0 + wm * (MI * 16) + i * 16 + g + h * 8;
      if (row >= p.m) continue;
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int64_t col = n0 + wn * (NI * 8) + j * 8 + 2 * t;
        float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
        if (direct) {
          v0 *= p.alpha;
          v1 *= p.alpha;
          if (p.beta != 0.f) {
            if (col < p.n) v0 += p.beta * C[row * p.ldc + col];
            if (col + 1 < p.n) v1 += p.beta * C[row * p.ldc + col + 1];
          }
        }
        float* out = D + row * ldd + col;
        if (pairs && col + 1 < p.n) {
          *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
        } else {
          if (col < p.n) out[0] = v0;
          if (col + 1 < p.n) out[1] = v1;
        }
      }
    }
#else
  __trap();  // never launched there: gemm_cuda.cpp routes sm < 80 to cuBLAS
#endif
}

// D[b] = alpha sum_s W[b, s] + beta C[b], the split-K partials summed in order s = 0, 1, ...
__global__ void splitk_reduce_k(const float* w, int splits, float* d, int64_t ldd, int64_t bsd,
                                const float* c, int64_t ldc, int64_t bsc, float alpha, float beta,
                                int64_t m, int64_t n, int64_t batch) {
  const int64_t mn = m * n, total = batch * mn;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / mn, rc = i % mn, row = rc / n, col = rc % n;
    const float* src = w + b * splits * mn + rc;
    float s = 0.f;
    for (int j = 0; j < splits; ++j) s += src[j * mn];
    float v = alpha * s;
    if (beta != 0.f) v += beta * c[b * bsc + row * ldc + col];
    d[b * bsd + row * ldd + col] = v;
  }
}

// Slices for split-K: the count that minimises (waves of blocks) x (k tiles per slice), with a
// small charge per slice for the partials' traffic; at least 8 k tiles per slice.
int pick_splits(int64_t tiles, int64_t k, int sms) {
  const int64_t ktiles = (k + kBK - 1) / kBK;
  int best = 1;
  double best_cost = 1e300;
  for (int s = 1; s <= 16; ++s) {
    if (s > 1 && ktiles / s < 8) break;
    const int64_t waves = (tiles * s + sms - 1) / sms;
    const double cost = double(waves) * double((ktiles + s - 1) / s) * (1.0 + 0.03 * (s - 1));
    if (cost < best_cost) best_cost = cost, best = s;
  }
  return best;
}

int g_sms[64] = {0};

int sm_count(int dev) {
  if (dev < 0 || dev >= 64) return 132;
  if (!g_sms[dev]) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0)
      v = 132;
    g_sms[dev] = v;
  }
  return g_sms[dev];
}

template <class T, bool kAK, bool kBKc>
cudaError_t launch(const Args& a, dim3 grid, int dev, cudaStream_t s) {
  static bool attr_set[64] = {false};  // benign race: every writer stores true
  if (dev < 0 || dev >= 64 || !attr_set[dev]) {
    if (cudaError_t e =
            cudaFuncSetAttribute(gemm_tf32x3_k<T, kAK, kBKc>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, int(T::kSmemBytes)))
      return e;
    if (dev >= 0 && dev < 64) attr_set[dev] = true;
  }
  gemm_tf32x3_k<T, kAK, kBKc><<<grid, T::kThreads, T::kSmemBytes, s>>>(a);
  return cudaGetLastError();
}

template <class T>
int splits_for(const Tf32x3Problem& p, int dev) {
  if (p.batch * 16 > 65535) return 1;  // grid z limit
  const int64_t tiles = ((p.m + T::BM - 1) / T::BM) * ((p.n + T::BN - 1) / T::BN) * p.batch;
  return pick_splits(tiles, p.k, sm_count(dev));
}

template <class T>
int run(const Tf32x3Problem& p, int dev, void* workspace, cudaStream_t s) {
  int splits = splits_for<T>(p, dev);
  if (splits > 1 && !workspace) splits = 1;
  Args a{};
  a.a = p.a, a.b = p.b, a.c = p.beta != 0.0 ? p.c : p.d;
  a.lda = p.lda, a.ldb = p.ldb, a.ldc = p.beta != 0.0 ? p.ldc : p.ldd;
  a.bsa = p.bsa, a.bsb = p.bsb, a.bsc = p.beta != 0.0 ? p.bsc : p.bsd, a.bsd = p.bsd;
  a.m = p.m, a.n = p.n, a.k = p.k;
  a.splits = splits;
  const int64_t ktiles = (p.k + kBK - 1) / kBK;
  a.k_per_split = ((ktiles + splits - 1) / splits) * kBK;
  a.alpha = float(p.alpha), a.beta = float(p.beta);
  a.d = splits > 1 ? static_cast<float*>(workspace) : p.d;
  a.ldd = p.ldd;
  const dim3 grid(unsigned((p.n + T::BN - 1) / T::BN), unsigned((p.m + T::BM - 1) / T::BM),
                  unsigned(p.batch * splits));
  cudaError_t e;
  if (p.transa == 0 && p.transb == 1)
    e = launch<T, true, true>(a, grid, dev, s);
  else if (p.transa == 0)
    e = launch<T, true, false>(a, grid, dev, s);
  else if (p.transb == 1)
    e = launch<T, false, true>(a, grid, dev, s);
  else
    e = launch<T, false, false>(a, grid, dev, s);
  if (e != cudaSuccess || splits == 1) return int(e);
  const int64_t total = p.batch * p.m * p.n;
  const int blocks = int(std::min<int64_t>((total + 255) / 256, 8 * sm_count(dev)));
  splitk_reduce_k<<<blocks, 256, 0, s>>>(static_cast<const float*>(workspace), splits, p.d, p.ldd,
                                         p.bsd, a.c, a.ldc, a.bsc, a.alpha, a.beta, p.m, p.n,
                                         p.batch);
  return int(cudaGetLastError());
}

#ifdef BT_TF32X3_VARIANTS
// Harness only (bench/gemm_tf32x3_check.cu times and checks the alternatives; Note [3xTF32]).
int g_variant = 0;
using Tile128x256Fast = Cfg<128, 256, 2, 4, 3, false, true>;  // 64 x 64 warps, no promotion
using Tile128Cvt = Cfg<128, 128, 2, 4, 4, true, false>;       // hi by cvt.rna.tf32
#define BT_TF32X3_DISPATCH(fn, ...)                    \
  (g_variant == 1   ? fn<Tile128x256Fast>(__VA_ARGS__) \
   : g_variant == 2 ? fn<Tile128Cvt>(__VA_ARGS__)      \
                    : fn<Tile128>(__VA_ARGS__))
#else
#define BT_TF32X3_DISPATCH(fn, ...) fn<Tile128>(__VA_ARGS__)
#endif

template <class T>
size_t workspace_for(const Tf32x3Problem& p, int dev) {
  const int s = splits_for<T>(p, dev);
  return s > 1 ? size_t(s) * size_t(p.batch * p.m * p.n) * sizeof(float) : 0;
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------
bool gemm_tf32x3_supported(const Tf32x3Problem& p) {
  auto al16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (!al16(p.a) || !al16(p.b) || p.lda % 4 || p.ldb % 4) return false;
  if (p.batch > 1 && (p.bsa % 4 || p.bsb % 4)) return false;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.batch <= 0 || p.batch > 65535) return false;
  return (p.m + 127) / 128 <= 65535 && p.k < (int64_t(1) << 30);  // m tiles in grid y; int k
}

size_t gemm_tf32x3_workspace_bytes(const Tf32x3Problem& p, int dev) {
  return BT_TF32X3_DISPATCH(workspace_for, p, dev);
}

int gemm_tf32x3(const Tf32x3Problem& p, int dev, void* workspace, void* stream) {
  return BT_TF32X3_DISPATCH(run, p, dev, workspace, static_cast<cudaStream_t>(stream));
}

}  // namespace blutrain::linalg::kern
