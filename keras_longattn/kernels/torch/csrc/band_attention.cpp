// Exact sliding-window (band) attention for float32 on the CPU, forward and
// backward, for keras_longattn.kernels.torch.band.
//
// Query position p of a sequence of T attends keys p - look_back .. p +
// look_ahead (clipped to the sequence, and to the keys marked valid). The
// queries of one (sequence, head) are taken in tiles of `tile` rows; a tile
// computes its scores against exactly the keys its rows can see (tile +
// look_back + look_ahead of them at most), so the only pairs computed and
// then masked are the two triangles at the ends of the tile's key range.
// A tile's scores fit in a thread's buffer: its softmax is one pass, with no
// running rescaling, and the four products per tile are BLAS calls (MKL's
// sgemm from libtorch).
//
// The backward pass recomputes a tile's probabilities from the saved
// log-sum-exp and adds the key and value gradients straight onto their
// rows: one thread owns every tile of a (sequence, head) pair, so nothing
// races, and no band-shaped gradient buffer is made or folded.
//
// Tensors are (N, T, H, d) of any strides with the last one 1 (views of the
// caller's tensors: heads of a slice, the columns of a strided pattern).
// A query that sees no key gets a zero output and a log-sum-exp of
// DEAD_LSE (finite, so that -ffast-math arithmetic stays defined).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

constexpr float kDeadLse = -1e30f;

// Row-major C (M x N, leading dimension ldc) = alpha op(A) op(B) + beta C,
// op(A) M x K, op(B) K x N; through column-major BLAS as C^T = op(B)^T op(A)^T.
inline void gemm_rm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                    float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  const char ta = trans_b ? 'T' : 'N';
  const char tb = trans_a ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

struct View {
  float* data;
  int64_t sn, st, sh;
  float* at(int64_t n, int64_t t, int64_t h) const { return data + n * sn + t * st + h * sh; }
};

View view_of(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "band kernel: a (N, T, H, d) tensor with "
              "unit last stride expected, got sizes ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "band kernel: float32 CPU tensors only");
  return {x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)};
}

struct Band {
  int64_t N, T, H, d, look_back, look_ahead, tile;
  float scale;
  const bool* valid;  // (N, T) contiguous, or null
  // Key range [lo, hi) of the query tile [t0, t1).
  void keys(int64_t t0, int64_t t1, int64_t* lo, int64_t* hi) const {
    *lo = std::max<int64_t>(0, t0 - look_back);
    *hi = std::min<int64_t>(T, t1 + look_ahead);
  }
  // Visible key columns [a, b) of the query at position p, relative to lo.
  void row(int64_t p, int64_t lo, int64_t hi, int64_t* a, int64_t* b) const {
    *a = std::max<int64_t>(lo, p - look_back) - lo;
    *b = std::min<int64_t>(hi, p + look_ahead + 1) - lo;
  }
};

// Probabilities of the rows of one tile from their scores S (rows x L):
// forward (lse == nullptr): softmax, writing each row's log-sum-exp into
// lse_out; backward: exp(S - lse). Masked entries become 0 (padded keys
// through a score of -1e30); dead rows are all 0 (and get DEAD_LSE in the
// forward pass).
void probabilities(const Band& band, int64_t n, int64_t t0, int64_t rows, int64_t lo, int64_t hi,
                   float* S, int64_t L, const float* lse_in, int64_t lse_stride, float* lse_out) {
  const bool* valid = band.valid ? band.valid + n * band.T + lo : nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    float* s = S + i * L;
    int64_t a, b;
    band.row(t0 + i, lo, hi, &a, &b);
    std::fill(s, s + a, 0.f);
    std::fill(s + b, s + L, 0.f);
    if (valid) {
      for (int64_t j = a; j < b; ++j)
        if (!valid[j]) s[j] = -1e30f;
    }
    float lse;
    if (lse_in) {
      lse = lse_in[i * lse_stride];
      if (lse < -1e29f) {
        std::fill(s + a, s + b, 0.f);
        continue;
      }
    } else {
      float m = -1e30f;
      for (int64_t j = a; j < b; ++j) m = std::max(m, s[j]);
      if (m < -1e29f) {  // no visible key
        std::fill(s + a, s + b, 0.f);
        lse_out[i * lse_stride] = kDeadLse;
        continue;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = a; j < b; ++j) {
        float e = expf(s[j] - m);
        s[j] = e;
        sum += e;
      }
      lse = m + logf(sum);
      lse_out[i * lse_stride] = lse;
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t j = a; j < b; ++j) s[j] *= inv;
      continue;
    }
