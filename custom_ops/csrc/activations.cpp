// Activations in the form each unit reads (activations.h).
#include "activations.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace tilefx {

namespace {
std::atomic<bool> int4_int8_x{false};  // set_int4_activations
std::atomic<bool> integer_gemm_x{true};  // set_int8_activations
}  // namespace

void set_int4_activations(const std::string& form) {
  TORCH_CHECK(form == "int16" || form == "int8", "tilefx: int4 decode reads x as int16 or int8, not '", form, "'");
  int4_int8_x = form == "int8";
}

std::string get_int4_activations() { return int4_int8_x ? "int8" : "int16"; }

void set_int8_activations(const std::string& form) {
  TORCH_CHECK(form == "int8" || form == "bf16", "tilefx: int8 and int4 GEMMs read x as int8 or bf16, not '", form,
              "'");
  integer_gemm_x = form == "int8";
}

std::string get_int8_activations() { return integer_gemm_x ? "int8" : "bf16"; }

ActivationForm activation_form(LinearUnit unit, WeightFormat format, int64_t rows, int64_t ldx) {
  if (format == WeightFormat::int8 && rows <= kGemvRows) return ActivationForm::int16_words;
  if (format == WeightFormat::int4 && rows <= kGemvRows) {
    return int4_int8_x.load(std::memory_order_relaxed) ? ActivationForm::int8_groups : ActivationForm::split_words;
  }
  if (rows > kGemvRows && reads_words(format) && integer_gemm_x.load(std::memory_order_relaxed)) {
    if (!reads_pairs(unit)) return ActivationForm::int16_words;
    if (ldx % 4 == 0) return ActivationForm::int8_groups;
  }
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

// Rows of the base form (fp32 for avx2, bf16 otherwise; ldx per row) as int8_groups.
void quantize_groups(LinearUnit unit, const void* rows, int64_t count, int64_t ldx, int8_t* bytes, float* scales,
                     float* sums, int32_t* totals) {
  switch (unit) {
    case LinearUnit::avx2:
      return quantize_groups_avx2(static_cast<const float*>(rows), count, ldx, bytes, scales, sums, totals);
    case LinearUnit::avx512:
      return quantize_groups_avx512(static_cast<const uint16_t*>(rows), count, ldx, bytes, scales, sums, totals);
    case LinearUnit::avx512_emulated:
#ifdef TILEFX_AVX512_EMULATION
      return quantize_groups_avx512_emulated(static_cast<const uint16_t*>(rows), count, ldx, bytes, scales, sums,
                                             totals);
#endif
      break;  // unreachable: set_path refuses the emulated path in builds without it
  }
}

// Words [ldx] of one row as split_words (kernels.h): per 4 inputs the low bytes, then the high bytes.
void split_row(const uint32_t* words, int64_t ldx, uint8_t* out) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
  for (int64_t k = 0; k < ldx; k += 4) {
    for (int j = 0; j < 4; ++j) {
      out[2 * k + j] = bytes[2 * (k + j)];
      out[2 * k + 4 + j] = bytes[2 * (k + j) + 1];
    }
  }
}

// Each 128 inputs' sum of the words [ldx] of one row (int4's x_sums over words: split_words, and int16_words for
// an int4 GEMM).
void word_sums(const uint32_t* words, int64_t ldx, float* sums) {
  const int16_t* values = reinterpret_cast<const int16_t*>(words);
  for (int64_t g = 0, k = 0; k < ldx; ++g) {
    int32_t sum = 0;
    for (const int64_t end = std::min(k + 2 * kInt4GroupPairs, ldx); k < end; ++k) sum += values[k];
    sums[g] = static_cast<float>(sum);
  }
}

constexpr int64_t kRowsPerTask = 64;

// body(begin, count) over the rows of `spans` in tasks of at most kRowsPerTask rows (a span's rows stay in order),
// across the threads; all on the calling thread where they come to no more than kRowsPerTask rows.
template <class Body>
void in_tasks(const std::vector<RowSpan>& spans, const Body& body) {
  int64_t total = 0;
  for (const RowSpan& span : spans) total += span.count;
  if (total <= kRowsPerTask) {  // (a decode's rows: no task list on its hot path)
    for (const RowSpan& span : spans) body(span.begin, span.count);
    return;
  }
  std::vector<RowSpan> tasks;
  for (const RowSpan& span : spans) {
    for (int64_t r = span.begin; r < span.begin + span.count; r += kRowsPerTask) {
      tasks.push_back({r, std::min(kRowsPerTask, span.begin + span.count - r)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) body(tasks[i].begin, tasks[i].count);
  });
}

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
                         int64_t src_stride, int64_t ldx, const RowPlan* plan)
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
  make_forms(plan);
}

Activations::Activations(LinearUnit unit, WeightFormat format, const float* rows, int64_t count, int64_t ldx,
                         const RowPlan* plan)
    : Activations(unit, format, count, ldx) {
  TORCH_CHECK(!reads_pairs(unit), "tilefx: fp32 activations are the AVX2 unit's form; ", unit_name(unit),
              " reads bf16 pairs");
  rows_ = rows;
  make_forms(plan);
}

ActivationForm Activations::form(int64_t rows) const {
  return activation_form(unit_, rows > kGemvRows ? gemm_x_format(format_, gemm_on_brgemm_) : format_, rows, ldx_);
}

