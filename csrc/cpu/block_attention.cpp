// CPU block attention (docs/design.md §3.1). One task per (request, kv head): the B x G query rows that
// share a kv head are processed together, so every context K/V tile is gathered and converted to
// fp32 once and reused by all of them. Keys (context, then the block's own K/V) stream through in
// tiles of absolute positions with an online softmax, so a verify row computes bit for bit what
// decoding its token alone computes. In tree mode (tree_parents) a block row sees the context and
// the block rows of its ancestors only (a bitmask per row, built per task), and a node's key sits
// at the position of its depth (siblings share one), so a node too computes bit for bit what
// decoding its path computes. Buffers are allocated once per thread chunk. A task's scores run with
// vectors across its query rows, or across keys where it has few rows (Problem::by_keys: a decode
// fills 3 of 8 lanes across rows); each score, probability and output element is the same FMA
// chain in the same order either way, so a decode row and its verify row stay bitwise equal. The
// two GEMMs of a tile (Q K^T, P V) run on 16-lane AVX-512 where the CPU has it (avx512_wanted), the
// same chains again: both paths give the same bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "to_float.h"
#include "x86_paths.h"
#include "sglang_dflash/checks.h"
#include "sglang_dflash/dispatch.h"
#include "sglang_dflash/online_softmax.h"

namespace sglang_dflash::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 64;  // context tokens per tile: K, V tiles and scores stay in L1/L2

