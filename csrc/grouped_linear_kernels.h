// fp32 grouped linear kernels (CUDA): declarations shared by the binding and the kernel file.
//
// Rows of x [T, in] are sorted by group; ends [G] int32 on the device holds where each group's rows end
// (torch._grouped_mm's `offs`). weight [G, out, in] is every group's Linear weight.
//   forward:      out [T, out] = x . weight[g]^T for the rows of group g
//   grad input:   out [T, in]  = grad . weight[g]
//   grad weight:  out [G, out, in], out[g] = grad_g^T . x_g (zero for a group without rows)
// Rows after the last end are not written.
#pragma once

#include <ATen/core/Tensor.h>

namespace r3 {

#ifdef R3_WITH_CUDA
void grouped_linear_forward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends,
                                 at::Tensor& out);
void grouped_linear_grad_input_cuda(const at::Tensor& grad, const at::Tensor& weight, const at::Tensor& ends,
                                    at::Tensor& out);
void grouped_linear_grad_weight_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& ends,
                                     at::Tensor& out);
#endif

}  // namespace r3
