// A decoder layer's small ops (RMSNorm, RoPE, attention) as MLX primitives
// on the CPU stream; step_ops.cpp says why.
#pragma once

#include <nanobind/nanobind.h>

// Adds rms_norm, rope and sdpa to the extension module.
void add_step_ops(nanobind::module_& m);
