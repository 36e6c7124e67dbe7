// cpu/attention.cpp: the reference flash attention on the CPU (every float dtype), in double.
// Simple loops, one (batch, head) pair per OpenMP work item: the semantics the CUDA kernels must
// reproduce (softmax(q k^T * scale) v with a top-left causal mask, lse = the rows' logsumexp).
#include "../attention.h"

#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "../backend.h"
#include "loops.h"

namespace bt {

namespace {
// Element offsets of a 4-D strided view.
struct View4 {
  int64_t s0, s1, s2, s3;
  explicit View4(const Tensor& t)
      : s0(t.strides()[0]), s1(t.strides()[1]), s2(t.strides()[2]), s3(t.strides()[3]) {}
  int64_t operator()(int64_t a, int64_t b, int64_t c) const { return a * s0 + b * s1 + c * s2; }
};
}  // namespace

void FlashAttention::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor &q = in[0], &k = in[1], &v = in[2];
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const View4 vq(q), vk(k), vv(v);
  const double sc = scale;
  const bool causal_ = causal;
  dispatch_float(q.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(out[1].dtype(), name(), [&](auto stag) {
      using LS = typename decltype(stag)::type;
      const T* qp = q.data<T>(name());
      const T* kp = k.data<T>(name());
      const T* vp = v.data<T>(name());
      T* op = out[0].data<T>(name());  // (B, L, H, D) contiguous
      LS* lp = out[1].data<LS>(name());
      const int64_t d0 = vq.s3, dk = vk.s3, dv = vv.s3;
      cpu::parallel_for(B * H, L * S * D, [&](int64_t bh) {
        const int64_t b = bh / H, h = bh % H;
        std::vector<double> s(S), acc(D);
        for (int64_t i = 0; i < L; ++i) {
          const T* qi = qp + vq(b, h, i);
          const int64_t n = causal_ ? std::min(i + 1, S) : S;
          double m = -std::numeric_limits<double>::infinity();
          bool nan = false;
          for (int64_t j = 0; j < n; ++j) {
            const T* kj = kp + vk(b, h, j);
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) {
              dot += static_cast<double>(qi[d * d0]) * static_cast<double>(kj[d * dk]);
            }
            s[j] = dot * sc;
            m = std::max(m, s[j]);
            nan = nan || std::isnan(s[j]);
          }
          T* o = op + ((b * L + i) * H + h) * D;
          if (m == -std::numeric_limits<double>::infinity() && !nan) {
            // Note [empty rows] (attention.h): no key has weight: o = 0, lse = -inf
            for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(0.0);
            lp[(b * H + h) * L + i] = static_cast<LS>(m);
            continue;
          }
          double l = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = 0; j < n; ++j) {
            const double p = std::exp(s[j] - m);
            l += p;
            const T* vj = vp + vv(b, h, j);
            for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<double>(vj[d * dv]);
          }
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / l);
          lp[(b * H + h) * L + i] = static_cast<LS>(m + std::log(l));
        }
      });
    });
  });
}