// Rows i..i+R-1 and vectors of columns j..j+V*W-1 of C += A * Bm (see gemm_accumulate): R x V
// accumulators in registers, each loaded Bm vector feeding R FMAs.
template <int R, int V, bool kTransA>
void accumulate_tile(int64_t i, int64_t j, int64_t K, const float* A, int64_t lda, const float* Bm, int64_t ldb,
                     float* C, int64_t ldc) {
  constexpr int64_t W = Vec::size();
  Vec c[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v] = Vec::loadu(C + (i + r) * ldc + j + v * W);
  for (int64_t k = 0; k < K; ++k) {
    Vec b[V];
    for (int v = 0; v < V; ++v) b[v] = Vec::loadu(Bm + k * ldb + j + v * W);
    for (int r = 0; r < R; ++r) {
      const Vec a(kTransA ? A[k * lda + i + r] : A[(i + r) * lda + k]);
      for (int v = 0; v < V; ++v) c[r][v] = at::vec::fmadd(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v].store(C + (i + r) * ldc + j + v * W);
}

#if SGLD_HAS_X86
// accumulate_tile on 16-lane AVX-512 vectors: every element is the same FMA chain in the same
// order, so both paths give the same bits; the AVX-512 one does twice the FMAs an instruction.
template <int R, int V, bool kTransA>
SGLD_AVX512 void accumulate_tile_avx512(int64_t i, int64_t j, int64_t K, const float* A, int64_t lda,
                                        const float* Bm, int64_t ldb, float* C, int64_t ldc) {
  constexpr int64_t W = 16;
  __m512 c[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) c[r][v] = _mm512_loadu_ps(C + (i + r) * ldc + j + v * W);
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[V];
    for (int v = 0; v < V; ++v) b[v] = _mm512_loadu_ps(Bm + k * ldb + j + v * W);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(kTransA ? A[k * lda + i + r] : A[(i + r) * lda + k]);
      for (int v = 0; v < V; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(C + (i + r) * ldc + j + v * W, c[r][v]);
}
#endif

// Covers columns j.. of C[M x N] with register tiles of W-float vectors, calling tile(R, V, i, j)
// (R rows from i, V vectors of columns from j; R and V as integral constants): columns in blocks
// of 4, 2, then 1 vector, their rows in tiles of R4, R2, R1 (then of 3, 2 and 1). Returns the
// first column left (fewer than W).
template <int64_t W, int R4, int R2, int R1, typename Tile>
int64_t register_tiles(int64_t M, int64_t N, int64_t j, Tile tile) {
  using std::integral_constant;
  auto columns = [&](auto vectors, auto tile_rows, int64_t j) {
    constexpr int R = decltype(tile_rows)::value;
    int64_t i = 0;
    for (; i + R <= M; i += R) tile(tile_rows, vectors, i, j);
    if constexpr (R > 3) {  // a decode's 3 query rows keep 3 chains a vector
      for (; i + 3 <= M; i += 3) tile(integral_constant<int, 3>{}, vectors, i, j);
    }
    if constexpr (R > 2) {
      for (; i + 2 <= M; i += 2) tile(integral_constant<int, 2>{}, vectors, i, j);
    }
    for (; i < M; ++i) tile(integral_constant<int, 1>{}, vectors, i, j);
  };
  for (; j + 4 * W <= N; j += 4 * W) columns(integral_constant<int, 4>{}, integral_constant<int, R4>{}, j);
  for (; j + 2 * W <= N; j += 2 * W) columns(integral_constant<int, 2>{}, integral_constant<int, R2>{}, j);
  for (; j + W <= N; j += W) columns(integral_constant<int, 1>{}, integral_constant<int, R1>{}, j);
  return j;
}

// C[M x N] += A[M x K] * Bm[K x N], fp32, Bm and C row-major; A row-major, or column-major
// (element (i, k) at A[k * lda + i]) when kTransA. Register tiles of 8-12 accumulators (24 on
// AVX-512's 32 registers), each loaded Bm vector feeding R FMAs: fewer than 8 independent chains
// leave the FMAs waiting on their own latency (a decode's 3 query rows in 1-row tiles ran at ~1/4
// of the FMA rate). Every element of C is one FMA chain over k in order, whatever its tile and
// vector width: neither the tiling nor the path changes a bit.
template <bool kTransA>
void gemm_accumulate(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* Bm,
                     int64_t ldb, float* C, int64_t ldc) {
  int64_t j = 0;
#if SGLD_HAS_X86
  if (avx512_wanted()) {
    j = register_tiles<16, 6, 8, 12>(M, N, j, [&](auto R, auto V, int64_t i, int64_t j0) {
      accumulate_tile_avx512<decltype(R)::value, decltype(V)::value, kTransA>(i, j0, K, A, lda, Bm, ldb, C, ldc);
    });
  }
#endif
  // On AVX-512, the 8 columns left (query rows come padded to a multiple of 8) take AVX2 tiles.
  j = register_tiles<Vec::size(), 3, 4, 8>(M, N, j, [&](auto R, auto V, int64_t i, int64_t j0) {
    accumulate_tile<decltype(R)::value, decltype(V)::value, kTransA>(i, j0, K, A, lda, Bm, ldb, C, ldc);
  });
  for (; j < N; ++j) {  // column tail (N not a multiple of the vector width)
    for (int64_t i = 0; i < M; ++i) {
      // std::fma, as the vector lanes: `acc += a * b` may or may not be contracted into an FMA,
      // differently in each instantiation, and a decode row and its verify row take different ones.
      float acc = C[i * ldc + j];
      for (int64_t k = 0; k < K; ++k) acc = std::fma(kTransA ? A[k * lda + i] : A[i * lda + k], Bm[k * ldb + j], acc);
      C[i * ldc + j] = acc;
    }
  }
}

// A task of at most this many query rows computes its scores with vectors across keys (the K tile
// transposed as it is loaded) instead of across query rows, whose vectors it would fill only in
// part (a decode's B 1 x G 3 query rows: 3 of 8 lanes). Both layouts compute every score,
// probability and output by the same FMA chains in the same order, so the choice never changes
// a bit: a decode row and the verify row of the same token stay equal.
constexpr int64_t kMaxRowsByKeys = 12;

struct Problem {
  int64_t block_size, group, kv_heads, head_dim, window;
  bool causal_block;
  float sm_scale;
  const int64_t* tree_parents;  // [bs, B] in tree mode, else null
  // Words of one block row's bitmask of the block rows it sees (tree mode).
  int64_t tree_words() const { return tree_parents ? (block_size + 63) / 64 : 0; }
  // The B x G query rows of one task, and that count rounded up to whole vectors: the row stride
  // of the query and score buffers, so the score GEMM and the softmax never take a scalar tail
  // (B 4 x G 3 = 12 rows would otherwise be computed one column at a time).
  int64_t rows() const { return block_size * group; }
  int64_t padded_rows() const { return (rows() + Vec::size() - 1) / Vec::size() * Vec::size(); }
  bool by_keys() const { return rows() <= kMaxRowsByKeys; }
};

// Per-thread scratch, sized once per parallel chunk. Across query rows (R = padded_rows(); the
// padding rows have all-zero queries, so their finite scores and outputs are computed and never
// read), scores are key-major ([T, R]): the K tile is used as gathered and the softmax runs across
// rows in vectors. Across keys (by_keys()), scores are row-major ([rows, ld]) against K^T.
struct Scratch {
  int64_t ld;                // keys a tile holds, rounded up to whole vectors (by_keys: K^T and score stride)
  std::vector<float> q;      // [D, R] queries of one (request, kv head), pre-scaled, transposed; by keys [rows, D]
  std::vector<float> k;      // [T, D] K tile; by keys K^T [D, ld]
  std::vector<float> v;      // [T, D] V tile
  std::vector<float> score;  // [T, R] scores, then probabilities, of one tile; by keys [rows, ld]
  std::vector<float> acc;    // [R, D]  un-normalised output
  std::vector<float> max, sum;       // [R] online-softmax state
  std::vector<float> scale, tile_sum;  // [R] per-tile work: new max / rescale factor, exp sums
  // Tree mode: bit c of row i = block row c is i or its ancestor; each row's depth; the rows in
  // (depth, row) order, the order their keys stream in.
  std::vector<uint64_t> sees;  // [B, words]
  std::vector<int64_t> depth, by_depth;  // [B]
  // `tile`: the most keys one tile holds (in tree mode kTile positions hold up to B nodes more).
  Scratch(const Problem& p, int64_t tile)
      : ld((tile + Vec::size() - 1) / Vec::size() * Vec::size()), q(p.head_dim * p.padded_rows()),
        k(ld * p.head_dim), v(ld * p.head_dim), score(ld * p.padded_rows()), acc(p.padded_rows() * p.head_dim),
        max(p.padded_rows()), sum(p.padded_rows()), scale(p.padded_rows()), tile_sum(p.padded_rows()),
        sees(p.block_size * p.tree_words()), depth(p.tree_words() ? p.block_size : 0),
        by_depth(depth.size()) {}
};

// Folds one tile's exp sum of row r into its running sum and rescales its output accumulator by
// `factor` (rescale_factor of the row's old and new max).
inline void fold_tile(Scratch& s, int64_t r, int64_t head_dim, float factor, float tile_sum) {
  s.sum[r] = s.sum[r] * factor + tile_sum;
  if (factor == 1.0f) return;
  float* acc = s.acc.data() + r * head_dim;
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= factor;
}

// Online-softmax update of all R query rows with one tile of `n` keys whose scores are in
// s.score ([n, R]); `visible(row_in_block, key)` says which (block row, tile key) pairs may
// attend, and is only consulted when `masked`. Everything runs across rows, W at a time.
template <typename Visible>
void softmax_tile(Scratch& s, const Problem& p, int64_t n, bool masked, Visible visible) {
  const int64_t rows = p.padded_rows(), W = Vec::size();
  float* score = s.score.data();
  float* new_max = s.scale.data();  // the new running max per row, then its rescale factor
  float* tile_sum = s.tile_sum.data();
  if (masked) {
    for (int64_t c = 0; c < n; ++c)
      for (int64_t i = 0; i < p.block_size; ++i)
        if (!visible(i, c)) std::fill_n(score + c * rows + i * p.group, p.group, -INFINITY);
  }
  std::copy(s.max.begin(), s.max.end(), new_max);
  std::fill(tile_sum, tile_sum + rows, 0.0f);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t r = 0; r < rows; r += W)  // rows is a whole number of vectors (padded_rows)
      at::vec::maximum(Vec::loadu(new_max + r), Vec::loadu(score + c * rows + r)).store(new_max + r);
  for (int64_t c = 0; c < n; ++c) {
    float* row = score + c * rows;
    for (int64_t r = 0; r < rows; r += W) {
      // Rows with nothing visible yet subtract 0, so exp(-inf) gives 0 rather than NaN.
      const Vec m = Vec::loadu(new_max + r);
      const Vec e = (Vec::loadu(row + r) - Vec::blendv(m, Vec(0.0f), m == Vec(-INFINITY))).exp_u20();
      e.store(row + r);
      (Vec::loadu(tile_sum + r) + e).store(tile_sum + r);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float factor = rescale_factor(s.max[r], new_max[r]);
    s.max[r] = new_max[r];
    new_max[r] = factor;
    fold_tile(s, r, p.head_dim, factor, tile_sum[r]);
  }
}

// Loads `n` key/value vectors of one kv head into the tile buffers, in fp32.
template <typename scalar_t, typename KeyPtr>
void load_tile(Scratch& s, int64_t n, int64_t head_dim, KeyPtr key_ptr) {
  for (int64_t c = 0; c < n; ++c) {
    const scalar_t* k;
    const scalar_t* v;
    key_ptr(c, k, v);
    to_float(k, s.k.data() + c * head_dim, head_dim);
    to_float(v, s.v.data() + c * head_dim, head_dim);
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// In place: r[i] becomes column i of the 8 x 8 matrix whose rows are r[0..7].
inline void transpose_8x8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// Loads `n` keys of one kv head as K^T ([D, ld], key c in column c) and their values row-major, in
// fp32. Columns n.. of the last vector repeat key n - 1 (their scores are masked).
template <typename scalar_t, typename KeyPtr>
void load_tile_by_keys(Scratch& s, int64_t n, int64_t D, KeyPtr key_ptr) {
  constexpr int64_t W = Vec::size();
  float* kt = s.k.data();
  const int64_t ld = s.ld;
  for (int64_t c0 = 0; c0 < n; c0 += W) {
    const scalar_t* keys[W];
    for (int64_t j = 0; j < W; ++j) {
      const scalar_t* v;
      key_ptr(std::min(c0 + j, n - 1), keys[j], v);
      if (c0 + j < n) to_float(v, s.v.data() + (c0 + j) * D, D);
    }
    int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX2)
    for (; d + W <= D; d += W) {
      __m256 block[8];
      for (int j = 0; j < 8; ++j) {
        block[j] = load_float_vector(keys[j] + d);
      }
      transpose_8x8(block);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d + i) * ld + c0, block[i]);
    }
#endif
    for (; d < D; ++d)
      for (int64_t j = 0; j < W; ++j) kt[d * ld + c0 + j] = static_cast<float>(keys[j][d]);
  }
}

// attend_tile across keys (by_keys()): scores [rows, keys] = Q K^T, each row's online-softmax
// update along its keys, acc += P V. Per element the same operations in the same order as across
// query rows: a score is one FMA chain over d from 0, a row's exp sum adds its keys in key order,
// an output element is one FMA chain over keys.
template <typename Visible>
void attend_tile_by_keys(Scratch& s, const Problem& p, int64_t n, bool masked, Visible visible) {
  const int64_t rows = p.rows(), D = p.head_dim, ld = s.ld, W = Vec::size();
  const int64_t n_vec = (n + W - 1) / W * W;
  float* scores = s.score.data();
  for (int64_t r = 0; r < rows; ++r) std::fill_n(scores + r * ld, n_vec, 0.0f);
  gemm_accumulate<false>(rows, n_vec, D, s.q.data(), D, s.k.data(), ld, scores, ld);
  for (int64_t r = 0; r < rows; ++r) {
    float* score = scores + r * ld;
    if (masked) {
      const int64_t i = r / p.group;
      for (int64_t c = 0; c < n; ++c)
        if (!visible(i, c)) score[c] = -INFINITY;
    }
    std::fill(score + n, score + n_vec, -INFINITY);
    Vec top(-INFINITY);
    for (int64_t c = 0; c < n_vec; c += W) top = at::vec::maximum(top, Vec::loadu(score + c));
    const float new_max = std::max(
        s.max[r], at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); },
                                                 top));
    // A row with nothing visible yet subtracts 0, so exp(-inf) gives 0 rather than NaN.
    const Vec shift(new_max == -INFINITY ? 0.0f : new_max);
    for (int64_t c = 0; c < n_vec; c += W) (Vec::loadu(score + c) - shift).exp_u20().store(score + c);
    s.scale[r] = rescale_factor(s.max[r], new_max);
    s.max[r] = new_max;
  }
  float* tile_sum = s.tile_sum.data();  // in key order; the rows' chains interleave
  std::fill_n(tile_sum, rows, 0.0f);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t r = 0; r < rows; ++r) tile_sum[r] += scores[r * ld + c];
  for (int64_t r = 0; r < rows; ++r) fold_tile(s, r, D, s.scale[r], tile_sum[r]);
  gemm_accumulate<false>(rows, D, n, scores, ld, s.v.data(), D, s.acc.data(), D);
}

