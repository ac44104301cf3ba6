// Schemas of the `torch.ops.overlap` flat-buffer and quantised ops and of the CPU AdamW step,
// and the Python module `overlap._C` whose import loads them. Implementations: flat_ops_cpu.cpp,
// flat_ops_cuda.cpp, quant_ops_cpu.cpp, quant_ops_cuda.cpp (semantics of the quantised ops:
// kernels/quantized.py), adamw_cpu.cpp (semantics: overlap/optim/reference.py).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(overlap, m) {
  m.def("pack(Tensor[] srcs, Tensor(a!) dst, int[] offsets, float scale) -> ()");
  m.def("accumulate(Tensor(a!) dst, Tensor src, float scale, int num_chunks) -> ()");
  m.def("quantize(Tensor src, Tensor(a!) q, Tensor(b!) scales, Tensor(c!)? error, int block, int bits) -> ()");
  m.def("dequantize_accumulate(Tensor(a!) dst, Tensor q, Tensor scales, int block, int bits, int chunks) -> ()");
  m.def("dequantize_into(Tensor(a!) dst, Tensor q, Tensor scales, int block, int bits) -> ()");
  m.def("adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float decay, "
        "float beta1_weight, float beta2, float one_minus_beta2, float bias2_sqrt, float eps, float neg_step_size, "
        "bool maximize) -> ()");
}

// The module has no Python functions of its own: importing it registers the ops above.
static struct PyModuleDef overlap_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&overlap_c_module); }
