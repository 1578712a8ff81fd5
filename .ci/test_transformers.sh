#!/usr/bin/env bash
# The adapter, parity and exact-parity tests, the architecture sweep and the gate's tests (changed models, PEFT)
# under each listed transformers release (make test-transformers):
#   .ci/test_transformers.sh 4.57.6 5.12.1 5.24.0
# Each release runs in its own environment (.ci/transformers_env.sh: that release, the tokenizers and
# huggingface_hub it pins, and .venv's torch and test tools), its log in .venv-transformers/VERSION/test.log; a
# summary line per release at the end; exits non-zero
# if any release fails.
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=(tests/test_hf_compat.py tests/test_hf_adapter.py tests/test_hf_parity.py tests/test_exact_parity.py
       tests/test_allowed_tokens.py tests/test_lean_llama.py tests/test_architectures.py tests/test_gate.py
       tests/test_changed_models.py tests/test_hf_peft.py)
status=0
summary=()
for version in "$@"; do
    echo "== transformers $version"
    python="$(.ci/transformers_env.sh "$version")" || { summary+=("$version: environment failed"); status=1; continue; }
    started=$SECONDS
    log="$(dirname "$(dirname "$python")")/test.log"
    if "$python" -m pytest -q -p no:cacheprovider -p no:warnings -rf "${TESTS[@]}" > "$log" 2>&1; then
        tail -n 1 "$log"
        summary+=("$version: passed ($((SECONDS - started)) s)")
    else
        grep -E "^(FAILED|ERROR)" "$log" | head -n 40
        tail -n 1 "$log"
        summary+=("$version: FAILED ($((SECONDS - started)) s)")
        status=1
    fi
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
