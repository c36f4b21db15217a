// Thin pybind11 binding: argument checks, then dispatch on device to the kernel files.
#include <torch/extension.h>

#include "routes_kernels.h"

namespace {

// Index bounds of a host plan, checked before any write so a bad plan leaves the output
// untouched. A device plan is trusted (reading it here would sync with the device).
void check_plan_bounds(const at::Tensor& token_index, const at::Tensor& layer_index, int64_t num_tokens,
                       int64_t num_layers) {
  if (!token_index.is_cpu()) return;
  const int32_t* tok = token_index.data_ptr<int32_t>();
  const int32_t* lay = layer_index.data_ptr<int32_t>();
  for (int64_t i = 0; i < token_index.size(0); ++i)
    TORCH_CHECK(tok[i] >= -1 && tok[i] < num_tokens, "token_index[", i, "] = ", static_cast<int64_t>(tok[i]),
                " outside [-1, ", num_tokens, ")");
  for (int64_t i = 0; i < layer_index.size(0); ++i)
    TORCH_CHECK(lay[i] >= 0 && lay[i] < num_layers, "layer_index[", i, "] = ", static_cast<int64_t>(lay[i]),
                " outside [0, ", num_layers, ")");
}

void check_plan(const at::Tensor& token_index, const at::Tensor& layer_index, const at::Device& device) {
  TORCH_CHECK(token_index.scalar_type() == at::kInt && layer_index.scalar_type() == at::kInt,
              "token_index and layer_index must be int32");
  TORCH_CHECK(token_index.dim() == 1 && layer_index.dim() == 1, "token_index and layer_index must be 1-D");
  TORCH_CHECK(token_index.is_contiguous() && layer_index.is_contiguous(), "index maps must be contiguous");
  TORCH_CHECK(token_index.device() == device && layer_index.device() == device,
              "index maps must live on the routes' device");
}

void check_compact(const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kByte || ids.scalar_type() == at::kShort,
              "compact ids must be uint8 or int16, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 3 && ids.is_contiguous(), "compact ids must be contiguous [tokens, layers, topk]");
}

// A contiguous bool mask on the ids' device whose shape is the leading `dims` sizes of ids.
void check_mask(const at::Tensor& mask, const at::Tensor& ids, int64_t dims, const char* what) {
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == dims &&
                  mask.sizes() == ids.sizes().slice(0, dims) && mask.device() == ids.device(),
              what, " must be contiguous bool ", ids.sizes().slice(0, dims), " on the ids' device, got ",
              mask.scalar_type(), " ", mask.sizes());
}

// Returns expert_ids [layers, tokens, topk] int64 for this rank.
at::Tensor gather_routes(const at::Tensor& ids, const at::Tensor& valid, const at::Tensor& token_index,
                         const at::Tensor& layer_index, c10::optional<at::Tensor> out_opt) {
  check_compact(ids);
  check_mask(valid, ids, 1, "valid");
  check_plan(token_index, layer_index, ids.device());
  check_plan_bounds(token_index, layer_index, ids.size(0), ids.size(1));
  const int64_t k = ids.size(2);
  at::Tensor out = out_opt.has_value()
                       ? *out_opt
                       : at::empty({layer_index.size(0), token_index.size(0), k}, ids.options().dtype(at::kLong));
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.device() == ids.device() &&
                  out.dim() == 3 && out.size(0) == layer_index.size(0) && out.size(1) == token_index.size(0) &&
                  out.size(2) == k,
              "out must be contiguous int64 [layers, tokens, topk] on the routes' device");
  if (out.numel() == 0) return out;
#ifdef R3_WITH_CUDA
  if (ids.is_cuda()) {
    r3::gather_routes_cuda(ids, valid, token_index, layer_index, out);
    return out;
  }
#endif
  TORCH_CHECK(ids.is_cpu(), "no kernel for device ", ids.device(), " in this build");
  r3::gather_routes_cpu(ids, valid, token_index, layer_index, out);
  return out;
}

