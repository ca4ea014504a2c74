// Exact sliding-window (band) attention for float32 on the CPU, forward and
// backward, for keras_longattn.kernels.torch.band.
//
// Query position p of a sequence of T attends keys p - look_back .. p +
// look_ahead (clipped to the sequence, and to the keys marked valid), or,
// given explicit key intervals, keys [first[p], last[p]) of a key sequence
// of its own length S (the fixed Sparse Transformer pattern's summaries). The
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
// Where the compiler targets AVX-512 (the build uses -march=native), tiles of
// 32 queries with a head size that is a multiple of 16, at most 64, take a
// second form: the tile's scores are kept transposed (keys x queries), so a
// query's softmax is one vector lane and every product is a register-blocked
// broadcast-FMA loop over the caller's rows, with no BLAS call (see
// "AVX-512 path" below). Same results to float rounding; other tiles, head
// sizes and CPUs use the BLAS form.
//
// Queries are (N, T, H, d), keys and values (N, S, H, d) (S = T without key
// intervals), of any strides with the last one 1 (views of the caller's
// tensors: heads of a slice, the columns of a strided pattern); rows a page
// or more apart are first copied into a per-thread buffer (see pack_rows).
// A query that sees no key gets a zero output and a log-sum-exp of
// DEAD_LSE (finite, so that -ffast-math arithmetic stays defined).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

constexpr float kDeadLse = -1e30f;

// Row stride of a tile's score buffers: the row length rounded up to 16
// floats (64 bytes), so that every row starts on a cache line.
inline int64_t padded(int64_t L) { return (L + 15) & ~int64_t(15); }
// The first 64-byte boundary in a buffer allocated 16 floats longer.
inline float* aligned(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

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

// Rows of a (sequence, head) far apart in memory (the columns of a strided
// pattern are a view whose rows lie l * H * d floats apart) fall into the
// same few cache sets: every pass over a tile's keys then reloads them from
// L3. Where a view's row stride is a page or more and a whole sequence of
// one head fits kPackLimit floats, the kernels first copy the rows they read
// into a contiguous thread-local buffer (and write gradients there, copied
// out once per sequence). The `pack` argument of the operators: -1 decides
// so, 0 never packs, 1 always does (the tests run both).
constexpr int64_t kPackLimit = int64_t(1) << 16;
constexpr int64_t kFarRows = 4096 / sizeof(float);

bool pack_rows(int64_t pack, int64_t T, int64_t d, std::initializer_list<const View*> views) {
  if (pack >= 0) return pack > 0;
  if (T * d > kPackLimit) return false;
  for (const View* v : views)
    if (v->st >= kFarRows) return true;
  return false;
}

// Per-thread scratch buffers that outlive a call: allocating them in every
// call costs, for any above malloc's mmap threshold (128 KiB in a fresh
// process), an mmap, page faults and an munmap (with its TLB shootdown on
// the other threads) each time. Slot i of the calling thread holds at least
// `count` floats; a buffer above kKeepScratch floats is released when the
// Scratch goes out of scope.
constexpr size_t kKeepScratch = size_t(1) << 22;  // 16 MiB
struct Scratch {
  std::vector<float>& buffer;
  Scratch(int slot, size_t count) : buffer(slots()[slot]) {
    if (buffer.size() < count) buffer.resize(count);
  }
  ~Scratch() {
    if (buffer.size() > kKeepScratch) std::vector<float>().swap(buffer);
  }
  float* data() { return buffer.data(); }
  static std::vector<float>* slots() {
    thread_local std::vector<float> kept[4];
    return kept;
  }
};

// A contiguous (T, d) view of `rows` floats: at(n, t, h) is row t for any n, h.
inline View local_view(float* rows, int64_t d) { return {rows, 0, d, 0}; }

// Rows a page apart defeat the hardware prefetchers: the copies below
// request each row's cache lines kAhead rows before they copy it.
constexpr int64_t kAhead = 8;
template <int write = 0>
inline void prefetch_row(const float* r, int64_t d) {
  for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(r + c, write);
}

// Rows [lo, hi) of (sequence n, head h) of x into rows [lo, hi) of `rows`.
inline void copy_rows(const View& x, int64_t n, int64_t h, int64_t lo, int64_t hi, int64_t d,
                      float* rows) {
  for (int64_t t = lo; t < std::min(hi, lo + kAhead); ++t) prefetch_row(x.at(n, t, h), d);
  for (int64_t t = lo; t < hi; ++t) {
    if (t + kAhead < hi) prefetch_row(x.at(n, t + kAhead, h), d);
    std::memcpy(rows + t * d, x.at(n, t, h), d * sizeof(float));
  }
}

// Rows [0, T) of the contiguous `rows` into (sequence n, head h) of x.
inline void store_rows(const float* rows, int64_t T, int64_t d, const View& x, int64_t n,
                       int64_t h) {
  for (int64_t t = 0; t < T; ++t) {
    if (t + kAhead < T) prefetch_row<1>(x.at(n, t + kAhead, h), d);
    std::memcpy(x.at(n, t, h), rows + t * d, d * sizeof(float));
  }
}

struct Band {
  int64_t N, T, S, H, d, look_back, look_ahead, tile;
  float scale;
  const bool* valid;  // (N, S) contiguous, or null
  // Explicit key intervals (2, T) int32 contiguous, or null: query p sees
  // keys [first[p], last[p]) of S (then look_back / look_ahead are unused).
  const int32_t* first;
  const int32_t* last;
  // Key range [lo, hi) of the query tile [t0, t1).
  void keys(int64_t t0, int64_t t1, int64_t* lo, int64_t* hi) const {
    if (first) {
      *lo = S;
      *hi = 0;
      for (int64_t p = t0; p < t1; ++p)
        if (last[p] > first[p]) {
          *lo = std::min<int64_t>(*lo, first[p]);
          *hi = std::max<int64_t>(*hi, last[p]);
        }
      if (*hi <= *lo) *lo = *hi = 0;  // no query of the tile sees a key
      return;
    }
    *lo = std::max<int64_t>(0, t0 - look_back);
    *hi = std::min<int64_t>(S, t1 + look_ahead);
  }
  // Visible key columns [a, b) of the query at position p, relative to lo
  // (b <= a: none).
  void row(int64_t p, int64_t lo, int64_t hi, int64_t* a, int64_t* b) const {
    if (first) {
      // Clipped to [lo, hi]: an empty interval may lie outside the tile's keys.
      *a = std::min<int64_t>(hi, std::max<int64_t>(lo, first[p])) - lo;
      *b = std::max<int64_t>(*a + lo, std::min<int64_t>(hi, last[p])) - lo;
      return;
    }
    *a = std::max<int64_t>(lo, p - look_back) - lo;
    *b = std::min<int64_t>(hi, p + look_ahead + 1) - lo;
  }
  // The most keys one tile sees.
  int64_t width() const {
    if (!first) return std::min<int64_t>(tile + look_back + look_ahead, S);
    int64_t w = 0;
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
      int64_t lo, hi;
      keys(t0, std::min(T, t0 + tile), &lo, &hi);
      w = std::max(w, hi - lo);
    }
    return w;
  }
};

