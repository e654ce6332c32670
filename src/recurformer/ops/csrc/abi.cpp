// `rf_abi()`: the library's description of its exports (abi.h), one line each,
// "function NAME RESULT:ARGUMENTS" or "struct NAME BYTES".
#include "abi.h"

extern "C" {

const char* rf_abi() {
  static const std::string text = [] {
    std::string joined;
    for (const std::string& line : rf::exports()) joined += line + "\n";
    return joined;
  }();
  return text.c_str();
}

}  // extern "C"
