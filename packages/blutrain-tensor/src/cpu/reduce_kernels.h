// cpu/reduce_kernels.h: the CPU one-dim reductions of float rows (Sum / Mean, Max / Min) as
// plain functions over raw rows, so bench/reduce_rows_check.cpp can check them bit for bit
// against the scalar loops they replaced, on every instruction set.
//
// Note [row sums in lanes]
// Each output of a row sum is its elements added one by one, in index order, into a double that
// starts at 0 (the bits reduce.cpp has always given: np.cumsum's last element). That is a chain of
// dependent adds per output, which a vector add cannot shorten; so the lanes of a double vector
// hold different rows instead: lane r of the accumulator is row r's running sum. Four rows x 8
// columns are loaded, transposed (as floats, in both 128-bit halves at once) so that vector c holds
// column j + c of the 4 rows, widened to double, and added column by column in index order; two
// groups of 4 rows are in flight. Every lane performs exactly the scalar loop's adds, in its order,
// on exactly its operands (widening float16 / bfloat16 / float to double is exact, a vector add
// rounds each lane as a scalar add does, nothing to contract), so the bits are the scalar loop's at
// any instruction set and any thread count; the columns past the last whole step continue each
// lane's sum in scalar code, still in order. Outputs adjacent in memory (the reduced dim strided,
// e.g. x.T.sum(-1)) need no transpose: a vector load of 8 outputs' j-th elements is one column.
// 2048 x 1024 float32 on one core (Zen 4, bench/reduce_rows_check.cpp): the scalar loop one row at
// a time 1.63 ms, 8 rows side by side (reduce.cpp until now) ~0.5 ms, the lanes 0.30 ms; float64
// 0.38 ms. One thing is not kept: which operand's NaN an add returns when both are NaNs (an input
// NaN and inf - inf's) is the compiler's choice of operand order, in the lanes as in the scalar
// loops (whose choice differed between 1 and 2 threads: 8-row chains and single rows), so
// reduce.cpp stores a NaN sum from these kernels as the default quiet NaN, as Max / Min do: a
// NaN sum's sign bit may differ from before, every other bit is the same. (Rows shorter than 64
// keep reduce.cpp's 8 chains, faster there, and their NaNs.)
//
// Note [exact row sums]
// The lanes still do one double add per element after a transpose; a float32 row is usually summed
// faster still, because its in-order double sum is exact and any order gives the same bits.
// Elements with `mant` mantissa bits whose largest magnitude has float32 exponent field emax and
// smallest nonzero one emin (subnormals counted as 1; 16-bit types widened) are all integer
// multiples of q = 2^(emin - bias - mant) and below 2^(emax - bias + 1) in magnitude; any partial
// sum of n of them, in any order, is a multiple of q below n 2^(emax - bias + 1), which a double
// holds exactly while that is at most 2^53 q: emax - emin + ceil(log2 n) <= 52 - mant (float32 rows
// of 1024: magnitudes within 2^19 of each other; a zero counts for nothing). Then every add of the
// in-order sum was exact, so was every add of any other order, and both are the exact sum: one pass
// adds the row in 4 column accumulators (no transpose) while tracking emin and emax, and returns
// false (the caller runs the lanes) where the bound fails or an infinity / NaN is present (whose
// sum's bits are the order's). A sum of exact zero is +0 both ways (an add of nonzero values never
// gives -0 in round-to-nearest, and the accumulators start at +0). float32 2048 x 1024: 0.15 ms
// where the bound holds (most rows of unit-scale data); PyTorch's float32 sum, in its own order,
// 0.105 ms. bfloat16 (mant 7) rows nearly always pass; float16 (mant 10, 30 binades) rows of up to
// 2^13 elements always do but for infinities and NaNs.
// Including files must be compiled with -ffp-contract=off.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../dtype.h"
#include "fastmath.h"  // BT_CPU_CLONES

// The kernels need GCC 12's (or clang's) __builtin_shufflevector; reduce.cpp runs them where
// lanes_enabled() (below), else its scalar loops.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define BT_REDUCE_LANES 1
#endif
#endif