// Probabilities of the rows of one tile from their scores S (rows x L):
// forward (lse == nullptr): softmax, writing each row's log-sum-exp into
// lse_out; backward: exp(S - lse). Masked entries become 0 (padded keys
// through a score of -1e30); dead rows are all 0 (and get DEAD_LSE in the
// forward pass).
void probabilities(const Band& band, int64_t n, int64_t t0, int64_t rows, int64_t lo, int64_t hi,
                   float* S, int64_t L, int64_t ld, const float* lse_in, int64_t lse_stride,
                   float* lse_out) {
  const bool* valid = band.valid ? band.valid + n * band.S + lo : nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    float* s = S + i * ld;
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

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);
inline __m512 exp512(__m512 x) { return _ZGVeN16v_expf(x); }
// ---------------------------------------------------------------------------
// AVX-512 path (tiles of 32 queries, head size a multiple of 16, at most 64).
// A tile is computed transposed: S^T (keys x 32 queries), so the softmax of
// a query is a column, i.e. one lane of two vectors, and every product is a
// broadcast-FMA register-blocked loop with no packing of the keys:
//   S^T = K Q^T, O = P V (through P^T), and in the backward pass dV += P^T dO,
//   dP^T = V dO^T, dQ = dS K, dK += dS^T Q.
constexpr int kTile = 32;

// C[r][0:16 NV] (=, +=) alpha * sum_k A[r * rs + k * ks] * B[k * ldb + 0:16 NV]
template <int R, int NV>
inline void micro(int64_t K, const float* A, int64_t rs, int64_t ks, const float* B,
                  int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(B + k * ldb + 16 * v);
    const float* a = A + k * ks;
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * rs]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(x, b[v], acc[r][v]);
    }
  }
  const __m512 s = _mm512_set1_ps(alpha);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      float* c = C + r * ldc + 16 * v;
      __m512 x = _mm512_mul_ps(acc[r][v], s);
      if (accumulate) x = _mm512_add_ps(x, _mm512_loadu_ps(c));
      _mm512_storeu_ps(c, x);
    }
}

