// CUDA gather (replay): compact uint8/int16 routes -> this rank's expert_ids [layers, tokens, topk] int64.
//
// Memory-bound by design: the int64 output is 8x the compact input, so the kernel lives or dies by how well
// it keeps stores streaming. A block owns a tile of kTileTokens consecutive router tokens and up to
// kTileLayers local layers. It first resolves the tile's tokens once (index map, per-token validity) into
// shared memory, so each output needs a single dependent load: its compact ids. Then consecutive threads
// produce consecutive pairs of outputs (a warp stores 512 contiguous bytes per instruction). Stores are
// streaming (evict-first): the output is read once, by a router later on, so caching it in L2 only evicts
// the ids the block is still reading. A source token's ids for all of a tile's layers share a few 32-byte
// sectors, so the block reads them from DRAM about once. Tile shape and store policy were picked on an H200
// over 4k-128k tokens x 24-94 layers (docs/dataplane.md).
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

__device__ __forceinline__ void store_streaming(int64_t* dst, const Vec<int64_t, 1>& value) {
  __stcs(reinterpret_cast<long long*>(dst), static_cast<long long>(value.v[0]));
}

__device__ __forceinline__ void store_streaming(int64_t* dst, const Vec<int64_t, 2>& value) {
  __stcs(reinterpret_cast<longlong2*>(dst), make_longlong2(value.v[0], value.v[1]));
}

template <typename id_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    gather_routes_kernel(const id_t* __restrict__ ids, const bool* __restrict__ valid,
                         const int32_t* __restrict__ token_index, const int32_t* __restrict__ layer_index,
                         int64_t* __restrict__ out, uint32_t num_local_tokens, uint32_t num_local_layers,
                         uint32_t topk, uint32_t num_src_layers) {
  __shared__ int64_t src_row0[kTileTokens];  // source row of the tile token's layer 0, or -1: no route
  __shared__ int32_t src_layer[kTileLayers];
  const uint32_t token0 = blockIdx.x * kTileTokens;
  const uint32_t layer0 = blockIdx.y * kTileLayers;
  const uint32_t tile_tokens = min(kTileTokens, num_local_tokens - token0);
  const uint32_t tile_layers = min(kTileLayers, num_local_layers - layer0);
  if (threadIdx.x < tile_tokens) {
    const int32_t src_token = __ldg(token_index + token0 + threadIdx.x);
    src_row0[threadIdx.x] = src_token >= 0 && valid[src_token] ? int64_t{src_token} * num_src_layers : -1;
  }
  if (threadIdx.x < tile_layers) src_layer[threadIdx.x] = __ldg(layer_index + layer0 + threadIdx.x);
  __syncthreads();

  const uint32_t units_per_layer = tile_tokens * topk / VEC;  // VEC divides topk
  const uint32_t units = units_per_layer * tile_layers;
  for (uint32_t u = threadIdx.x; u < units; u += kThreads) {
    const uint32_t l = u / units_per_layer;
    const uint32_t e = (u - l * units_per_layer) * VEC;
    const uint32_t t = e / topk;
    const uint32_t j = e - t * topk;
    Vec<int64_t, VEC> result;
#pragma unroll
    for (int i = 0; i < VEC; ++i) result.v[i] = -1;
    const int64_t row0 = src_row0[t];
    if (row0 >= 0) {
      const Vec<id_t, VEC> packed = *reinterpret_cast<const Vec<id_t, VEC>*>(ids + (row0 + src_layer[l]) * topk + j);
#pragma unroll
      for (int i = 0; i < VEC; ++i) result.v[i] = static_cast<int64_t>(packed.v[i]);
    }
    store_streaming(out + (int64_t{layer0 + l} * num_local_tokens + token0 + t) * topk + j, result);
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