#pragma omp simd
    for (int64_t j = a; j < b; ++j) s[j] = expf(s[j] - lse);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.sizes() == k.sizes() && q.sizes() == v.sizes(),
              "band kernel: query, key and value shapes differ: ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
}

Band make_band(const at::Tensor& q, int64_t look_back, int64_t look_ahead, int64_t tile,
               double scale, const c10::optional<at::Tensor>& valid) {
  Band band{q.size(0), q.size(1), q.size(2), q.size(3), look_back, look_ahead, tile,
            static_cast<float>(scale), nullptr};
  TORCH_CHECK(look_back >= 0 && look_ahead >= 0 && tile > 0, "band kernel: bad extents");
  if (valid.has_value()) {
    TORCH_CHECK(valid->scalar_type() == at::kBool && valid->is_contiguous() &&
                    valid->dim() == 2 && valid->size(0) == band.N && valid->size(1) == band.T,
                "band kernel: key_valid must be a contiguous bool (N, T)");
    band.valid = valid->data_ptr<bool>();
  }
  return band;
}

void band_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const c10::optional<at::Tensor>& key_valid, int64_t look_back,
                  int64_t look_ahead, int64_t tile, double scale, const at::Tensor& out,
                  const at::Tensor& lse) {
  check_inputs(query, key, value);
  TORCH_CHECK(out.sizes() == query.sizes(), "band kernel: out shape");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == query.size(0) && lse.size(1) == query.size(1) &&
                  lse.size(2) == query.size(2) && lse.scalar_type() == at::kFloat,
              "band kernel: lse must be float (N, T, H)");
  const Band band = make_band(query, look_back, look_ahead, tile, scale, key_valid);
  const View Q = view_of(query), K = view_of(key), V = view_of(value), O = view_of(out);
  float* lse_data = lse.data_ptr<float>();
  const int64_t ln = lse.stride(0), lt = lse.stride(1), lh = lse.stride(2);
  const int64_t tiles = (band.T + tile - 1) / tile;
  const int64_t width = tile + look_back + look_ahead;
  at::parallel_for(0, band.N * band.H * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(tile * std::min<int64_t>(width, band.T));
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n = u / (band.H * tiles), h = (u / tiles) % band.H, x = u % tiles;
      const int64_t t0 = x * tile, t1 = std::min(band.T, t0 + tile), rows = t1 - t0;
      int64_t lo, hi;
      band.keys(t0, t1, &lo, &hi);
      const int64_t L = hi - lo;
      float* S = buffer.data();
      gemm_rm(false, true, rows, L, band.d, band.scale, Q.at(n, t0, h), Q.st, K.at(n, lo, h),
              K.st, 0.f, S, L);
      probabilities(band, n, t0, rows, lo, hi, S, L, nullptr, lt,
                    lse_data + n * ln + t0 * lt + h * lh);
      gemm_rm(false, false, rows, band.d, L, 1.f, S, L, V.at(n, lo, h), V.st, 0.f,
              O.at(n, t0, h), O.st);
    }
  });
}

