// Every dartree op schema, in one place. Kernels register per device in csrc/cpu and csrc/cuda;
// fake (meta) kernels and Python wrappers live in dartree/ops.py.
#include <Python.h>
#include <torch/library.h>

// A bare module: importing dartree._C runs the static registrars below and in the kernel files.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(dartree, m) {
  // Move the accepted tree rows of every layer's K and V into place after a verify pass:
  // kv[..., prefix_len + j, :] = kv[..., prefix_len + accepted[j], :] for j < len(accepted).
  // kv: [..., S, D] contiguous (the whole static cache); accepted: int64 [A], increasing.
  m.def("kv_commit(Tensor(a!) kv, int prefix_len, Tensor accepted) -> ()");
}
