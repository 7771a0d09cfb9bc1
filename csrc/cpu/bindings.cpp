// Python bindings of the CPU kernels; the GIL is released while they run.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "splitserve CPU paged-attention kernels";
  m.def("write_kv", &write_kv, "write new tokens' KV into their cache slots",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention,
        "attention of query rows over paged context prefixes (decode and varlen prefill)",
        py::call_guard<py::gil_scoped_release>());
}