// inputs q, k, v, o, do, lse, dlse; outputs dq (B, L, H, D), dk, dv (B, S, H, D), unit D stride
// (contiguous, or the packed backward's slices of one (B, T, 3 H D) gradient), or with
// heads_major (B, H, L|S, D) contiguous (attention_grad_rows gives the (B, L|S, H, D) views).
void FlashAttentionBackward::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor &q = in[0], &k = in[1], &v = in[2], &o = in[3], &g = in[4];
  const Tensor lse = cpu::contiguous_raw(in[5]);
  const Tensor dlse = in[6].defined() ? cpu::contiguous_raw(in[6]) : Tensor();  // none: zero
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  const View4 vq(q), vk(k), vv(v), vo(o), vg(g);  // o, do are (B, L, H, D)
  const std::vector<Tensor> rows = attention_grad_rows(out, heads_major);
  const View4 wq(rows[0]), wk(rows[1]), wv(rows[2]);  // dq, dk, dv: (B, L|S, H, D) views
  const double sc = scale;
  const bool causal_ = causal;
  dispatch_float(q.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(lse.dtype(), name(), [&](auto stag) {
      using LS = typename decltype(stag)::type;
      const T* qp = q.data<T>(name());
      const T* kp = k.data<T>(name());
      const T* vp = v.data<T>(name());
      const T* opp = o.data<T>(name());
      const T* gp = g.data<T>(name());
      const LS* lp = lse.data<LS>(name());
      const LS* dlp = dlse.defined() ? dlse.data<LS>(name()) : nullptr;
      T* dqp = out[0].data<T>(name());
      T* dkp = out[1].data<T>(name());
      T* dvp = out[2].data<T>(name());
      cpu::parallel_for(B * H, 3 * L * S * D, [&](int64_t bh) {
        const int64_t b = bh / H, h = bh % H;
        auto get = [D](const T* base, int64_t sd, std::vector<double>& dst) {
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<double>(base[d * sd]);
        };
        std::vector<double> dk(S * D, 0.0), dv(S * D, 0.0), dq(D), qi(D), gi(D), kj(D), vj(D);
        for (int64_t i = 0; i < L; ++i) {
          get(qp + vq(b, h, i), vq.s3, qi);
          get(gp + vg(b, i, h), vg.s3, gi);
          const T* oi = opp + vo(b, i, h);
          double Di = dlp ? -static_cast<double>(dlp[(b * H + h) * L + i]) : 0.0;
          for (int64_t d = 0; d < D; ++d) Di += gi[d] * static_cast<double>(oi[d * vo.s3]);
          const double lse_i = static_cast<double>(lp[(b * H + h) * L + i]);
          std::fill(dq.begin(), dq.end(), 0.0);
          // Note [empty rows]: a row of -inf scores (lse -inf) weighs no key: no gradient
          const bool empty = lse_i == -std::numeric_limits<double>::infinity();
          const int64_t n = empty ? 0 : causal_ ? std::min(i + 1, S) : S;
          for (int64_t j = 0; j < n; ++j) {
            get(kp + vk(b, h, j), vk.s3, kj);
            get(vp + vv(b, h, j), vv.s3, vj);
            double s = 0, dp = 0;
            for (int64_t d = 0; d < D; ++d) {
              s += qi[d] * kj[d];
              dp += gi[d] * vj[d];
            }
            const double p = std::exp(s * sc - lse_i);
            const double ds = p * (dp - Di) * sc;
            for (int64_t d = 0; d < D; ++d) {
              dq[d] += ds * kj[d];
              dk[j * D + d] += ds * qi[d];
              dv[j * D + d] += p * gi[d];
            }
          }
          T* o_dq = dqp + wq(b, i, h);
          for (int64_t d = 0; d < D; ++d) o_dq[d] = static_cast<T>(dq[d]);
        }
        for (int64_t j = 0; j < S; ++j) {
          T* o_dk = dkp + wk(b, j, h);
          T* o_dv = dvp + wv(b, j, h);
          for (int64_t d = 0; d < D; ++d) {
            o_dk[d] = static_cast<T>(dk[j * D + d]);
            o_dv[d] = static_cast<T>(dv[j * D + d]);
          }
        }
      });
    });
  });
}

double abs_max_cpu(const Tensor& t) {
  if (!is_floating(t.dtype())) return 0;
  std::mutex mu;
  double best = 0;
  dispatch_float(t.dtype(), "scaled_dot_product_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* p = t.data<T>("scaled_dot_product_attention");
    cpu::for_each_strided<1>(t.shape(), {t.strides()}, [&](auto off, int64_t n, auto st) {
      double m = 0;
      for (int64_t e = 0; e < n; ++e) {
        const double x = std::abs(static_cast<double>(p[off[0] + e * st[0]]));
        m = x > m || x != x ? (x != x ? std::numeric_limits<double>::infinity() : x) : m;
      }
      std::lock_guard<std::mutex> lock(mu);
      best = std::max(best, m);
    });
  });
  return best;
}

// Packed: q, k, v are views of X; dq, dk, dv are the three (B, T, H, D) slices of dX.
void FlashAttentionPacked::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  FlashAttention(scale, causal).eval_cpu(packed_qkv_views(in[0], heads), out);
}

void FlashAttentionPackedBackward::eval_cpu(const std::vector<Tensor>& in,
                                            std::vector<Tensor>& out) {
  auto qkv = packed_qkv_views(in[0], heads);
  auto douts = packed_grad_views(out[0], heads);
  FlashAttentionBackward(scale, causal)
      .eval_cpu({qkv[0], qkv[1], qkv[2], in[1], in[2], in[3], in[4]}, douts);
  if (!colsum) return;
  // dX's column sums (Note [packed column sums]) in double, over the stored (rounded) values
  const int64_t N = out[0].size(2), M = N ? out[0].numel() / N : 0;
  dispatch_float(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(out[1].dtype(), name(), [&](auto stag) {
      using S = typename decltype(stag)::type;
      const T* dx = out[0].data<T>(name());
      S* cs = out[1].data<S>(name());
      cpu::parallel_for(N, M, [&](int64_t j) {
        double s = 0;
        for (int64_t i = 0; i < M; ++i) s += static_cast<double>(dx[i * N + j]);
        cs[j] = static_cast<S>(s);
      });
    });
  });
}

// The linear's GEMM into qkv, then the packed attention on it.
void QkvAttention::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  std::vector<Tensor> proj{out[2]};
  Matmul(true, has_bias).eval_cpu(in, proj);
  const int64_t M = out[2].size(0), N = out[2].size(1);
  std::vector<Tensor> att{out[0], out[1]};
  FlashAttentionPacked(scale, causal, heads)
      .eval_cpu({make_view(out[2], {M / seq, seq, N}, {seq * N, N, 1}, out[2].offset())}, att);
}

#ifndef BT_WITH_CUDA
void QkvAttention::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void FlashAttentionPacked::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void FlashAttentionPackedBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void FlashAttention::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void FlashAttentionBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
