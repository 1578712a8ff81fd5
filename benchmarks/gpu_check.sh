#!/usr/bin/env bash
# The GPU check, in one run on a machine with an NVIDIA GPU, from the repository root:
#
#     bash benchmarks/gpu_check.sh
#
# 1. the environment: nvidia-smi, Python, torch (and its CUDA), transformers and the packages the suite reads;
# 2. the graph path's tests: tests/test_cuda.py -k cuda_graphs (capture and replay on the device), then
#    tests/test_cuda_graphs.py and tests/test_static_cache.py (the same step uncaptured, on the CPU);
# 3. the benchmark (benchmarks/suite.py --device cuda --table graphs): transformers' generate against ours eager
#    (cuda_graphs=False) and ours by default (no option: the graph path, which each row checks it took) on the
#    workloads and the 1B Llama shape in bfloat16, greedy and beam 4, batches 16, 64 and 1 (the targets' rows
#    first), each difference from transformers classified (float32: the margin check; bfloat16 / float16: issue
#    39's rule, both hypotheses scored in float32, at most 0.01 nats per token lost, printed beside its control:
#    transformers' static cache against its default); the suite starts no case
#    after its time budget, and prints each row as it finishes;
# 4. the rest of the CUDA tests (tests/test_cuda.py without the graph cases, tests/test_stopping.py) with the time
#    left (at least 60 s).
# The graph tests and the benchmark come before the older CUDA tests so that the new path's results come first
# when time runs short. Every step goes on after a failure, and tests list every failure with its traceback.
#
# Everything is written under $OUT (default ./gpu_out): environment.log, graph_tests.log, suite_cuda.log,
# suite-gpu.md (or, stopped early, suite-gpu.partial.md: the rows it finished), cuda_tests.log, status.txt. The
# exit status is the first failing step's.
#
# Without network access: the Hugging Face adapter works with the transformers releases it is tested with (4.57 to
# 5.24, adapters/hf_compat.py); the machine's own (5.17 in the device image) is one. To measure with the pinned one
# (requirements-dev.txt) instead, put its wheel (and a huggingface_hub it accepts) in $GPU_WHEELS (default
# runs/gpu_wheels, an ignored folder: carry it); they are unpacked into a temporary folder placed first on
# PYTHONPATH (no pip, no network).
#
# Settings (environment): PYTHON (python3), OUT, GPU_WHEELS, TIME_BUDGET (seconds for the whole run, 300),
# SUITE_DEVICE (cuda; cpu only to try this script where there is no GPU), SUITE_MODELS, SUITE_BEAMS, SUITE_BATCHES,
# SUITE_REPEATS, SUITE_ENGINES, SKIP_TESTS (1: the benchmark only).

set -u -o pipefail

OUT="${OUT:-./gpu_out}"
PYTHON="${PYTHON:-python3}"
GPU_WHEELS="${GPU_WHEELS:-runs/gpu_wheels}"
TIME_BUDGET="${TIME_BUDGET:-300}"
SUITE_DEVICE="${SUITE_DEVICE:-cuda}"
SUITE_MODELS="${SUITE_MODELS:-t5-small,gpt2,llama-1b,g2p,t5-small-eos,llama,qwen2,mistral}"
SUITE_BEAMS="${SUITE_BEAMS:-4,1}"
SUITE_BATCHES="${SUITE_BATCHES:-16,64,1}"
SUITE_REPEATS="${SUITE_REPEATS:-2}"
SUITE_ENGINES="${SUITE_ENGINES:-hf,ours,ours-graphs}"
SKIP_TESTS="${SKIP_TESTS:-0}"

mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
left() { local l=$(( TIME_BUDGET - SECONDS )); [ "$l" -lt "$1" ] && l=$1; echo "$l"; }

# ---------------------------------------------------------------------------------------------- environment
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm) $(git rev-parse --short HEAD 2>/dev/null)" \
    | tee "$OUT/environment.log"
