// bench/reduce_rows_check.cpp: the one-dim reduction kernels (src/cpu/reduce_kernels.h: row sums
// in lanes, exact row sums, max / min in lanes) against the scalar loops they replaced, bit for
// bit, and timed.
//
//   bash bench/cpu_kernels_check.sh      # builds this once per instruction set and runs each
//
// Built as reduce.cpp is compiled (-ffp-contract=off), BT_CPU_CLONES empty, -march=x86-64-v4, -v3
// and the baseline in turn (the baseline build is checked but not run in production: reduce.cpp
// keeps its scalar loops on CPUs without AVX2, lanes_enabled()). Timing: LDPAD=16 pads the rows
// (4 KiB apart by default, the case Note [row sums in lanes]'s 16-column steps are for).
//
// v1 is reduce.cpp's scalar loop (one running double per row, in index order; max / min: the
// first extreme). Inputs: random rows of many lengths (1..70, 1023, 1025) in float32, float64,
// bfloat16 and float16, rows spanning huge and tiny magnitudes, NaN and infinities, zeros of both
// signs; rows on both sides of Note [exact row sums]'s bound (a bound one binade looser fails
// here); every float16 bit pattern through the branchless widening. Times: the calling thread's CPU
// time, best of --reps.
#include <time.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../src/cpu/reduce_kernels.h"
#include "../src/dtype.h"

using bt::bfloat16;
using bt::float16;
namespace rk = bt::cpu::reduce;

