// Python bindings of the CPU kernels; the GIL is released while they run.
#include "decoder_layer.h"
#include "group_quant.h"
#include "lora_products.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "splitserve CPU kernels: paged attention, KV write, batch-invariant linear, fused per-row ops";
  m.def("write_kv", &write_kv, "write new tokens' KV into their cache slots",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention,
        "attention of query rows over paged context prefixes (decode and varlen prefill)",
        py::call_guard<py::gil_scoped_release>());
  m.def("attention_path", &attention_path,
        "which path paged_attention takes for a dtype and head shape, in words");
  m.def("pack_linear_weight", &pack_linear_weight,
        "lay an [N, K] weight out as linear reads it: [ceil(N / 64), K, 64]",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_dot_product_kernel", &int8_dot_product_kernel,
        "whether this build has the AVX512-VNNI W8A8 kernel");
  m.def("pack_int8_quads", &pack_int8_quads,
        "lay an [N, K] int8 weight out for linear_int8; returns (packed, column sums)",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_int8", &linear_int8, "batch-invariant W8A8: x quantized per row, int32 sums",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("colsums"),
        py::arg("out_features"), py::arg("bias") = py::none(), py::arg("kernel") = "auto",
        py::call_guard<py::gil_scoped_release>());
  m.def("group_quant_paths", &group_quant_paths,
        "the paths of the group-quantized linear in this build: [fp32 activations, int8 ones]");
  m.def("linear_group_quant", &linear_group_quant,
        "batch-invariant x @ w.T over group-quantized weights, dequantized in registers",
        py::arg("x"), py::arg("codes"), py::arg("low"), py::arg("high"), py::arg("super_scale"),
        py::arg("sub_scale"), py::arg("super_min"), py::arg("sub_min"), py::arg("bits"),
        py::arg("group"), py::arg("per_super"), py::arg("zero"), py::arg("out_features"),
        py::arg("kernel") = "auto", py::call_guard<py::gil_scoped_release>());
  m.def("repack_kquant_amx", &repack_kquant_amx,
        "Q2_K-Q6_K parts in the panels of linear_group_quant's int8-amx and int8-panels kernels",
        py::call_guard<py::gil_scoped_release>());
  m.def("repack_block_panels", &repack_block_panels,
        "Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 parts in the panels of the int8-amx and int8-panels "
        "kernels",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot_product_kernel", &bf16_dot_product_kernel,
        "whether this build has the AVX512-BF16 dot-product kernel");
  m.def("amx_tiles", &amx_tiles,
        "whether the bf16 and int8 linears run on AMX tiles: on, refused or absent");
  m.def("pack_bf16_pairs", &pack_bf16_pairs,
        "lay an [N, K] bf16 weight out in pairs: [ceil(N / 64), pairs, 128]",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16_pairs", &linear_bf16_pairs,
        "x @ w.T (+ bias) over pair-packed bf16 weights, by the named kernel", py::arg("x"),
        py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("kernel") = "auto", py::arg("float_out") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_silu_mul_bf16_pairs", &linear_silu_mul_bf16_pairs,
        "silu(gate) * up over a pair-packed gate_up, by the named kernel", py::arg("x"),
        py::arg("packed"), py::arg("inter"), py::arg("kernel") = "auto", py::arg("bf16_out") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_features", &cpu_features, "instruction sets the kernels were built with");
  m.def("core_peak_gops", &core_peak_gops, "one core's multiply-add peak, measured (Gop/s)",
        py::arg("numerics"), py::arg("iterations") = 20000000,
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, "batch-invariant x @ w.T (+ bias) over a packed weight",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("float_out") = false, py::call_guard<py::gil_scoped_release>());
  m.def("linear_silu_mul", &linear_silu_mul,
        "silu(gate) * up of x @ w.T over a gate_up weight packed as pairs of panels",
        py::arg("x"), py::arg("packed"), py::arg("inter"), py::arg("bf16_out") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add", &lora_add, "y += LoRA products", py::arg("y"), py::arg("x"), py::arg("slots"),
        py::arg("a"), py::arg("b"), py::arg("ranks"), py::arg("bounds"),
        py::arg("interleave") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "each row's first maximum, as torch.argmax",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "per-row RMSNorm times weight", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("bf16_out") = false, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place; returns its RMSNorm",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"),
        py::arg("bf16_out") = false, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [rows, 2 * inter] product",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv,
        "rotate q and k, write k and v to the cache; q in the cache's dtype where it rounds",
        py::call_guard<py::gil_scoped_release>());
  m.def("decoder_layer", &decoder_layer, "one Llama-family layer's kernels in one call",
        py::call_guard<py::gil_scoped_release>());
}
