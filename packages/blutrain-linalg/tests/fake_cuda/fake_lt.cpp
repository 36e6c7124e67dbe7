// A fake libcublasLt.so.13: column-major semantics computed on the host, strict attribute sizes.
#include <cublasLt.h>

#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "half.h"
using namespace blutrain::linalg;
#define API extern "C" __attribute__((visibility("default")))
#define CHECK(c)                                                                  \
  do {                                                                            \
    if (!(c)) {                                                                   \
      fprintf(stderr, "FAKE LT CHECK FAILED %s:%d %s\n", __FILE__, __LINE__, #c); \
      abort();                                                                    \
    }                                                                             \
  } while (0)
struct Desc {
  int compute, scale;
  int32_t ta = 0, tb = 0;
  uint32_t epi = 1;
  const void* bias = nullptr;
  int32_t bias_t = -1;
  void* aux = nullptr;
  int64_t aux_ld = 0;
  int32_t aux_t = -1;
};
struct Lay {
  int type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct Pref {
  uint64_t ws = 0;
  uint32_t al[4] = {256, 256, 256, 256};
};
static int dt_of(int t) {
  switch (t) {
    case CUDA_R_32F:
      return 0;
    case CUDA_R_64F:
      return 1;
    case CUDA_R_16F:
      return 2;
    case CUDA_R_16BF:
      return 3;
  }
  CHECK(false);
  return -1;
}
static size_t esz(int t) {
  int d = dt_of(t);
  return d == 0 ? 4 : d == 1 ? 8 : 2;
}
static double ld_(const void* p, int t, int64_t i) {
  switch (dt_of(t)) {
    case 0:
      return ((const float*)p)[i];
    case 1:
      return ((const double*)p)[i];
    case 2:
      return f16_to_f32(((const uint16_t*)p)[i]);
    default:
      return bf16_to_f32(((const uint16_t*)p)[i]);
  }
}
static void st_(void* p, int t, int64_t i, double v) {
  switch (dt_of(t)) {
    case 0:
      ((float*)p)[i] = (float)v;
      break;
    case 1:
      ((double*)p)[i] = v;
      break;
    case 2:
      ((uint16_t*)p)[i] = f32_to_f16((float)v);
      break;
    default:
      ((uint16_t*)p)[i] = f32_to_bf16((float)v);
  }
}
API cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = (cublasLtHandle_t)malloc(16);
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  free(h);
  return CUBLAS_STATUS_SUCCESS;
}
API size_t cublasLtGetVersion(void) { return 130000; }
API const char* cublasLtGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED" : "fake status";
}
API cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t c,
                                            cudaDataType_t s) {
  auto* x = new Desc;
  x->compute = c;
  x->scale = s;
  *d = (cublasLtMatmulDesc_t)x;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete (Desc*)d;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                                  cublasLtMatmulDescAttributes_t a, const void* b,
                                                  size_t n) {
  Desc* x = (Desc*)d;
  switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      CHECK(n == 4);
      memcpy(&x->ta, b, 4);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      CHECK(n == 4);
      memcpy(&x->tb, b, 4);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      CHECK(n == 4);
      memcpy(&x->epi, b, 4);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      CHECK(n == 8);
      memcpy(&x->bias, b, 8);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      CHECK(n == 4);
      memcpy(&x->bias_t, b, 4);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      CHECK(n == 8);
      memcpy(&x->aux, b, 8);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      CHECK(n == 8);
      memcpy(&x->aux_ld, b, 8);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
      CHECK(n == 4);
      memcpy(&x->aux_t, b, 4);
      break;
    default:
      CHECK(false);
  }
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType t, uint64_t r,
                                              uint64_t c, int64_t ld) {
  CHECK(ld >= (int64_t)(r > 0 ? r : 1));
  auto* x = new Lay;
  x->type = t;
  x->rows = r;
  x->cols = c;
  x->ld = ld;
  *l = (cublasLtMatrixLayout_t)x;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete (Lay*)l;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                    cublasLtMatrixLayoutAttribute_t a,
                                                    const void* b, size_t n) {
  Lay* x = (Lay*)l;
  if (a == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT) {
    CHECK(n == 4);
    memcpy(&x->batch, b, 4);
  } else if (a == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) {
    CHECK(n == 8);
    memcpy(&x->stride, b, 8);
  } else
    CHECK(false);
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = (cublasLtMatmulPreference_t) new Pref;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete (Pref*)p;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                        cublasLtMatmulPreferenceAttributes_t a,
                                                        const void* b, size_t n) {
  Pref* x = (Pref*)p;
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    CHECK(n == 8);
    memcpy(&x->ws, b, 8);
  } else if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
             a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES) {
    CHECK(n == 4);
    memcpy(&x->al[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], b, 4);
  } else
    CHECK(false);
  return CUBLAS_STATUS_SUCCESS;
}
static bool supported(const Desc* d) {
  const char* no = getenv("FAKE_LT_NO_EPI");
  if (no && d->epi != CUBLASLT_EPILOGUE_DEFAULT) return false;
  return true;
}
API cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                                  cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                                  cublasLtMatrixLayout_t c,
                                                  cublasLtMatrixLayout_t dd,
                                                  cublasLtMatmulPreference_t p, int want,
                                                  cublasLtMatmulHeuristicResult_t* res, int* got) {
  CHECK(want >= 1);
  *got = 0;
  if (!supported((Desc*)d)) return CUBLAS_STATUS_NOT_SUPPORTED;
  int n = want < 3 ? want : 3;
  for (int i = 0; i < n; ++i) {
    memset(&res[i], 0, sizeof res[i]);
    res[i].algo.data[0] = 1000 + i;
    res[i].workspaceSize = ((Pref*)p)->ws ? 4096 * (i + 1) : 0;
    res[i].state = CUBLAS_STATUS_SUCCESS;
  }
  *got = n;
  return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t, cublasLtMatmulDesc_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           const cublasLtMatmulAlgo_t* a,
                                           cublasLtMatmulHeuristicResult_t* r) {
  CHECK(a->data[0] >= 1000 && a->data[0] < 1003);
  memset(r, 0, sizeof *r);
  r->workspaceSize = 4096;
  return CUBLAS_STATUS_SUCCESS;
}
static double gelu_(double z) { return gelu<double>(z); }
API cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t dd, const void* alpha,
                                  const void* A, cublasLtMatrixLayout_t la, const void* B,
                                  cublasLtMatrixLayout_t lb, const void* beta, const void* C,
                                  cublasLtMatrixLayout_t lc, void* D, cublasLtMatrixLayout_t ld,
                                  const cublasLtMatmulAlgo_t* algo, void* ws, size_t wsz,
                                  cudaStream_t) {
  Desc* d = (Desc*)dd;
  Lay *a = (Lay*)la, *b = (Lay*)lb, *c = (Lay*)lc, *o = (Lay*)ld;
  CHECK(algo && algo->data[0] >= 1000 && algo->data[0] < 1003);
  if (wsz) {
    CHECK(ws);
    memset(ws, 0xCD, wsz);
  }
  if (!supported(d)) return CUBLAS_STATUS_NOT_SUPPORTED;
  double al = d->scale == CUDA_R_64F ? *(const double*)alpha : *(const float*)alpha;
  double be = d->scale == CUDA_R_64F ? *(const double*)beta : *(const float*)beta;
  uint64_t M = o->rows, N = o->cols;
  CHECK(c->rows == M && c->cols == N);
  uint64_t K = d->ta ? a->rows : a->cols;
  CHECK((d->ta ? a->cols : a->rows) == M);
  CHECK((d->tb ? b->rows : b->cols) == N);
  CHECK((d->tb ? b->cols : b->rows) == K);
  CHECK(a->type == b->type);
  CHECK(c->type == o->type);
  int batch = o->batch;
  CHECK(a->batch == batch && b->batch == batch && c->batch == batch);
  CHECK(K > 0);
  auto A_ = [&](int64_t x, uint64_t i, uint64_t k) {
    return d->ta ? ld_(A, a->type, x * a->stride + k + i * a->ld)
                 : ld_(A, a->type, x * a->stride + i + k * a->ld);
  };
  auto B_ = [&](int64_t x, uint64_t k, uint64_t j) {
    return d->tb ? ld_(B, b->type, x * b->stride + j + k * b->ld)
                 : ld_(B, b->type, x * b->stride + k + j * b->ld);
  };
  uint32_t e = d->epi;
  bool has_bias = e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
                  e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  bool gel = e == CUBLASLT_EPILOGUE_GELU || e == CUBLASLT_EPILOGUE_GELU_BIAS ||
             e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  bool aux_out = e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  bool dg = e == CUBLASLT_EPILOGUE_DGELU || e == CUBLASLT_EPILOGUE_DGELU_BGRAD;
  if (has_bias || e == CUBLASLT_EPILOGUE_DGELU_BGRAD || e == CUBLASLT_EPILOGUE_BGRADA ||
      e == CUBLASLT_EPILOGUE_BGRADB)
    CHECK(d->bias);
  if (aux_out || dg) {
    CHECK(d->aux);
    CHECK(d->aux_ld >= (int64_t)M);
  }
  int bt = d->bias_t >= 0 ? d->bias_t : o->type;
  int at = d->aux_t >= 0 ? d->aux_t : o->type;
  std::vector<double> colacc(M, 0.0);
  for (int x = 0; x < batch; ++x) {
    for (uint64_t j = 0; j < N; ++j)
      for (uint64_t i = 0; i < M; ++i) {
        double s = 0;
        for (uint64_t k = 0; k < K; ++k) s += A_(x, i, k) * B_(x, k, j);
        double v = al * s + (be != 0 ? be * ld_(C, c->type, x * c->stride + i + j * c->ld) : 0.0);
        if (has_bias) v += ld_(d->bias, bt, i);
        if (aux_out) st_(d->aux, at, i + j * d->aux_ld, v);
        if (gel) v = gelu_(v);
        if (dg) v *= dgelu<double>(ld_(d->aux, at, i + j * d->aux_ld));
        if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD) colacc[i] += v;
        st_(D, o->type, x * o->stride + i + j * o->ld, v);
      }
    if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD)
      for (uint64_t i = 0; i < M; ++i) st_((void*)d->bias, bt, i, colacc[i]);
    if (e == CUBLASLT_EPILOGUE_BGRADA)
      for (uint64_t i = 0; i < M; ++i) {
        double s = 0;
        for (uint64_t k = 0; k < K; ++k) s += A_(x, i, k);
        st_((void*)d->bias, bt, i, s);
      }
    if (e == CUBLASLT_EPILOGUE_BGRADB)
      for (uint64_t j = 0; j < N; ++j) {
        double s = 0;
        for (uint64_t k = 0; k < K; ++k) s += B_(x, k, j);
        st_((void*)d->bias, bt, j, s);
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}
