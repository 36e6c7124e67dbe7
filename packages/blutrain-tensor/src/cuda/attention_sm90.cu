// cuda/attention_sm90.cu: bf16/fp16 flash attention on Hopper warpgroup MMA (wgmma) and TMA: the
// forward (D 64, 128) and the D 64 backward (attn_bwd_sm90_ws, near the end of the kernels).
//
// Same semantics and output layout as attn_fwd_v2 (attention.cu): o (B, L, H, D) contiguous,
// lse (B, H, L) float32, natural log.  Built only for sm_90a (wgmma is an arch-specific feature);
// the launchers return false elsewhere and attention.cu runs mma.sync.
//
// Block: kWG warpgroups (128 threads each), each owning 64 query rows (kBr = 64 kWG), sharing
// a ring of K / V tiles of kBc keys that all threads load with cp.async.  Per key tile, per
// warpgroup:  S = Q K^T  (wgmma, A = Q from registers, B = K from shared memory, K-major),  the
// online softmax on S in registers (the accumulator layout is mma.sync's C layout per warp, so the
// masking and softmax code matches attn_fwd_v2),  O += P V  (wgmma, A = P from registers, B = V
// from shared memory, N-major: the transposed-B form).  No TMA or warp specialisation.
// attn_fwd_sm90_ws (the default where TMA maps can describe q, k, v): the same math with one
// producer warp loading through TMA and mbarriers, the consumers free of loads and block barriers,
// warpgroups taking turns at the tensor cores (Note [ping-pong]) and, by default, one persistent
// block per SM walking the query tiles (Note [persistent forward]).  Measured (H200, B16 H12
// T1024 D64, bench/attn_sm90_check.cu, session 13): persistent ws 0.090 ms causal / 0.143 full
// (Bc 128, 4 stages, ping-pong), one block per tile 0.110 / 0.159, cp.async kernel 0.120 causal,
// mma.sync 0.137; D128 (H6): persistent 0.078 / 0.122, one block per tile 0.086 / 0.129.  Tried
// and slower for the cp.async kernel: key tiles of 128, three warpgroups, one warpgroup per
// block, a share of the exponentials as an FMA polynomial, heads as the fast grid index; for ws:
// two blocks of 64-key tiles per SM, three warpgroups.
//
// Note [shared-memory layout for wgmma]: tiles are panels of 64 columns (128 bytes a row); in a
// panel, 16-byte chunk c of row r sits at chunk c ^ (r % 8): the hardware's 128-byte swizzle,
// with each 8-row group (1024 bytes) one swizzle atom, so every tile starts 1024-byte aligned.
// For D = 64 this is attention_mma.cuh's swz<64> layout.  Descriptors (PTX "matrix descriptor"):
//   K-major (Q as A, K as B): rows = M|N, 64 elements of K per panel row; SBO = 1024 (next 8
//     rows); LBO unused; the k-step of 16 elements (32 bytes) advances the start address by 32
//     bytes inside the atom, panel p by p * rows * 128 bytes.
//   N-major (V as B, transposed): rows = K (keys), 64 N-elements (d) per panel row; SBO = 1024
//     (next 8 keys), LBO = the panel stride (next 64 d); the k-step of 16 keys advances the start
//     by 16 * 128 bytes.
// wgmma register layouts (m64nNk16, per warp w of the warpgroup, g = lane / 4, t = lane % 4): the
// f32 accumulator d[4 i + e] is row 16 w + g + 8 (e / 2), column 8 i + 2 t + (e % 2) — mma.sync's
// C tile i; the register A fragment (four .b32) is mma.sync's m16n8k16 A fragment of rows
// 16 w .. 16 w + 15.
#include <cuda.h>  // CUtensorMap (the encoder is fetched through the runtime: no -lcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "attention_mma.cuh"
#include "attention_rows.cuh"
#include "common.cuh"

namespace bt::cuda {

namespace {

// Which of a tensor map's middle coordinates is the head: maps list dims by increasing stride
// (d, then head and row in stride order, then batch).
struct TmaOrder {
  bool q_h_inner, k_h_inner, v_h_inner, g_h_inner;  // (g: dO, backward only)
};
// Registers per thread for kMinBlocks blocks of kWG warpgroups + 1 warp on an SM (64 K registers,
// allocated 8 per thread at a time, to warps in groups of 4: a 9-warp block is charged for 12, so
// 201 registers fail to launch with "too many resources"; at most 255).  Spelled out (not
// launch-bounds' minimum blocks): ptxas's own cap for 288 threads x 2 blocks was 94, and spilled.
constexpr int ws_max_regs(int wg, int min_blocks) {
  const int warps = (wg * 4 + 1 + 3) / 4 * 4;
  const int r = 65536 / (min_blocks * warps * 32) / 8 * 8;
  return r > 255 ? 255 : r;
}

// ==== kernels ==================================================================================

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BT_SM90_WGMMA 1
#endif

__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wg_fence() {
#ifdef BT_SM90_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#ifdef BT_SM90_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#ifdef BT_SM90_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Generic-proxy writes (cp.async) to shared memory made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
#ifdef BT_SM90_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for register A operands: keeps them live (unrecycled) until the wgmma reading them is
// known complete.
template <int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
  }
}

// The wgmma wrappers: d (N / 2 floats) += A B (or = A B when scale_d is 0), bf16 or fp16
// inputs, A from registers; B from shared memory, K-major (wgmma_rs) or N-major (wgmma_rs_tb).
#define BT_WG_REGS32                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define BT_WG_OUT32(d)                                                                            \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define BT_WG_REGS64                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, "                                                                                       \
  "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "  \
  "%57, "                                                                                       \
  "%58, %59, %60, %61, %62, %63}"
#define BT_WG_OUT64(d)                                                                           \
  BT_WG_OUT32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),  \
      "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), \
      "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
      "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), \
      "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d += A B with A (64 x 16) from registers (a: four .b32 of two 16-bit elements), B N-major.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4],
                                            uint64_t db) {
#ifdef BT_SM90_WGMMA
  if constexpr (N == 64 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BT_WG_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : BT_WG_OUT32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " BT_WG_REGS32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : BT_WG_OUT32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 128 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BT_WG_REGS64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : BT_WG_OUT64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else {
    static_assert(N == 128, "wgmma_rs_tb: N is 64 or 128");
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " BT_WG_REGS64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : BT_WG_OUT64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
#else
  __trap();
#endif
}

// d = (scale_d ? d : 0) + A B, A (64 x 16) from registers, B K-major (S = Q K^T with Q held in
// registers: only K is read from shared memory).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db,
                                         int scale_d) {
#ifdef BT_SM90_WGMMA
  if constexpr (N == 64 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BT_WG_REGS32
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : BT_WG_OUT32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  } else if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " BT_WG_REGS32
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : BT_WG_OUT32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  } else if constexpr (N == 128 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BT_WG_REGS64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : BT_WG_OUT64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  } else {
    static_assert(N == 128, "wgmma_rs: N is 64 or 128");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " BT_WG_REGS64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : BT_WG_OUT64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  }
#else
  __trap();
#endif
}

// d = (scale_d ? d : 0) + A B with A and B both from shared memory, K-major unless kTA / kTB (S =
// Q K^T in the warp-specialised forward: Q is read from shared memory, which keeps the consumers
// within the register budget of two 288-thread blocks per SM; the backward's dQ = dS K reads both
// operands M|N-major: kTA = kTB = 1).
template <typename T, int N, int kTA = 0, int kTB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
#ifdef BT_SM90_WGMMA
  if constexpr (N == 64 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BT_WG_REGS32
        ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : BT_WG_OUT32(d)
        : "l"(da), "l"(db), "r"(scale_d), "n"(kTA), "n"(kTB));
  } else if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " BT_WG_REGS32
        ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : BT_WG_OUT32(d)
        : "l"(da), "l"(db), "r"(scale_d), "n"(kTA), "n"(kTB));
  } else if constexpr (N == 128 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BT_WG_REGS64
        ", %64, %65, p, 1, 1, %67, %68;\n}\n"
        : BT_WG_OUT64(d)
        : "l"(da), "l"(db), "r"(scale_d), "n"(kTA), "n"(kTB));
  } else {
    static_assert(N == 128, "wgmma_ss: N is 64 or 128");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " BT_WG_REGS64
        ", %64, %65, p, 1, 1, %67, %68;\n}\n"
        : BT_WG_OUT64(d)
        : "l"(da), "l"(db), "r"(scale_d), "n"(kTA), "n"(kTB));
  }
#else
  __trap();
#endif
}

