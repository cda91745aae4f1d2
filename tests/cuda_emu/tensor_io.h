// Tensors between pytest and an emulator driver (tests/cuda_emulator.py writes and reads them):
//   op <name>\n
//   tensor <name> <dtype> <ndim> <d0> ... <nbytes>\n<nbytes raw bytes, contiguous>   (repeated)
//   end\n
// The driver runs the op on the tensors in place and writes them all back in the same format.
// Every tensor is 16-byte aligned and named to the race detector, so a report says "scores + 8".
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda_emulation.h"

namespace emu {

struct Tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::unique_ptr<unsigned char[]> storage;
  unsigned char* data = nullptr;
  size_t bytes = 0;

  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t i) const { return shape.at(i < 0 ? i + dim() : i); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t stride0() const { return dim() == 0 ? 1 : numel() / std::max<int64_t>(1, size(0)); }
  template <typename T>
  T* ptr() const {
    return reinterpret_cast<T*>(data);
  }
  void allocate(size_t n) {
    bytes = n;
    storage.reset(new unsigned char[n + 16]);
    data = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(storage.get()) + 15) & ~uintptr_t(15));
  }
};

struct Request {
  std::string op;
  std::map<std::string, Tensor> tensors;

  bool has(const std::string& name) const { return tensors.count(name) != 0; }
  Tensor& at(const std::string& name) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      std::fprintf(stderr, "driver: op %s needs tensor '%s'\n", op.c_str(), name.c_str());
      std::exit(2);
    }
    return it->second;
  }
  template <typename T>
  T* ptr_or_null(const std::string& name) {
    return has(name) ? at(name).ptr<T>() : nullptr;
  }
  int64_t scalar_int(const std::string& name) { return at(name).ptr<int64_t>()[0]; }
  double scalar_double(const std::string& name) { return at(name).ptr<double>()[0]; }
};

// Scratch memory of a launcher (at::empty): poisoned, named for the race detector.
struct Scratch {
  Tensor t;
  Scratch(size_t bytes, const std::string& name) {
    t.allocate(std::max<size_t>(bytes, 1));
    std::memset(t.data, 0xFF, t.bytes);
    name_memory(t.data, t.bytes, "scratch " + name);
  }
  template <typename T>
  T* ptr() const {
    return t.ptr<T>();
  }
};

inline Request read_request(const char* path) {
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr) {
    std::perror(path);
    std::exit(2);
  }
  Request r;
  char word[256];
  auto fail_format = [&] {
    std::fprintf(stderr, "driver: malformed request %s\n", path);
    std::exit(2);
  };
  if (std::fscanf(f, "op %255s\n", word) != 1) fail_format();
  r.op = word;
  while (std::fscanf(f, "%255s", word) == 1 && std::strcmp(word, "end") != 0) {
    if (std::strcmp(word, "tensor") != 0) fail_format();
    char name[256], dtype[32];
    int ndim = 0;
    if (std::fscanf(f, "%255s %31s %d", name, dtype, &ndim) != 3) fail_format();
    Tensor t;
    t.dtype = dtype;
    for (int i = 0; i < ndim; ++i) {
      long long d;
      if (std::fscanf(f, "%lld", &d) != 1) fail_format();
      t.shape.push_back(d);
    }
    unsigned long long bytes;
    if (std::fscanf(f, "%llu", &bytes) != 1 || std::fgetc(f) != '\n') fail_format();
    t.allocate(bytes);
    if (std::fread(t.data, 1, bytes, f) != bytes) fail_format();
    name_memory(t.data, std::max<size_t>(bytes, 1), name);
    r.tensors[name] = std::move(t);
  }
  std::fclose(f);
  return r;
}

inline void write_tensors(const char* path, const Request& r) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr) {
    std::perror(path);
    std::exit(2);
  }
  std::fprintf(f, "op %s\n", r.op.c_str());
  for (const auto& [name, t] : r.tensors) {
    std::fprintf(f, "tensor %s %s %d", name.c_str(), t.dtype.c_str(), static_cast<int>(t.dim()));
    for (int64_t d : t.shape) std::fprintf(f, " %lld", static_cast<long long>(d));
    std::fprintf(f, " %zu\n", t.bytes);
    std::fwrite(t.data, 1, t.bytes, f);
  }
  std::fprintf(f, "end\n");
  std::fclose(f);
}

}  // namespace emu