// Scores of all query rows against the loaded tile (S^T = K Q^T), the online softmax, then
// acc += P V with P read transposed from the key-major scores.
template <typename Visible>
void attend_tile(Scratch& s, const Problem& p, int64_t n, bool masked, Visible visible) {
  const int64_t rows = p.padded_rows();
  std::fill_n(s.score.data(), n * rows, 0.0f);
  gemm_accumulate<false>(n, rows, p.head_dim, s.k.data(), p.head_dim, s.q.data(), rows, s.score.data(),
                         rows);
  softmax_tile(s, p, n, masked, visible);
  gemm_accumulate<true>(p.rows(), p.head_dim, n, s.score.data(), rows, s.v.data(), p.head_dim, s.acc.data(),
                        p.head_dim);
}

// One tile of `n` keys (key_ptr(c, k, v) points at key c's K and V) for every query row of the
// task, across keys or across query rows (Problem::by_keys).
template <typename scalar_t, typename KeyPtr, typename Visible>
void load_and_attend(Scratch& s, const Problem& p, int64_t n, KeyPtr key_ptr, bool masked, Visible visible) {
  if (p.by_keys()) {
    load_tile_by_keys<scalar_t>(s, n, p.head_dim, key_ptr);
    attend_tile_by_keys(s, p, n, masked, visible);
  } else {
    load_tile<scalar_t>(s, n, p.head_dim, key_ptr);
    attend_tile(s, p, n, masked, visible);
  }
}