// ---- mbarriers and TMA (the warp-specialised kernel) ------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void mbar_init_fence() {
#ifdef BT_SM90_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also expects `bytes` of TMA transactions before the phase can complete.
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* bar, uint32_t bytes) {
#ifdef BT_SM90_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
#else
  __trap();  // (sm_90 only; the launchers never run these kernels elsewhere)
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Spins until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifndef BT_SM90_WGMMA
  __trap();
#endif
  uint32_t done = 0;
  do {
#ifdef BT_SM90_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
#endif
  } while (!done);
}
// Named barriers 1.. (0 is __syncthreads): `threads` = the waiting + the arriving threads.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Register budget of this warp's warpgroup changed to N per thread (every warp of the warpgroup
// runs the same one): the producer gives registers back, the consumers take them.
template <int N>
__device__ __forceinline__ void regs_dec() {
#ifdef BT_SM90_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void regs_inc() {
#ifdef BT_SM90_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
// One box of a 4-d tensor map into shared memory; completion counted on `bar` (in bytes).
__device__ __forceinline__ void tma_load4(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                          int c1, int c2, int c3) {
#ifdef BT_SM90_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}

// Adds a box of float32 shared memory into global memory through a 3-d tensor map (TMA reduce:
// the L2 does the read-modify-write; the issuing thread goes on at once).  One bulk group per
// commit; wait_read<N>: all but the newest N groups have finished reading shared memory;
// wait_all: all complete, their writes performed.
__device__ __forceinline__ void tma_reduce_add3(const void* src, const CUtensorMap* map, int c0,
                                                int c1, int c2) {
#ifdef BT_SM90_WGMMA
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef BT_SM90_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef BT_SM90_WGMMA
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void bulk_wait_all() {
#ifdef BT_SM90_WGMMA
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Shared-memory accesses by 32-bit shared address (a generic pointer costs 64-bit arithmetic).
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v2f(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ float2 ld_shared_v2f(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// The n-th of `count` work items this block runs, -1 past its last.  One item per block (a 2-d
// grid): item blockIdx.y * gridDim.x + blockIdx.x at n = 0.  Persistent (one block per SM): block
// i of G takes items i, 2G - 1 - i, 2G + i, ..., a snake that spreads the costly items, dealt
// first, over every block (Note [persistent forward]).
template <bool kPersistent>
__device__ __forceinline__ int block_item(int n, int count) {
  if constexpr (!kPersistent) {
    return n == 0 ? static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x) : -1;
  } else {
    const int G = gridDim.x, i = blockIdx.x;
    const int t = n * G + ((n & 1) ? G - 1 - i : i);
    return t < count ? t : -1;
  }
}

// Element offset of (row, 16-byte chunk c) in a panel-swizzled tile of R rows and D columns.
template <int R>
__device__ __forceinline__ int pswz(int row, int c) {
  return (c >> 3) * R * 64 + row * 64 + (((c & 7) ^ (row & 7)) << 3);
}
// Async copy of rows [row0, row0 + R) of a (rows, D) matrix with row stride ld into a
// panel-swizzled tile; rows >= nrows are zero-filled.  All NT threads of the block call it.
template <int R, int D, int NT, typename T>
__device__ __forceinline__ void load_ptile(T* tile, const T* src, int64_t ld, int row0, int nrows) {
  constexpr int C = D / 8;
#pragma unroll
  for (int idx = threadIdx.x; idx < R * C; idx += NT) {
    const int r = idx / C, c = idx % C;
    const bool ok = row0 + r < nrows;
    const T* s = ok ? src + (row0 + r) * ld + c * 8 : src;
    cp_async16(smem_u32(tile + pswz<R>(r, c)), s, ok);
  }
}

// ---- the consumer's per-tile steps (both forward kernels) ------------------------------------
// s: S_j in the accumulator layout -> P_j (unnormalised, log2 domain); m, l: running max and
// per-thread partial sum of rows row_lo and row_lo + 8; alpha: O's rescale factors.  Columns past
// S or (causal) past the row are masked; warp_row0 is the warp's first row.
template <int kBc>
__device__ __forceinline__ void online_softmax(float (&s)[kBc / 2], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], const AttnParams& p, int k0,
                                               int warp_row0, int row_lo, int t, float sl2) {
  if (k0 + kBc > p.S || (p.causal && k0 + kBc - 1 > warp_row0)) {
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + (e >> 1) * 8;
        if (col >= p.S || (p.causal && col > row)) s[4 * nt + e] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // rows g and g + 8, log2 domain
    // max(S) sl2 = max(S sl2) as sl2 > 0 (the op takes the fused path only for a positive
    // scale): one multiply per row, not per element
    float hi = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) {
      hi = fmaxf(hi, fmaxf(s[4 * nt + 2 * r], s[4 * nt + 2 * r + 1]));
    }
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
    const float mx = fmaxf(m[r], hi * sl2);
    const float base = mx == -INFINITY ? 0.f : mx;
    alpha[r] = fast_exp2(m[r] - base);
    m[r] = mx;
    float rs = 0.f;
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = fmaf(s[4 * nt + 2 * r + e], sl2, -base);
        const float pv = fast_exp2(x);
        s[4 * nt + 2 * r + e] = pv;
        rs += pv;
      }
    }
    l[r] = l[r] * alpha[r] + rs;  // per-thread partial: the quad's sum is taken at the end
  }
}
// C tiles 2 kk, 2 kk + 1 of P are the A fragment of keys 16 kk .. 16 kk + 15.
template <typename T, int kBc>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[kBc / 16][4], const float (&s)[kBc / 2]) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) {
    pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}
template <int D>
__device__ __forceinline__ void rescale_o(float (&oacc)[D / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    oacc[4 * dt + 0] *= alpha[0];
    oacc[4 * dt + 1] *= alpha[0];
    oacc[4 * dt + 2] *= alpha[1];
    oacc[4 * dt + 3] *= alpha[1];
  }
}
// O += P V for one key tile: P from registers (pa), V from the panel-swizzled tile whose
// N-major descriptor is db0 (sw128_desc(v_addr, kBc * 128, 1024)); a k-step of 16 keys is 2048
// bytes, 128 descriptor units.
template <typename T, int D, int kBc>
__device__ __forceinline__ void issue_pv_desc(float (&oacc)[D / 2],
                                              const uint32_t (&pa)[kBc / 16][4], uint64_t db0) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) wgmma_rs_tb<T, D>(oacc, pa[kk], db0 + 128 * kk);
  wg_commit();
}
template <typename T, int D, int kBc>
__device__ __forceinline__ void issue_pv_tile(float (&oacc)[D / 2],
                                              const uint32_t (&pa)[kBc / 16][4], uint32_t v_addr) {
  issue_pv_desc<T, D, kBc>(oacc, pa, sw128_desc(v_addr, kBc * 128, 1024));
}
// o rows row_lo, row_lo + 8 (B, L, H, D) = oacc / l and their lse (natural log).  A row with a
// non-finite value gets lse kBadRowLse instead, for attn_fix_marked_rows (Note [no calls in
// wgmma kernels], attention_rows.cuh).
template <typename T, int D>
__device__ __forceinline__ void store_o_lse(const float (&oacc)[D / 2], const float (&m)[2],
                                            const float (&l)[2], const AttnParams& p, int b, int h,
                                            int row_lo, int t, T* __restrict__ o,
                                            float* __restrict__ lse) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    const int row = row_lo + 8 * r;
    // Packed before the row test: wgmma accumulators read on a divergent path make ptxas
    // serialise the next tile's wgmmas (the persistent kernel's loop).
    const float inv = lr == 0.f ? 0.f : 1.f / lr;  // an empty row: o = 0, lse -inf
    uint32_t packed[D / 8];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      packed[dt] = pack2<T>(oacc[4 * dt + 2 * r] * inv, oacc[4 * dt + 2 * r + 1] * inv);
    }
    reg_fence(packed);
    bool bad = false;
    if (row < p.L) {
      T* orow = o + ((static_cast<int64_t>(b) * p.L + row) * p.H + h) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        bad |= pair_nonfinite<T>(packed[dt]);
        *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = packed[dt];
      }
    }
    // the row's quad (lanes 4 g .. 4 g + 3 hold row g) flagged it: all lanes take the ballot
    const unsigned quads = __ballot_sync(0xffffffffu, bad);
    if (row < p.L && t == 0) {
      const bool row_bad = (quads >> (threadIdx.x % 32)) & 0xfu;
      lse[(static_cast<int64_t>(b) * p.H + h) * p.L + row] =
          row_bad ? __uint_as_float(kBadRowLse) : (m[r] + log2f(lr)) * kLn2;
    }
  }
}

// Note [non-finite rows] for the Hopper forwards: recomputes each row they marked (lse bits
// kBadRowLse) by one warp, the CPU's arithmetic; every other row costs a read of its lse.  o is
// (B, L, H, D) contiguous, lse (B, H, L).
template <typename T>
__global__ void __launch_bounds__(256)
    attn_fix_marked_rows(const __grid_constant__ AttnParams p, const T* q, const T* k, const T* v,
                         T* o, float* lse) {
  grid_dependency_wait();  // o and lse come from the forward kernel before
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.L;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i - threadIdx.x % 32 >= rows) return;  // whole warps
  const bool bad = i < rows && __float_as_uint(lse[i]) == kBadRowLse;
  for_bad_rows<1>(bad, [&](int lane) {
    const int64_t row = i - threadIdx.x % 32 + lane;
    const int l = static_cast<int>(row % p.L), bh = static_cast<int>(row / p.L);
    const int b = bh / p.H, h = bh % p.H;
    const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
    fix_o_row<T>(ra, q + b * p.q_b + h * p.q_h, k + b * p.k_b + h * p.k_h,
                 v + b * p.v_b + h * p.v_h, l,
                 o + ((static_cast<int64_t>(b) * p.L + l) * p.H + h) * p.D, lse + row);
  });
}