// All `rows` rows of C, in blocks of R (and a remainder block).
template <int R, int NV>
void rows_of(int64_t rows, int64_t K, const float* A, int64_t rs, int64_t ks, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    micro<R, NV>(K, A + r * rs, rs, ks, B, ldb, C + r * ldc, ldc, alpha, accumulate);
  const int64_t rest = rows - r;
  if (rest <= 0) return;
  A += r * rs;
  C += r * ldc;
  if constexpr (R > 1) {
    switch (rest) {
#define KLA_CASE(n) case n: if constexpr (n < R) micro<n, NV>(K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate); break;
      KLA_CASE(1) KLA_CASE(2) KLA_CASE(3) KLA_CASE(4) KLA_CASE(5) KLA_CASE(6)
      KLA_CASE(7) KLA_CASE(8) KLA_CASE(9) KLA_CASE(10) KLA_CASE(11)
#undef KLA_CASE
      default: break;
    }
  }
}

// C (rows x 16 NV, ldc) = alpha * A-rows x B with the right register block.
template <int NV>
void product(int64_t rows, int64_t K, const float* A, int64_t rs, int64_t ks, const float* B,
             int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  if constexpr (NV <= 2)
    rows_of<12, NV>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate);
  else if constexpr (NV == 3)
    rows_of<7, NV>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate);
  else
    rows_of<6, NV>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate);
}

void product_d(int64_t d, int64_t rows, int64_t K, const float* A, int64_t rs, int64_t ks,
               const float* B, int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  switch (d / 16) {
    case 1: product<1>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate); break;
    case 2: product<2>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate); break;
    case 3: product<3>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate); break;
    default: product<4>(rows, K, A, rs, ks, B, ldb, C, ldc, alpha, accumulate); break;
  }
}

inline bool fast_path(const Band& band) {
  return band.tile == kTile && band.d % 16 == 0 && band.d <= 64;
}

// In-register transpose of a 16 x 16 block: r[i] holds row i before, column
// i after.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), e = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

// X^T of `rows` rows of x (row stride st, d columns, d a multiple of 16)
// into (d x 32), scaled; rows past `rows` are zero. In 16 x 16 blocks, each
// transposed in registers.
inline void pack_transposed(const float* x, int64_t st, int64_t rows, int64_t d, float scale,
                            float* out) {
  if (st >= kFarRows)  // rows a page apart: request them all first
    for (int64_t i = 0; i < rows; ++i) prefetch_row(x + i * st, d);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < kTile; i0 += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, rows - i0));
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < n ? _mm512_loadu_ps(x + (i0 + i) * st + c0) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < 16; ++j)
        _mm512_storeu_ps(out + (c0 + j) * kTile + i0, _mm512_mul_ps(r[j], s));
    }
  }
}

// Lane bounds of a tile: query i sees columns [a_i, b_i) of S^T (relative to
// lo); padding lanes (i >= rows) see nothing. The 16 lanes of half v
// together see the key rows [lo[v], hi[v]) (the least a_i and greatest b_i
// of its lanes that see a key): only those are computed for them.
struct Lanes {
  __m512i a[2], b[2];
  int64_t lo[2], hi[2], count[2];
};
inline Lanes lanes(const Band& band, int64_t t0, int64_t rows, int64_t lo, int64_t hi) {
  alignas(64) int32_t a[kTile], b[kTile];
  Lanes l;
  for (int v = 0; v < 2; ++v) {
    l.lo[v] = hi - lo;
    l.hi[v] = 0;
    l.count[v] = std::max<int64_t>(0, std::min<int64_t>(16, rows - 16 * v));
  }
  for (int64_t i = 0; i < kTile; ++i) {
    if (i < rows) {
      int64_t x, y;
      band.row(t0 + i, lo, hi, &x, &y);
      a[i] = static_cast<int32_t>(x);
      b[i] = static_cast<int32_t>(y);
      if (y > x) {
        l.lo[i / 16] = std::min(l.lo[i / 16], x);
        l.hi[i / 16] = std::max(l.hi[i / 16], y);
      }
    } else {
      a[i] = 1;
      b[i] = 0;  // padding lanes see nothing
    }
  }
  for (int v = 0; v < 2; ++v) {
    if (l.hi[v] <= l.lo[v]) l.lo[v] = l.hi[v] = 0;  // the half sees nothing
    l.a[v] = _mm512_load_si512(a + 16 * v);
    l.b[v] = _mm512_load_si512(b + 16 * v);
  }
  return l;
}