// Tree mode's key stream of one (request, kv head) task: the context, then node c at position
// ctx + depth(c); a tile holds the context tokens and the nodes of its kTile positions, nodes in
// (depth, row) order, and row i sees the context and the nodes set in its ancestor bitmask. A
// node's ancestors are one per depth, in depth order, at the positions its path's tokens hold in
// decoding: the same keys in the same tiles in the same order as decoding that path.
template <typename scalar_t, typename ContextKey, typename BlockKey>
void attend_tree(Scratch& s, const Problem& p, int64_t b, int64_t ctx, ContextKey context_key,
                 BlockKey block_key) {
  const int64_t B = p.block_size, words = p.tree_words();
  const int64_t* parent = p.tree_parents + b * B;
  for (int64_t i = 0; i < B; ++i) {  // parents come first (checked): a parent's row is complete
    uint64_t* row = s.sees.data() + i * words;
    if (parent[i] >= 0) {
      std::copy_n(s.sees.data() + parent[i] * words, words, row);
      s.depth[i] = s.depth[parent[i]] + 1;
    } else {  // the root, or an unused node: sees only itself, at depth 0
      std::fill_n(row, words, uint64_t{0});
      s.depth[i] = 0;
    }
    row[i / 64] |= uint64_t{1} << (i % 64);
    s.by_depth[i] = i;
  }
  std::stable_sort(s.by_depth.begin(), s.by_depth.end(),
                   [&](int64_t x, int64_t y) { return s.depth[x] < s.depth[y]; });
  auto sees = [&](int64_t i, int64_t c) { return ((s.sees[i * words + c / 64] >> (c % 64)) & 1) != 0; };
  for (int64_t t0 = 0, next = 0; next < B; t0 += kTile) {
    const int64_t n_ctx = std::max<int64_t>(0, std::min(t0 + kTile, ctx) - t0);
    int64_t stop = next;  // nodes next..stop-1 (in depth order) sit at positions < t0 + kTile
    while (stop < B && ctx + s.depth[s.by_depth[stop]] < t0 + kTile) ++stop;
    const int64_t n = n_ctx + stop - next;
    auto key_ptr = [&](int64_t c, const scalar_t*& k, const scalar_t*& v) {
      if (c < n_ctx) {
        context_key(t0 + c, k, v);
      } else {
        block_key(s.by_depth[next + c - n_ctx], k, v);
      }
    };
    load_and_attend<scalar_t>(s, p, n, key_ptr, stop > next, [&](int64_t i, int64_t c) {
      return c < n_ctx || sees(i, s.by_depth[next + c - n_ctx]);
    });
    next = stop;
  }
}