void band_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const c10::optional<at::Tensor>& key_valid, int64_t look_back,
                   int64_t look_ahead, int64_t tile, double scale, const at::Tensor& out,
                   const at::Tensor& lse, const at::Tensor& grad_out, const at::Tensor& grad_query,
                   const at::Tensor& grad_key, const at::Tensor& grad_value) {
  check_inputs(query, key, value);
  for (const auto* t : {&out, &grad_out, &grad_query, &grad_key, &grad_value})
    TORCH_CHECK(t->sizes() == query.sizes(), "band kernel: gradient shapes");
  const Band band = make_band(query, look_back, look_ahead, tile, scale, key_valid);
  const View Q = view_of(query), K = view_of(key), V = view_of(value), O = view_of(out),
             dO = view_of(grad_out), dQ = view_of(grad_query), dK = view_of(grad_key),
             dV = view_of(grad_value);
  const float* lse_data = lse.data_ptr<float>();
  const int64_t ln = lse.stride(0), lt = lse.stride(1), lh = lse.stride(2);
  const int64_t tiles = (band.T + tile - 1) / tile;
  const int64_t width = std::min<int64_t>(tile + look_back + look_ahead, band.T);
  const int64_t d = band.d;
  at::parallel_for(0, band.N * band.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(tile * width), dprobs(tile * width), rowdot(tile);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n = u / band.H, h = u % band.H;
      for (int64_t t = 0; t < band.T; ++t) {
        std::memset(dK.at(n, t, h), 0, d * sizeof(float));
        std::memset(dV.at(n, t, h), 0, d * sizeof(float));
      }
      for (int64_t x = 0; x < tiles; ++x) {
        const int64_t t0 = x * tile, t1 = std::min(band.T, t0 + tile), rows = t1 - t0;
        int64_t lo, hi;
        band.keys(t0, t1, &lo, &hi);
        const int64_t L = hi - lo;
        float* P = probs.data();
        float* dS = dprobs.data();
        gemm_rm(false, true, rows, L, d, band.scale, Q.at(n, t0, h), Q.st, K.at(n, lo, h), K.st,
                0.f, P, L);
        probabilities(band, n, t0, rows, lo, hi, P, L, lse_data + n * ln + t0 * lt + h * lh, lt,
                      nullptr);
        // dV[lo:hi] += P^T dO
        gemm_rm(true, false, L, d, rows, 1.f, P, L, dO.at(n, t0, h), dO.st, 1.f, dV.at(n, lo, h),
                dV.st);
        // dP = dO V^T
        gemm_rm(false, true, rows, L, d, 1.f, dO.at(n, t0, h), dO.st, V.at(n, lo, h), V.st, 0.f,
                dS, L);
        for (int64_t i = 0; i < rows; ++i) {
          const float* o = O.at(n, t0 + i, h);
          const float* g = dO.at(n, t0 + i, h);
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < d; ++c) acc += o[c] * g[c];
          float* ds = dS + i * L;
          const float* p = P + i * L;
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) ds[j] = p[j] * (ds[j] - acc);
        }
        // dQ = scale dS K ; dK[lo:hi] += scale dS^T Q
        gemm_rm(false, false, rows, d, L, band.scale, dS, L, K.at(n, lo, h), K.st, 0.f,
                dQ.at(n, t0, h), dQ.st);
        gemm_rm(true, false, L, d, rows, band.scale, dS, L, Q.at(n, t0, h), Q.st, 1.f,
                dK.at(n, lo, h), dK.st);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(keras_longattn_band, m) {
  m.def("forward(Tensor query, Tensor key, Tensor value, Tensor? key_valid, int look_back, "
        "int look_ahead, int tile, float scale, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("backward(Tensor query, Tensor key, Tensor value, Tensor? key_valid, int look_back, "
        "int look_ahead, int tile, float scale, Tensor out, Tensor lse, Tensor grad_out, "
        "Tensor(a!) grad_query, Tensor(b!) grad_key, Tensor(c!) grad_value) -> ()");
}

TORCH_LIBRARY_IMPL(keras_longattn_band, CPU, m) {
  m.impl("forward", band_forward);
  m.impl("backward", band_backward);
}