#ifdef BT_REDUCE_LANES
namespace bt::cpu::reduce {

typedef float v4sf __attribute__((vector_size(16)));
typedef float v8sf __attribute__((vector_size(32)));
typedef double v4df __attribute__((vector_size(32)));
typedef uint16_t v4hu __attribute__((vector_size(8)));
typedef uint16_t v8hu __attribute__((vector_size(16)));
typedef uint32_t v4su __attribute__((vector_size(16)));
typedef uint32_t v8su __attribute__((vector_size(32)));
typedef int32_t v4si __attribute__((vector_size(16)));
typedef int32_t v8si __attribute__((vector_size(32)));

constexpr int kLanes = 8;      // rows per group of the adjacent-outputs sums
constexpr int kGroups = 2;     // groups in flight: 16 rows per block
constexpr int kRowLanes = 4;   // rows per group of the contiguous-row sums (a double vector)
constexpr int kRowGroups = 2;  // groups in flight: 8 rows per block (4 groups: 16 rows 4 KiB
                               // apart overflow an 8-way L1 set)
constexpr int kStep = 16;      // columns a step (a float32 row's whole cache line)

// ---- exact widening loads ---------------------------------------------------------------------
// float16 bits (in 32-bit lanes) to float, exactly float16::to_float without a branch: the
// exponent rebiased; infinities and NaNs (exponent 31) rebiased once more; subnormals and zeros
// (exponent 0) as 2^-14 (1 + m / 1024) - 2^-14 = m * 2^-24, an exact float subtraction.
template <typename VU, typename VF>
inline VF half_bits_to_float(VU h) {
  const VU em = (h & 0x7fffu) << 13;
  const VU e = em & 0x0f800000u;
  const VU normal = em + (112u << 23);
  const VU special = em + (224u << 23);
  VF sub;
  const VU subbits = em + (113u << 23);
  std::memcpy(&sub, &subbits, sizeof(VF));
  sub = sub - static_cast<float>(1.0 / 16384.0);  // 2^-14
  VU subu;
  std::memcpy(&subu, &sub, sizeof(VF));
  VU r = e == 0x0f800000u ? special : normal;
  r = e == 0u ? subu : r;
  r |= (h & 0x8000u) << 16;
  VF f;
  std::memcpy(&f, &r, sizeof(VF));
  return f;
}

// N consecutive elements (N = 4 or 8) as floats (T 32 bits or less) or doubles (4, T = double):
// the exact values.  (GCC vector types are structural: Lanes<4>::f is v4sf.)
template <int N>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * N)));
  typedef uint16_t h __attribute__((vector_size(2 * N)));
  typedef uint32_t u __attribute__((vector_size(4 * N)));
};
template <int N>
inline typename Lanes<N>::f load_lanes(const float* p) {
  typename Lanes<N>::f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N>
inline typename Lanes<N>::f load_lanes(const bfloat16* p) {
  typename Lanes<N>::h h;
  std::memcpy(&h, p, sizeof h);
  const typename Lanes<N>::u u = __builtin_convertvector(h, typename Lanes<N>::u) << 16;
  typename Lanes<N>::f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
template <int N>
inline typename Lanes<N>::f load_lanes(const float16* p) {
  typename Lanes<N>::h h;
  std::memcpy(&h, p, sizeof h);
  return half_bits_to_float<typename Lanes<N>::u, typename Lanes<N>::f>(
      __builtin_convertvector(h, typename Lanes<N>::u));
}
template <typename T>
inline v4sf load4(const T* p) {
  return load_lanes<4>(p);
}
inline v4df load4(const double* p) {
  v4df v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
inline v8sf load8(const T* p) {
  return load_lanes<8>(p);
}

// One element as the scalar loop read it: T -> compute_t<T> -> double.
template <typename T>
inline double wide(T v) {
  return static_cast<double>(static_cast<compute_t<T>>(v));
}

// Widening written lane by lane: GCC 12 turns this into one vcvtps2pd, where
// __builtin_convertvector went through the stack.
inline v4df to_double4(v4sf v) { return v4df{v[0], v[1], v[2], v[3]}; }
inline v4df to_double4(v4df v) { return v; }
template <typename V>
inline auto lo4(V v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3);
}
template <typename V>
inline auto hi4(V v) {
  auto h = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  // one vextract: without the (empty) asm GCC 12 merged the shuffle into the widening that
  // follows and built the 4 lanes one by one (bfloat16 exact sums 1.5x slower)
  if constexpr (sizeof(h) == 16) asm("" : "+x"(h));
  return h;
}

// a_i = [row i, cols c..c+3 | row i + 4, cols c..c+3] (i < 4) -> c_k = column c + k of rows 0..7
// (each 128-bit half transposed 4 x 4: unpacks, then shuffles within the halves).
template <typename V>
inline void transpose_halves(V& a0, V& a1, V& a2, V& a3) {
  const V t0 = __builtin_shufflevector(a0, a1, 0, 8, 1, 9, 4, 12, 5, 13);
  const V t1 = __builtin_shufflevector(a0, a1, 2, 10, 3, 11, 6, 14, 7, 15);
  const V t2 = __builtin_shufflevector(a2, a3, 0, 8, 1, 9, 4, 12, 5, 13);
  const V t3 = __builtin_shufflevector(a2, a3, 2, 10, 3, 11, 6, 14, 7, 15);
  a0 = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
  a1 = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
  a2 = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
  a3 = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
}

// ---- sums ---------------------------------------------------------------------------------
// Columns k = 0..3 of 4 rows as double vectors of the 4 rows (lane r: row r), in index order:
// f(c_k) for each. The vectors are 32 bytes at most (wider generic vectors, which AVX2 lacks,
// went through the stack with GCC 12).
template <typename T, typename F>
inline void columns8(const T* r0, const T* r1, const T* r2, const T* r3, F&& f) {
  if constexpr (std::is_same_v<T, double>) {
    for (int h = 0; h < 8; h += 4) {
      const v4df a0 = load4(r0 + h), a1 = load4(r1 + h), a2 = load4(r2 + h), a3 = load4(r3 + h);
      const v4df t0 = __builtin_shufflevector(a0, a1, 0, 4, 2, 6);
      const v4df t1 = __builtin_shufflevector(a0, a1, 1, 5, 3, 7);
      const v4df t2 = __builtin_shufflevector(a2, a3, 0, 4, 2, 6);
      const v4df t3 = __builtin_shufflevector(a2, a3, 1, 5, 3, 7);
      f(__builtin_shufflevector(t0, t2, 0, 1, 4, 5));
      f(__builtin_shufflevector(t1, t3, 0, 1, 4, 5));
      f(__builtin_shufflevector(t0, t2, 2, 3, 6, 7));
      f(__builtin_shufflevector(t1, t3, 2, 3, 6, 7));
    }
  } else {
    v8sf a0 = load8(r0), a1 = load8(r1), a2 = load8(r2), a3 = load8(r3);
    transpose_halves(a0, a1, a2, a3);  // a_k = [rows 0-3 at k | rows 0-3 at 4 + k]
    f(to_double4(lo4(a0)));
    f(to_double4(lo4(a1)));
    f(to_double4(lo4(a2)));
    f(to_double4(lo4(a3)));
    f(to_double4(hi4(a0)));
    f(to_double4(hi4(a1)));
    f(to_double4(hi4(a2)));
    f(to_double4(hi4(a3)));
  }
}

// out[r] = row r's elements p[r][0], ..., p[r][n - 1] added in order into a double from 0
// (Note [row sums in lanes]), for r < 4 * G; rows contiguous.
template <int G, typename T>
inline void sum_rows_lanes(const T* const* p, int64_t n, double* out) {
  v4df acc[G];
  for (int g = 0; g < G; ++g) acc[g] = v4df{};
  // 16 columns a step: a float32 row's whole cache line used at once (rows 4 KiB apart share an
  // L1 set; read in halves, 16 rows' lines were evicted between the halves: 2.2x slower)
  const int64_t full = n / kStep * kStep;
  for (int64_t j = 0; j < full; j += kStep) {
    for (int g = 0; g < G; ++g) {
      const T* const* q = p + g * 4;
      for (int h = 0; h < kStep; h += 8) {
        columns8(q[0] + j + h, q[1] + j + h, q[2] + j + h, q[3] + j + h,
                 [&](v4df c) { acc[g] += c; });
      }
    }
  }
  double as[G][4];  // the lanes through an array (see sum_row_exact)
  std::memcpy(as, acc, sizeof as);
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) {
      const T* q = p[g * 4 + k];
      double s = as[g][k];
      for (int64_t i = full; i < n; ++i) s += wide(q[i]);
      out[g * 4 + k] = s;
    }
  }
}