template <typename scalar_t, typename table_t>
void block_attention_kernel(const at::Tensor& q, const at::Tensor& k_block,
                            const at::Tensor& v_block, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& req_to_token,
                            const int64_t* pool_index, const int64_t* ctx_len, const Problem& p,
                            int64_t batch, at::Tensor& out) {
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* kb_ptr = k_block.data_ptr<scalar_t>();
  const scalar_t* vb_ptr = v_block.data_ptr<scalar_t>();
  const scalar_t* kc_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc_ptr = v_cache.data_ptr<scalar_t>();
  const table_t* table = req_to_token.data_ptr<table_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t B = p.block_size, G = p.group, D = p.head_dim, rows = p.padded_rows();

  at::parallel_for(0, batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch s(p, kTile + (p.tree_words() ? B : 0));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.kv_heads, h = task % p.kv_heads;
      const int64_t ctx = ctx_len[b];
      const table_t* slots = table + pool_index[b] * req_to_token.stride(0);
      for (int64_t i = 0; i < B; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* src = q_ptr + (b * B + i) * q.stride(0) + (h * G + g) * q.stride(1);
          const int64_t r = i * G + g;
          for (int64_t d = 0; d < D; ++d) {
            (p.by_keys() ? s.q[r * D + d] : s.q[d * rows + r]) = static_cast<float>(src[d]) * p.sm_scale;
          }
        }
      }
      std::fill(s.acc.begin(), s.acc.end(), 0.0f);
      std::fill(s.max.begin(), s.max.end(), -INFINITY);
      std::fill(s.sum.begin(), s.sum.end(), 0.0f);

      // Keys by absolute position: context token j at j, block row c at ctx + c (in tree mode at
      // ctx + its depth). Tiles cover kTile positions aligned to multiples of kTile, whatever the
      // split between context and block, and a masked key adds an exact 0 to every sum: so a row's
      // output is bitwise the same whether the tokens before it come from the cache (decode, B = 1)
      // or from its own block (verify, or its path in a tree). Row i (position ctx + i) sees
      // context token j when ctx + i - j < window.
      auto context_key = [&](int64_t pos, const scalar_t*& k, const scalar_t*& v) {
        const int64_t slot = static_cast<int64_t>(slots[pos]);
        k = kc_ptr + slot * k_cache.stride(0) + h * k_cache.stride(1);
        v = vc_ptr + slot * v_cache.stride(0) + h * v_cache.stride(1);
      };
      auto block_key = [&](int64_t c, const scalar_t*& k, const scalar_t*& v) {
        k = kb_ptr + (b * B + c) * k_block.stride(0) + h * k_block.stride(1);
        v = vb_ptr + (b * B + c) * v_block.stride(0) + h * v_block.stride(1);
      };
      if (p.tree_words()) {
        attend_tree<scalar_t>(s, p, b, ctx, context_key, block_key);
      } else {
        const int64_t first = p.window >= 1 ? std::max<int64_t>(0, ctx - p.window + 1) : 0;
        const int64_t end = ctx + B;
        auto visible = [&](int64_t i, int64_t pos) {
          if (pos < ctx) return p.window < 1 || ctx + i - pos < p.window;
          const int64_t c = pos - ctx;
          return !(p.causal_block && c > i) && (p.window < 1 || std::abs(i - c) < p.window);
        };
        for (int64_t t0 = first / kTile * kTile; t0 < end; t0 += kTile) {
          const int64_t n = std::min(kTile, end - t0);
          auto key_ptr = [&](int64_t c, const scalar_t*& k, const scalar_t*& v) {
            if (t0 + c < ctx) {
              context_key(t0 + c, k, v);
            } else {
              block_key(t0 + c - ctx, k, v);
            }
          };
          const bool masked = p.window >= 1 || t0 < first || (p.causal_block && t0 + n > ctx + 1);
          load_and_attend<scalar_t>(s, p, n, key_ptr, masked, [&](int64_t i, int64_t c) { return visible(i, t0 + c); });
        }
      }

      for (int64_t i = 0; i < B; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const float inv = 1.0f / s.sum[r];
          const float* src = s.acc.data() + r * D;
          scalar_t* dst = out_ptr + ((b * B + i) * p.kv_heads * G + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv);
        }
      }
    }
  });
}

}  // namespace

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_block,
                           const at::Tensor& v_block, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& ctx_lens,
                           int64_t block_size, double sm_scale, int64_t window,
                           bool causal_block, const std::optional<at::Tensor>& tree_parents) {
  const auto shape = check_block_attention_args(q, k_block, v_block, k_cache, v_cache,
                                                req_to_token, req_pool_indices, ctx_lens,
                                                block_size, window, causal_block, tree_parents);
  check_block_attention_indices(k_cache, req_to_token, req_pool_indices, ctx_lens, tree_parents);
  // The table is read row by row through stride(0), so only its columns must be contiguous.
  const auto table = req_to_token.stride(1) == 1 ? req_to_token : req_to_token.contiguous();
  const auto pools = req_pool_indices.to(at::kLong).contiguous();
  const auto lens = ctx_lens.to(at::kLong).contiguous();
  const auto parents = tree_parents ? tree_parents->to(at::kLong).contiguous() : at::Tensor();
  auto out = at::empty({q.size(0), shape.q_heads, shape.head_dim}, q.options());
  if (q.size(0) == 0) return out;

  const Problem problem{block_size,       shape.q_heads / shape.kv_heads,
                        shape.kv_heads,   shape.head_dim,
                        window,           causal_block,
                        static_cast<float>(sm_scale),
                        tree_parents ? parents.const_data_ptr<int64_t>() : nullptr};
  SGLD_DISPATCH_FLOAT_TYPES(q.scalar_type(), "block_attention", [&] {
    if (table.scalar_type() == at::kInt) {
      block_attention_kernel<scalar_t, int32_t>(q, k_block, v_block, k_cache, v_cache, table,
                                                pools.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                                problem, shape.batch, out);
    } else {
      block_attention_kernel<scalar_t, int64_t>(q, k_block, v_block, k_cache, v_cache, table,
                                                pools.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                                problem, shape.batch, out);
    }
  });
  return out;
}

}  // namespace sglang_dflash::cpu
