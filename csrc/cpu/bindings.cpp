// Python bindings of the CPU kernels; the GIL is released while they run.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "splitserve CPU kernels: paged attention, KV write, batch-invariant linear";
  m.def("write_kv", &write_kv, "write new tokens' KV into their cache slots",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention,
        "attention of query rows over paged context prefixes (decode and varlen prefill)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_linear_weight", &pack_linear_weight,
        "lay an [N, K] weight out as linear reads it: [ceil(N / 64), K, 64]",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, "batch-invariant x @ w.T (+ bias) over a packed weight",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