// Writes this rank's recorded rows into the global compact layout, in place.
void scatter_routes(const at::Tensor& expert_ids, const at::Tensor& token_index, const at::Tensor& layer_index,
                    at::Tensor out_ids, at::Tensor out_recorded) {
  check_compact(out_ids);
  check_mask(out_recorded, out_ids, 2, "out_recorded");
  check_plan(token_index, layer_index, out_ids.device());
  check_plan_bounds(token_index, layer_index, out_ids.size(0), out_ids.size(1));
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong || expert_ids.scalar_type() == at::kInt,
              "recorded expert ids must be int64 or int32");
  TORCH_CHECK(expert_ids.dim() == 3 && expert_ids.is_contiguous() && expert_ids.size(0) == layer_index.size(0) &&
                  expert_ids.size(1) == token_index.size(0) && expert_ids.size(2) == out_ids.size(2),
              "recorded expert ids must be contiguous [layers, tokens, topk] matching the plan");
  TORCH_CHECK(expert_ids.device() == out_ids.device(), "recorded ids and output must share a device");
  if (expert_ids.numel() == 0) return;
#ifdef R3_WITH_CUDA
  if (expert_ids.is_cuda()) {
    r3::scatter_routes_cuda(expert_ids, token_index, layer_index, out_ids, out_recorded);
    return;
  }
#endif
  TORCH_CHECK(expert_ids.is_cpu(), "no kernel for device ", expert_ids.device(), " in this build");
  r3::scatter_routes_cpu(expert_ids, token_index, layer_index, out_ids, out_recorded);
}

// A bytes-like object's JSON nested integer lists at `start` (no copy of the text).
py::tuple parse_int_lists(const py::buffer& text, int64_t start) {
  const py::buffer_info info = text.request();
  TORCH_CHECK(info.ndim == 1 && info.itemsize == 1 && info.strides[0] == 1, "text must be contiguous bytes");
  std::tuple<at::Tensor, std::vector<int64_t>, int64_t> parsed;
  {
    py::gil_scoped_release release;
    parsed = r3::parse_int_lists(static_cast<const uint8_t*>(info.ptr), info.size, start);
  }
  return py::make_tuple(std::get<0>(parsed), std::get<1>(parsed), std::get<2>(parsed));
}


// A bytes-like object's JSON per-position log-probs at `start` (no copy of the text).
py::tuple parse_logprob_positions(const py::buffer& text, int64_t start) {
  const py::buffer_info info = text.request();
  TORCH_CHECK(info.ndim == 1 && info.itemsize == 1 && info.strides[0] == 1, "text must be contiguous bytes");
  std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> parsed;
  {
    py::gil_scoped_release release;
    parsed = r3::parse_logprob_positions(static_cast<const uint8_t*>(info.ptr), info.size, start);
  }
  return py::make_tuple(std::get<0>(parsed), std::get<1>(parsed), std::get<2>(parsed), std::get<3>(parsed));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-r3 kernels: routing packing (gather for replay, scatter for record), JSON route lists and log-probs";
#ifdef R3_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("gather_routes", &gather_routes, "compact routes -> this rank's expert_ids [layers, tokens, topk] int64",
        py::arg("ids"), py::arg("valid"), py::arg("token_index"), py::arg("layer_index"),
        py::arg("out") = py::none());
  m.def("scatter_routes", &scatter_routes, "this rank's recorded expert_ids -> global compact routes (in place)",
        py::arg("expert_ids"), py::arg("token_index"), py::arg("layer_index"), py::arg("out_ids"),
        py::arg("out_recorded"));
  m.def("parse_int_lists", &parse_int_lists,
        "JSON nested integer lists at text[start:] -> (flat int32 tensor, shape, offset after the list)",
        py::arg("text"), py::arg("start") = 0);
  m.def("parse_logprob_positions", &parse_logprob_positions,
        "vLLM's JSON per-position log-probs at text[start:] -> (token ids, log-probs, entries per position, offset "
        "after the list)",
        py::arg("text"), py::arg("start") = 0);
}