// The key rows only half v sees, below and above the rows [both_lo, both_hi)
// both halves see (none shared when both_hi <= both_lo): two intervals
// [parts[i][0], parts[i][1]), either possibly empty.
inline void own_rows(const Lanes& l, int v, int64_t both_lo, int64_t both_hi,
                     int64_t parts[2][2]) {
  parts[0][0] = l.lo[v];
  parts[0][1] = l.hi[v];
  parts[1][0] = parts[1][1] = 0;
  if (both_hi > both_lo) {
    parts[0][1] = std::min(l.hi[v], both_lo);
    parts[1][0] = std::max(l.lo[v], both_hi);
    parts[1][1] = l.hi[v];
  }
}

// out (key rows x 32 lanes) = X (key rows, row stride xst) Bt (d x 32), the
// rows of each half only: rows both halves see as two-vector rows, the
// others one vector.
void lane_products(const Lanes& l, int64_t d, const float* X, int64_t xst, const float* bt,
                   float* out) {
  const int64_t both_lo = std::max(l.lo[0], l.lo[1]), both_hi = std::min(l.hi[0], l.hi[1]);
  const bool overlap = both_hi > both_lo;
  if (overlap)
    product<2>(both_hi - both_lo, d, X + both_lo * xst, xst, 1, bt, kTile, out + both_lo * kTile,
               kTile, 1.f, false);
  for (int v = 0; v < 2; ++v) {
    int64_t parts[2][2];
    own_rows(l, v, both_lo, both_hi, parts);
    for (const auto& part : parts)
      if (part[1] > part[0])
        product<1>(part[1] - part[0], d, X + part[0] * xst, xst, 1, bt + 16 * v, kTile,
                   out + part[0] * kTile + 16 * v, kTile, 1.f, false);
  }
}

// C (key rows, ldc) += alpha * P^T-rows x Y (the tile's query rows, stride
// yst): each key row summed over the lanes that see it (half 0, both, half 1).
void key_products(const Lanes& l, int64_t d, const float* pt, const float* Y, int64_t yst,
                  float* C, int64_t ldc, float alpha) {
  const int64_t both_lo = std::max(l.lo[0], l.lo[1]), both_hi = std::min(l.hi[0], l.hi[1]);
  const bool overlap = both_hi > both_lo;
  if (overlap)  // half 0 is full here: lanes 0 .. count[0] + count[1] - 1
    product_d(d, both_hi - both_lo, l.count[0] + l.count[1], pt + both_lo * kTile, kTile, 1, Y,
              yst, C + both_lo * ldc, ldc, alpha, true);
  for (int v = 0; v < 2; ++v) {
    if (l.count[v] == 0) continue;
    int64_t parts[2][2];
    own_rows(l, v, both_lo, both_hi, parts);
    for (const auto& part : parts)
      if (part[1] > part[0])
        product_d(d, part[1] - part[0], l.count[v], pt + part[0] * kTile + 16 * v, kTile, 1,
                  Y + 16 * v * yst, yst, C + part[0] * ldc, ldc, alpha, true);
  }
}

// acc (32 x d) = P Y-rows through P^T: query rows of half v over its key rows.
void query_products(const Lanes& l, int64_t d, const float* pt, const float* Y, int64_t yst,
                    float* acc, float alpha) {
  for (int v = 0; v < 2; ++v)
    if (l.count[v] > 0) {
      if (l.hi[v] > l.lo[v])
        product_d(d, l.count[v], l.hi[v] - l.lo[v], pt + l.lo[v] * kTile + 16 * v, 1, kTile,
                  Y + l.lo[v] * yst, yst, acc + 16 * v * d, d, alpha, false);
      else
        std::fill(acc + 16 * v * d, acc + (16 * v + l.count[v]) * d, 0.f);
    }
}

inline __mmask16 visible(const Lanes& l, int v, int64_t j, const bool* valid) {
  if (valid && !valid[j]) return 0;
  const __m512i jj = _mm512_set1_epi32(static_cast<int32_t>(j));
  return _mm512_mask_cmpgt_epi32_mask(_mm512_cmple_epi32_mask(l.a[v], jj), l.b[v], jj);
}