if compgen -G "$GPU_WHEELS/*.whl" > /dev/null; then
    site="$(mktemp -d /tmp/beamsearch-gpu-site.XXXXXX)"
    for wheel in "$GPU_WHEELS"/*.whl; do
        echo "unpacking $wheel into $site" | tee -a "$OUT/environment.log"
        "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$site"
    done
    export PYTHONPATH="$site:$PYTHONPATH"
fi
{
    echo "PYTHONPATH=$PYTHONPATH"
    echo "== nvidia-smi"
    nvidia-smi -L || echo "nvidia-smi failed (status $?)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm --format=csv 2>/dev/null
    echo "== versions"
    "$PYTHON" - <<'PY'
import importlib
import platform
import sys

print("python", platform.python_version(), sys.executable)
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available(),
      "cpu threads", torch.get_num_threads())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    print("sdpa backends: flash", torch.backends.cuda.flash_sdp_enabled(), "mem_efficient",
          torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn", torch.backends.cuda.cudnn_sdp_enabled())
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "numpy", "pytest", "hypothesis",
             "matplotlib", "ctranslate2"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as error:  # noqa: BLE001 - report and go on
        print(name, "not importable:", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
try:
    import transformers

    from beamsearch.hf_compat import untested_message

    print(untested_message(transformers.__version__) or "transformers release in the tested range")
except Exception as error:  # noqa: BLE001
    print("transformers not importable:", error)
PY
} 2>&1 | tee -a "$OUT/environment.log"

# ---------------------------------------------------------------------------------------------- graph tests
graph_status=0
if [ "$SKIP_TESTS" != 1 ]; then
    echo "== graph tests ($(date -u +%H:%M:%S))"
    TORCH_SHOW_CPP_STACKTRACES=1 timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --tb=long \
        --durations=5 tests/test_cuda.py -k cuda_graphs tests/test_cuda_graphs.py tests/test_static_cache.py \
        tests/test_half_precision_rule.py \
        2>&1 | tee "$OUT/graph_tests.log" | tail -n 60
    graph_status=${PIPESTATUS[0]}
fi

# ---------------------------------------------------------------------------------------------- benchmark
budget=$(left 60)
[ "$budget" -gt 75 ] && budget=$(( budget - 75 ))  # keep time for the other CUDA tests
echo "== suite on $SUITE_DEVICE ($(date -u +%H:%M:%S), cases started within ${budget}s)"
rm -f "$OUT/suite-gpu.md" "$OUT/suite-gpu.partial.md"
timeout --signal=INT --kill-after=20 $(( budget + 90 )) "$PYTHON" benchmarks/suite.py --device "$SUITE_DEVICE" \
    --engines "$SUITE_ENGINES" --models "$SUITE_MODELS" --beams "$SUITE_BEAMS" --batches "$SUITE_BATCHES" \
    --repeats "$SUITE_REPEATS" --lengths "" --table graphs --time-budget "$budget" --no-plot \
    --markdown-out "$OUT/suite-gpu.md" 2>&1 | tee "$OUT/suite_cuda.log"
suite_status=$?
if [ ! -s "$OUT/suite-gpu.md" ]; then  # stopped or failed: the rows it finished, under the table's header
    {
        echo "Partial run (status $suite_status): the rows finished before it stopped; see suite_cuda.log."
        echo
        "$PYTHON" -c 'import sys; sys.path.insert(0, "benchmarks"); import suite_graphs
print("\n".join(suite_graphs.table([])))'
        grep '^| ' "$OUT/suite_cuda.log" | grep -v '^| model ' | grep -v '^|---' | sort -u || true
    } > "$OUT/suite-gpu.partial.md" 2>&1
fi

# ---------------------------------------------------------------------------------------------- other CUDA tests
tests_status=0
if [ "$SKIP_TESTS" != 1 ]; then
    rest=$(left 60)
    echo "== other CUDA tests ($(date -u +%H:%M:%S), at most ${rest}s)"
    timeout "$rest" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/test_cuda.py \
        -k "not cuda_graphs" tests/test_stopping.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -n 40
    tests_status=${PIPESTATUS[0]}
fi

{
    echo "graph_tests_status=$graph_status"
    echo "suite_status=$suite_status"
    echo "cuda_tests_status=$tests_status"
    echo "seconds=$SECONDS"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null
} | tee "$OUT/status.txt"
for status in "$graph_status" "$suite_status" "$tests_status"; do
    [ "$status" -ne 0 ] && exit "$status"
done
exit 0