// Forward.  Per warpgroup, iteration j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back,
// waits for S_j only, and runs the softmax of S_j while the P V product is on the tensor cores; O
// is rescaled once that product lands.  K / V tiles: a ring of kStages (tiles j + 1 .. j + kStages
// - 2 load while j and j - 1 are read); one block barrier per tile.  Q is held in registers as A
// fragments (S's wgmma then reads only K from shared memory).
template <typename T, int D, int kWG, int kBc, int kStages>
__global__ void __launch_bounds__(kWG * 128)
    attn_fwd_sm90(AttnParams p, const T* __restrict__ q, const T* __restrict__ k,
                  const T* __restrict__ v, T* __restrict__ o, float* __restrict__ lse) {
  constexpr int kBr = 64 * kWG, NT = kWG * 128, KS = D / 16, kTile = kBc * D;
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte aligned tiles (the swizzle atom); the launcher allocates 1 KB of slack.
  T* sQ = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  T* sK = sQ + kBr * D;                // kStages x kBc x D
  T* sV = sK + kStages * kTile;        // kStages x kBc x D
  constexpr int kAhead = kStages - 2;  // tiles in flight (j and j - 1 are being read)
  const int wg = threadIdx.x / 128, wl = threadIdx.x % 128;  // warpgroup, thread in it
  const int warp = wl / 32, lane = wl % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBr;
  const T* qb = q + b * p.q_b + h * p.q_h;
  const T* kb = k + b * p.k_b + h * p.k_h;
  const T* vb = v + b * p.v_b + h * p.v_h;
  const int kend = p.causal ? min(q0 + kBr, p.S) : p.S;
  const int nkb = (kend + kBc - 1) / kBc;
  const int wrow0 = q0 + 64 * wg;  // the warpgroup's first query row

  load_ptile<kBr, D, NT>(sQ, qb, p.q_l, q0, p.L);
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {  // one cp.async group per tile (Q rides with tile 0)
    if (i < nkb) {
      load_ptile<kBc, D, NT>(sK + i * kTile, kb, p.k_l, i * kBc, p.S);
      load_ptile<kBc, D, NT>(sV + i * kTile, vb, p.v_l, i * kBc, p.S);
    }
    cp_async_commit();
  }

  float oacc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = static_cast<float>(p.scale) * kLog2e;
  const int row_lo = wrow0 + 16 * warp + g;  // rows row_lo and row_lo + 8
  float s[kBc / 2];                          // S_j, then P_j in float
  uint32_t pa[kBc / 16][4];                  // P_{j-1}: the A operand of the in-flight P V product
  float alpha[2];

  // Every wgmma sits in warpgroup-uniform code (no per-warpgroup branches around them: ptxas
  // would serialise them).  Causal blocks: the first warpgroup also runs the last key tile, all
  // masked for its rows.
  uint32_t qf[D / 16][4];        // the warp's 16 Q rows as A fragments
  auto next_tile = [&](int j) {  // tile j landed and visible; tile j + kAhead starts loading
    cp_async_wait<kAhead - 1>();
    fence_proxy_async();
    __syncthreads();  // also: every warpgroup is done with tile j - 2's slot
    const int jn = j + kAhead;
    if (jn < nkb) {
      const int slot = jn % kStages;
      load_ptile<kBc, D, NT>(sK + slot * kTile, kb, p.k_l, jn * kBc, p.S);
      load_ptile<kBc, D, NT>(sV + slot * kTile, vb, p.v_l, jn * kBc, p.S);
    }
    cp_async_commit();  // (possibly empty: keeps one group per tile)
  };
  auto issue_s = [&](int j) {  // S = Q K_j^T
    const uint32_t k_addr = smem_u32(sK + (j % kStages) * kTile);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint32_t poff = (ks / 4) * 128u, koff = (ks % 4) * 32u;
      const uint64_t db = sw128_desc(k_addr + poff * kBc + koff, 16, 1024);
      wgmma_rs<T, kBc>(s, qf[ks], db, ks > 0);
    }
    wg_commit();
  };
  auto issue_pv = [&](int j) {
    issue_pv_tile<T, D, kBc>(oacc, pa, smem_u32(sV + (j % kStages) * kTile));
  };
  next_tile(0);
  {
    const int r = 64 * wg + 16 * warp + lane % 16;  // ldmatrix rows of the A fragments
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      ldsm_x4(qf[ks], smem_u32(sQ + pswz<kBr>(r, 2 * ks + lane / 16)));
  }
  wg_fence();
  issue_s(0);
  wg_wait<0>();
  reg_fence(s);
  online_softmax<kBc>(s, m, l, alpha, p, 0, wrow0 + 16 * warp, row_lo, t,
                      sl2);  // O = 0: no rescale
  pack_p<T, kBc>(pa, s);
  for (int j = 1; j < nkb; ++j) {
    next_tile(j);
    wg_fence();
    issue_s(j);
    issue_pv(j - 1);
    wg_wait<1>();  // S_j landed (groups retire in order); P_{j-1} V_{j-1} may still run
    reg_fence(s);
    online_softmax<kBc>(s, m, l, alpha, p, j * kBc, wrow0 + 16 * warp, row_lo, t, sl2);
    wg_wait<0>();
    reg_fence(oacc);
    reg_fence(pa);
    rescale_o<D>(oacc, alpha);
    pack_p<T, kBc>(pa, s);
  }
  wg_fence();
  issue_pv(nkb - 1);
  wg_wait<0>();
  reg_fence(oacc);

  store_o_lse<T, D>(oacc, m, l, p, b, h, row_lo, t, o, lse);
}

// Warp-specialised forward (the default where TMA applies).  Block: kWG consumer warpgroups
// (64 query rows each) and one producer warp.  The producer's elected lane loads each tile's Q
// and then K / V tiles into a ring of kStages slots with TMA; each slot has a `full` mbarrier
// (one arrival + the transaction bytes) and an `empty` one (one arrival per consumer warpgroup once
// its wgmmas reading the slot are complete).  Consumers never run a block barrier, never issue a
// load, and read Q from shared memory (S = Q K^T as shared x shared).  Per tile, per warpgroup:
// as attn_fwd_sm90 (S_j and P_{j-1} V_{j-1} in flight together, softmax of S_j under the P V).
// TMA zero-fills rows past L / S, so partial tiles need no special load path.
// Note [persistent forward]: with kPersistent the grid is one block per SM and each block walks
// query tiles (tile_at): the producer runs ahead into the next tile (Q in a second buffer, K / V
// through the same ring, whose counter runs on across tiles), so a tile's first loads land while
// the previous tile's last P V and O store finish: without it every block starts on an empty
// pipeline (a causal T 1024 block does only 4.5 key tiles on average).  Tiles are ordered most
// work first (the last query tiles when causal) and dealt in a snake (block i takes tiles i,
// 2G - 1 - i, 2G + i, ...), which balances the causal triangle within ~2% of a dynamic queue.
template <typename T, int D, int kWG, int kBc, int kStages, int kMinBlocks, bool kPingPong,
          bool kPersistent>