void tile_forward(const Band& band, const View& Q, const View& K, const View& V, const View& O,
                  int64_t n, int64_t h, int64_t t0, int64_t rows, int64_t lo, int64_t hi,
                  float* lse_out, int64_t lse_stride, float* qt, float* st, float* acc) {
  const int64_t d = band.d;
  pack_transposed(Q.at(n, t0, h), Q.st, rows, d, band.scale, qt);
  const Lanes l = lanes(band, t0, rows, lo, hi);
  // S^T = K Qt: (L x 32), the rows each half sees.
  lane_products(l, d, K.at(n, lo, h), K.st, qt, st);
  const bool* valid = band.valid ? band.valid + n * band.S + lo : nullptr;
  const __m512 neg = _mm512_set1_ps(-1e30f);
  __m512 m[2] = {neg, neg}, sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int v = 0; v < 2; ++v)
    for (int64_t j = l.lo[v]; j < l.hi[v]; ++j) {
      const __mmask16 k = visible(l, v, j, valid);
      m[v] = _mm512_mask_max_ps(m[v], k, m[v], _mm512_loadu_ps(st + j * kTile + 16 * v));
    }
  for (int v = 0; v < 2; ++v)
    for (int64_t j = l.lo[v]; j < l.hi[v]; ++j) {
      float* s = st + j * kTile + 16 * v;
      const __mmask16 k = visible(l, v, j, valid);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(s), m[v])));
      _mm512_storeu_ps(s, e);
      sum[v] = _mm512_add_ps(sum[v], e);
    }
  alignas(64) float mx[kTile], sm[kTile];
  for (int v = 0; v < 2; ++v) {
    _mm512_store_ps(mx + 16 * v, m[v]);
    _mm512_store_ps(sm + 16 * v, sum[v]);
  }
  // O (rows x d) = P V through P^T (rows of st are keys, lanes queries).
  query_products(l, d, st, V.at(n, lo, h), V.st, acc, 1.f);
  for (int64_t i = 0; i < rows; ++i) {
    float* o = O.at(n, t0 + i, h);
    const bool dead = mx[i] < -1e29f;
    const float inv = dead ? 0.f : 1.f / sm[i];
    for (int64_t c = 0; c < d; ++c) o[c] = acc[i * d + c] * inv;
    lse_out[i * lse_stride] = dead ? kDeadLse : mx[i] + logf(sm[i]);
  }
}
#endif

#if defined(__AVX512F__)
// One tile's gradients (see tile_forward): P^T from the saved log-sum-exp,
// dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D), dQ = scale dS K,
// dK += scale dS^T Q.
void tile_backward(const Band& band, const View& Q, const View& K, const View& V,
                   const View& O, const View& dO, const View& dQ, const View& dK,
                   const View& dV, int64_t n, int64_t h, int64_t t0, int64_t rows, int64_t lo,
                   int64_t hi, const float* lse_in, int64_t lse_stride, float* qt, float* pt,
                   float* dpt, float* acc) {
  const int64_t d = band.d;
  pack_transposed(Q.at(n, t0, h), Q.st, rows, d, band.scale, qt);
  const Lanes l = lanes(band, t0, rows, lo, hi);
  lane_products(l, d, K.at(n, lo, h), K.st, qt, pt);  // S^T
  const bool* valid = band.valid ? band.valid + n * band.S + lo : nullptr;
  alignas(64) float lse[kTile], D[kTile];
  for (int64_t i = 0; i < kTile; ++i) {
    // Dead and padding lanes: a log-sum-exp so large that exp() is 0.
    const float x = i < rows ? lse_in[i * lse_stride] : kDeadLse;
    lse[i] = x < -1e29f ? 1e30f : x;
    float acc_d = 0.f;
    if (i < rows) {
      const float* o = O.at(n, t0 + i, h);
      const float* g = dO.at(n, t0 + i, h);
      for (int64_t c = 0; c < d; ++c) acc_d += o[c] * g[c];
    }
    D[i] = acc_d;
  }
  __m512 lv[2], dv[2];
  for (int v = 0; v < 2; ++v) {
    lv[v] = _mm512_load_ps(lse + 16 * v);
    dv[v] = _mm512_load_ps(D + 16 * v);
  }
  for (int v = 0; v < 2; ++v)
    for (int64_t j = l.lo[v]; j < l.hi[v]; ++j) {
      float* p = pt + j * kTile + 16 * v;
      const __mmask16 k = visible(l, v, j, valid);
      _mm512_storeu_ps(p, _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(p), lv[v]))));
    }
  // dV[lo:hi] += P^T dO: rows are keys, the sum runs over the tile's queries.
  key_products(l, d, pt, dO.at(n, t0, h), dO.st, dV.at(n, lo, h), dV.st, 1.f);
  // dP^T = V dO^T
  pack_transposed(dO.at(n, t0, h), dO.st, rows, d, 1.f, qt);
  lane_products(l, d, V.at(n, lo, h), V.st, qt, dpt);
  for (int v = 0; v < 2; ++v)
    for (int64_t j = l.lo[v]; j < l.hi[v]; ++j) {
      float* g = dpt + j * kTile + 16 * v;
      const __m512 p = _mm512_loadu_ps(pt + j * kTile + 16 * v);
      _mm512_storeu_ps(g, _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(g), dv[v])));
    }
  // dQ = scale dS K (through dS^T), written; dK[lo:hi] += scale dS^T Q.
  query_products(l, d, dpt, K.at(n, lo, h), K.st, acc, band.scale);
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(dQ.at(n, t0 + i, h), acc + i * d, d * sizeof(float));
  key_products(l, d, dpt, Q.at(n, t0, h), Q.st, dK.at(n, lo, h), dK.st, band.scale);
}
#endif

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  bool intervals) {
  TORCH_CHECK(k.sizes() == v.sizes(), "band kernel: key and value shapes differ: ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(3) == k.size(3),
              "band kernel: query ", q.sizes(), " and key ", k.sizes(),
              " differ in batch, heads or head size");
  TORCH_CHECK(intervals || q.size(1) == k.size(1),
              "band kernel: queries and keys of different lengths need explicit key intervals");
}

