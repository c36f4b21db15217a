// CPU gather (replay): one (layer, token) row of top-k ids per inner step, rows split over threads.
#include <ATen/Parallel.h>

#include "routes_kernels.h"

namespace r3 {

template <typename id_t>
static void gather_rows(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out) {
  const int64_t num_src_layers = ids.size(1), k = ids.size(2);
  const int64_t n = token_index.size(0), rows = layer_index.size(0) * n;
  const id_t* src = ids.data_ptr<id_t>();
  const bool* ok = valid.data_ptr<bool>();
  const int32_t* tok = token_index.data_ptr<int32_t>();
  const int32_t* lay = layer_index.data_ptr<int32_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 2048, [&](int64_t begin, int64_t end) {
    int64_t layer = begin / n, token = begin % n;  // walk rows in order; divide once per chunk
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = tok[token];
      int64_t* o = dst + row * k;
      if (t < 0 || !ok[t]) {
        for (int64_t j = 0; j < k; ++j) o[j] = -1;
      } else {
        const id_t* i = src + (t * num_src_layers + lay[layer]) * k;
        for (int64_t j = 0; j < k; ++j) o[j] = static_cast<int64_t>(i[j]);
      }
      if (++token == n) {
        token = 0;
        ++layer;
      }
    }
  });
}

void gather_routes_cpu(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                       const at::Tensor& layer_index, at::Tensor& out) {
  if (ids.scalar_type() == at::kByte) {
    gather_rows<uint8_t>(ids, valid, token_index, layer_index, out);
  } else {
    gather_rows<int16_t>(ids, valid, token_index, layer_index, out);
  }
}

}  // namespace r3