// 4 consecutive elements as doubles.
template <typename T>
inline v4df load4d(const T* p) {
  return to_double4(load4(p));
}

// The same sums for 8 * G rows whose elements j are adjacent: row r's element j at
// p[r + j * stride] (outputs adjacent in memory, the reduced dim strided): no transpose.
template <int G, typename T>
inline void sum_cols_lanes(const T* p, int64_t n, int64_t stride, double* out) {
  v4df acc[2 * G];
  for (int g = 0; g < 2 * G; ++g) acc[g] = v4df{};
  for (int64_t j = 0; j < n; ++j) {
    for (int g = 0; g < 2 * G; ++g) acc[g] += load4d(p + j * stride + g * 4);
  }
  std::memcpy(out, acc, sizeof acc);
}

// Row sums of 4 * kRowGroups (block) or 4 (group) rows at p[r], n contiguous elements each.
template <typename T>
BT_CPU_CLONES void sum_rows_block(const T* const* p, int64_t n, double* out) {
  sum_rows_lanes<kRowGroups>(p, n, out);
}
template <typename T>
BT_CPU_CLONES void sum_rows_group(const T* const* p, int64_t n, double* out) {
  sum_rows_lanes<1>(p, n, out);
}
// Sums of 8 * kGroups (block) or 8 (group) adjacent outputs.
template <typename T>
BT_CPU_CLONES void sum_cols_block(const T* p, int64_t n, int64_t stride, double* out) {
  sum_cols_lanes<kGroups>(p, n, stride, out);
}
template <typename T>
BT_CPU_CLONES void sum_cols_group(const T* p, int64_t n, int64_t stride, double* out) {
  sum_cols_lanes<1>(p, n, stride, out);
}