__global__ void __launch_bounds__(kWG * 128 + 32) __maxnreg__(ws_max_regs(kWG, kMinBlocks))
    attn_fwd_sm90_ws(const AttnParams p, const __grid_constant__ CUtensorMap tq,
                     const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                     const TmaOrder ord, T* __restrict__ o, float* __restrict__ lse) {
  constexpr int kBr = 64 * kWG, KS = D / 16, kTile = kBc * D, kPanels = D / 64;
  constexpr int kQBufs = kPersistent ? 2 : 1;
  constexpr uint32_t kTileBytes = kTile * sizeof(T);
  extern __shared__ unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  T* sK = sQ + kQBufs * kBr * D;  // kStages x kBc x D
  T* sV = sK + kStages * kTile;   // kStages x kBc x D
  uint64_t* full = reinterpret_cast<uint64_t*>(sV + kStages * kTile);
  uint64_t* empty = full + kStages;
  uint64_t* qfull = empty + kStages;  // kQBufs each
  uint64_t* qempty = qfull + kQBufs;
  const int BH = p.B * p.H, nq = (p.L + kBr - 1) / kBr, ntiles = BH * nq;
  // The block's n-th tile (-1 past the last): tile t is query tile nq - 1 - t / BH of head t % BH.
  auto tile_at = [&](int n) { return block_item<kPersistent>(n, ntiles); };
  auto key_tiles = [&](int q0) { return ((p.causal ? min(q0 + kBr, p.S) : p.S) + kBc - 1) / kBc; };

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, kWG);
    }
    for (int i = 0; i < kQBufs; ++i) {
      mbar_init(qfull + i, 1);
      mbar_init(qempty + i, kWG);
    }
    mbar_init_fence();
  }
  __syncthreads();         // the last block-wide barrier: roles split here
  grid_dependency_wait();  // q, k, v may come from the kernel before (a GEMM)

  if (threadIdx.x >= kWG * 128) {  // ---- producer warp: one lane issues every load
    if (threadIdx.x == kWG * 128) {
      int it = 0;  // K / V ring position, across tiles
      for (int n = 0;; ++n) {
        const int tile = tile_at(n);
        if (tile < 0) break;
        const int b = (tile % BH) / p.H, h = tile % p.H, q0 = (nq - 1 - tile / BH) * kBr;
        // Box coordinates (d, then row / head in the map's order, then batch).
        auto load = [&](T* dst, const CUtensorMap* map, bool h_inner, uint64_t* bar, int row,
                        int pnl) {
          if (h_inner) {
            tma_load4(dst, map, bar, 64 * pnl, h, row, b);
          } else {
            tma_load4(dst, map, bar, 64 * pnl, row, h, b);
          }
        };
        const int qs = n % kQBufs;
        if (n >= kQBufs) mbar_wait(qempty + qs, ((n / kQBufs) - 1) & 1);
        mbar_arrive_tx(qfull + qs, kBr * D * sizeof(T));
#pragma unroll
        for (int pnl = 0; pnl < kPanels; ++pnl)
          load(sQ + (qs * kPanels + pnl) * kBr * 64, &tq, ord.q_h_inner, qfull + qs, q0, pnl);
        const int nkb = key_tiles(q0);
        for (int j = 0; j < nkb; ++j, ++it) {
          const int slot = it % kStages;
          if (it >= kStages) mbar_wait(empty + slot, ((it / kStages) - 1) & 1);
          mbar_arrive_tx(full + slot, 2 * kTileBytes);
#pragma unroll
          for (int pnl = 0; pnl < kPanels; ++pnl) {
            load(sK + slot * kTile + pnl * kBc * 64, &tk, ord.k_h_inner, full + slot, j * kBc, pnl);
            load(sV + slot * kTile + pnl * kBc * 64, &tv, ord.v_h_inner, full + slot, j * kBc, pnl);
          }
        }
      }
    }
    return;
  }

  // ---- consumers (the warpgroup index through a shuffle: warp-uniform for ptxas, so the
  // wgmma descriptors live in uniform registers; Note [backward instruction count])
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int wl = threadIdx.x % 128;
  const int warp = wl / 32, lane = wl % 32, g = lane / 4, t = lane % 4;
  const float sl2 = static_cast<float>(p.scale) * kLog2e;
  float s[kBc / 2];          // S_j, then P_j in float
  uint32_t pa[kBc / 16][4];  // P_{j-1}: the A operand of the in-flight P V product
  // Note [ping-pong]: the warpgroups wait on the same `full` barriers, so left alone they issue
  // their GEMMs together and then all run softmax together (tensor cores idle, MUFU contended).
  // With kPingPong they take turns issuing: warpgroup w waits on named barrier 1 + w, issues, then
  // lets w + 1 go, so one warpgroup's softmax runs under another's GEMMs.  The last warpgroup
  // opens the first turn; warpgroup 0 takes the final arrival after its last tile (balanced
  // barriers; every warpgroup takes the same number of turns per tile, so the chain of turns
  // runs on unbroken from tile to tile).
  auto my_turn = [&] {
    if constexpr (kPingPong) named_bar_sync(1 + wg, 256);
  };
  auto next_turn = [&] {
    if constexpr (kPingPong) named_bar_arrive(1 + (wg + 1) % kWG, 256);
  };
  if (kPingPong && wg == kWG - 1) named_bar_arrive(1, 256);

  int it = 0;  // K / V ring position of the tile's first key tile
  for (int n = 0;; ++n) {
    const int tile = tile_at(n);
    if (tile < 0) break;
    const int b = (tile % BH) / p.H, h = tile % p.H, q0 = (nq - 1 - tile / BH) * kBr;
    const int nkb = key_tiles(q0), qs = n % kQBufs;
    const int wrow0 = q0 + 64 * wg;
    const int row_lo = wrow0 + 16 * warp + g;  // rows row_lo and row_lo + 8
    float oacc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
    // the warpgroup's rows in each panel of this tile's Q buffer (K-major descriptor; a k-step of
    // 16 elements is 32 bytes, 2 descriptor units; a panel kBr | kBc rows of 128 bytes)
    const uint64_t dq0 = sw128_desc(smem_u32(sQ + qs * kBr * D) + wg * 64 * 128, 16, 1024);

    auto issue_s = [&](int j) {  // waits for key tile j, then S = Q K_j^T
      const int slot = (it + j) % kStages;
      mbar_wait(full + slot, ((it + j) / kStages) & 1);
      const uint64_t dk0 = sw128_desc(smem_u32(sK + slot * kTile), 16, 1024);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t pnl = ks / 4, kstep = (ks % 4) * 2;
        wgmma_ss<T, kBc>(s, dq0 + pnl * kBr * 8 + kstep, dk0 + pnl * kBc * 8 + kstep, ks > 0);
      }
      wg_commit();
    };
    auto v_addr = [&](int j) { return smem_u32(sV + ((it + j) % kStages) * kTile); };
    auto release = [&](int j) {  // this warpgroup is done with key tile j's slot
      if (wl == 0) mbar_arrive(empty + (it + j) % kStages);
    };

    mbar_wait(qfull + qs, (n / kQBufs) & 1);
    my_turn();
    wg_fence();
    issue_s(0);
    next_turn();
    wg_wait<0>();
    reg_fence(s);
    online_softmax<kBc>(s, m, l, alpha, p, 0, wrow0 + 16 * warp, row_lo, t, sl2);
    pack_p<T, kBc>(pa, s);
    for (int j = 1; j < nkb; ++j) {
      my_turn();
      wg_fence();
      issue_s(j);
      issue_pv_tile<T, D, kBc>(oacc, pa, v_addr(j - 1));
      next_turn();
      wg_wait<1>();  // S_j landed; P_{j-1} V_{j-1} may still run
      reg_fence(s);
      online_softmax<kBc>(s, m, l, alpha, p, j * kBc, wrow0 + 16 * warp, row_lo, t, sl2);
      wg_wait<0>();
      reg_fence(oacc);
      reg_fence(pa);
      release(j - 1);
      rescale_o<D>(oacc, alpha);
      pack_p<T, kBc>(pa, s);
    }
    if constexpr (!kPersistent) {
      if (kPingPong && wg == 0) my_turn();
    }
    wg_fence();
    issue_pv_tile<T, D, kBc>(oacc, pa, v_addr(nkb - 1));
    wg_wait<0>();
    reg_fence(oacc);
    if constexpr (kPersistent) {  // the producer reuses both for the tile after next
      release(nkb - 1);
      if (wl == 0) mbar_arrive(qempty + qs);
    }
    store_o_lse<T, D>(oacc, m, l, p, b, h, row_lo, t, o, lse);
    it += nkb;
  }
  if constexpr (kPersistent) {
    if (kPingPong && wg == 0) my_turn();
  }
}

// Threads of the backward block: kWG consumer warpgroups and a producer warp, or with kDefer a
// producer warpgroup (setmaxnreg moves registers between whole warpgroups).
constexpr int bwd_threads(int wg, bool defer) { return wg * 128 + (defer ? 128 : 32); }
// kDefer's register split (per thread; 128 x 40 + 256 x 232 <= 64 K): the producer needs few.
constexpr int kBwdProducerRegs = 40, kBwdConsumerRegs = 232;

// Backward on wgmma (D = 64), warp-specialised; dK, dV stored, dQ added to a float32 dq_acc
// (B, H, L, D) (attn_bwd_dq_convert scales and converts it).  Block: kWG consumer warpgroups, each
// owning 64 keys (kBc = 64 kWG), and one producer warp.  The producer loads the block's K and V
// once, then per query tile (kBr = 64 queries) Q, dO (TMA) and lse, Dvec (its 32 lanes) into a ring
// of kStages slots (full / empty mbarriers as in the forward; rows past L get lse = +inf, so P = 0
// there with no mask).  Per tile, per warpgroup, keys as the M dimension (FA2's order, so P^T and
// dS^T are register A operands):
//   S^T = K Q^T, dP^T = V dO^T       (wgmma, all four K-major from shared memory: K and V as
//                                     register fragments would need more than the 168 registers
//                                     a 9-warp block can have)
//   P^T = exp2(S^T scale log2e - lse log2e),  dS^T = P^T (dP^T - Dvec)
//   dV += P^T dO, dK += dS^T Q        (register A, dO / Q N-major: the forward's P V form)
//   dS^T -> shared memory; dQ_part = dS K (both operands M|N-major from shared memory, the
//   warpgroup's 64 keys), added to dq_acc: kDq 1 by red.global.add.v4 from registers, kDq 2
//   through shared memory and a TMA reduce-add issued by one thread (the consumers do not wait
//   for it), kDq 3 (the default) as kDq 2 but over the block's 128 keys by one warpgroup per tile
//   (Note [deferred dQ]); kDq 0 skips it (timing only: wrong dq).
// sDS (and kDq 2's buffer) are double-buffered: the warpgroup barrier of tile i (before its dQ
// wgmma) orders every warp's reads of tile i - 1's buffer before anyone writes it at tile i + 1.
// kPingPong: the warpgroups take turns issuing their GEMM batches (Note [ping-pong]).
// Measured (H200, B16 H12 T1024 D64 causal, memset + kernel + convert, bench/attn_sm90_bwd_check):
// kDq 2, 3 stages, ping-pong 0.333 ms (0.325 after Note [backward instruction count]; full
// 0.538); without ping-pong 0.341; 2 stages 0.344; kDq 1 0.404; no dQ adds at all 0.264 (0.231);
// the mma.sync one-kernel backward 0.396.  Tried and slower: exchanging
// dQ halves between the warpgroups so each element is added once (red.v4 0.355, TMA 0.345);
// waiting for S^T alone and running the exponentials under dP^T (0.49: spills, serialised wgmma);
// each warp reducing its own 16 rows of dQ, no warpgroup barrier (0.340); a producer warpgroup
// handing registers to the consumers (setmaxnreg 24 / 240) with K and V as register fragments
// (0.336): the dQ stage (0.08 ms over "no dQ") does not shrink with fewer barriers or traffic.
// Note [deferred dQ]: with kDefer the producer is a warpgroup that gives registers to the
// consumers (setmaxnreg 40 / 232), and tile i's dQ GEMM is issued with tile i + 1's S^T, dP^T
// (one more wgmma group in flight during the exponentials; its part is stored after them).  The
// dQ GEMM never waits in a stage of its own, and ptxas keeps the wgmmas asynchronous only when no
// group is in flight across a wgmma.fence (issuing dQ_i in tile i + 1's first stage does that;
// storing dQ_i under tile i + 1's S^T, dP^T with dQ_i still in tile i's last stage made ptxas
// serialise every wgmma, C7514).  kDq 3 (needs kDefer and ping-pong, 2 warpgroups): tile i's
// dQ part is computed by warpgroup i % 2 alone over the block's 128 keys (both warpgroups' dS^T,
// all of sK), so every dq_acc element gets one TMA reduce-add per key block instead of two.  The
// other warpgroup's dS^T is complete and visible by then through the ping-pong barriers: its
// stores, fence.proxy.async and bar.arrive precede this warpgroup's next turn, and the buffers
// (sDS double-buffered by tile parity) are rewritten only after the dQ GEMM reading them was
// waited for, one turn earlier.  Measured (session 14, same harness): kDq 3 (the default) 0.299
// ms causal / 0.487 full against kDq 2's 0.329 / 0.546; kDefer with kDq 2 0.335 / 0.555 (the
// deferral alone gains nothing: the dQ stage's cost was its reduce traffic, not its wait).
// Note [persistent backward]: with kPersist the grid is one block per SM and each block walks
// work items (head, key block) in the forward's snake order.  K and V get two buffers (kvfull /
// kvempty mbarriers), and the Q / dO ring's position runs on across items, so the producer loads
// the next item's K, V and first query tiles while the consumers finish the current item and store
// its dK, dV; without it every block starts on an empty pipeline and ends on a drained one.
// Every parity (ring slot and phase, dS^T buffer, kDq 3's owner and sXq buffer) follows the ring
// position, so the ordering arguments above hold across items unchanged; an item's last dQ turn
// sits between its last tile and the next item's first, like a tile's first turn.  Tried and
// not kept (session 17, commit 59bcac1): the producer warpgroup's idle second warp taking each dQ
// part and ordering a query tile's parts across blocks with counters in global memory (key block
// 0 stores its part, so dq_acc needs no zeroing; the last part's item loads the others' sum, adds
// its own and writes dq, so no conversion pass), under a cooperative launch.  Memset + kernel +
// conversion against counters' memset + kernel: causal 0.281 / 0.284 / 0.282 ms against 0.275 /
// 0.282 / 0.280 (three runs), full 0.469-0.474 against 0.499-0.503: about 1% for ~300 lines of
// waits between blocks (a hang if the protocol ever breaks), so kDq 3 stays.  Also tried
// (session 18): causal, the second warpgroup's first query tile of each item is all masked (its
// keys follow every query there), 1 of its ~9 tiles at T 1024; skipping that tile's GEMMs and
// exponentials (keeping the turns, a zero dS^T and the slot's release) measured 0.280-0.283 ms
// against 0.282-0.284: with one warpgroup idle the other's GEMM / exponential chain is exposed,
// so the skipped work was not on the critical path.
template <typename T, int D, int kWG, int kStages, int kDq, bool kPingPong, bool kDefer,
          bool kPersist>
