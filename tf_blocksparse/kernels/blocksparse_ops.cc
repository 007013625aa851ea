// Fused CPU kernels of tf_blocksparse's per-variable compression step.
//
// A variable of `outer * num_blocks * inner` elements is viewed as [outer, num_blocks, inner]
// (see tf_blocksparse/blocks.py); block b is the [outer, inner] slice at index b.
//
//   BlockAccumulateScore(grad, residual) -> (acc = grad + residual, scores [num_blocks])
//   BlockScores(x)                       -> scores [num_blocks]
//   TakeBlocks(acc, ids)                 -> (values [k, outer * inner], residual)
//
// Scores are L1 (sum |v|) or L2 (sqrt of sum v^2) norms.  The work is split into tiles that
// depend on the shape only (never on the thread count), each tile sums in a fixed order and
// the per-tile partial sums are combined in tile order, so the scores are deterministic.
// `acc` and the residual are exact: one IEEE addition per element, blocks copied / zeroed.
// The inner loops use 16-byte vectors; `acc` is written with streaming stores where aligned,
// since only its few selected blocks are read again: memory traffic is that of one
// `residual += grad` pass (read grad, read residual, write acc).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace tf_blocksparse {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::errors::InvalidArgument;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
using int64 = std::int64_t;

// Elements per tile: big enough to amortise scheduling, small enough to spread over cores.
constexpr int64 kTileElems = 1 << 15;
constexpr int kLanes = 8;

Status LayoutShapeFn(InferenceContext* c, bool with_acc) {
  int64 num_blocks;
  TF_RETURN_IF_ERROR(c->GetAttr("num_blocks", &num_blocks));
  ShapeHandle shape = c->input(0);
  if (with_acc) {
    TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &shape));
    c->set_output(0, shape);
    c->set_output(1, c->Vector(num_blocks));
  } else {
    c->set_output(0, c->Vector(num_blocks));
  }
  return Status();
}

REGISTER_OP("BlockAccumulateScore")
    .Input("grad: T")
    .Input("residual: T")
    .Output("acc: T")
    .Output("scores: T")
    .Attr("T: {float, double}")
    .Attr("outer: int >= 1")
    .Attr("num_blocks: int >= 1")
    .Attr("inner: int >= 1")
    .Attr("metric: {'l1', 'l2'} = 'l1'")
    .SetShapeFn([](InferenceContext* c) { return LayoutShapeFn(c, true); })
    .Doc("acc = grad + residual and the L1/L2 norm of each block of acc, in one pass.");

REGISTER_OP("BlockScores")
    .Input("x: T")
    .Output("scores: T")
    .Attr("T: {float, double}")
    .Attr("outer: int >= 1")
    .Attr("num_blocks: int >= 1")
    .Attr("inner: int >= 1")
    .Attr("metric: {'l1', 'l2'} = 'l1'")
    .SetShapeFn([](InferenceContext* c) { return LayoutShapeFn(c, false); })
    .Doc("The L1/L2 norm of each block of x, in one pass.");

REGISTER_OP("TakeBlocks")
    .Input("acc: T")
    .Input("ids: Tidx")
    .Output("values: T")
    .Output("residual: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT32")
    .Attr("outer: int >= 1")
    .Attr("num_blocks: int >= 1")
    .Attr("inner: int >= 1")
    .SetShapeFn([](InferenceContext* c) {
      int64 outer, inner;
      TF_RETURN_IF_ERROR(c->GetAttr("outer", &outer));
      TF_RETURN_IF_ERROR(c->GetAttr("inner", &inner));
      ShapeHandle ids;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &ids));
      c->set_output(0, c->Matrix(c->Dim(ids, 0), outer * inner));
      c->set_output(1, c->input(0));
      return Status();
    })
    .Doc("The blocks ids of acc as rows, and acc with those blocks zeroed (in place when "
         "acc's buffer can be forwarded).");

template <typename T, bool kL2>
inline T Term(T v) {
  return kL2 ? v * v : std::abs(v);
}