Band make_band(const at::Tensor& q, const at::Tensor& k, int64_t look_back, int64_t look_ahead,
               int64_t tile, double scale, const c10::optional<at::Tensor>& valid,
               const c10::optional<at::Tensor>& intervals) {
  Band band{q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), look_back, look_ahead, tile,
            static_cast<float>(scale), nullptr, nullptr, nullptr};
  TORCH_CHECK(look_back >= 0 && look_ahead >= 0 && tile > 0, "band kernel: bad extents");
  if (valid.has_value()) {
    TORCH_CHECK(valid->scalar_type() == at::kBool && valid->is_contiguous() &&
                    valid->dim() == 2 && valid->size(0) == band.N && valid->size(1) == band.S,
                "band kernel: key_valid must be a contiguous bool (N, S)");
    band.valid = valid->data_ptr<bool>();
  }
  if (intervals.has_value()) {
    TORCH_CHECK(intervals->scalar_type() == at::kInt && intervals->is_contiguous() &&
                    intervals->dim() == 2 && intervals->size(0) == 2 &&
                    intervals->size(1) == band.T,
                "band kernel: key intervals must be a contiguous int32 (2, T)");
    band.first = intervals->data_ptr<int32_t>();
    band.last = band.first + band.T;
    for (int64_t p = 0; p < band.T; ++p)
      TORCH_CHECK(band.first[p] >= 0 && band.last[p] <= band.S,
                  "band kernel: key interval of query ", p, " outside [0, ", band.S, "]");
  }
  return band;
}

