// What the library was built from and which of its instruction-set builds (gemm.cpp) this CPU can run; the
// Python side (miles_kernels/native/__init__.py) picks the widest and calls it through ctypes.
#include <string.h>

#ifndef MILES_SOURCE_HASH
#error "build.py defines MILES_SOURCE_HASH (the sha256 of the sources)"
#endif

extern "C" const char* miles_native_source_hash() { return MILES_SOURCE_HASH; }

extern "C" int miles_native_cpu_supports(const char* isa) {
  __builtin_cpu_init();
  if (strcmp(isa, "avx512") == 0) return __builtin_cpu_supports("avx512f");
  if (strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return strcmp(isa, "generic") == 0;
}