// 16-byte vectors (GCC / Clang vector extensions: SSE2 on x86-64, NEON on arm64).  A group
// of kLanes values is kLanes / kWidth vectors; lane l of the group is element l % kWidth of
// vector l / kWidth, so the vector code adds exactly what a scalar loop over lanes would.
template <typename T>
struct Simd {
  static constexpr int kWidth = 16 / sizeof(T);
  static constexpr int kVectors = kLanes / kWidth;
  typedef T V __attribute__((vector_size(16)));
  typedef typename std::conditional<sizeof(T) == 4, std::int32_t, std::int64_t>::type I;
  typedef I IV __attribute__((vector_size(16)));

  static V Load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
  }
  static void Store(T* p, V v) { std::memcpy(p, &v, sizeof(V)); }
  static void Stream(T* p, V v) {
#if defined(__SSE2__)
    if ((reinterpret_cast<std::uintptr_t>(p) & 15) == 0) {
      if constexpr (sizeof(T) == 4) {
        _mm_stream_ps(reinterpret_cast<float*>(p), reinterpret_cast<__m128>(v));
      } else {
        _mm_stream_pd(reinterpret_cast<double*>(p), reinterpret_cast<__m128d>(v));
      }
      return;
    }
#endif
    Store(p, v);
  }
  template <bool kL2>
  static V Term(V v) {
    if (kL2) return v * v;
    const IV magnitude = IV{} + std::numeric_limits<I>::max();  // every bit but the sign
    return reinterpret_cast<V>(reinterpret_cast<IV>(v) & magnitude);
  }
};

// The group of kLanes values a[i..i+kLanes) (+ b[..], streamed to out[..] when kAdd) into
// v.  All loads come before any store, so out may alias a or b; without kAdd, b and out are
// not touched (they may be null).
template <typename T, bool kAdd>
inline void LoadGroup(const T* a, const T* b, T* out, int64 i, typename Simd<T>::V* v) {
  using S = Simd<T>;
  for (int j = 0; j < S::kVectors; ++j) {
    v[j] = S::Load(a + i + j * S::kWidth);
    if (kAdd) v[j] += S::Load(b + i + j * S::kWidth);
  }
  if (kAdd) {
    for (int j = 0; j < S::kVectors; ++j) S::Stream(out + i + j * S::kWidth, v[j]);
  }
}

// The scalar version for the tail: a[i] (+ b[i], written to out[i] when kAdd).
template <typename T, bool kAdd>
inline T LoadOne(const T* a, const T* b, T* out, int64 i) {
  const T v = kAdd ? a[i] + b[i] : a[i];
  if (kAdd) out[i] = v;
  return v;
}

// Sum of Term over n values a[i] (+ b[i], written to out[i] when kAdd); out may alias a or b.
template <typename T, bool kL2, bool kAdd>
inline T RunSum(const T* a, const T* b, T* out, int64 n) {
  using S = Simd<T>;
  typename S::V lane[S::kVectors] = {};
  int64 i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    typename S::V v[S::kVectors];
    LoadGroup<T, kAdd>(a, b, out, i, v);
    for (int j = 0; j < S::kVectors; ++j) lane[j] += S::template Term<kL2>(v[j]);
  }
  T l[kLanes];
  std::memcpy(l, lane, sizeof(l));
  T tail = T(0);
  for (; i < n; ++i) {
    const T v = LoadOne<T, kAdd>(a, b, out, i);
    tail += Term<T, kL2>(v);
  }
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])) + tail;
}

// One row of [num_blocks] columns (inner == 1): partial[b] += Term(a[b] (+ b[b])).
template <typename T, bool kL2, bool kAdd>
inline void ColumnSums(const T* a, const T* b, T* out, T* partial, int64 n) {
  using S = Simd<T>;
  int64 i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    typename S::V v[S::kVectors];
    LoadGroup<T, kAdd>(a, b, out, i, v);
    for (int j = 0; j < S::kVectors; ++j) {
      T* p = partial + i + j * S::kWidth;
      S::Store(p, S::Load(p) + S::template Term<kL2>(v[j]));
    }
  }
  for (; i < n; ++i) {
    const T v = LoadOne<T, kAdd>(a, b, out, i);
    partial[i] += Term<T, kL2>(v);
  }
}

// Tiles: `chunks` row ranges of `rows` rows times `cols` block ranges of `span` blocks.
struct Tiling {
  int64 rows, chunks, span, cols;
};

// Row ranges beyond this many would make the per-range partial sums (chunks * num_blocks)
// approach the gradient's size: a wide layer (e.g. a [768, 50257] LM head, one block per
// column) gets at most kMaxChunks row ranges of more rows each.
constexpr int64 kMaxChunks = 16;