namespace {

int failures = 0;

double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

template <typename T>
T make(double v) {
  return static_cast<T>(v);
}

// Rows [0, R) of an R x n matrix (row stride ld): v2 in blocks, groups, then single rows, as
// reduce.cpp calls them.
template <typename T>
void v2_rows(const T* x, int64_t R, int64_t n, int64_t ld, double* out) {
  int64_t r = 0;
  const T* p[rk::kRowLanes * rk::kRowGroups];
  for (; r + rk::kRowLanes * rk::kRowGroups <= R; r += rk::kRowLanes * rk::kRowGroups) {
    for (int k = 0; k < rk::kRowLanes * rk::kRowGroups; ++k) p[k] = x + (r + k) * ld;
    rk::sum_rows_block(p, n, out + r);
  }
  for (; r + rk::kRowLanes <= R; r += rk::kRowLanes) {
    for (int k = 0; k < rk::kRowLanes; ++k) p[k] = x + (r + k) * ld;
    rk::sum_rows_group(p, n, out + r);
  }
  for (; r < R; ++r) out[r] = rk::sum_row(x + r * ld, n, 1);
}

// The transposed case: output r's element j at x[r + j * ld].
template <typename T>
void v2_cols(const T* x, int64_t R, int64_t n, int64_t ld, double* out) {
  int64_t r = 0;
  for (; r + rk::kLanes * rk::kGroups <= R; r += rk::kLanes * rk::kGroups) {
    rk::sum_cols_block(x + r, n, ld, out + r);
  }
  for (; r + rk::kLanes <= R; r += rk::kLanes) rk::sum_cols_group(x + r, n, ld, out + r);
  for (; r < R; ++r) out[r] = rk::sum_row(x + r, n, ld);
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

long exact_true = 0, exact_false = 0;

template <typename C>
bool same_value_bits(C a, C b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b);
}

// extreme_row: where it answers, the scalar loop's bits (a zero's sign included).
template <bool IsMax, typename T>
void check_extreme(const char* tname, const T* x, int64_t R, int64_t n, int64_t ld) {
  for (int64_t r = 0; r < R; ++r) {
    using C = bt::compute_t<T>;
    C got;
    const C ref = rk::extreme_row_scalar<IsMax>(x + r * ld, n, 1);
    if (rk::extreme_row<IsMax>(x + r * ld, n, &got) && !same_value_bits(ref, got) &&
        failures++ < 10)
      std::printf("FAIL %s %s n=%lld row %lld: %.9g vs %.9g\n", IsMax ? "max" : "min", tname,
                  (long long)n, (long long)r, (double)ref, (double)got);
  }
}

// sum_row_exact: where it claims exactness, the in-order sum's bits.
template <typename T>
void check_exact(const char* tname, const T* x, int64_t R, int64_t n, int64_t ld) {
  for (int64_t r = 0; r < R; ++r) {
    double got = -1;
    const double ref = rk::sum_row(x + r * ld, n, 1);
    if (!rk::sum_row_exact(x + r * ld, n, &got)) {
      ++exact_false;
      continue;
    }
    ++exact_true;
    if (!same_bits(ref, got) && failures++ < 10)
      std::printf("FAIL exact %s n=%lld row %lld: %.17g vs %.17g\n", tname, (long long)n,
                  (long long)r, ref, got);
  }
}

// Rows whose magnitudes span `spread` binades from 2^e0 (signs random): around the bound of
// Note [exact row sums], where in-order double sums start to round.
template <typename T>
void check_spreads(const char* tname, std::mt19937_64& gen) {
  std::uniform_real_distribution<double> u(1.0, 2.0);
  for (int64_t n : {2, 3, 17, 64, 100, 1024, 1025, 4096}) {
    for (int spread = 0; spread <= 50; ++spread) {
      for (int e0 : {-140, -130, -20, 0, 40, 100}) {
        std::uniform_int_distribution<int> e(0, spread);
        std::vector<T> x(static_cast<size_t>(n * 4));
        for (auto& v : x) {
          double d = std::ldexp(u(gen), e0 + e(gen));
          if (gen() & 1) d = -d;
          if ((gen() & 31) == 0) d = 0;
          v = make<T>(d);
        }
        // force both ends of the spread into each row
        for (int64_t r = 0; r < 4; ++r) {
          x[static_cast<size_t>(r * n)] = make<T>(std::ldexp(1.0, e0));
          x[static_cast<size_t>(r * n + n - 1)] = make<T>(-std::ldexp(1.75, e0 + spread));
        }
        check_exact(tname, x.data(), 4, n, n);
        // near the worst case of the bound: 3 in 4 elements just below 2^(e0 + spread + 1), the
        // others at 2^e0 with random last bits, which an in-order sum past 2^53 ulps of 2^e0 rounds
        for (int64_t i = 0; i < 2 * n; ++i) {
          const double m = 1.0 + std::ldexp(static_cast<double>(gen() % 8388608), -23);
          x[static_cast<size_t>(i)] =
              make<T>(i % 4 ? std::ldexp(1.99, e0 + spread) : std::ldexp(m, e0));
        }
        check_exact(tname, x.data(), 2, n, n);
      }
    }
  }
}

template <typename T>
void check(const char* tname, std::mt19937_64& gen, int64_t R, int64_t n, int kind) {
  const int64_t ld = n + 3;  // rows not adjacent
  std::vector<T> x(static_cast<size_t>(R * ld + R * 4 + 8));
  std::normal_distribution<double> nd;
  std::uniform_int_distribution<int> e(-60, 60);
  for (auto& v : x) {
    double d = nd(gen);
    if (kind == 1) d = std::ldexp(d, e(gen));  // magnitudes over many binades
    v = make<T>(d);
  }
  if (kind == 2 && R >= 3) {  // specials
    x[static_cast<size_t>(n / 2)] = make<T>(NAN);
    x[static_cast<size_t>(ld + n / 3)] = make<T>(INFINITY);
    x[static_cast<size_t>(2 * ld + 1 % n)] = make<T>(-INFINITY);
    x[static_cast<size_t>(2 * ld)] = make<T>(INFINITY);
  }
  if (kind == 3) {  // zeros of both signs and negatives: the max is a zero
    for (auto& v : x) v = make<T>(-std::fabs(static_cast<double>(static_cast<float>(v))));
    for (size_t i = 0; i < x.size(); i += 5) x[i] = make<T>(i % 2 ? 0.0 : -0.0);
  }
  std::vector<double> ref(R), got(R, -1.0);
  for (int64_t r = 0; r < R; ++r) ref[r] = rk::sum_row(x.data() + r * ld, n, 1);
  v2_rows(x.data(), R, n, ld, got.data());
  for (int64_t r = 0; r < R; ++r) {
    if (!same_bits(ref[r], got[r]) && !(std::isnan(ref[r]) && std::isnan(got[r]))) {
      if (failures++ < 10)
        std::printf("FAIL rows %s R=%lld n=%lld kind=%d row %lld: %.17g vs %.17g\n", tname,
                    (long long)R, (long long)n, kind, (long long)r, ref[r], got[r]);
    }
  }
  if constexpr (!std::is_same_v<T, double>) check_exact(tname, x.data(), R, n, ld);
  check_extreme<true>(tname, x.data(), R, n, ld);
  check_extreme<false>(tname, x.data(), R, n, ld);
  // columns: R outputs, n elements each, output r's j-th at x[r + j * (R + 2)]
  const int64_t cld = R + 2;
  if (static_cast<int64_t>(x.size()) >= n * cld) {
    for (int64_t r = 0; r < R; ++r) ref[r] = rk::sum_row(x.data() + r, n, cld);
    v2_cols(x.data(), R, n, cld, got.data());
    for (int64_t r = 0; r < R; ++r) {
      if (!same_bits(ref[r], got[r]) && !(std::isnan(ref[r]) && std::isnan(got[r]))) {
        if (failures++ < 10)
          std::printf("FAIL cols %s R=%lld n=%lld row %lld\n", tname, (long long)R, (long long)n,
                      (long long)r);
      }
    }
  }
}

template <typename T>
void check_all(const char* tname, std::mt19937_64& gen) {
  std::vector<int64_t> ns;
  for (int64_t n = 1; n <= 70; ++n) ns.push_back(n);
  ns.push_back(1023);
  ns.push_back(1024);
  ns.push_back(1025);
  for (int64_t n : ns) {
    for (int64_t R : {1, 7, 8, 9, 16, 23, 40}) {
      for (int kind = 0; kind < 4; ++kind) check<T>(tname, gen, R, n, kind);
    }
  }
}

template <typename T>
void time_rows(const char* tname, int reps) {
  const char* pad = std::getenv("LDPAD");
  const int64_t R = 2048, n = 1024, ld = n + (pad ? std::atoi(pad) : 0);
  std::vector<T> x(static_cast<size_t>(R * ld));
  std::mt19937_64 gen(1);
  std::normal_distribution<double> nd;
  for (auto& v : x) v = make<T>(nd(gen));
  std::vector<double> out(R);
  double best1 = 1e30, best2 = 1e30, best3 = 1e30, best4 = 1e30, best5 = 1e30, sink = 0;
  for (int i = 0; i < reps; ++i) {
    double t0 = cpu_ms();
    for (int64_t r = 0; r < R; ++r) out[r] = rk::sum_row(x.data() + r * ld, n, 1);
    double t1 = cpu_ms();
    sink += out[5];
    v2_rows(x.data(), R, n, ld, out.data());
    double t2 = cpu_ms();
    sink += out[7];
    double t3 = cpu_ms();
    if constexpr (!std::is_same_v<T, double>) {
      for (int64_t r = 0; r < R; ++r) rk::sum_row_exact(x.data() + r * ld, n, out.data() + r);
    }
    sink += out[3];
    best3 = std::min(best3, cpu_ms() - t3);
    double t4 = cpu_ms();
    for (int64_t r = 0; r < R; ++r) sink += rk::extreme_row_scalar<true>(x.data() + r * ld, n, 1);
    double t5 = cpu_ms();
    for (int64_t r = 0; r < R; ++r) {
      bt::compute_t<T> m;
      if (rk::extreme_row<true>(x.data() + r * ld, n, &m)) sink += m;
    }
    best4 = std::min(best4, t5 - t4);
    best5 = std::min(best5, cpu_ms() - t5);
    best1 = std::min(best1, t1 - t0);
    best2 = std::min(best2, t2 - t1);
  }
  std::printf(
      "  %-9s %lldx%lld sum(-1): v1 (one row at a time) %.3f ms, lanes %.3f ms, exact %.3f ms%s\n",
      tname, (long long)R, (long long)n, best1, best2, best3, sink == 12345.0 ? " " : "");
  std::printf("  %-9s %lldx%lld amax(-1): v1 %.3f ms, lanes %.3f ms\n", tname, (long long)R,
              (long long)n, best4, best5);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 10;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--reps") reps = std::atoi(argv[i + 1]);
  // every float16 bit pattern through the branchless widening
  for (uint32_t h = 0; h < 65536; h += 8) {
    uint16_t b[8];
    for (int k = 0; k < 8; ++k) b[k] = static_cast<uint16_t>(h + k);
    float16 f[8];
    std::memcpy(f, b, sizeof b);
    const rk::v8sf v = rk::load8(f);
    for (int k = 0; k < 8; ++k) {
      const float ref = float16::to_float(b[k]);
      if (std::memcmp(&ref, &v[k], 4) != 0 && failures++ < 10)
        std::printf("FAIL float16 widening 0x%04x\n", b[k]);
    }
  }
  std::mt19937_64 gen(36);
  check_all<float>("float32", gen);
  check_all<double>("float64", gen);
  check_all<bfloat16>("bfloat16", gen);
  check_all<float16>("float16", gen);
  check_spreads<float>("float32", gen);
  check_spreads<bfloat16>("bfloat16", gen);
  check_spreads<float16>("float16", gen);
  std::printf("exact row sums: %ld rows proven exact, %ld not (the lanes path)\n", exact_true,
              exact_false);
  std::printf("row sums: %s\n", failures ? "FAILED" : "bit-identical to the scalar loop");
  time_rows<float>("float32", reps);
  time_rows<double>("float64", reps);
  time_rows<bfloat16>("bfloat16", reps);
  time_rows<float16>("float16", reps);
  return failures ? 1 : 0;
}
