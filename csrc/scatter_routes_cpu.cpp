// CPU scatter (record): this rank's [layers, tokens, topk] rows back into the global compact layout.
#include <ATen/Parallel.h>

#include "routes_kernels.h"

namespace r3 {

template <typename in_t, typename id_t>
static void scatter_rows(const at::Tensor& expert_ids, const at::Tensor& token_index, const at::Tensor& layer_index,
                         at::Tensor& out_ids, at::Tensor& out_recorded) {
  const int64_t num_dst_tokens = out_ids.size(0), num_dst_layers = out_ids.size(1), k = out_ids.size(2);
  const int64_t n = token_index.size(0), rows = layer_index.size(0) * n;
  const in_t* src = expert_ids.data_ptr<in_t>();
  const int32_t* tok = token_index.data_ptr<int32_t>();
  const int32_t* lay = layer_index.data_ptr<int32_t>();
  id_t* dst = out_ids.data_ptr<id_t>();
  bool* done = out_recorded.data_ptr<bool>();
  // Distinct rows of one plan write distinct destinations, so threads never collide.
  at::parallel_for(0, rows, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = tok[row % n], l = lay[row / n];
      if (t < 0) continue;
      const in_t* i = src + row * k;
      bool recorded = false;
      for (int64_t j = 0; j < k; ++j) recorded |= (i[j] != -1);
      if (!recorded) continue;
      const int64_t d = t * num_dst_layers + l;
      for (int64_t j = 0; j < k; ++j) dst[d * k + j] = static_cast<id_t>(i[j]);
      done[d] = true;
    }
  });
}

template <typename in_t>
static void scatter_dispatch_out(const at::Tensor& e, const at::Tensor& t, const at::Tensor& l, at::Tensor& ids,
                                 at::Tensor& recorded) {
  if (ids.scalar_type() == at::kByte) {
    scatter_rows<in_t, uint8_t>(e, t, l, ids, recorded);
  } else {
    scatter_rows<in_t, int16_t>(e, t, l, ids, recorded);
  }
}

void scatter_routes_cpu(const at::Tensor& expert_ids, const at::Tensor& token_index, const at::Tensor& layer_index,
                        at::Tensor& out_ids, at::Tensor& out_recorded) {
  if (expert_ids.scalar_type() == at::kLong) {
    scatter_dispatch_out<int64_t>(expert_ids, token_index, layer_index, out_ids, out_recorded);
  } else {
    scatter_dispatch_out<int32_t>(expert_ids, token_index, layer_index, out_ids, out_recorded);
  }
}

}  // namespace r3
