// Activations in the form each unit reads (activations.h).
#include "activations.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace tilefx {

ActivationForm activation_form(LinearUnit unit, WeightFormat format, int64_t rows) {
  if (reads_words(format) && rows <= kWordRows) return ActivationForm::int16_words;
  return reads_pairs(unit) ? ActivationForm::bf16_pairs : ActivationForm::fp32;
}

namespace {

// Rows of the base form (fp32 for avx2, bf16 otherwise; ldx per row) as int16 words and their scales.
void quantize_words(LinearUnit unit, const void* rows, int64_t count, int64_t ldx, uint32_t* words, float* scales) {
  switch (unit) {
    case LinearUnit::avx2: return quantize_words_avx2(static_cast<const float*>(rows), count, ldx, words, scales);
    case LinearUnit::avx512: return quantize_words_avx512(static_cast<const uint16_t*>(rows), count, ldx, words, scales);
    case LinearUnit::avx512_emulated:
#ifdef TILEFX_AVX512_EMULATION
      return quantize_words_avx512_emulated(static_cast<const uint16_t*>(rows), count, ldx, words, scales);
#endif
      break;  // unreachable: set_path refuses the emulated path in builds without it
  }
}

constexpr int64_t kRowsPerTask = 64;

}  // namespace

int64_t Activations::row_elems() const { return reads_pairs(unit_) ? ldx_ / 2 : ldx_; }

void Activations::write_row(int64_t r, const uint16_t* src, int64_t n) {
  uint32_t* dst = base_.data() + r * row_elems();
  if (!reads_pairs(unit_)) {
    float* row = reinterpret_cast<float*>(dst);
    bf16_to_float_avx2(src, row, n);
    if (ldx_ > n) row[n] = 0.0f;
  } else {
    uint16_t* row = reinterpret_cast<uint16_t*>(dst);
    std::memcpy(row, src, n * sizeof(uint16_t));
    if (ldx_ > n) row[n] = 0;
  }
}

Activations::Activations(LinearUnit unit, WeightFormat format, const uint16_t* src, int64_t count, int64_t n,
                         int64_t src_stride, int64_t ldx, bool every_row_words)
    : Activations(unit, format, count, ldx) {
  const bool already_pairs = reads_pairs(unit) && n == ldx && (src_stride == ldx || count == 1) &&
                             reinterpret_cast<uintptr_t>(src) % alignof(uint32_t) == 0;
  if (already_pairs) {  // bf16 x with even K is the AVX512-BF16 units' pairs as it is
    rows_ = src;
  } else {
    base_.resize(count * row_elems());
    at::parallel_for(0, count, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) write_row(r, src + r * src_stride, n);
    });
  }
  make_words(every_row_words);
}

Activations::Activations(LinearUnit unit, WeightFormat format, const float* rows, int64_t count, int64_t ldx,
                         bool every_row_words)
    : Activations(unit, format, count, ldx) {
  if (!reads_pairs(unit)) {
    rows_ = rows;
  } else {  // round to bf16 pairs (nearest even), as HF's bf16 experts read their activations
    base_.resize(count * row_elems());
    uint16_t* out = reinterpret_cast<uint16_t*>(base_.data());
    at::parallel_for(0, count, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * ldx; i < end * ldx; ++i) out[i] = c10::BFloat16(rows[i]).x;
    });
  }
  make_words(every_row_words);
}

void Activations::make_words(bool every_row_words) {
  if (rows_ == nullptr) rows_ = base_.data();
  if (!reads_words(format_) || (!every_row_words && count_ > kWordRows)) return;
  const int64_t ldw = ldx_ / 2;
  words_.resize(count_ * ldw);
  word_scales_.resize(count_);
  const bool sums = format_ == WeightFormat::int4;
  const int64_t groups = (ldw + kInt4GroupPairs - 1) / kInt4GroupPairs;  // the last may be partial
  if (sums) word_sums_.resize(count_ * groups);
  const int64_t row_bytes = ldx_ * (reads_pairs(unit_) ? sizeof(uint16_t) : sizeof(float));
  at::parallel_for(0, count_, kRowsPerTask, [&](int64_t begin, int64_t end) {
    quantize_words(unit_, static_cast<const char*>(rows_) + begin * row_bytes, end - begin, ldx_,
                   words_.data() + begin * ldw, word_scales_.data() + begin);
    if (!sums) return;
    // int4's zero points: per row, the sum of its words over each group (at most 128 * 32767: exact in fp32)
    for (int64_t r = begin; r < end; ++r) {
      const int16_t* row = reinterpret_cast<const int16_t*>(words_.data() + r * ldw);
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * 2 * kInt4GroupPairs; k < std::min((g + 1) * 2 * kInt4GroupPairs, ldx_); ++k) sum += row[k];
        word_sums_[r * groups + g] = static_cast<float>(sum);
      }
    }
  });
}

void Activations::attach(LinearProblem& p, int64_t row) const {
  p.x_form = activation_form(unit_, format_, p.M);
  if (p.x_form == ActivationForm::int16_words) {
    TORCH_CHECK(!words_.empty(), "tilefx: activations of ", p.M, " rows were not prepared as words");
    p.x = words_.data() + row * (ldx_ / 2);
    p.x_scales = word_scales_.data() + row;
    p.x_sums = word_sums_.empty() ? nullptr : word_sums_.data() + row * ((ldx_ / 2 + kInt4GroupPairs - 1) / kInt4GroupPairs);
    return;
  }
  const int64_t row_bytes = ldx_ * (reads_pairs(unit_) ? sizeof(uint16_t) : sizeof(float));
  p.x = static_cast<const char*>(rows_) + row * row_bytes;
  p.x_scales = nullptr;
  p.x_sums = nullptr;
}

}  // namespace tilefx
