// The standalone runners' protocol: one request on stdin, its answer on stdout, raw little-endian values.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace fp8kv::standalone {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "runner: %s\n", what);
  std::exit(2);
}

template <typename T>
std::vector<T> read(int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  if (n > 0 && std::fread(v.data(), sizeof(T), v.size(), stdin) != v.size()) fail("short input");
  return v;
}

template <typename T>
void write(const std::vector<T>& v) {
  if (!v.empty() && std::fwrite(v.data(), sizeof(T), v.size(), stdout) != v.size()) fail("short output");
}

}  // namespace fp8kv::standalone
