// A decoder layer's small ops (RMSNorm, RoPE, attention) as MLX primitives
// on the CPU stream; step_ops.cpp says why.
#pragma once

#include <nanobind/nanobind.h>

#include <vector>

#include "mlx/array.h"

// Adds rms_norm, rope, sdpa, cache_write, logsumexp and swiglu to the extension module.
void add_step_ops(nanobind::module_& m);

// Adds sdpa (step_sdpa.cpp).
void add_sdpa(nanobind::module_& m);

// Adds sdpa_quant (step_sdpa_quant.cpp).
void add_sdpa_quant(nanobind::module_& m);

// Adds cache_write (step_cache.cpp).
void add_cache_write(nanobind::module_& m);

// Adds prompt_sdpa (prompt_sdpa.cpp).
void add_prompt_sdpa(nanobind::module_& m);

// Adds dequantize (prompt_dequant.cpp).
void add_prompt_dequant(nanobind::module_& m);

// Adds expert_glu and slot_rows (expert_ops.cpp).
void add_expert_ops(nanobind::module_& m);

namespace flashserve_step {

// A step op whose result feeds a quantized matmul (RMSNorm before q/k/v and
// gate/up, SwiGLU before down) is computed by the matmul on its way in: one
// graph node less each (graph_folds.h says why that matters), the same
// numbers (the same function computes them). Were the result read elsewhere
// too, its node stays for that reader. qmm_module.cpp asks what made its input.
enum class PrologueKind : int { none = 0, rms_norm = 1, swiglu = 2 };

struct Prologue {
  PrologueKind kind = PrologueKind::none;
  std::vector<mlx::core::array> inputs;  // the op's inputs
  float eps = 0.0f;                      // RMSNorm's
};

// The step op that made x (an array not yet evaluated), or kind none.
Prologue prologue_of(const mlx::core::array& x);

// That op's result for `inputs` (evaluated), row-major into `out`.
void run_prologue(PrologueKind kind, float eps, const std::vector<mlx::core::array>& inputs,
                  float* out);

// swiglu's numbers for `rows` contiguous rows of `cols` (gate, x, out): row by
// row, as the swiglu op computes them (its vector and tail paths split by row).
void swiglu_rows(const float* gate, const float* x, float* out, int64_t rows, int cols);

}  // namespace flashserve_step
