// Writing a step's keys and values into their cache slots, for the CPU attention kernels of each
// dtype: token t's heads go to block slots[t] / 16, offset slots[t] % 16.
#pragma once

#include <cstdint>
#include <cstring>

namespace conveyor {

// key/value rows are [kv_heads, head_dim], `key_stride` and `value_stride` elements apart;
// caches [blocks, kv_heads, 16, head_dim]. One copy a row and head, where index_put scatters:
// 16 tokens a task, head by head, so that a prompt's consecutive slots are written front to
// back (a head's rows of a block are contiguous), on `threads` threads.
template <class T>
void write_kv(const T* key, int64_t key_stride, const T* value, int64_t value_stride,
              const int64_t* slots, T* k_cache, T* v_cache, int64_t tokens, int64_t kv_heads,
              int64_t head_dim, int threads) {
  constexpr int64_t kBlock = 16;
  const size_t bytes = static_cast<size_t>(head_dim) * sizeof(T);
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens > kBlock)
  for (int64_t t0 = 0; t0 < tokens; t0 += kBlock) {
    const int64_t end = t0 + kBlock < tokens ? t0 + kBlock : tokens;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t t = t0; t < end; ++t) {
        const int64_t block = slots[t] / kBlock, offset = slots[t] % kBlock;
        const int64_t at = ((block * kv_heads + h) * kBlock + offset) * head_dim;
        std::memcpy(k_cache + at, key + t * key_stride + h * head_dim, bytes);
        std::memcpy(v_cache + at, value + t * value_stride + h * head_dim, bytes);
      }
  }
}

}  // namespace conveyor
