// What the library exports, described by the library itself: every exported function's
// argument and result types and every struct's size, read by `ops/kernels.py` when it
// loads the build. Python then takes each function's ctypes signature from here (so a
// kernel's arguments are declared once, in C++) and checks each ctypes struct mirror's
// size against the struct it mirrors.
//
// A source file lists its exports after its `extern "C"` block:
//   RF_EXPORT_FUNCTION(rf_window_step)
//   RF_EXPORT_STRUCT(WindowStepWeights)
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace rf {

template <typename T>
inline constexpr bool unsupported_type = false;

// One letter per C type that crosses the C interface: p pointer, i int, q int64_t,
// f float, d double (ctypes' c_void_p, c_int, c_int64, c_float, c_double).
template <typename T>
constexpr char type_code() {
  if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, int>) return 'i';
  else if constexpr (std::is_same_v<T, int64_t>) return 'q';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_same_v<T, double>) return 'd';
  else static_assert(unsupported_type<T>, "an exported function takes or returns a type ctypes is not told about");
}

// "q:pqi" for `int64_t f(void*, int64_t, int)`: the result, then the arguments.
template <typename R, typename... A>
std::string signature(R (*)(A...)) {
  return std::string{type_code<R>(), ':'} + std::string{type_code<A>()...};
}

// The lines `rf_abi()` returns, one per export, gathered as the library loads.
inline std::vector<std::string>& exports() {
  static std::vector<std::string> lines;
  return lines;
}

inline bool describe(const std::string& line) {
  exports().push_back(line);
  return true;
}

}  // namespace rf

#define RF_EXPORT_FUNCTION(fn) static const bool rf_exported_##fn = rf::describe("function " #fn " " + rf::signature(&fn));
#define RF_EXPORT_STRUCT(T) \
  static const bool rf_exported_##T = rf::describe("struct " #T " " + std::to_string(sizeof(T)));