void band_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const c10::optional<at::Tensor>& key_valid, int64_t look_back,
                  int64_t look_ahead, int64_t tile, double scale, const at::Tensor& out,
                  const at::Tensor& lse, int64_t pack,
                  const c10::optional<at::Tensor>& intervals) {
  check_inputs(query, key, value, intervals.has_value());
  TORCH_CHECK(out.sizes() == query.sizes(), "band kernel: out shape");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == query.size(0) && lse.size(1) == query.size(1) &&
                  lse.size(2) == query.size(2) && lse.scalar_type() == at::kFloat,
              "band kernel: lse must be float (N, T, H)");
  const Band band = make_band(query, key, look_back, look_ahead, tile, scale, key_valid,
                              intervals);
  const View Q = view_of(query), K = view_of(key), V = view_of(value), O = view_of(out);
  float* lse_data = lse.data_ptr<float>();
  const int64_t ln = lse.stride(0), lt = lse.stride(1), lh = lse.stride(2);
  const int64_t tiles = (band.T + tile - 1) / tile;
  const int64_t width = band.width();
  const bool packed = pack_rows(pack, band.S, band.d, {&K, &V});
  at::parallel_for(0, band.N * band.H * tiles, 1, [&](int64_t begin, int64_t end) {
    Scratch buffer(0, tile * padded(width) + 16);
    // Packed keys and values: rows [plo, phi) of sequence pn, head ph (the
    // next tile of the same sequence adds only its new rows).
    Scratch rows(1, packed ? 2 * band.S * band.d + 16 : 0);
    int64_t pn = -1, ph = -1, plo = 0, phi = 0;
#if defined(__AVX512F__)
    const bool fast = fast_path(band);
    Scratch fbuf(2, fast ? kTile * (band.d * 2 + width) + 64 : 0);
#endif
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n = u / (band.H * tiles), h = (u / tiles) % band.H, x = u % tiles;
      const int64_t t0 = x * tile, t1 = std::min(band.T, t0 + tile), count = t1 - t0;
      int64_t lo, hi;
      band.keys(t0, t1, &lo, &hi);
      View k = K, v = V;
      if (packed) {
        float* kb = aligned(rows.data());
        float* vb = kb + band.S * band.d;
        if (n != pn || h != ph || lo < plo || lo > phi) {
          pn = n;
          ph = h;
          plo = phi = lo;
        }
        if (hi > phi) {
          copy_rows(K, n, h, phi, hi, band.d, kb);
          copy_rows(V, n, h, phi, hi, band.d, vb);
          phi = hi;
        }
        k = local_view(kb, band.d);
        v = local_view(vb, band.d);
      }
#if defined(__AVX512F__)
      if (fast) {
        float* qt = aligned(fbuf.data());
        float* acc = qt + kTile * band.d;
        float* st = acc + kTile * band.d;
        tile_forward(band, Q, k, v, O, n, h, t0, count, lo, hi,
                     lse_data + n * ln + t0 * lt + h * lh, lt, qt, st, acc);
        continue;
      }
#endif
      const int64_t L = hi - lo, ld = padded(L);
      float* S = aligned(buffer.data());
      gemm_rm(false, true, count, L, band.d, band.scale, Q.at(n, t0, h), Q.st, k.at(n, lo, h),
              k.st, 0.f, S, ld);
      probabilities(band, n, t0, count, lo, hi, S, L, ld, nullptr, lt,
                    lse_data + n * ln + t0 * lt + h * lh);
      gemm_rm(false, false, count, band.d, L, 1.f, S, ld, v.at(n, lo, h), v.st, 0.f,
              O.at(n, t0, h), O.st);
    }
  });
}

