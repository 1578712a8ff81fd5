#!/usr/bin/env bash
# The GPU check, in one run on a machine with an NVIDIA GPU, from the repository root:
#
#     bash benchmarks/gpu_check.sh
#
# 1. the environment: nvidia-smi -L, Python, torch (and its CUDA), transformers and the packages the suite reads;
# 2. the CUDA tests (tests/test_cuda.py) and tests/test_stopping.py (its CUDA criterion test), stopping at the
#    first failure; after a failure, once more without -x, so that every failure is listed;
# 3. a short benchmark suite run on the GPU (benchmarks/suite.py --device cuda, engines hf and ours: CTranslate2
#    is not needed, the compiled engines are left out because their compiling warm-ups would take the time),
#    stopped after the time left of a 6-minute budget; its table goes to suite-h100.md, or, when stopped early,
#    the rows it finished to suite-h100.partial.md.
#
# Everything is written under $OUT (default ./gpu_out): environment.log, cuda_tests.log (cuda_tests_all.log after
# a failure), suite_cuda.log, suite-h100.md, suite-h100.png, status.txt. The script goes on to the benchmark when
# tests fail; it exits with the tests' status, else the suite's.
#
# Without network access: the Hugging Face adapter follows transformers' private generation helpers of the pinned
# version (requirements-dev.txt); GenerationMixin._maybe_prepare_encoder_kwargs_for_generation, which it calls,
# appeared in transformers 5.18. If the machine has an older transformers, put the wheels of the pinned one (and of
# a huggingface_hub it accepts) in $GPU_WHEELS (default runs/gpu_wheels, an ignored folder: carry it); they are
# unpacked into a temporary folder placed first on PYTHONPATH (no pip, no network).
#
# Settings (environment): PYTHON (python3), OUT, GPU_WHEELS, TIME_BUDGET (seconds, 330), SUITE_DEVICE (cuda; cpu only
# to try this script where there is no GPU), SUITE_MODELS, SUITE_BEAMS, SUITE_BATCHES, SUITE_REPEATS, SUITE_ENGINES.

set -u -o pipefail

OUT="${OUT:-./gpu_out}"
PYTHON="${PYTHON:-python3}"
GPU_WHEELS="${GPU_WHEELS:-runs/gpu_wheels}"
TIME_BUDGET="${TIME_BUDGET:-330}"
SUITE_DEVICE="${SUITE_DEVICE:-cuda}"
SUITE_MODELS="${SUITE_MODELS:-t5-small,t5-small-eos,g2p,gpt2,llama}"
SUITE_BEAMS="${SUITE_BEAMS:-1,4}"
SUITE_BATCHES="${SUITE_BATCHES:-1,16,64}"
SUITE_REPEATS="${SUITE_REPEATS:-3}"
SUITE_ENGINES="${SUITE_ENGINES:-hf,ours}"

mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# ---------------------------------------------------------------------------------------------- environment
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm)" | tee "$OUT/environment.log"
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
    echo "== nvidia-smi -L"
    nvidia-smi -L || echo "nvidia-smi failed (status $?)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    echo "== versions"
    "$PYTHON" - <<'PY'
import importlib
import platform
import sys

print("python", platform.python_version(), sys.executable)
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "numpy", "pytest", "hypothesis",
             "matplotlib", "ctranslate2"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as error:  # noqa: BLE001 - report and go on
        print(name, "not importable:", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
try:
    from transformers.generation.utils import GenerationMixin

    if not hasattr(GenerationMixin, "_maybe_prepare_encoder_kwargs_for_generation"):
        print("WARNING: this transformers lacks GenerationMixin._maybe_prepare_encoder_kwargs_for_generation "
              "(added in 5.18): beamsearch.generate will fail (see GPU_WHEELS in benchmarks/gpu_check.sh)")
except Exception as error:  # noqa: BLE001
    print("transformers generation utilities not importable:", error)
PY
} 2>&1 | tee -a "$OUT/environment.log"

# ---------------------------------------------------------------------------------------------- tests
echo "== tests ($(date -u +%H:%M:%S))"
timeout 240 "$PYTHON" -m pytest -q tests/test_cuda.py tests/test_stopping.py -x -p no:cacheprovider -rs \
    2>&1 | tee "$OUT/cuda_tests.log"
tests_status=$?
if [ "$tests_status" -ne 0 ] && [ "$SECONDS" -lt 150 ]; then
    echo "== tests failed (status $tests_status): again without -x, to list every failure"
    timeout 150 "$PYTHON" -m pytest -q tests/test_cuda.py tests/test_stopping.py -p no:cacheprovider -rfEs \
        2>&1 | tail -n 80 > "$OUT/cuda_tests_all.log"
    tail -n 40 "$OUT/cuda_tests_all.log"
fi

# ---------------------------------------------------------------------------------------------- benchmark suite
left=$(( TIME_BUDGET - SECONDS ))
[ "$left" -lt 60 ] && left=60
echo "== suite on $SUITE_DEVICE ($(date -u +%H:%M:%S), at most ${left}s)"
rm -f "$OUT/suite-h100.md" "$OUT/suite-h100.partial.md"
timeout --signal=INT --kill-after=20 "$left" "$PYTHON" benchmarks/suite.py --device "$SUITE_DEVICE" \
    --engines "$SUITE_ENGINES" --models "$SUITE_MODELS" --beams "$SUITE_BEAMS" --batches "$SUITE_BATCHES" \
    --repeats "$SUITE_REPEATS" --lengths "" --plot "$OUT/suite-h100.png" --markdown-out "$OUT/suite-h100.md" \
    2>&1 | tee "$OUT/suite_cuda.log"
suite_status=$?
if [ ! -s "$OUT/suite-h100.md" ]; then  # stopped or failed: the rows it finished, under the table's header
    {
        echo "Partial run (status $suite_status): the rows finished before it stopped; see suite_cuda.log."
        echo
        "$PYTHON" -c 'import sys; sys.path.insert(0, "benchmarks"); import suite; print("\n".join(suite.table([])))'
        grep '^| ' "$OUT/suite_cuda.log" | grep -v '^| model ' || true
    } > "$OUT/suite-h100.partial.md" 2>&1
fi

{
    echo "tests_status=$tests_status"
    echo "suite_status=$suite_status"
    echo "seconds=$SECONDS"
} | tee "$OUT/status.txt"
[ "$tests_status" -ne 0 ] && exit "$tests_status"
exit "$suite_status"
