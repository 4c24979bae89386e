// A mixture-of-experts layer's routed experts around a kernel that runs the products of one
// expert's rows (experts_f32.cpp on AVX2, experts_bf16.cpp's dot products and
// experts_amx.cpp's tiles in bfloat16): the (token, expert) pairs sorted by expert (stably, as
// torch.sort(stable=True) sorts them), each expert's tokens copied into a buffer of whole tiles
// of 16 rows, its SwiGLU (the gate/up product and activation, then the down product, in tasks
// of whole experts or of parts of their columns), and each token's k output rows times their
// routing weights, summed. One pass where torch's version is a sort, a gather, two products,
// the activation, a product by the weights, a scatter and a sum, each a pass over memory (at
// 4,096 tokens the scatter and sum alone took longer than the experts' products).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace conveyor {

constexpr int64_t kTileRows = 16;

inline int64_t whole_tiles(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

// How many tasks to cut each expert's `strips` of columns into: whole experts where there
// are several for each thread (each thread then reads an expert's weights alone, front to
// back), else parts of them, so that a model of few experts (Mixtral: 8) keeps every core busy.
inline int64_t parts_of(int64_t strips, int64_t experts, int threads) {
  const int64_t wanted = (4 * threads + experts - 1) / experts;
  return std::max<int64_t>(1, std::min(wanted, strips));
}

// Kernel: its Element (the dtype's storage), Weight (the weights' storage: Element, or bfloat16
// values for float32's) and kColumns (the columns a task's share is a multiple of); begin()
// and end() around a thread's products; product(a, lda, b, n_dim, c, ldc, rows, padded, k_dim,
// n0, n1): c[m, n] = sum_k a[m, k] * b[k, n] for m < rows and n in
// [n0, n1), a [padded, k_dim] rows `lda` apart (padded: rows in whole tiles, those past `rows`
// zero, read or not, their results dropped), b one expert's weight of n_dim columns in the
// kernel's layout; silu_mul(h, rows, inter, c0, c1): in place over columns [c0, c1) of each
// row's first `inter`, SiLU(gate) * up with up `inter` columns further; combine(outs, place,
// weights, weights_f32, first, k, hidden, out): one token's output row, the sum of its k pairs'
// rows of outs (at place[first + j]) times their weights.
//
// x [tokens, hidden]; top_index [tokens, k]; weights [tokens, k], float32 where weights_f32,
// else bfloat16; gate_up [E, hidden, 2 * inter] and down [E, inter, hidden] (each expert's
// weight in the kernel's layout); outs [tokens * k, hidden] scratch (each pair's expert output,
// in expert order); result [tokens, hidden].
template <class Kernel, class Element = typename Kernel::Element,
          class Weight = typename Kernel::Weight>
void routed_experts(const Element* x, const int64_t* top_index, const void* weights,
                    bool weights_f32, const Weight* gate_up, const Weight* down, Element* outs,
                    Element* result, int64_t tokens, int64_t k, int64_t experts, int64_t hidden,
                    int64_t inter, int threads) {
  const int64_t pairs = tokens * k;
  // a counting sort of the pairs by expert: order[i] the pair at place i, place[pair] its place
  std::vector<int64_t> starts(experts + 1, 0), order(pairs), place(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++starts[top_index[p] + 1];
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    place[p] = next[top_index[p]]++;
    order[place[p]] = p;
  }
  // the experts that have rows, where each one's rows start in whole tiles, and the most tiles
  std::vector<int64_t> active, padded_start(experts + 1, 0);
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = starts[e + 1] - starts[e];
    if (n > 0) active.push_back(e);
    padded_start[e + 1] = padded_start[e] + whole_tiles(n);
    most = std::max(most, whole_tiles(n));
  }
  const int64_t count = static_cast<int64_t>(active.size());
  constexpr int64_t width = Kernel::kColumns;
  const bool cuttable = inter % width == 0 && hidden % width == 0;
  const int64_t up_parts = cuttable ? parts_of(inter / width, count, threads) : 1;
  const int64_t down_parts = cuttable ? parts_of(hidden / width, count, threads) : 1;
  const bool whole = up_parts == 1 && down_parts == 1;
  // each expert's tokens into `rows`, the rest of its tiles zero
  auto gather = [&](int64_t e, Element* rows) {
    const int64_t n = starts[e + 1] - starts[e];
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(rows + r * hidden, x + order[starts[e] + r] / k * hidden,
                  hidden * sizeof(Element));
    std::memset(rows + n * hidden, 0, (whole_tiles(n) - n) * hidden * sizeof(Element));
  };
  // gate and up of expert e's columns [c0, c1) of its `inter` into h, and SiLU(gate) * up
  auto up = [&](Kernel& kernel, int64_t e, const Element* rows, Element* h, int64_t c0,
                int64_t c1) {
    const int64_t n = starts[e + 1] - starts[e], padded = whole_tiles(n);
    const Weight* w = gate_up + e * hidden * 2 * inter;
    if (c0 == 0 && c1 == inter) {  // all of gate and up: one product (inter need not be cut)
      kernel.product(rows, hidden, w, 2 * inter, h, 2 * inter, n, padded, hidden, 0, 2 * inter);
    } else {
      kernel.product(rows, hidden, w, 2 * inter, h, 2 * inter, n, padded, hidden, c0, c1);
      kernel.product(rows, hidden, w, 2 * inter, h, 2 * inter, n, padded, hidden, inter + c0,
                     inter + c1);
    }
    kernel.silu_mul(h, n, inter, c0, c1);
  };
  // the down product of expert e's output columns [c0, c1)
  auto down_part = [&](Kernel& kernel, int64_t e, const Element* h, int64_t c0, int64_t c1) {
    const int64_t n = starts[e + 1] - starts[e];
    kernel.product(h, 2 * inter, down + e * inter * hidden, hidden, outs + starts[e] * hidden,
                   hidden, n, whole_tiles(n), inter, c0, c1);
  };
  // split: every expert's rows and activations at once, their tasks spread over the threads
  std::unique_ptr<Element[]> a_all, h_all;
  if (!whole) {
    a_all.reset(new Element[padded_start[experts] * hidden]);
    h_all.reset(new Element[padded_start[experts] * 2 * inter]);
  }
#pragma omp parallel num_threads(threads)
  {
    Kernel kernel;
    kernel.begin();
    if (whole) {  // one expert a task, its rows and activations in the thread's cache
      std::unique_ptr<Element[]> rows(new Element[most * hidden]);
      std::unique_ptr<Element[]> h(new Element[most * 2 * inter]);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < count; ++i) {
        gather(active[i], rows.get());
        up(kernel, active[i], rows.get(), h.get(), 0, inter);
        down_part(kernel, active[i], h.get(), 0, hidden);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < count; ++i)
        gather(active[i], a_all.get() + padded_start[active[i]] * hidden);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < count * up_parts; ++task) {
        const int64_t e = active[task / up_parts], part = task % up_parts;
        const int64_t strips = inter / width;
        up(kernel, e, a_all.get() + padded_start[e] * hidden,
           h_all.get() + padded_start[e] * 2 * inter, part * strips / up_parts * width,
           (part + 1) * strips / up_parts * width);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < count * down_parts; ++task) {
        const int64_t e = active[task / down_parts], part = task % down_parts;
        const int64_t strips = hidden / width;
        down_part(kernel, e, h_all.get() + padded_start[e] * 2 * inter,
                  part * strips / down_parts * width, (part + 1) * strips / down_parts * width);
      }
    }
    kernel.end();
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t)
      Kernel::combine(outs, place.data(), weights, weights_f32, t * k, k, hidden,
                      result + t * hidden);
  }
}

}  // namespace conveyor