// ---- exact sums (Note [exact row sums]) ------------------------------------------------------
template <typename T>
constexpr int kMantissaBits = 23;  // float
template <>
constexpr int kMantissaBits<bfloat16> = 7;
template <>
constexpr int kMantissaBits<float16> = 10;

// Whether every partial sum of n elements, in any order, is exact in a double, given the
// smallest nonzero |element| bits minus 1 (umin1; 0xffffffff: no nonzero element) and the largest
// |element| bits (umax), both as float32 bits, of elements with `mant` mantissa bits.
inline bool sums_exact(uint32_t umin1, uint32_t umax, int64_t n, int mant) {
  if (umin1 == 0xffffffffu) return true;  // all zeros: +0 in any order
  const int emax = static_cast<int>(umax >> 23);
  if (emax == 255) return false;  // an infinity or a NaN: the scalar order decides
  int emin = static_cast<int>((umin1 + 1) >> 23);
  if (emin == 0) emin = 1;  // a subnormal: a multiple of the smallest normal's ulp
  int k = 0;
  while ((int64_t{1} << k) < n) ++k;  // n <= 2^k
  return emax - emin + k <= 52 - mant;
}

inline v8su bits_of(v8sf v) {
  v8su u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// out = the row's sum in double, when Note [exact row sums] proves it equal to the in-order sum
// (returns true); else false (out unspecified). T: float, bfloat16, float16; n >= 0.
template <typename T>
BT_CPU_CLONES bool sum_row_exact(const T* p, int64_t n, double* out) {
  v4df a0{}, a1{}, a2{}, a3{};
  v8su mn = ~v8su{}, mx = v8su{};
  const uint32_t abs_mask = 0x7fffffffu;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    v8sf x0, x1;
    if constexpr (std::is_same_v<T, bfloat16>) {
      // 16 bfloat16 as 8 pairs: the even elements' floats are the low halves shifted up, the
      // odd ones' the high halves (any order will do here), no zero-extending shuffles
      // (2048 x 1024, one core, x86-64-v3: 0.39 -> 0.23 ms; float16 below 0.64 -> 0.48 ms)
      v8su w;
      std::memcpy(&w, p + j, sizeof w);
      const v8su even = w << 16, odd = w & 0xffff0000u;
      std::memcpy(&x0, &even, sizeof x0);
      std::memcpy(&x1, &odd, sizeof x1);
    } else if constexpr (std::is_same_v<T, float16>) {  // the same pairs, widened
      v8su w;
      std::memcpy(&w, p + j, sizeof w);
      x0 = half_bits_to_float<v8su, v8sf>(w & 0xffffu);
      x1 = half_bits_to_float<v8su, v8sf>(w >> 16);
    } else {
      x0 = load8(p + j);
      x1 = load8(p + j + 8);
    }
    const v8su u0 = bits_of(x0) & abs_mask, u1 = bits_of(x1) & abs_mask;
    const v8su m0 = u0 - 1u, m1 = u1 - 1u;
    mn = m0 < mn ? m0 : mn;
    mn = m1 < mn ? m1 : mn;
    mx = u0 > mx ? u0 : mx;
    mx = u1 > mx ? u1 : mx;
    if constexpr (std::is_same_v<T, float>) {  // widened from memory: no extracts
      a0 += load4d(p + j);
      a1 += load4d(p + j + 4);
      a2 += load4d(p + j + 8);
      a3 += load4d(p + j + 12);
    } else {  // 16-bit: widened once
      a0 += to_double4(lo4(x0));
      a1 += to_double4(hi4(x0));
      a2 += to_double4(lo4(x1));
      a3 += to_double4(hi4(x1));
    }
  }
  for (; j + 8 <= n; j += 8) {
    const v8sf x0 = load8(p + j);
    const v8su u0 = bits_of(x0) & abs_mask;
    const v8su m0 = u0 - 1u;
    mn = m0 < mn ? m0 : mn;
    mx = u0 > mx ? u0 : mx;
    a0 += to_double4(lo4(x0));
    a1 += to_double4(hi4(x0));
  }
  a0 += a1;
  a2 += a3;
  a0 += a2;
  // the lanes through arrays: a vector subscript with a variable index kept mn and mx in memory
  // in the whole loop (GCC 12, target_clones)
  double as[4];
  uint32_t mns[8], mxs[8];
  std::memcpy(as, &a0, sizeof as);
  std::memcpy(mns, &mn, sizeof mns);
  std::memcpy(mxs, &mx, sizeof mxs);
  double s = as[0] + as[1] + as[2] + as[3];
  uint32_t umin1 = mns[0], umax = mxs[0];
  for (int k = 1; k < 8; ++k) {
    umin1 = mns[k] < umin1 ? mns[k] : umin1;
    umax = mxs[k] > umax ? mxs[k] : umax;
  }
  for (; j < n; ++j) {
    const float f = static_cast<float>(p[j]);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u &= abs_mask;
    umin1 = u - 1u < umin1 ? u - 1u : umin1;
    umax = u > umax ? u : umax;
    s += static_cast<double>(f);
  }
  *out = s;
  return sums_exact(umin1, umax, n, kMantissaBits<T>);
}

