// CPU kernels of tilefx::rms_norm and tilefx::add_rms_norm (custom_ops/norm.py): one row of the hidden states a
// task, each row on the path's linear unit (UnitEpilogue::rms_norm_row); the references (*_portable) on the
// reference path and for what the native kernel does not take.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "dispatch.h"
#include "kernels.h"
#include "ops.h"

namespace tilefx {
namespace {

// Where row r of `t` taken as [rows, D] (D its last dim) begins, in values from its data pointer: its leading dims
// may lie at any strides (Qwen3's per-head norms read heads of a fused projection's rows).
class RowOffsets {
 public:
  explicit RowOffsets(const at::Tensor& t) : sizes_(t.sizes().begin(), t.sizes().end() - 1),
                                             strides_(t.strides().begin(), t.strides().end() - 1) {}
  int64_t operator()(int64_t r) const {
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      offset += (r % sizes_[d]) * strides_[d];
      r /= sizes_[d];
    }
    return offset;
  }

 private:
  std::vector<int64_t> sizes_, strides_;
};

// Whether the native kernel takes these: bf16 throughout, weight [D] dense, each row of x (and residual) dense.
bool native_takes(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight) {
  const auto rows_dense = [](const at::Tensor& t) { return t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1); };
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 || weight.dim() != 1 ||
      weight.stride(0) != 1 || !rows_dense(x) || weight.size(0) != x.size(-1)) {
    return false;
  }
  return residual == nullptr ||
         (residual->scalar_type() == at::kBFloat16 && residual->sizes() == x.sizes() && rows_dense(*residual));
}

// The rows of x (and residual) normalized into `out` (and their sums into `sum`), contiguous [rows, D].
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor* sum,
               at::Tensor& out) {
  const UnitEpilogue& unit = epilogue_of(current_units().linear);
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* res = residual ? reinterpret_cast<const uint16_t*>(residual->data_ptr<at::BFloat16>()) : nullptr;
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* total = sum ? reinterpret_cast<uint16_t*>(sum->data_ptr<at::BFloat16>()) : nullptr;
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const RowOffsets x_row(x);
  const RowOffsets res_row(residual ? *residual : x);
  // a row is a few thousand values: tasks of a few rows, so a decode's one row stays on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      unit.rms_norm_row(src + x_row(r), res ? res + res_row(r) : nullptr, dim, w, static_cast<float>(eps),
                        total ? total + r * dim : nullptr, dst + r * dim);
    }
  });
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!current_units().native || !native_takes(x, nullptr, weight)) {
    static const auto portable = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("tilefx::rms_norm_portable", "")
                                     .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    return portable.call(x, weight, eps);
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  norm_rows(x, nullptr, weight, eps, nullptr, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  if (!current_units().native || !native_takes(x, &residual, weight)) {
    static const auto portable =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("tilefx::add_rms_norm_portable", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      double)>();
    return portable.call(x, residual, weight, eps);
  }
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  norm_rows(x, &residual, weight, eps, &sum, out);
  return {sum, out};
}

}  // namespace tilefx
