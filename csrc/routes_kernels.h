// Routing packing kernels: declarations shared by the binding and the kernel files.
//
// Shapes (N source tokens, L source layers, K = top-k; n router tokens, l local layers):
//   gather  (replay): ids [N, L, K] uint8|int16, valid [N, L] bool,
//                     token_index [n] int32 (-1 = padding), layer_index [l] int32
//                     -> expert_ids [l, n, K] int64, a row of -1 where there is no route.
//   scatter (record): expert_ids [l, n, K] int64|int32 (a row of -1 = nothing recorded)
//                     -> writes rows of out_ids [N, L, K] uint8|int16 and out_valid [N, L];
//                     rows this rank does not see are left untouched.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace r3 {

// Checked before any write, so a bad plan leaves the output untouched.
inline void check_plan_bounds(const int32_t* tok, int64_t n, const int32_t* lay, int64_t l, int64_t num_tokens,
                              int64_t num_layers) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(tok[i] >= -1 && tok[i] < num_tokens, "token_index[", i, "] = ", tok[i], " outside [-1, ",
                num_tokens, ")");
  for (int64_t i = 0; i < l; ++i)
    TORCH_CHECK(lay[i] >= 0 && lay[i] < num_layers, "layer_index[", i, "] = ", lay[i], " outside [0, ",
                num_layers, ")");
}

void gather_routes_cpu(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                       const at::Tensor& layer_index, at::Tensor& out);
void scatter_routes_cpu(const at::Tensor& expert_ids, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out_ids, at::Tensor& out_valid);

#ifdef R3_WITH_CUDA
void gather_routes_cuda(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out);
void scatter_routes_cuda(const at::Tensor& expert_ids, const at::Tensor& token_index,
                         const at::Tensor& layer_index, at::Tensor& out_ids, at::Tensor& out_valid);
#endif

}  // namespace r3
