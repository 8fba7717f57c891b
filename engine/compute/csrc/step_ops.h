// A decoder layer's small ops (RMSNorm, RoPE, attention) as MLX primitives
// on the CPU stream; step_ops.cpp says why.
#pragma once

#include <nanobind/nanobind.h>

// Adds rms_norm, rope, sdpa, logsumexp and swiglu to the extension module.
void add_step_ops(nanobind::module_& m);

// Adds sdpa (step_sdpa.cpp).
void add_sdpa(nanobind::module_& m);
