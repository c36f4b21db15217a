// CUDA gather (replay): compact uint8/int16 routes -> this rank's expert_ids [layers, tokens, topk] int64.
//
// Memory-bound by design. A block owns a tile of kTileTokens consecutive router tokens and up to
// kTileLayers local layers. It walks the tile layer by layer; within a layer, consecutive threads produce
// consecutive pairs of outputs (one load of two compact ids, one 16-byte store), so a warp writes 512
// contiguous bytes per store. A source token's ids for all layers share a few 32-byte sectors; because one
// block walks all of a tile's layers, those sectors come from DRAM about once and then from cache, instead
// of once per layer. The source row comes from the plan's int32 index maps; padding (-1) and invalid rows give -1.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "routes_kernels.h"

namespace r3 {
namespace {

constexpr uint32_t kTileTokens = 64;
constexpr uint32_t kTileLayers = 8;
constexpr int kThreads = 256;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename id_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    gather_routes_kernel(const id_t* __restrict__ ids, const bool* __restrict__ valid,
                         const int32_t* __restrict__ token_index, const int32_t* __restrict__ layer_index,
                         int64_t* __restrict__ out, uint32_t num_local_tokens, uint32_t num_local_layers,
                         uint32_t topk, uint32_t num_src_layers) {
  const uint32_t token0 = blockIdx.x * kTileTokens;
  const uint32_t layer0 = blockIdx.y * kTileLayers;
  const uint32_t tile_tokens = min(kTileTokens, num_local_tokens - token0);
  const uint32_t tile_layers = min(kTileLayers, num_local_layers - layer0);
  const uint32_t units_per_layer = tile_tokens * topk / VEC;  // VEC divides topk
  const uint32_t units = units_per_layer * tile_layers;
  for (uint32_t u = threadIdx.x; u < units; u += kThreads) {
    const uint32_t l = u / units_per_layer;
    const uint32_t e = (u - l * units_per_layer) * VEC;
    const uint32_t t = e / topk;
    const uint32_t j = e - t * topk;
    const uint32_t layer = layer0 + l;
    const int32_t src_token = __ldg(token_index + token0 + t);
    Vec<int64_t, VEC> result;
#pragma unroll
    for (int i = 0; i < VEC; ++i) result.v[i] = -1;
    if (src_token >= 0) {
      const int64_t src_row = static_cast<int64_t>(src_token) * num_src_layers + __ldg(layer_index + layer);
      // Both loads are issued before either is waited on: the ids of an invalid row are in bounds, just unused.
      const Vec<id_t, VEC> packed = *reinterpret_cast<const Vec<id_t, VEC>*>(ids + src_row * topk + j);
      if (valid[src_row]) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) result.v[i] = static_cast<int64_t>(packed.v[i]);
      }
    }
    const int64_t dst = (static_cast<int64_t>(layer) * num_local_tokens + token0 + t) * topk + j;
    *reinterpret_cast<Vec<int64_t, VEC>*>(out + dst) = result;
  }
}

template <typename id_t, int VEC>
void launch(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
            const at::Tensor& layer_index, at::Tensor& out) {
  const int64_t n = token_index.size(0), layers = layer_index.size(0);
  TORCH_CHECK(n < (int64_t{1} << 31) && layers <= int64_t{65535} * kTileLayers,
              "too many local tokens or layers for one launch");
  const dim3 grid(static_cast<unsigned>((n + kTileTokens - 1) / kTileTokens),
                  static_cast<unsigned>((layers + kTileLayers - 1) / kTileLayers));
  gather_routes_kernel<id_t, VEC><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      ids.data_ptr<id_t>(), valid.data_ptr<bool>(), token_index.data_ptr<int32_t>(),
      layer_index.data_ptr<int32_t>(), out.data_ptr<int64_t>(), static_cast<uint32_t>(n),
      static_cast<uint32_t>(layers), static_cast<uint32_t>(ids.size(2)), static_cast<uint32_t>(ids.size(1)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename id_t>
void launch_vec(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                const at::Tensor& layer_index, at::Tensor& out) {
  // Pairs need an even top-k and 2-element alignment of both buffers (an offset `out` view may lack it).
  const bool pairs = ids.size(2) % 2 == 0 && reinterpret_cast<uintptr_t>(ids.data_ptr()) % (2 * sizeof(id_t)) == 0 &&
                     reinterpret_cast<uintptr_t>(out.data_ptr()) % (2 * sizeof(int64_t)) == 0;
  if (pairs) {
    launch<id_t, 2>(ids, valid, token_index, layer_index, out);
  } else {
    launch<id_t, 1>(ids, valid, token_index, layer_index, out);
  }
}

}  // namespace

void gather_routes_cuda(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                        const at::Tensor& layer_index, at::Tensor& out) {
  TORCH_CHECK(ids.size(2) <= 1024 && ids.size(1) < (int64_t{1} << 31), "top-k or layer count out of range");
  const c10::cuda::CUDAGuard guard(ids.device());
  if (ids.scalar_type() == at::kByte) {
    launch_vec<uint8_t>(ids, valid, token_index, layer_index, out);
  } else {
    launch_vec<int16_t>(ids, valid, token_index, layer_index, out);
  }
}

}  // namespace r3
