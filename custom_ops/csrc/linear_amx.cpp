// tilefx::linear on AMX through oneDNN brgemm (at::native::cpublas). The packed
// layout (kernels.h) is already brgemm's VNNI layout for B, one block of kBlockN
// columns at a time. Only called where could_pack(kBFloat16) holds: elsewhere
// brgemm is a slow reference loop and the AVX2 / AVX512 units are used.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ATen.h>

#include <vector>

#include "kernels.h"
#include "layout.h"
#include "ops.h"

namespace tilefx {

bool amx_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features) {
  TORCH_CHECK(amx_available(), "tilefx linear: the AMX path needs a CPU with AMX-BF16 (set TILEFX_ISA to another path)");
  const int64_t k_pairs = packed_pairs(packed), in_features = x.size(-1);
  at::Tensor x2 = x.reshape({-1, in_features}).contiguous();
  if (2 * k_pairs > in_features) x2 = at::constant_pad_nd(x2, {0, 2 * k_pairs - in_features});
  const int64_t rows = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const at::BFloat16* a = x2.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const at::BFloat16* b = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, packed_blocks(packed), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(rows * kBlockN);
    for (int64_t nb = begin; nb < end; ++nb) {
      at::native::cpublas::brgemm(rows, kBlockN, 2 * k_pairs, 2 * k_pairs, kBlockN, kBlockN, false, a,
                                  w + nb * k_pairs * 2 * kBlockN, c.data());
      const int64_t col0 = nb * kBlockN, cols = std::min(kBlockN, out_features - col0);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < cols; ++j)
          out[m * out_features + col0 + j] =
              static_cast<at::BFloat16>(c[m * kBlockN + j] + (b ? static_cast<float>(b[col0 + j]) : 0.0f));
    }
    at::native::cpublas::brgemm_release();
  });
  return y.view(out_shape);
}

}  // namespace tilefx
