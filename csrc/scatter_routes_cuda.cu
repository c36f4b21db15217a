// CUDA scatter (record): this rank's recorded [layers, tokens, topk] rows -> the global compact layout.
// One thread per (layer, token) row; rows of one plan have distinct destinations, so no atomics.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "routes_kernels.h"

namespace r3 {
namespace {

template <typename in_t, typename id_t>
__global__ void scatter_routes_kernel(const in_t* __restrict__ expert_ids, const int32_t* __restrict__ token_index,
                                      const int32_t* __restrict__ layer_index, id_t* __restrict__ out_ids,
                                      bool* __restrict__ out_recorded, int64_t num_local_tokens, int64_t topk,
                                      int64_t num_dst_layers, int64_t num_rows) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < num_rows; row += stride) {
    const int64_t layer = row / num_local_tokens;
    const int32_t dst_token = __ldg(token_index + (row - layer * num_local_tokens));
    if (dst_token < 0) continue;
    const in_t* src = expert_ids + row * topk;
    bool recorded = false;
    for (int64_t j = 0; j < topk; ++j) recorded |= (src[j] != -1);
    if (!recorded) continue;
    const int64_t dst = static_cast<int64_t>(dst_token) * num_dst_layers + __ldg(layer_index + layer);
    for (int64_t j = 0; j < topk; ++j) out_ids[dst * topk + j] = static_cast<id_t>(src[j]);
    out_recorded[dst] = true;
  }
}

template <typename in_t, typename id_t>
void launch(const at::Tensor& expert_ids, const at::Tensor& token_index, const at::Tensor& layer_index,
            at::Tensor& out_ids, at::Tensor& out_recorded) {
  constexpr int threads = 256;
  const int64_t rows = layer_index.size(0) * token_index.size(0);
  const int64_t blocks = std::min<int64_t>((rows + threads - 1) / threads, int64_t{1} << 30);
  scatter_routes_kernel<in_t, id_t><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      expert_ids.data_ptr<in_t>(), token_index.data_ptr<int32_t>(), layer_index.data_ptr<int32_t>(),
      out_ids.data_ptr<id_t>(), out_recorded.data_ptr<bool>(), token_index.size(0), out_ids.size(2),
      out_ids.size(1), rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename in_t>
void launch_out(const at::Tensor& e, const at::Tensor& t, const at::Tensor& l, at::Tensor& ids, at::Tensor& recorded) {
  if (ids.scalar_type() == at::kByte) {
    launch<in_t, uint8_t>(e, t, l, ids, recorded);
  } else {
    launch<in_t, int16_t>(e, t, l, ids, recorded);
  }
}

}  // namespace

void scatter_routes_cuda(const at::Tensor& expert_ids, const at::Tensor& token_index, const at::Tensor& layer_index,
                         at::Tensor& out_ids, at::Tensor& out_recorded) {
  const c10::cuda::CUDAGuard guard(expert_ids.device());
  if (expert_ids.scalar_type() == at::kLong) {
    launch_out<int64_t>(expert_ids, token_index, layer_index, out_ids, out_recorded);
  } else {
    launch_out<int32_t>(expert_ids, token_index, layer_index, out_ids, out_recorded);
  }
}

}  // namespace r3
