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

  // Attention of T draft-tree queries over a static KV cache (the target's verify pass).
  // q [B, Hq, T, D]; k, v [B, Hkv, S, D], the tree's own keys at rows [prefix_len, prefix_len + T);
  // tree_mask bool [B, T, T], True where key j is query i or one of its ancestors. Query i sees
  // keys [0, prefix_len) and the tree keys its mask row allows; rows after prefix_len + T are never
  // read. Hq % Hkv == 0 (grouped-query heads); scale defaults to D ** -0.5.
  // Returns a new contiguous [B, Hq, T, D] tensor in q's dtype.
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor tree_mask, int prefix_len, "
        "float? scale=None) -> Tensor");
}