Tiling MakeTiling(int64 outer, int64 nb, int64 inner) {
  Tiling t;
  const int64 row = nb * inner;
  t.rows = std::min(outer, std::max<int64>(1, kTileElems / row));
  t.chunks = (outer + t.rows - 1) / t.rows;
  if (t.chunks > kMaxChunks) {
    t.rows = (outer + kMaxChunks - 1) / kMaxChunks;
    t.chunks = (outer + t.rows - 1) / t.rows;
  }
  t.span = row <= kTileElems ? nb : std::max<int64>(1, kTileElems / inner);
  t.cols = (nb + t.span - 1) / t.span;
  return t;
}

template <typename T, bool kL2, bool kAdd>
void ScoreTiles(OpKernelContext* ctx, const T* a, const T* b, T* out, T* scores, int64 outer,
                int64 nb, int64 inner) {
  const Tiling t = MakeTiling(outer, nb, inner);
  std::vector<T> partial_buf(t.chunks > 1 ? t.chunks * nb : 0, T(0));
  T* partial = t.chunks > 1 ? partial_buf.data() : scores;
  if (t.chunks == 1) std::fill(scores, scores + nb, T(0));
  const int64 row = nb * inner;
  auto tile = [&](int64 first, int64 last) {
    for (int64 id = first; id < last; ++id) {
      const int64 c = id / t.cols, j = id % t.cols;
      const int64 r0 = c * t.rows, r1 = std::min(outer, r0 + t.rows);
      const int64 b0 = j * t.span, b1 = std::min(nb, b0 + t.span);
      T* p = partial + c * nb;
      for (int64 r = r0; r < r1; ++r) {
        const int64 base = r * row;
        if (inner == 1) {
          ColumnSums<T, kL2, kAdd>(a + base + b0, kAdd ? b + base + b0 : nullptr,
                                   kAdd ? out + base + b0 : nullptr, p + b0, b1 - b0);
          continue;
        }
        for (int64 blk = b0; blk < b1; ++blk) {
          const int64 off = base + blk * inner;
          p[blk] += RunSum<T, kL2, kAdd>(a + off, kAdd ? b + off : nullptr,
                                         kAdd ? out + off : nullptr, inner);
        }
      }
    }
#if defined(__SSE2__)
    if (kAdd) _mm_sfence();
#endif
  };
  const int64 tiles = t.chunks * t.cols;
  const int64 tile_cost = std::min(outer, t.rows) * std::min(nb, t.span) * inner * 4;
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  if (tiles == 1) {
    tile(0, 1);
  } else {
    pool->ParallelFor(tiles, tile_cost, tile);
  }
  if (t.chunks > 1 || kL2) {
    auto finish = [&](int64 first, int64 last) {
      for (int64 blk = first; blk < last; ++blk) {
        T s = t.chunks > 1 ? partial[blk] : scores[blk];
        for (int64 c = 1; c < t.chunks; ++c) s += partial[c * nb + blk];
        scores[blk] = kL2 ? std::sqrt(s) : s;
      }
    };
    pool->ParallelFor(nb, t.chunks * 2 + 8, finish);
  }
}

class LayoutKernel : public OpKernel {
 public:
  explicit LayoutKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("outer", &outer_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_blocks", &nb_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("inner", &inner_));
  }

 protected:
  bool CheckSize(OpKernelContext* ctx, const Tensor& x, const char* name) {
    if (x.NumElements() == outer_ * nb_ * inner_) return true;
    ctx->CtxFailure(__FILE__, __LINE__,
                    InvalidArgument(name, " has ", x.NumElements(), " elements, the layout [",
                                    outer_, ", ", nb_, ", ", inner_, "] needs ",
                                    outer_ * nb_ * inner_));
    return false;
  }
  int64 outer_, nb_, inner_;
};