__global__ void __launch_bounds__(bwd_threads(kWG, kDefer)) __maxnreg__(ws_max_regs(kWG, 1))
    attn_bwd_sm90_ws(const AttnParams p, const __grid_constant__ CUtensorMap tq,
                     const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                     const __grid_constant__ CUtensorMap tg,
                     const __grid_constant__ CUtensorMap tacc, const TmaOrder ord,
                     const float* __restrict__ lse, const float* __restrict__ dvec,
                     T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc,
                     int* __restrict__ bad_keys) {  // Note [no calls in wgmma kernels]
  static_assert(D == 64, "attn_bwd_sm90: D 64 (D 128 would not fit the registers)");
  constexpr int kBr = 64, kBc = 64 * kWG, KS = D / 16, kQTile = kBr * D;
  constexpr int kKvBufs = kPersist ? 2 : 1;  // K, V buffers (Note [persistent backward])
  extern __shared__ unsigned char smem_raw[];
  // kKvBufs x (K, V): buffer c's K at sKV + 2 c kBc D, its V kBc D after
  T* sKV = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  T* sQ = sKV + kKvBufs * 2 * kBc * D;  // kStages x kBr x D
  T* sG = sQ + kStages * kQTile;        // kStages x kBr x D
  T* sDS = sG + kStages * kQTile;       // kWG x 2 x (64 keys x kBr queries)
  float* sL = reinterpret_cast<float*>(sDS + kWG * 2 * 64 * kBr);  // kStages x kBr: lse log2e
  float* sDv = sL + kStages * kBr;                                 // kStages x kBr: Dvec
  uint64_t* full = reinterpret_cast<uint64_t*>(sDv + kStages * kBr);
  // kDq 2: per warpgroup 2 buffers of the 64 x 64 float dQ part (1024-aligned: after sDS), as two
  // 64 x 32 panels in the 128-byte swizzle (conflict-free float2 stores, the TMA box layout)
  float* sXq = reinterpret_cast<float*>(sDS + kWG * 2 * 64 * kBr);
  static_assert(kDq != 3 || (kDefer && kPingPong && kWG == 2), "kDq 3: deferred, ping-pong, 2 WG");
  constexpr bool kTmaDq = kDq >= 2;  // dQ parts through shared memory and TMA reduce-adds
  if constexpr (kTmaDq) {
    sL = sXq + kWG * 2 * 64 * 64;
    sDv = sL + kStages * kBr;
    full = reinterpret_cast<uint64_t*>(sDv + kStages * kBr);
  }
  uint64_t* empty = full + kStages;
  uint64_t* kvfull = empty + kStages;  // kKvBufs each
  uint64_t* kvempty = kvfull + kKvBufs;
  // Work items (bh, key block) in order key block 0 (causal: the most query tiles) of every head
  // first.  One item per block: grid (B H, key blocks); kPersist: one block per SM, block i taking
  // items i, 2G - 1 - i, 2G + i, ... (the forward's snake, Note [persistent forward]).
  const int BH = p.B * p.H, nkv = (p.S + kBc - 1) / kBc, i_end = (p.L + kBr - 1) / kBr;
  auto item_at = [&](int n) { return block_item<kPersist>(n, BH * nkv); };
  // The item's head, first key and first query tile (causal: the tiles below its keys are skipped)
  auto item_k0 = [&](int item) { return item / BH * kBc; };
  auto item_begin = [&](int item) { return p.causal ? item_k0(item) / kBr : 0; };

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(full + i, 33);  // the TMA arrival + one per producer lane (lse, Dvec stores)
      mbar_init(empty + i, kWG * 128);  // every consumer thread (each read lse / Dvec itself)
    }
    for (int i = 0; i < kKvBufs; ++i) {
      mbar_init(kvfull + i, 1);
      mbar_init(kvempty + i, kWG * 128);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the last block-wide barrier

  if (threadIdx.x >= kWG * 128) {  // ---- producer warp
    if constexpr (kDefer) {
      regs_dec<kBwdProducerRegs>();
      if (threadIdx.x >= kWG * 128 + 32) return;  // one warp of the producer warpgroup works
    }
    const int lane = threadIdx.x - kWG * 128;
    int gt = 0;  // ring position: the block's query tiles counted across items
    for (int n = 0;; ++n) {
      const int item = item_at(n);
      if (item < 0) break;
      const int bh = item % BH, b = bh / p.H, h = bh % p.H, k0 = item_k0(item);
      auto load = [&](T* dst, const CUtensorMap* map, bool h_inner, uint64_t* bar, int row) {
        if (h_inner) {
          tma_load4(dst, map, bar, 0, h, row, b);
        } else {
          tma_load4(dst, map, bar, 0, row, h, b);
        }
      };
      const int kb = n % kKvBufs;
      if (n >= kKvBufs) mbar_wait(kvempty + kb, ((n / kKvBufs) - 1) & 1);
      if (lane == 0) {
        T* sK = sKV + kb * 2 * kBc * D;
        mbar_arrive_tx(kvfull + kb, 2 * kBc * D * sizeof(T));
        load(sK, &tk, ord.k_h_inner, kvfull + kb, k0);
        load(sK + kBc * D, &tv, ord.v_h_inner, kvfull + kb, k0);
      }
      // Dvec comes from the kernel before: the K, V loads above may start before it ends
      if (n == 0) grid_dependency_wait();
      const float* lb = lse + static_cast<int64_t>(bh) * p.L;
      const float* db = dvec + static_cast<int64_t>(bh) * p.L;
      for (int i = item_begin(item); i < i_end; ++i, ++gt) {
        const int slot = gt % kStages, q0 = i * kBr;
        if (gt >= kStages) mbar_wait(empty + slot, ((gt / kStages) - 1) & 1);
        if (lane == 0) {
          mbar_arrive_tx(full + slot, 2 * kQTile * sizeof(T));
          load(sQ + slot * kQTile, &tq, ord.q_h_inner, full + slot, q0);
          load(sG + slot * kQTile, &tg, ord.g_h_inner, full + slot, q0);
        }
#pragma unroll
        for (int r = lane; r < kBr; r += 32) {
          const bool ok = q0 + r < p.L;
          sL[slot * kBr + r] = ok ? lb[q0 + r] * kLog2e : INFINITY;
          sDv[slot * kBr + r] = ok ? db[q0 + r] : 0.f;
        }
        mbar_arrive(full + slot);
      }
    }
    return;
  }

  // ---- consumers
  if constexpr (kDefer) regs_inc<kBwdConsumerRegs>();
  grid_dependency_wait();  // before the dq_acc reduce-adds and the dK, dV stores
  // Note [backward instruction count]: the loop below was written for few instructions besides
  // the wgmmas and exponentials (ncu, call 4 of session 13: 863 warp instructions per warp and
  // tile against cuDNN's 640, the same 20 wgmmas): the warpgroup index goes through a shuffle so
  // ptxas sees it warp-uniform (descriptors in uniform registers); descriptors are built once and
  // stepped by adding offsets (a descriptor's address field is address / 16); shared memory is
  // addressed with 32-bit shared addresses (generic pointers cost 64-bit address arithmetic per
  // access); masking runs only on the tiles that need it.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int wl = threadIdx.x % 128;
  const int warp = wl / 32, lane = wl % 32, g = lane / 4, t = lane % 4;
  // The current item (set per item below): head, the warpgroup's first key, the thread's keys
  // key_lo and key_lo + 8, its query tiles i_begin + [0, ntiles) at ring positions gbase + it.
  int bh = 0, b = 0, h = 0, key_w0 = 0, key_lo = 0, i_begin = 0, ntiles = 0, gbase = 0;
  const float sl2 = static_cast<float>(p.scale) * kLog2e;
  // Turns at the tensor cores (Note [ping-pong]; barriers 5 + w): a warpgroup issues its S^T, dP^T
  // GEMMs, then its dV, dK, dQ GEMMs, each batch in its turn, so one warpgroup's exponentials and
  // dQ stage run under the other's GEMMs.
  auto my_turn = [&] {
    if constexpr (kPingPong) named_bar_sync(5 + wg, 256);
  };
  auto next_turn = [&] {
    if constexpr (kPingPong) named_bar_arrive(5 + (wg + 1) % kWG, 256);
  };
  if (kPingPong && wg == kWG - 1) named_bar_arrive(5, 256);
  float dka[D / 2], dva[D / 2];
  // The item's K / V buffer: the warpgroup's keys (one panel) are the A operand of S^T, dP^T
  // (K-major) and B of dQ (N-major); kDq 3's dQ reads the block's 128 keys (all of sK).
  uint64_t dk_kmaj = 0, dv_kmaj = 0, dk_nmaj = 0, dkk_all = 0;
  // This thread's shared-memory byte offsets: dS^T element (key row 16 warp + g (+ 8), query
  // chunk n) at row * 128 + ((n ^ g) << 4) + 4 t (the 128-byte swizzle; row % 8 = g); kDq 2's
  // float2 of dQ row 16 warp + g (+ 8), chunk 2 (n % 4) + t / 2 of panel n / 4 at row * 128 +
  // ((chunk ^ g) << 4) + 8 (t % 2).
  const uint32_t ds_thr = (16 * warp + g) * 128 + 4 * t, g16 = g << 4;
  const uint32_t xq_thr = (16 * warp + g) * 128 + 8 * (t & 1), tg16 = ((t >> 1) ^ g) << 4;
  const uint32_t sds_base = smem_u32(sDS) + wg * 2 * 64 * kBr * sizeof(T);
  const uint32_t sxq_base = smem_u32(sXq) + wg * 2 * 64 * 64 * sizeof(float);
  const uint32_t sl_base = smem_u32(sL) + 8 * t, sdv_base = smem_u32(sDv) + 8 * t;

  float dq[D / 2];  // kDefer: tile it - 1's dQ part, computed beside tile it's S^T, dP^T
  uint32_t pa[kBr / 16][4], da[kBr / 16][4];  // P^T, dS^T as A fragments
  // The dQ part of the tile at ring position gi (rows from q0): kDq 1 adds it to dq_acc from
  // registers; kDq 2 / 3 put it in an sXq buffer, and one thread adds the buffer with a TMA reduce.
  auto store_dq = [&](int gi, int q0) {
    if constexpr (kDq == 1) {
      const bool odd = t & 1;
      const int qq = q0 + 16 * warp + g + (odd ? 8 : 0);
      float* dst = dq_acc + (static_cast<int64_t>(bh) * p.L + qq) * D + 2 * (t & 2);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        red_add_c_tile(dst + 8 * n, dq[4 * n], dq[4 * n + 1], dq[4 * n + 2], dq[4 * n + 3], odd,
                       qq < p.L);
      }
    } else if constexpr (kTmaDq) {
      // kDq 3: a warpgroup stores every other tile's part (its buffers alternate per store)
      const int buf = kDq == 3 ? (gi >> 1) & 1 : gi & 1;
      const uint32_t xq = sxq_base + buf * 64 * 64 * sizeof(float);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const uint32_t off = xq + xq_thr + (n >> 2) * 8192 + (tg16 ^ ((n & 3) << 5));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          st_shared_v2f(off + r * 1024, dq[4 * n + 2 * r], dq[4 * n + 2 * r + 1]);
        }
      }
      fence_proxy_async();
      named_bar_sync(1 + wg, 128);
      if (wl == 0) {
        float* xqp = sXq + (wg * 2 + buf) * 64 * 64;
        tma_reduce_add3(xqp, &tacc, 0, q0, bh);
        tma_reduce_add3(xqp + 2048, &tacc, 32, q0, bh);
        bulk_commit();
      }
    }
  };
  // This tile's GEMMs reading the slot (and, unless kDefer, its dQ GEMM) are complete: the slot
  // is released.
  auto tile_done = [&](int slot) {
    reg_fence(dka);
    reg_fence(dva);
    reg_fence(pa);
    reg_fence(da);
    // Q, dO, lse, Dvec of this slot all read.  Every thread arrives: racecheck follows an
    // mbarrier arrive -> wait edge, but not one thread's arrival on behalf of its warp (measured:
    // the same time as one arrival per warpgroup).
    mbar_arrive(empty + slot);
  };
  // dQ_part = dS K, dS^T from buffer `buf` (16 keys a step: 2048 bytes = 128 descriptor units),
  // committed as one group: over the warpgroup's 64 keys, or (kDq 3) over the block's 128 keys,
  // both warpgroups' dS^T and all of sK.
  constexpr uint32_t kDsBuf = 64 * kBr * sizeof(T) / 16;  // one dS^T buffer, descriptor units
  auto issue_dq = [&](int buf) {
    if constexpr (kDq == 3) {
      const uint64_t dds = sw128_desc(smem_u32(sDS), 64 * 128, 1024) + buf * kDsBuf;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        wgmma_ss<T, D, 1, 1>(dq, dds + (kk / 4) * 2 * kDsBuf + 128 * (kk % 4), dkk_all + 128 * kk,
                             kk > 0);
      }
    } else {
      const uint64_t dds = sw128_desc(sds_base, 64 * 128, 1024) + buf * kDsBuf;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_ss<T, D, 1, 1>(dq, dds + 128 * kk, dk_nmaj + 128 * kk, kk > 0);
      }
    }
    wg_commit();
  };
  // Whether this warpgroup computes and stores the dQ part of the tile at ring position gi (kDq 3:
  // positions of its parity).
  auto dq_mine = [&](int gi) { return kDq != 3 || (gi & 1) == wg; };
  // The item's query tile it, at ring position gi = gbase + it (slots, phases and every buffer
  // parity follow gi, so they alternate across items too).  kDefer (Note [deferred dQ]):
  // `pending` = the previous tile's dQ GEMM not issued yet; it runs beside this tile's S^T, dP^T
  // and is stored after the exponentials.
  auto tile = [&](int it, auto pending) {
    const int gi = gbase + it, slot = gi % kStages, q0 = (i_begin + it) * kBr;
    const uint32_t ds_addr = sds_base + (gi & 1) * 64 * kBr * sizeof(T);
    const uint32_t q_addr = smem_u32(sQ + slot * kQTile), g_addr = smem_u32(sG + slot * kQTile);
    const uint64_t dq_kmaj = sw128_desc(q_addr, 16, 1024), dg_kmaj = sw128_desc(g_addr, 16, 1024);
    mbar_wait(full + slot, (gi / kStages) & 1);
    float s[kBr / 2], dp[kBr / 2];
    my_turn();
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {  // k-step: 16 elements = 32 bytes = 2 descriptor units
      wgmma_ss<T, kBr>(s, dk_kmaj + 2 * ks, dq_kmaj + 2 * ks, ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      wgmma_ss<T, kBr>(dp, dv_kmaj + 2 * ks, dg_kmaj + 2 * ks, ks > 0);
    }
    wg_commit();
    constexpr bool kPending = decltype(pending)::value;
    const bool dq_now = kPending && dq_mine(gi - 1);
    // (S^T and dP^T waited for together: waiting for S^T alone and overlapping the exponentials
    // with dP^T measured 35% slower, with spills)
    if (dq_now) {
      issue_dq((gi - 1) & 1);
      next_turn();
      wg_wait<1>();
    } else {
      next_turn();
      wg_wait<0>();
    }
    reg_fence(s);
    reg_fence(dp);
    // element (n, e): key key_lo + 8 (e / 2), query q0 + 8 n + 2 t + (e % 2); P^T, dS^T in place
    const uint32_t cl = sl_base + slot * kBr * 4, cd = sdv_base + slot * kBr * 4;
    auto exp_ds = [&](auto masked) {
#pragma unroll
      for (int n = 0; n < kBr / 8; ++n) {
        const float2 lv = ld_shared_v2f(cl + 32 * n), dvv = ld_shared_v2f(cd + 32 * n);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = fast_exp2(fmaf(s[4 * n + e], sl2, -((e & 1) ? lv.y : lv.x)));
          if constexpr (decltype(masked)::value) {
            const int key = key_lo + 8 * (e >> 1), c = 8 * n + 2 * t + (e & 1);
            if (key >= p.S || (p.causal && q0 + c < key)) pv = 0.f;
          }
          s[4 * n + e] = pv;
          dp[4 * n + e] = pv * (dp[4 * n + e] - ((e & 1) ? dvv.y : dvv.x));
        }
      }
    };
    if ((p.causal && q0 < key_w0 + 64) || key_w0 + 64 > p.S) {
      exp_ds(std::true_type{});
    } else {
      exp_ds(std::false_type{});
    }
    pack_p<T, kBr>(pa, s);
    pack_p<T, kBr>(da, dp);
    // dS^T to shared memory for dQ: rows (keys) 16 warp + g + 8 r, query chunk n hold the pair
    // da[n / 2][2 (n % 2) + r] (the A fragment's own words: packed once)
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) {
      const uint32_t col = g16 ^ (n << 4);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        st_shared_b32(ds_addr + ds_thr + r * 1024 + col, da[n >> 1][2 * (n & 1) + r]);
      }
    }
    if (dq_now) {
      wg_wait<0>();  // tile it - 1's dQ part
      reg_fence(dq);
      store_dq(gi - 1, q0 - kBr);
    }
    my_turn();
    wg_fence();
    issue_pv_desc<T, D, kBr>(dva, pa, sw128_desc(g_addr, kBr * 128, 1024));  // dV += P^T dO
    issue_pv_desc<T, D, kBr>(dka, da, sw128_desc(q_addr, kBr * 128, 1024));  // dK += dS^T Q
    fence_proxy_async();  // sDS stores -> the wgmma (async proxy)
    if constexpr (kTmaDq) {
      // the sXq buffer stored next (this tile's, or with kDefer the previous tile's at the next
      // tile) was last reduced two stores ago
      if (wl == 0) bulk_wait_read<1>();
    }
    named_bar_sync(1 + wg, 128);
    if constexpr (!kDefer) issue_dq(gi & 1);
    next_turn();
    wg_wait<0>();
    if constexpr (!kDefer) {
      reg_fence(dq);
      tile_done(slot);
      store_dq(gi, q0);
    } else {
      tile_done(slot);
    }
  };
  const float sc = static_cast<float>(p.scale);
  for (int n = 0;; ++n) {
    const int item = item_at(n);
    if (item < 0) break;
    const int k0 = item_k0(item), kb = n % kKvBufs;
    bh = item % BH, b = bh / p.H, h = bh % p.H;
    key_w0 = k0 + 64 * wg, key_lo = key_w0 + 16 * warp + g;
    i_begin = item_begin(item), ntiles = i_end - i_begin;
    const uint32_t sk = smem_u32(sKV + kb * 2 * kBc * D);
    const uint32_t k_addr = sk + 64 * wg * 128, v_addr = k_addr + kBc * D * sizeof(T);
    dk_kmaj = sw128_desc(k_addr, 16, 1024), dv_kmaj = sw128_desc(v_addr, 16, 1024);
    dk_nmaj = sw128_desc(k_addr, kBc * 128, 1024), dkk_all = sw128_desc(sk, kBc * 128, 1024);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dka[i] = dva[i] = 0.f;
    mbar_wait(kvfull + kb, (n / kKvBufs) & 1);
    if constexpr (kDefer) {
      if (ntiles > 0) {
        tile(0, std::false_type{});
        for (int it = 1; it < ntiles; ++it) tile(it, std::true_type{});
        const int gl = gbase + ntiles - 1;  // the item's last tile
        const bool last = dq_mine(gl);
        my_turn();
        if (last) {
          wg_fence();
          issue_dq(gl & 1);
        }
        next_turn();
        if (last) {
          wg_wait<0>();
          reg_fence(dq);
          store_dq(gl, (i_begin + ntiles - 1) * kBr);
        }
      }
    } else {
      for (int it = 0; it < ntiles; ++it) tile(it, std::false_type{});
    }
    gbase += ntiles;
    // Every wgmma reading this item's K / V has been waited for: the producer may refill it
    // (it loads item n + 2 there) while the dK, dV below are stored.
    reg_fence(dka);
    reg_fence(dva);
    mbar_arrive(kvempty + kb);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key_lo + 8 * r;
      bool bad = false;
      if (key < p.S) {
        const int64_t base = p.dg.kv(b, h, key);
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
          const uint32_t wk = pack2<T>(dka[4 * c + 2 * r] * sc, dka[4 * c + 2 * r + 1] * sc);
          const uint32_t wv = pack2<T>(dva[4 * c + 2 * r], dva[4 * c + 2 * r + 1]);
          bad |= pair_nonfinite<T>(wk) || pair_nonfinite<T>(wv);
          *reinterpret_cast<uint32_t*>(dk + base + 8 * c + 2 * t) = wk;
          *reinterpret_cast<uint32_t*>(dv + base + 8 * c + 2 * t) = wv;
        }
      }
      if (bad) *bad_keys = 1;  // the dq conversion recomputes the bad key rows
    }
  }

  if (kPingPong && wg == 0) my_turn();  // the last warpgroup's final arrival
  if constexpr (kTmaDq) {
    if (wl == 0) bulk_wait_all();  // sXq stays allocated and the adds land before exit
  }
}

}  // namespace