void Activations::make_forms(const RowPlan* plan) {
  if (rows_ == nullptr) rows_ = base_.data();
  RowPlan whole;  // with no plan: every row, in the form of `count_` rows
  if (plan == nullptr) {
    (count_ <= kGemvRows ? whole.words : whole.gemm).push_back({0, count_});
    plan = &whole;
  }
  gemm_on_brgemm_ = plan->gemm_on_brgemm;
  // The spans each form is made for: words (int16, or split) for decode rows and for int8 and int4 GEMM rows on
  // the AVX2 unit (int4's with their sums), int8 groups for int4 decode rows where set_int4_activations asks and
  // for int8 and int4 GEMM rows on the AVX512-BF16 units. Each buffer holds every row, but only the spans' rows
  // are written (and read), so the others' pages are never touched.
  const ActivationForm decode = form(1), gemm = form(kGemvRows + 1);
  std::vector<RowSpan> byte_spans, word_spans, split_spans;
  if (reads_words(format_)) (decode == ActivationForm::int8_groups ? byte_spans : word_spans) = plan->words;
  if (decode == ActivationForm::split_words) split_spans = plan->words;  // (int4 decode: the words' bytes apart)
  if (gemm == ActivationForm::int8_groups) byte_spans.insert(byte_spans.end(), plan->gemm.begin(), plan->gemm.end());
  if (gemm == ActivationForm::int16_words) word_spans.insert(word_spans.end(), plan->gemm.begin(), plan->gemm.end());
  const int64_t row_bytes = ldx_ * (reads_pairs(unit_) ? sizeof(uint16_t) : sizeof(float));
  const char* rows = static_cast<const char*>(rows_);
  const int64_t groups = int4_groups(ldx_);
  if (!byte_spans.empty()) {
    bytes_.resize(count_ * ldx_);
    byte_scales_.resize(count_ * x_groups(ldx_));
    word_sums_.resize(count_ * groups);
    if (format_ == WeightFormat::int8) byte_totals_.resize(count_ * x_groups(ldx_));  // (int8 GEMMs read them)
    in_tasks(byte_spans, [&](int64_t begin, int64_t count) {
      quantize_groups(unit_, rows + begin * row_bytes, count, ldx_, bytes_.data() + begin * ldx_,
                      byte_scales_.data() + begin * x_groups(ldx_), word_sums_.data() + begin * groups,
                      byte_totals_.empty() ? nullptr : byte_totals_.data() + begin * x_groups(ldx_));
    });
  }
  if (word_spans.empty()) return;
  const int64_t ldw = ldx_ / 2;
  words_.resize(count_ * ldw);
  word_scales_.resize(count_);
  const bool sums = format_ == WeightFormat::int4;  // int4 takes its zero points off with each group's sum of words
  if (sums) word_sums_.resize(count_ * groups);
  if (!split_spans.empty()) split_.resize(count_ * 2 * ldx_);
  in_tasks(word_spans, [&](int64_t begin, int64_t count) {
    quantize_words(unit_, rows + begin * row_bytes, count, ldx_, words_.data() + begin * ldw,
                   word_scales_.data() + begin);
    for (int64_t r = begin; sums && r < begin + count; ++r) {
      word_sums(words_.data() + r * ldw, ldx_, word_sums_.data() + r * groups);
    }
  });
  in_tasks(split_spans, [&](int64_t begin, int64_t count) {
    for (int64_t r = begin; r < begin + count; ++r) {
      split_row(words_.data() + r * ldw, ldx_, split_.data() + r * 2 * ldx_);
    }
  });
}

void Activations::attach(LinearProblem& p, int64_t row) const {
  p.x_form = form(p.M);
  if (p.x_form == ActivationForm::int8_groups) {
    TORCH_CHECK(!bytes_.empty(), "tilefx: activations of ", p.M, " rows were not prepared as int8 groups");
    p.x = bytes_.data() + row * ldx_;
    p.x_scales = byte_scales_.data() + row * x_groups(ldx_);
    p.x_sums = word_sums_.data() + row * int4_groups(ldx_);
    p.x_totals = byte_totals_.empty() ? nullptr : byte_totals_.data() + row * x_groups(ldx_);
    return;
  }
  if (p.x_form == ActivationForm::int16_words || p.x_form == ActivationForm::split_words) {
    TORCH_CHECK(!words_.empty(), "tilefx: activations of ", p.M, " rows were not prepared as words");
    if (p.x_form == ActivationForm::split_words) {
      p.x = split_.data() + row * 2 * ldx_;
      p.x_scales = word_scales_.data() + row;
      p.x_sums = word_sums_.data() + row * int4_groups(ldx_);
      return;
    }
    p.x = words_.data() + row * (ldx_ / 2);
    p.x_scales = word_scales_.data() + row;
    p.x_sums = word_sums_.empty() ? nullptr : word_sums_.data() + row * int4_groups(ldx_);  // (int4's GEMM)
    p.x_totals = nullptr;
    return;
  }
  const int64_t row_bytes = ldx_ * (reads_pairs(unit_) ? sizeof(uint16_t) : sizeof(float));
  p.x = static_cast<const char*>(rows_) + row * row_bytes;
  p.x_scales = nullptr;
  p.x_sums = nullptr;
}

}  // namespace tilefx
