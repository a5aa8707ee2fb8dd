// CPU kernels of tilefx::rms_norm and tilefx::add_rms_norm (custom_ops/norm.py): one row of the hidden states a
// task, each row on the path's linear unit (UnitEpilogue::rms_norm_row); the references (*_portable) on the
// reference path and for what the native kernel does not take.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <tuple>

#include "dispatch.h"
#include "kernels.h"
#include "ops.h"

namespace tilefx {
namespace {

// The stride between consecutive rows of D values of `t` taken as [rows, D] (D = its last dim, dense): its leading
// dims must step as one (a contiguous tensor, or a slice of each row of one); -1 where they do not. Dims of size 1
// do not step.
int64_t row_stride(const at::Tensor& t) {
  if (t.dim() < 1 || (t.size(-1) > 1 && t.stride(-1) != 1)) return -1;
  int64_t stride = t.size(-1), inner_size = 1, inner_stride = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (inner_stride < 0) {
      stride = t.stride(d);  // the innermost leading dim that steps sets the rows' stride
    } else if (t.stride(d) != inner_stride * inner_size) {
      return -1;
    }
    inner_size = t.size(d);
    inner_stride = t.stride(d);
  }
  return stride;
}

// Whether the native kernel takes these: bf16 throughout, weight [D] dense, x (and residual) rows at one stride.
bool native_takes(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight) {
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 || weight.dim() != 1 ||
      weight.stride(0) != 1 || x.dim() < 1 || weight.size(0) != x.size(-1) || row_stride(x) < 0) {
    return false;
  }
  return residual == nullptr || (residual->scalar_type() == at::kBFloat16 && residual->sizes() == x.sizes() &&
                                 row_stride(*residual) >= 0);
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
  const int64_t x_stride = row_stride(x), res_stride = residual ? row_stride(*residual) : 0;
  // a row is a few thousand values: tasks of a few rows, so a decode's one row stays on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      unit.rms_norm_row(src + r * x_stride, res ? res + r * res_stride : nullptr, dim, w, static_cast<float>(eps),
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
