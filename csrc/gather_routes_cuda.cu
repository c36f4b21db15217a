// CUDA gather (replay): compact uint8/int16 routes -> this rank's expert_ids [layers, tokens, topk] int64.
//
// Memory-bound by design: each thread produces VEC = 2 consecutive outputs of one (layer, token) row
// with one load of 2 compact ids and one 16-byte store, so a warp writes 512 contiguous bytes per
// instruction (full coalescing; 16 bytes is the widest store on sm_90). The source row comes from the plan's precomputed int32 index maps, which are
// tiny and stay in cache; an invalid source row or a padding token (-1) yields -1.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "routes_kernels.h"

namespace r3 {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename id_t, typename idx_t, int VEC>
__global__ void gather_routes_kernel(const id_t* __restrict__ ids, const bool* __restrict__ valid,
                                     const int32_t* __restrict__ token_index,
                                     const int32_t* __restrict__ layer_index, int64_t* __restrict__ out,
                                     idx_t num_local_tokens, idx_t topk, idx_t num_src_layers, idx_t num_vecs) {
  const idx_t stride = static_cast<idx_t>(gridDim.x) * blockDim.x;
  for (idx_t v = static_cast<idx_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < num_vecs; v += stride) {
    const idx_t e = v * VEC;
    const idx_t row = e / topk;
    const idx_t j = e - row * topk;
    const idx_t layer = row / num_local_tokens;
    const idx_t token = row - layer * num_local_tokens;
    const int32_t src_token = __ldg(token_index + token);
    Vec<int64_t, VEC> result;
    bool routed = false;
    idx_t src_row = 0;
    if (src_token >= 0) {
      src_row = static_cast<idx_t>(src_token) * num_src_layers + __ldg(layer_index + layer);
      routed = valid[src_row];
    }
    if (routed) {
      const Vec<id_t, VEC> packed = *reinterpret_cast<const Vec<id_t, VEC>*>(ids + src_row * topk + j);
#pragma unroll
      for (int i = 0; i < VEC; ++i) result.v[i] = static_cast<int64_t>(packed.v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) result.v[i] = -1;
    }
    *reinterpret_cast<Vec<int64_t, VEC>*>(out + e) = result;
  }
}

template <typename id_t, typename idx_t, int VEC>
void launch(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
            const at::Tensor& layer_index, at::Tensor& out) {
  constexpr int threads = 256;
  const int64_t num_vecs = out.numel() / VEC;
  const int64_t blocks = std::min<int64_t>((num_vecs + threads - 1) / threads, int64_t{1} << 30);
  gather_routes_kernel<id_t, idx_t, VEC><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ids.data_ptr<id_t>(), valid.data_ptr<bool>(), token_index.data_ptr<int32_t>(),
      layer_index.data_ptr<int32_t>(), out.data_ptr<int64_t>(), static_cast<idx_t>(token_index.size(0)),
      static_cast<idx_t>(ids.size(2)), static_cast<idx_t>(ids.size(1)), static_cast<idx_t>(num_vecs));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename id_t, typename idx_t>
void launch_vec(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                const at::Tensor& layer_index, at::Tensor& out) {
  const int64_t k = ids.size(2);
  auto aligned = [&](int vec) {
    return k % vec == 0 && reinterpret_cast<uintptr_t>(ids.data_ptr()) % (sizeof(id_t) * vec) == 0 &&
           reinterpret_cast<uintptr_t>(out.data_ptr()) % (sizeof(int64_t) * vec) == 0;
  };
  if (aligned(2)) {
    launch<id_t, idx_t, 2>(ids, valid, token_index, layer_index, out);
  } else {
    launch<id_t, idx_t, 1>(ids, valid, token_index, layer_index, out);
  }
}

template <typename id_t>
void launch_index(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                  const at::Tensor& layer_index, at::Tensor& out) {
  // 32-bit index math is markedly cheaper; use it whenever every offset fits.
  constexpr int64_t limit = (int64_t{1} << 31) - 1;
  if (out.numel() < limit && ids.numel() < limit) {
    launch_vec<id_t, uint32_t>(ids, valid, token_index, layer_index, out);
  } else {
    launch_vec<id_t, int64_t>(ids, valid, token_index, layer_index, out);
  }
}

}  // namespace

void gather_routes_cuda(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(ids.device());
  if (ids.scalar_type() == at::kByte) {
    launch_index<uint8_t>(ids, valid, token_index, layer_index, out);
  } else {
    launch_index<int16_t>(ids, valid, token_index, layer_index, out);
  }
}

}  // namespace r3
