#!/usr/bin/env bash
# The GPU check (issue 43): flashserve's token-identity tests and its bench on MLX's
# default device. It installs nothing: run it where flashserve, its test dependencies and
# an MLX with a GPU backend import (`pip install -e ".[cuda13,test]"`, or the lent-machine
# kit in ../shared/gpu, whose run.sh installs into PYTHONPATH and PATH first).
#
#   bash tests/gpu/check.sh                  # from anywhere; runs in the repository root
#
# 1. device: MLX's default device, versions; stops (exit 3) unless it is a GPU
# 2. identity: streaming, experts, batching, prompt cache (memory and disk), prefill:
#    greedy tokens equal to the fully resident model's on the same device; issue 46's
#    expert path (prefetch, store reads, next turn, kv_bits); then tests/gpu/expert_stages.py
# 3. bench: flashserve bench --sections layers,experts,batch,prefill at full size (the CPU
#    takes far longer; a big GPU a few minutes)
# Results in $OUT: summary.txt, device.txt, pytest.log, bench.txt. Exit 0 only if every
# step passed.
# Env: PY (python3), OUT (/tmp/flashserve-gpu-check), BUDGET (seconds for it all, 560),
# GPU_CHECK_CPU=1 (run on the CPU: a dry run of this script), GPU_CHECK_TESTS (another
# test list), GPU_CHECK_WORKERS (pytest-xdist workers, 4), BENCH_ARGS (e.g. --quick).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/../.." || exit 2
PY=${PY:-python3}
OUT=${OUT:-/tmp/flashserve-gpu-check}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
SUM=$OUT/summary.txt
: >"$SUM"
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
note() { echo "$*" | tee -a "$SUM"; }
failed=0

# ------------------------------------------------------------------ 1: device
"$PY" - >"$OUT/device.txt" 2>&1 <<'EOF'
import importlib.metadata as md
import mlx.core as mx
print("default_device", mx.default_device(), "gpu_available", mx.is_available(mx.gpu))
for dist in ("mlx", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal", "mlx-lm", "flashserve"):
    try:
        print(" ", dist, md.version(dist))
    except md.PackageNotFoundError:
        pass
from flashserve.engine.compute import device
from flashserve.engine.weights.model import compute_dtype
device.select("auto")
print("flashserve device", device.describe(), "compute dtype", compute_dtype())
EOF
note "$(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname) $(date -u +%FT%TZ)"
note "$(cat "$OUT/device.txt")"
if ! grep -q "flashserve device gpu" "$OUT/device.txt" && [ "${GPU_CHECK_CPU:-0}" != 1 ]; then
    note "NO GPU: MLX's default device is not a GPU (set GPU_CHECK_CPU=1 for a dry run)"
    exit 3
fi

# ------------------------------------------------------------------ 2: identity tests
TESTS=${GPU_CHECK_TESTS:-"tests/test_streaming.py tests/test_experts.py tests/test_batching.py
tests/test_prompt_cache.py tests/test_prompt_cache_disk.py tests/test_prefill.py tests/test_alignment.py
tests/test_expert_prefetch.py tests/test_expert_direct_reads.py tests/test_next_turn_pressure.py
tests/test_prompt_disk_race.py tests/test_kv_quantization.py"}
# Not here: the default model's GGUF (a separate wheel) and flashserve's CPU-only kernel.
KEXPR="not default_gguf and not default_model and not fast_kernel"
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n ${GPU_CHECK_WORKERS:-4}"
PLUGIN=""  # the kit's per-worker PTX cache, where it is importable
"$PY" -c "import fsgpu_ptx" 2>/dev/null && PLUGIN="-p fsgpu_ptx"
# shellcheck disable=SC2086  # word splitting of the lists is intended
timeout -s INT -k 10 $(($(left) * 55 / 100)) "$PY" -m pytest $PLUGIN $XDIST -q -rfE --tb=short \
    -o log_level=WARNING -k "$KEXPR" $TESTS >"$OUT/pytest.log" 2>&1
rc=$?
note "identity tests rc=$rc: $(grep -E '^=* ?[0-9]+ (passed|failed).*' "$OUT/pytest.log" | tail -1)"
grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | head -30 | tee -a "$SUM"
[ "$rc" = 0 ] || failed=1

# Where an expert's numbers part from the whole call's, stage by stage (all zeros on the CPU)
timeout -s INT -k 5 60 "$PY" tests/gpu/expert_stages.py "$OUT/stages" >"$OUT/stages.txt" 2>&1
note "expert stages rc=$?: $(grep -c "'out': '0'" "$OUT/stages.txt") of 6 calls equal per expert"
grep -E "^mlx.core.float" "$OUT/stages.txt" >>"$SUM"

# ------------------------------------------------------------------ 3: bench
BENCH=(flashserve)
command -v flashserve >/dev/null || BENCH=("$PY" -m flashserve.server.cli.main)
# shellcheck disable=SC2086
timeout -s INT -k 10 $(($(left) - 5)) "${BENCH[@]}" bench --sections layers,experts,batch,prefill \
    --work-dir "$OUT/bench-models" ${BENCH_ARGS:-} >"$OUT/bench.txt" 2>&1
rc=$?
note "bench rc=$rc"
grep -E "^(float matmuls|\||[A-Z][a-z].*:$)|Traceback|Error" "$OUT/bench.txt" | head -80 >>"$SUM"
[ "$rc" = 0 ] || failed=1
rm -rf "$OUT/bench-models"  # GBs of random models
note "done in $(($(date +%s) - T0)) s; $([ $failed = 0 ] && echo PASS || echo FAIL)"
exit $failed