// ==== launchers ================================================================================

template <typename T, int D, int kWG, int kBc, int kStages>
constexpr size_t sm90_fwd_smem() {
  return (64 * kWG + 2 * kStages * kBc) * D * sizeof(T) + 1024;
}

template <typename T, int D, int kWG, int kBc, int kStages>
void launch_fwd_sm90_cfg(const AttnParams& p, const T* q, const T* k, const T* v, T* o, float* lse,
                         cudaStream_t st, const char* op) {
  constexpr size_t smem = sm90_fwd_smem<T, D, kWG, kBc, kStages>();
  auto kern = attn_fwd_sm90<T, D, kWG, kBc, kStages>;
  BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  dim3 grid(p.B * p.H, static_cast<unsigned>((p.L + 64 * kWG - 1) / (64 * kWG)));
  kern<<<grid, kWG * 128, smem, st>>>(p, q, k, v, o, lse);
  BT_CUDA_LAUNCH_CHECK(op);
}

// ---- tensor maps (warp-specialised kernel) ----------------------------------------------------
using EncodeTiledFn = decltype(&cuTensorMapEncodeTiled);

// The driver's encoder through the runtime (null when the driver lacks it: the cp.async kernel
// runs instead).
EncodeTiledFn tensor_map_encoder() {
  static const EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// A 4-d map over the (rows, D) matrices of one of q / k / v (element strides s_b, s_h, s_l, unit d
// stride): dims d, then head and row in increasing stride (*h_inner: the head first), then batch;
// a size-1 dim takes the nested stride.  Box: 64 d x box_rows rows, 128-byte swizzle (the wgmma
// layout of Note [shared-memory layout for wgmma]); rows past the end read as zeros.  False when
// the driver refuses (pointer or strides not 16-byte multiples, ...).
template <typename T>
bool make_row_map(CUtensorMap* map, bool* h_inner, const T* base, int D, int rows, int H, int B,
                  int64_t s_b, int64_t s_h, int64_t s_l, int box_rows) {
  const EncodeTiledFn enc = tensor_map_encoder();
  if (!enc) return false;
  constexpr uint64_t es = sizeof(T);
  const uint64_t key_h = H > 1 ? uint64_t(s_h) : UINT64_MAX,
                 key_l = rows > 1 ? uint64_t(s_l) : UINT64_MAX;
  *h_inner = key_h < key_l;
  cuuint64_t dim[4] = {cuuint64_t(D), 0, 0, cuuint64_t(B)},
             stride[4] = {es, 0, 0, uint64_t(s_b) * es};
  cuuint32_t box[4] = {64, 1, 1, 1};
  const int mid_h = *h_inner ? 1 : 2, mid_l = 3 - mid_h;
  dim[mid_h] = cuuint64_t(H), stride[mid_h] = uint64_t(s_h) * es;
  dim[mid_l] = cuuint64_t(rows), stride[mid_l] = uint64_t(s_l) * es;
  box[mid_l] = cuuint32_t(box_rows);
  for (int i = 1; i < 4; ++i) {
    if (dim[i] == 1) stride[i] = stride[i - 1] * dim[i - 1];
  }
  const cuuint32_t elem_step[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dt = std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                  : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return enc(map, dt, 4, const_cast<T*>(base), dim, stride + 1, box, elem_step,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename T, int D, int kWG, int kBc, int kStages, bool kPersistent>
constexpr size_t sm90_ws_smem() {
  constexpr int kQBufs = kPersistent ? 2 : 1;
  return sm90_fwd_smem<T, D, kWG, kBc, kStages>() + (kQBufs - 1) * 64 * kWG * D * sizeof(T) +
         (2 * kStages + 2 * kQBufs) * sizeof(uint64_t);
}

// Multiprocessors of the current device (cached per device; 0 when it cannot be read).
int sm_count_current() {
  static int count[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (count[dev] == 0 &&
      cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    count[dev] = 0;
  }
  return count[dev];
}

// False (nothing launched) when the tensor maps cannot describe q, k or v.
template <typename T, int D, int kWG, int kBc, int kStages, int kMinBlocks, bool kPingPong,
          bool kPersistent = false>
bool launch_fwd_sm90_ws_cfg(const AttnParams& p, const T* q, const T* k, const T* v, T* o,
                            float* lse, cudaStream_t st, const char* op) {
  CUtensorMap tq, tk, tv;
  TmaOrder ord{};
  if (!make_row_map(&tq, &ord.q_h_inner, q, D, p.L, p.H, p.B, p.q_b, p.q_h, p.q_l, 64 * kWG) ||
      !make_row_map(&tk, &ord.k_h_inner, k, D, p.S, p.H, p.B, p.k_b, p.k_h, p.k_l, kBc) ||
      !make_row_map(&tv, &ord.v_h_inner, v, D, p.S, p.H, p.B, p.v_b, p.v_h, p.v_l, kBc)) {
    return false;
  }
  constexpr size_t smem = sm90_ws_smem<T, D, kWG, kBc, kStages, kPersistent>();
  auto kern = attn_fwd_sm90_ws<T, D, kWG, kBc, kStages, kMinBlocks, kPingPong, kPersistent>;
  BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  // Tile indices are int (q alone would pass 32 TB before they overflow).
  const int64_t nq = (p.L + 64 * kWG - 1) / (64 * kWG), ntiles = int64_t(p.B) * p.H * nq;
  if (ntiles > 2147483647LL) return false;
  dim3 grid(p.B * p.H, static_cast<unsigned>(nq));
  if constexpr (kPersistent) {  // one block per SM (or per tile, if the count is unknown)
    const int sms = sm_count_current();
    grid = dim3(static_cast<unsigned>(sms > 0 ? std::min<int64_t>(ntiles, int64_t(sms) * kMinBlocks)
                                              : ntiles));
  }
  // overlaps the previous kernel's tail (Note [programmatic dependent launch])
  launch_dependent(true, kern, grid, kWG * 128 + 32, smem, st, op, p, tq, tk, tv, ord, o, lse);
  BT_CUDA_LAUNCH_CHECK(op);
  return true;
}

// Hopper path: built for sm_90a (BT_CUDA_SM90A), device of compute capability 9.0, D 64 or 128,
// grid limits; BT_ATTN_SM90=0 in the environment turns it off (comparisons, escape hatch).
bool attn_fwd_sm90_supported(const AttnParams& p) {
#if defined(BT_CUDA_SM90A)
  static const bool enabled = [] {
    const char* e = std::getenv("BT_ATTN_SM90");
    return !(e && e[0] == '0');
  }();
  if (!enabled || (p.D != 64 && p.D != 128) || p.L < 1 || p.S < 1) return false;
  if (static_cast<int64_t>(p.B) * p.H > 2147483647LL || (p.L + 127) / 128 > 65535) return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  static int cc[64] = {};  // per device: 0 unknown, else 10 major + minor (the device set is fixed)
  if (dev < 0 || dev >= 64) return false;
  if (cc[dev] == 0) {
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      return false;
    }
    cc[dev] = 10 * major + minor;
  }
  return cc[dev] == 90;
#else
  (void)p;
  return false;
#endif
}

template <typename T>
void attn_fwd_sm90(const AttnParams& p, const T* q, const T* k, const T* v, T* o, float* lse,
                   cudaStream_t st, const char* op) {
  if (p.D == 64) {
    if (!launch_fwd_sm90_ws_cfg<T, 64, 2, 128, 4, 1, true, true>(p, q, k, v, o, lse, st, op)) {
      launch_fwd_sm90_cfg<T, 64, 2, 64, 5>(p, q, k, v, o, lse, st, op);
    }
  } else if (!launch_fwd_sm90_ws_cfg<T, 128, 2, 64, 4, 1, true, true>(p, q, k, v, o, lse, st, op)) {
    launch_fwd_sm90_cfg<T, 128, 2, 64, 4>(p, q, k, v, o, lse, st, op);
  }
  // the rows the kernel marked (Note [no calls in wgmma kernels])
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.L;
  launch_dependent(true, attn_fix_marked_rows<T>, static_cast<unsigned>((rows + 255) / 256), 256, 0,
                   st, op, p, q, k, v, o, lse);
  BT_CUDA_LAUNCH_CHECK(op);
}
// ---- backward ----------------------------------------------------------------------------------
// dq_acc (B H, L, 64) float32 for the TMA reduce: box 32 x 64 rows (128-byte rows, swizzled).
bool make_acc_map(CUtensorMap* map, float* acc, int L, int BH) {
  const EncodeTiledFn enc = tensor_map_encoder();
  if (!enc) return false;
  const cuuint64_t dim[3] = {64, cuuint64_t(L), cuuint64_t(BH)};
  const cuuint64_t stride[2] = {64 * sizeof(float), uint64_t(L) * 64 * sizeof(float)};
  const cuuint32_t box[3] = {32, 64, 1}, elem_step[3] = {1, 1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, acc, dim, stride, box, elem_step,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename T, int D, int kWG, int kStages, int kDq, bool kPersist>
constexpr size_t sm90_bwd_smem() {
  constexpr int kKvBufs = kPersist ? 2 : 1;
  return (kKvBufs * 2 * 64 * kWG + 2 * kStages * 64 + kWG * 2 * 64) * D * sizeof(T) +
         (2 * kStages * 64 + (kDq >= 2 ? kWG * 2 * 64 * 64 : 0)) * sizeof(float) +
         (2 * kStages + 2 * kKvBufs) * sizeof(uint64_t) + 1024;
}

template <typename T, int kWG, int kStages, int kDq = 1, bool kPingPong = false,
          bool kDefer = false, bool kPersist = false>
bool launch_bwd_sm90_cfg(const AttnParams& p, const T* q, const T* k, const T* v, const T* g,
                         const float* lse, const float* dvec, float* dq_acc, T* dk, T* dv,
                         int* bad_keys, cudaStream_t st, const char* op, int max_blocks = 0) {
  constexpr int D = 64, kBc = 64 * kWG;
  CUtensorMap tq, tk, tv, tg, tacc;
  TmaOrder ord{};
  if (!make_row_map(&tq, &ord.q_h_inner, q, D, p.L, p.H, p.B, p.q_b, p.q_h, p.q_l, 64) ||
      !make_row_map(&tk, &ord.k_h_inner, k, D, p.S, p.H, p.B, p.k_b, p.k_h, p.k_l, kBc) ||
      !make_row_map(&tv, &ord.v_h_inner, v, D, p.S, p.H, p.B, p.v_b, p.v_h, p.v_l, kBc) ||
      !make_row_map(&tg, &ord.g_h_inner, g, D, p.L, p.H, p.B, p.g_b, p.g_h, p.g_l, 64) ||
      !make_acc_map(&tacc, dq_acc, p.L, p.B * p.H)) {
    return false;
  }
  constexpr size_t smem = sm90_bwd_smem<T, D, kWG, kStages, kDq, kPersist>();
  auto kern = attn_bwd_sm90_ws<T, D, kWG, kStages, kDq, kPingPong, kDefer, kPersist>;
  BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  const int64_t nkv = (p.S + kBc - 1) / kBc, items = int64_t(p.B) * p.H * nkv;
  if (items > 2147483647LL) return false;  // item indices are int
  dim3 grid(p.B * p.H, static_cast<unsigned>(nkv));
  if constexpr (kPersist) {  // one block per SM (or per item, if the count is unknown)
    const int sms = max_blocks > 0 ? max_blocks : sm_count_current();  // (a harness sets fewer)
    grid = dim3(static_cast<unsigned>(sms > 0 ? std::min<int64_t>(items, sms) : items));
  }
  // overlaps the Dvec kernel's tail (Note [programmatic dependent launch])
  launch_dependent(true, kern, grid, bwd_threads(kWG, kDefer), smem, st, op, p, tq, tk, tv, tg,
                   tacc, ord, lse, dvec, dk, dv, dq_acc, bad_keys);
  return true;
}

template <typename T>
bool attn_bwd_sm90(const AttnParams& p, const T* q, const T* k, const T* v, const T* g,
                   const float* lse, const float* dvec, float* dq_acc, T* dk, T* dv, int* bad_keys,
                   cudaStream_t st, const char* op) {
  if (p.D != 64 || !attn_fwd_sm90_supported(p)) return false;
  // kDq 3, 3 stages, ping-pong, persistent (Note [persistent backward]; B16 H12 T1024 causal,
  // memset + kernel + convert: 0.284 ms against 0.300 one item per block, session 16)
  return launch_bwd_sm90_cfg<T, 2, 3, 3, true, true, true>(p, q, k, v, g, lse, dvec, dq_acc, dk, dv,
                                                           bad_keys, st, op);
}
template bool attn_bwd_sm90<__nv_bfloat16>(const AttnParams&, const __nv_bfloat16*,
                                           const __nv_bfloat16*, const __nv_bfloat16*,
                                           const __nv_bfloat16*, const float*, const float*, float*,
                                           __nv_bfloat16*, __nv_bfloat16*, int*, cudaStream_t,
                                           const char*);
template bool attn_bwd_sm90<__half>(const AttnParams&, const __half*, const __half*, const __half*,
                                    const __half*, const float*, const float*, float*, __half*,
                                    __half*, int*, cudaStream_t, const char*);

template void attn_fwd_sm90<__nv_bfloat16>(const AttnParams&, const __nv_bfloat16*,
                                           const __nv_bfloat16*, const __nv_bfloat16*,
                                           __nv_bfloat16*, float*, cudaStream_t, const char*);
template void attn_fwd_sm90<__half>(const AttnParams&, const __half*, const __half*, const __half*,
                                    __half*, float*, cudaStream_t, const char*);

}  // namespace bt::cuda
