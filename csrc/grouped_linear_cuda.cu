// CUDA fp32 grouped linear layers: rows sorted by group, group ends on the device, no host sync.
//
// torch's fp32 grouped GEMM on CUDA (torch._grouped_mm) loops over the groups on the host, so it reads
// the group ends back; these kernels read them on the device. A block of the row kernel finds its
// group and its 64 rows of it by walking the ends; a block of the weight-gradient kernel owns a 64 x 64
// tile of one group's gradient and sums over that group's rows. Plain fp32 FMAs: the results match
// per-group matmuls up to the order of the sums, no TF32.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "grouped_linear_kernels.h"

namespace r3 {
namespace {

constexpr int kTile = 64;  // rows and columns of a block's output tile
constexpr int kStep = 16;  // the reduction dimension per shared-memory step
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each

// c[t, :] = a[t, :] . B_g for each row t of group g, B_g(k, n) = b[g * b_group + k * b_k + n * b_n].
__global__ void __launch_bounds__(kThreads)
    grouped_rows_kernel(const float* __restrict__ a, const float* __restrict__ b, const int32_t* __restrict__ ends,
                        float* __restrict__ c, int num_groups, int64_t inner, int64_t cols, int64_t b_group,
                        int64_t b_k, int64_t b_n) {
  // This block's group and first row: the blocks of group g follow those of groups < g.
  int64_t tile = blockIdx.x, start = 0;
  int g = 0;
  for (; g < num_groups; ++g) {
    const int64_t end = ends[g];
    const int64_t tiles = (end - start + kTile - 1) / kTile;
    if (tile < tiles) break;
    tile -= tiles;
    start = end;
  }
  if (g == num_groups) return;
  const int64_t row0 = start + tile * kTile, row_end = ends[g];
  const int64_t col0 = int64_t{blockIdx.y} * kTile;
  const float* bg = b + g * b_group;

  __shared__ float as[kStep][kTile];
  __shared__ float bs[kStep][kTile];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < inner; k0 += kStep) {
    for (int i = threadIdx.x; i < kStep * kTile; i += kThreads) {
      const int r = i / kStep, kk = i % kStep;  // a: consecutive threads read along a row
      const int64_t row = row0 + r, k = k0 + kk;
      as[kk][r] = row < row_end && k < inner ? a[row * inner + k] : 0.f;
      const int n = i % kTile, kb = i / kTile;
      const int64_t col = col0 + n, kr = k0 + kb;
      bs[kb][n] = col < cols && kr < inner ? bg[kr * b_k + col * b_n] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kStep; ++kk) {
      float ar[4], br[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) ar[i] = as[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) br[j] = bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + ty * 4 + i;
    if (row >= row_end) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + tx * 4 + j;
      if (col < cols) c[row * cols + col] = acc[i][j];
    }
  }
}

// dw[g] = grad_g^T . x_g over the rows of group g: dw [groups, out_features, in_features].
__global__ void __launch_bounds__(kThreads)
    grouped_weight_grad_kernel(const float* __restrict__ grad, const float* __restrict__ x,
                               const int32_t* __restrict__ ends, float* __restrict__ dw, int64_t out_features,
                               int64_t in_features) {
  const int g = blockIdx.z;
  const int64_t start = g == 0 ? 0 : ends[g - 1], end = ends[g];
  const int64_t n0 = int64_t{blockIdx.y} * kTile, k0 = int64_t{blockIdx.x} * kTile;
  __shared__ float gs[kStep][kTile];
  __shared__ float xs[kStep][kTile];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t t0 = start; t0 < end; t0 += kStep) {
    for (int i = threadIdx.x; i < kStep * kTile; i += kThreads) {
      const int tt = i / kTile, j = i % kTile;
      const int64_t t = t0 + tt;
      gs[tt][j] = t < end && n0 + j < out_features ? grad[t * out_features + n0 + j] : 0.f;
      xs[tt][j] = t < end && k0 + j < in_features ? x[t * in_features + k0 + j] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int tt = 0; tt < kStep; ++tt) {
      float gr[4], xr[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) gr[i] = gs[tt][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) xr[j] = xs[tt][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(gr[i], xr[j], acc[i][j]);
    }
    __syncthreads();
  }
  float* out = dw + g * out_features * in_features;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t n = n0 + ty * 4 + i;
    if (n >= out_features) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + tx * 4 + j;
      if (k < in_features) out[n * in_features + k] = acc[i][j];
    }
  }
}

void launch_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends, at::Tensor& c, int64_t inner,
                 int64_t cols, int64_t b_k, int64_t b_n) {
  const int64_t rows = a.size(0), groups = ends.size(0);
  if (rows == 0 || cols == 0) return;
  const int64_t row_tiles = (rows + kTile - 1) / kTile + groups;  // a bound on the sum over groups
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  TORCH_CHECK(row_tiles < (int64_t{1} << 31) && col_tiles <= 65535, "grouped linear: too large for one launch");
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  grouped_rows_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), ends.data_ptr<int32_t>(), c.data_ptr<float>(),
      static_cast<int>(groups), inner, cols, b.size(1) * b.size(2), b_k, b_n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void grouped_linear_forward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends,
                                 at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  // out = x . W_g^T: B_g(k, n) = weight[g, n, k].
  launch_rows(x, weight, ends, out, weight.size(2), weight.size(1), 1, weight.size(2));
}

void grouped_linear_grad_input_cuda(const at::Tensor& grad, const at::Tensor& weight, const at::Tensor& ends,
                                    at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(grad.device());
  // out = grad . W_g: B_g(k, n) = weight[g, k, n].
  launch_rows(grad, weight, ends, out, weight.size(1), weight.size(2), weight.size(2), 1);
}

void grouped_linear_grad_weight_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& ends,
                                     at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t groups = out.size(0), out_features = out.size(1), in_features = out.size(2);
  if (out.numel() == 0) return;
  TORCH_CHECK(groups <= 65535 && (out_features + kTile - 1) / kTile <= 65535,
              "grouped linear: too many groups or output features for one launch");
  const dim3 grid(static_cast<unsigned>((in_features + kTile - 1) / kTile),
                  static_cast<unsigned>((out_features + kTile - 1) / kTile), static_cast<unsigned>(groups));
  grouped_weight_grad_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      grad.data_ptr<float>(), x.data_ptr<float>(), ends.data_ptr<int32_t>(), out.data_ptr<float>(), out_features,
      in_features);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace r3
