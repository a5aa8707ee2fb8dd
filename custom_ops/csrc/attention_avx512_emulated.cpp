// attention_avx512.cpp built on SIMDe's portable AVX512 intrinsics (any x86-64), so the
// tests run the AVX512-BF16 attention unit's code on CPUs without AVX512. setup.py builds
// it only where simde-py is installed; it is never a path the ops take by themselves.
#define TILEFX_AVX512_EMULATED
#include "attention_avx512.cpp"
