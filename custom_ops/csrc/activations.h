// How a linear's activations reach its unit: the one place that picks the form a problem's
// x takes (per unit, weight format and rows) and prepares it, shared by the linear ops
// (linear_ops.cpp) and fused_moe's experts (moe.cpp). The units read whatever form
// LinearProblem::x_form names (kernels.h) and never convert x themselves.
#pragma once
#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <vector>

#include "aligned.h"
#include "dispatch.h"
#include "kernels.h"

namespace tilefx {

inline bool reads_words(WeightFormat format) { return format == WeightFormat::int8 || format == WeightFormat::int4; }

// The form a unit reads x in for a problem of `rows` rows over `format` weights, x ldx values a row:
// int16 words for int8 decode (up to kGemvRows rows); for int4 decode the words' bytes apart (15 bits), or, where
// set_int4_activations chose "int8", int8 per kXGroup inputs (half the multiplies, docs/PERFORMANCE.md). An int8 or
// int4 GEMM (more than kGemvRows rows) multiplies integers: on the AVX512-BF16 units x as int8 per kXGroup inputs where
// ldx is a multiple of 4 (`vpdpbusd`, twice the products an instruction of the bf16 GEMM over a dequantized block), on
// the AVX2 unit as int16 words (`vpmaddwd`, twice the products an instruction of its fp32 FMAs). Else the unit's base
// form (fp32 on AVX2, bf16 pairs on the AVX512-BF16 units). A GEMM on oneDNN's brgemm reads the base form: its callers
// ask for the bf16 weights' form (gemm_x_format). set_int8_activations("bf16") keeps int8 and int4 GEMMs on the base
// form too.
ActivationForm activation_form(LinearUnit unit, WeightFormat format, int64_t rows, int64_t ldx);
// How int4 decode reads x, for the whole process: "int16" (the default) or "int8" (custom_ops/isa.py sets it
// from TILEFX_INT4_ACTIVATIONS).
void set_int4_activations(const std::string& form);
std::string get_int4_activations();
// How an int8 or int4 GEMM on the units reads x, for the whole process: "int8" (integer products, the default: int8
// per kXGroup inputs on the AVX512-BF16 units, int16 words on AVX2) or "bf16" (over dequantized blocks:
// the weight-only numerics; custom_ops/isa.py sets it from TILEFX_INT8_ACTIVATIONS).
void set_int8_activations(const std::string& form);
std::string get_int8_activations();

// Whether `unit`'s base form is bf16 pairs (the AVX512-BF16 units) rather than fp32 rows (AVX2).
inline bool reads_pairs(LinearUnit unit) { return unit != LinearUnit::avx2; }
// The unit whose base form a GEMM reads: oneDNN's brgemm (linear_brgemm.cpp) reads bf16 pairs,
// whichever unit's epilogue it uses.
inline LinearUnit gemm_reader(LinearUnit unit, bool brgemm) {
  return brgemm && !reads_pairs(unit) ? LinearUnit::avx512 : unit;
}
// The weight format whose forms x is prepared in for a GEMM: brgemm multiplies bf16 (a quantized
// block becomes a bf16 panel first), so at any row count it reads x's base form, as over bf16 weights.
inline WeightFormat gemm_x_format(WeightFormat format, bool brgemm) { return brgemm ? WeightFormat::bf16 : format; }

// Rows [begin, begin + count) of a batch of activations.
struct RowSpan {
  int64_t begin, count;
};

// Which rows of a batch problems of few and of many rows read, where one batch serves problems of several sizes
// (fused_moe: each expert's rows are one problem).
struct RowPlan {
  std::vector<RowSpan> words;   // rows of problems of at most kGemvRows rows (made words for int8 / int4 weights)
  std::vector<RowSpan> gemm;    // rows of problems of more than kGemvRows rows (made int8's GEMM form where it has one)
  bool gemm_on_brgemm = false;  // the GEMMs run oneDNN's brgemm, which reads the base form
};

// `count` rows of x, each ldx values wide (K padded to even with a zero), prepared for
// problems over `format` weights on `unit`: in the unit's base form and, where a problem
// of up to kGemvRows rows will read words, or an int8 GEMM its integer form, in that form too. A problem's
// `attach` points it at its rows in the form activation_form gives for its p.M. Which rows are made which:
// `plan`'s (fused_moe), or with none given, all of them in the form of `count` rows.
class Activations {
 public:
  // From bf16 rows: row r at src + r * src_stride (n values each).
  Activations(LinearUnit unit, WeightFormat format, const uint16_t* src, int64_t count, int64_t n, int64_t src_stride,
              int64_t ldx, const RowPlan* plan = nullptr);
  // From bf16 rows that `row(r)` returns (gathered or strided sources).
  template <class RowOf>
  Activations(LinearUnit unit, WeightFormat format, int64_t count, int64_t n, int64_t ldx, const RowPlan* plan,
              const RowOf& row)
      : Activations(unit, format, count, ldx) {
    base_.resize(count * row_elems());
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) write_row(r, row(r), n);
    });
    make_forms(plan);
  }
  // From fp32 rows [count, ldx] (fused_moe's SiLU-and-mul result on the AVX2 unit, its base form: read as
  // they are).
  Activations(LinearUnit unit, WeightFormat format, const float* rows, int64_t count, int64_t ldx,
              const RowPlan* plan);

  // Points p (p.M and p.ldx set) at rows [row, row + p.M).
  void attach(LinearProblem& p, int64_t row) const;

 private:
  Activations(LinearUnit unit, WeightFormat format, int64_t count, int64_t ldx)
      : unit_(unit), format_(format), count_(count), ldx_(ldx) {}
  int64_t row_elems() const;  // uint32 elements per base row
  void write_row(int64_t r, const uint16_t* src, int64_t n);
  void make_forms(const RowPlan* plan);
  ActivationForm form(int64_t rows) const;  // what a problem of `rows` rows reads

  LinearUnit unit_;
  WeightFormat format_;
  int64_t count_, ldx_;
  bool gemm_on_brgemm_ = false;  // RowPlan::gemm_on_brgemm
  const void* rows_ = nullptr;   // the base form: base_, or the caller's bf16 rows where they already are pairs
  // Each buffer is written before it is read: the base form for every row, the words' forms for the rows
  // that read them (the others are never touched, so their pages cost nothing).
  UninitializedAlignedVector<uint32_t> base_;   // fp32 bits (avx2) or bf16 pairs (brgemm's A)
  UninitializedAlignedVector<uint32_t> words_;  // int16 pairs, ldx / 2 per row
  UninitializedAlignedVector<float> word_scales_;
  UninitializedAlignedVector<uint8_t> split_;    // int4: the words as split_words, 2 * ldx bytes per row
  UninitializedAlignedVector<int8_t> bytes_;     // int8_groups (int4 decode, int8 and int4 GEMMs): ldx bytes a row
  UninitializedAlignedVector<float> byte_scales_;  // their scales, x_groups(ldx) per row
  UninitializedAlignedVector<int32_t> byte_totals_;  // int8 weights: their sums, x_groups(ldx) per row (x_totals)
  UninitializedAlignedVector<float> word_sums_;  // x_sums: per row and 128 inputs (int4's forms, int8_groups)
};

}  // namespace tilefx
