// Routing packing kernels: declarations shared by the binding and the kernel files.
//
// Shapes (N source tokens, L source layers, K = top-k; n router tokens, l local layers):
//   gather  (replay): ids [N, L, K] uint8|int16, valid [N] bool (per source token),
//                     token_index [n] int32 (-1 = padding), layer_index [l] int32
//                     -> expert_ids [l, n, K] int64, a row of -1 where there is no route.
//   scatter (record): expert_ids [l, n, K] int64|int32 (a row of -1 = nothing recorded)
//                     -> writes rows of out_ids [N, L, K] uint8|int16 and sets out_recorded [N, L];
//                     rows this rank does not see are left untouched.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace r3 {

// The kernels trust the plan: the binding checks index bounds before any write.
void gather_routes_cpu(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                       const at::Tensor& layer_index, at::Tensor& out);
void scatter_routes_cpu(const at::Tensor& expert_ids, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out_ids, at::Tensor& out_recorded);

// JSON nested integer lists from `start` of `text` -> (flat int32 values, shape, offset after the closing ']').
// Raises (c10::Error) on anything but strict, rectangular, non-empty lists of int32 integers.
std::tuple<at::Tensor, std::vector<int64_t>, int64_t> parse_int_lists(const uint8_t* text, int64_t size,
                                                                      int64_t start);
// vLLM's JSON per-position log-probs at text[start:] -> (entry token ids int64, entry log-probs float64,
// entries per position int64, offset after the list); strict (logprob_positions_cpu.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> parse_logprob_positions(const uint8_t* text, int64_t size,
                                                                                 int64_t start);

#ifdef R3_WITH_CUDA
void gather_routes_cuda(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out);
void scatter_routes_cuda(const at::Tensor& expert_ids, const at::Tensor& token_index,
                         const at::Tensor& layer_index, at::Tensor& out_ids, at::Tensor& out_recorded);
#endif

}  // namespace r3
