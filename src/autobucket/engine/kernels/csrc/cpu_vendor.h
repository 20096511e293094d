// The x86 vendor the kernels tune for, read once per process. Some choices that change no value (whether
// to stage aliased output rows, whether decode prefetches K/V) paid on one vendor and cost on the other;
// see fixed_order_linear.cpp and invariant_attention.cpp for the measurements.
#pragma once

enum class CpuVendor { kAmd, kIntel, kOther };

inline CpuVendor cpu_vendor() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return CpuVendor::kAmd;
  if (__builtin_cpu_is("intel")) return CpuVendor::kIntel;
#endif
  return CpuVendor::kOther;
}