void band_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const c10::optional<at::Tensor>& key_valid, int64_t look_back,
                   int64_t look_ahead, int64_t tile, double scale, const at::Tensor& out,
                   const at::Tensor& lse, const at::Tensor& grad_out, const at::Tensor& grad_query,
                   const at::Tensor& grad_key, const at::Tensor& grad_value, int64_t pack,
                   const c10::optional<at::Tensor>& intervals) {
  check_inputs(query, key, value, intervals.has_value());
  for (const auto* t : {&out, &grad_out, &grad_query})
    TORCH_CHECK(t->sizes() == query.sizes(), "band kernel: gradient shapes");
  for (const auto* t : {&grad_key, &grad_value})
    TORCH_CHECK(t->sizes() == key.sizes(), "band kernel: gradient shapes");
  const Band band = make_band(query, key, look_back, look_ahead, tile, scale, key_valid,
                              intervals);
  const View Q = view_of(query), K = view_of(key), V = view_of(value), O = view_of(out),
             dO = view_of(grad_out), dQ = view_of(grad_query), dK = view_of(grad_key),
             dV = view_of(grad_value);
  const float* lse_data = lse.data_ptr<float>();
  const int64_t ln = lse.stride(0), lt = lse.stride(1), lh = lse.stride(2);
  const int64_t tiles = (band.T + tile - 1) / tile;
  const int64_t width = band.width();
  const int64_t d = band.d, T = band.T, S = band.S;
  const bool packed =
      pack_rows(pack, std::max(T, S), d, {&Q, &K, &V, &O, &dO, &dQ, &dK, &dV});
  at::parallel_for(0, band.N * band.H, 1, [&](int64_t begin, int64_t end) {
    Scratch probs(0, tile * padded(width) + 16), dprobs(3, tile * padded(width) + 16);
    // Packed sequence: q, o, dO, dq (T rows each) and k, v, dk, dv (S rows).
    Scratch rows(1, packed ? 4 * (T + S) * d + 16 : 0);
#if defined(__AVX512F__)
    const bool fast = fast_path(band);
    Scratch fbuf(2, fast ? kTile * (2 * d + 2 * width) + 64 : 0);
#endif
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n = u / band.H, h = u % band.H;
      View q = Q, k = K, v = V, o = O, go = dO, gq = dQ, gk = dK, gv = dV;
      if (packed) {
        // Each view in turn gets `length` rows of the buffer, the inputs
        // copied there, the gradients written there (copied out below).
        float* at = aligned(rows.data());
        auto take = [&](View& x, int64_t length, bool input) {
          if (input) copy_rows(x, n, h, 0, length, d, at);
          x = local_view(at, d);
          at += length * d;
        };
        for (View* x : {&q, &o, &go}) take(*x, T, true);
        for (View* x : {&k, &v}) take(*x, S, true);
        take(gq, T, false);
        for (View* x : {&gk, &gv}) take(*x, S, false);
      }
      // Key and value gradient rows are zeroed just before the first tile
      // that adds to them (rows [0, zeroed) are), while they are about to be
      // in cache anyway; the rest at the end.
      int64_t zeroed = 0;
      auto zero_rows = [&](int64_t upto) {
        for (; zeroed < upto; ++zeroed) {
          std::memset(gk.at(n, zeroed, h), 0, d * sizeof(float));
          std::memset(gv.at(n, zeroed, h), 0, d * sizeof(float));
        }
      };
      for (int64_t x = 0; x < tiles; ++x) {
        const int64_t t0 = x * tile, t1 = std::min(T, t0 + tile), count = t1 - t0;
        int64_t lo, hi;
        band.keys(t0, t1, &lo, &hi);
        zero_rows(hi);
        const float* lse_tile = lse_data + n * ln + t0 * lt + h * lh;
#if defined(__AVX512F__)
        if (fast) {
          float* qt = aligned(fbuf.data());
          float* acc = qt + kTile * d;
          float* pt = acc + kTile * d;
          float* dpt = pt + kTile * width;
          tile_backward(band, q, k, v, o, go, gq, gk, gv, n, h, t0, count, lo, hi, lse_tile, lt,
                        qt, pt, dpt, acc);
          continue;
        }
#endif
        const int64_t L = hi - lo, ld = padded(L);
        float* P = aligned(probs.data());
        float* dS = aligned(dprobs.data());
        gemm_rm(false, true, count, L, d, band.scale, q.at(n, t0, h), q.st, k.at(n, lo, h), k.st,
                0.f, P, ld);
        probabilities(band, n, t0, count, lo, hi, P, L, ld, lse_tile, lt, nullptr);
        // dV[lo:hi] += P^T dO
        gemm_rm(true, false, L, d, count, 1.f, P, ld, go.at(n, t0, h), go.st, 1.f,
                gv.at(n, lo, h), gv.st);
        // dP = dO V^T
        gemm_rm(false, true, count, L, d, 1.f, go.at(n, t0, h), go.st, v.at(n, lo, h), v.st, 0.f,
                dS, ld);
        for (int64_t i = 0; i < count; ++i) {
          const float* orow = o.at(n, t0 + i, h);
          const float* g = go.at(n, t0 + i, h);
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < d; ++c) acc += orow[c] * g[c];
          float* ds = dS + i * ld;
          const float* p = P + i * ld;
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) ds[j] = p[j] * (ds[j] - acc);
        }
        // dQ = scale dS K ; dK[lo:hi] += scale dS^T Q
        gemm_rm(false, false, count, d, L, band.scale, dS, ld, k.at(n, lo, h), k.st, 0.f,
                gq.at(n, t0, h), gq.st);
        gemm_rm(true, false, L, d, count, band.scale, dS, ld, q.at(n, t0, h), q.st, 1.f,
                gk.at(n, lo, h), gk.st);
      }
      zero_rows(S);
      if (packed) {
        store_rows(gq.data, T, d, dQ, n, h);
        store_rows(gk.data, S, d, dK, n, h);
        store_rows(gv.data, S, d, dV, n, h);
      }
    }
  });
}

}  // namespace

// 1 where the AVX-512 tiles above are compiled in (-march=native on a CPU
// with AVX-512F), else 0.
int64_t vector_path() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

TORCH_LIBRARY(keras_longattn_band, m) {
  m.def("vector_path() -> int", &vector_path);
  m.def("forward(Tensor query, Tensor key, Tensor value, Tensor? key_valid, int look_back, "
        "int look_ahead, int tile, float scale, Tensor(a!) out, Tensor(b!) lse, int pack=-1, "
        "Tensor? intervals=None) -> ()");
  m.def("backward(Tensor query, Tensor key, Tensor value, Tensor? key_valid, int look_back, "
        "int look_ahead, int tile, float scale, Tensor out, Tensor lse, Tensor grad_out, "
        "Tensor(a!) grad_query, Tensor(b!) grad_key, Tensor(c!) grad_value, int pack=-1, "
        "Tensor? intervals=None) -> ()");
}

TORCH_LIBRARY_IMPL(keras_longattn_band, CPU, m) {
  m.impl("forward", band_forward);
  m.impl("backward", band_backward);
}