// ---- max / min ----------------------------------------------------------------------------
// The row's max (IsMax) or min as the scalar loop gives it (the first extreme in index order,
// `c > best`; NaN if any element is one), from 4 W lanes (W = 8, 4 for double): lane k keeps
// the first extreme of elements k, k + 4 W, ... and the row's extreme is the lanes' one. Equal
// floats have equal bits but for zeros (+0 == -0: the scalar loop keeps the first one's sign),
// so an extreme of zero returns false and the caller runs the scalar loop; so do rows shorter
// than 4 W. The last 4 W elements are read again for the tail (an extreme does not change, and
// a NaN stays a NaN).
template <bool IsMax, typename T>
BT_CPU_CLONES bool extreme_row(const T* p, int64_t n, compute_t<T>* out) {
  using C = compute_t<T>;
  constexpr int W = std::is_same_v<T, double> ? 4 : 8;  // 32-byte vectors
  auto ld = [](const T* q) {
    if constexpr (W == 4) {
      return load4(q);
    } else {
      return load8(q);
    }
  };
  if (n < 4 * W) return false;
  auto b0 = ld(p), b1 = ld(p + W), b2 = ld(p + 2 * W), b3 = ld(p + 3 * W);
  auto nan = (b0 != b0) | (b1 != b1) | (b2 != b2) | (b3 != b3);
  auto step = [&](const T* q) {
    const auto v0 = ld(q), v1 = ld(q + W), v2 = ld(q + 2 * W), v3 = ld(q + 3 * W);
    nan |= (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3);
    if constexpr (IsMax) {
      b0 = v0 > b0 ? v0 : b0;
      b1 = v1 > b1 ? v1 : b1;
      b2 = v2 > b2 ? v2 : b2;
      b3 = v3 > b3 ? v3 : b3;
    } else {
      b0 = v0 < b0 ? v0 : b0;
      b1 = v1 < b1 ? v1 : b1;
      b2 = v2 < b2 ? v2 : b2;
      b3 = v3 < b3 ? v3 : b3;
    }
  };
  int64_t j = 4 * W;
  for (; j + 4 * W <= n; j += 4 * W) step(p + j);
  if (j < n) step(p + n - 4 * W);
  using V = decltype(b0);
  using M = decltype(nan);
  C bs[4][W];  // the lanes through arrays (see sum_row_exact)
  std::memcpy(bs[0], &b0, sizeof(V));
  std::memcpy(bs[1], &b1, sizeof(V));
  std::memcpy(bs[2], &b2, sizeof(V));
  std::memcpy(bs[3], &b3, sizeof(V));
  std::remove_reference_t<decltype(nan[0])> nans[W];
  static_assert(sizeof nans == sizeof(M));
  std::memcpy(nans, &nan, sizeof nans);
  C best = bs[0][0];
  bool any_nan = false;
  for (int k = 0; k < W; ++k) {
    any_nan = any_nan || nans[k] != 0;
    for (int v = 0; v < 4; ++v) {
      if (IsMax ? bs[v][k] > best : bs[v][k] < best) best = bs[v][k];
    }
  }
  if (any_nan) {
    *out = std::numeric_limits<C>::quiet_NaN();
    return true;
  }
  if (best == 0) return false;
  *out = best;
  return true;
}