template <typename T, bool kAdd>
class ScoreOp : public LayoutKernel {
 public:
  explicit ScoreOp(OpKernelConstruction* ctx) : LayoutKernel(ctx) {
    std::string metric;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("metric", &metric));
    l2_ = metric == "l2";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    if (!CheckSize(ctx, a, kAdd ? "grad" : "x")) return;
    const T* b = nullptr;
    T* out = nullptr;
    int score_index = 0;
    if (kAdd) {
      const Tensor& r = ctx->input(1);
      OP_REQUIRES(ctx, a.shape() == r.shape(),
                  InvalidArgument("grad ", a.shape().DebugString(), " and residual ",
                                  r.shape().DebugString(), " differ in shape"));
      Tensor* acc = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0, 1}, 0, a.shape(), &acc));
      b = r.flat<T>().data();
      out = acc->flat<T>().data();
      score_index = 1;
    }
    Tensor* scores = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(score_index, TensorShape({nb_}), &scores));
    const T* ap = a.flat<T>().data();
    T* sp = scores->flat<T>().data();
    if (l2_) {
      ScoreTiles<T, true, kAdd>(ctx, ap, b, out, sp, outer_, nb_, inner_);
    } else {
      ScoreTiles<T, false, kAdd>(ctx, ap, b, out, sp, outer_, nb_, inner_);
    }
  }

 private:
  bool l2_;
};

template <typename T, typename Tidx>
class TakeBlocksOp : public LayoutKernel {
 public:
  explicit TakeBlocksOp(OpKernelConstruction* ctx) : LayoutKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& acc = ctx->input(0);
    const Tensor& ids_t = ctx->input(1);
    if (!CheckSize(ctx, acc, "acc")) return;
    OP_REQUIRES(ctx, ids_t.dims() == 1,
                InvalidArgument("ids must be a vector, got ", ids_t.shape().DebugString()));
    const int64 k = ids_t.NumElements();
    const auto ids = ids_t.flat<Tidx>();
    for (int64 i = 0; i < k; ++i) {
      OP_REQUIRES(ctx, ids(i) >= 0 && ids(i) < nb_,
                  InvalidArgument("ids[", i, "] = ", static_cast<int64>(ids(i)),
                                  " is not in [0, ", nb_, ")"));
    }
    const int64 bs = outer_ * inner_;
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k, bs}), &values));
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, acc.shape(), &residual));
    const T* src = acc.flat<T>().data();
    T* res = residual->flat<T>().data();
    T* val = values->flat<T>().data();
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64 row = nb_ * inner_;
    const size_t run = inner_ * sizeof(T);
    // Gather every block before zeroing any: res may be src's buffer, ids may repeat.
    auto gather = [&](int64 first, int64 last) {
      for (int64 i = first; i < last; ++i) {
        const int64 off = static_cast<int64>(ids(i)) * inner_;
        for (int64 o = 0; o < outer_; ++o) {
          std::memcpy(val + i * bs + o * inner_, src + o * row + off, run);
        }
      }
    };
    if (k * bs > kTileElems) {
      pool->ParallelFor(k, bs * 2, gather);
    } else {
      gather(0, k);
    }
    if (res != src) {  // not forwarded: copy acc first
      const int64 n = acc.NumElements();
      pool->ParallelFor(n, 2, [&](int64 first, int64 last) {
        std::memcpy(res + first, src + first, (last - first) * sizeof(T));
      });
    }
    for (int64 i = 0; i < k; ++i) {
      const int64 off = static_cast<int64>(ids(i)) * inner_;
      for (int64 o = 0; o < outer_; ++o) std::memset(res + o * row + off, 0, run);
    }
  }
};

#define REGISTER_SCORES(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("BlockAccumulateScore").Device(DEVICE_CPU).TypeConstraint<T>("T"),              \
      ScoreOp<T, true>);                                                                    \
  REGISTER_KERNEL_BUILDER(Name("BlockScores").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
                          ScoreOp<T, false>);                                               \
  REGISTER_KERNEL_BUILDER(Name("TakeBlocks")                                                \
                              .Device(DEVICE_CPU)                                           \
                              .TypeConstraint<T>("T")                                       \
                              .TypeConstraint<std::int32_t>("Tidx"),                        \
                          TakeBlocksOp<T, std::int32_t>);                                   \
  REGISTER_KERNEL_BUILDER(Name("TakeBlocks")                                                \
                              .Device(DEVICE_CPU)                                           \
                              .TypeConstraint<T>("T")                                       \
                              .TypeConstraint<std::int64_t>("Tidx"),                        \
                          TakeBlocksOp<T, std::int64_t>);

REGISTER_SCORES(float);
REGISTER_SCORES(double);

}  // namespace tf_blocksparse