// The scalar loop it replaces (any stride), also for the rows it leaves.
template <bool IsMax, typename T>
inline compute_t<T> extreme_row_scalar(const T* p, int64_t n, int64_t stride) {
  using C = compute_t<T>;
  C best = static_cast<C>(p[0]);
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    const C c = static_cast<C>(p[j * stride]);
    if (c != c) nan = true;
    if (IsMax ? (c > best) : (c < best)) best = c;
  }
  if constexpr (std::is_floating_point<C>::value) {
    if (nan) best = std::numeric_limits<C>::quiet_NaN();
  }
  return best;
}

// The scalar loop (one row, any stride): the reference of the lanes and the rows they leave.
template <typename T>
inline double sum_row(const T* p, int64_t n, int64_t stride) {
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += wide(p[j * stride]);
  return s;
}

// Whether reduce.cpp runs these kernels: on x86-64 with AVX2, where BT_CPU_CLONES picks an AVX2
// or AVX-512 build of them (their 32-byte vectors split into SSE2 halves are slower than the
// scalar loops: max 4x) or where the whole build targets AVX2.
inline bool lanes_enabled() {
#if defined(__AVX2__)
  return true;
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx2;
#else
  return false;
#endif
}

}  // namespace bt::cpu::reduce
#endif  // BT_REDUCE_LANES
