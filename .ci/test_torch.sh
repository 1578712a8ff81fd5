#!/usr/bin/env bash
# The whole test suite under each listed torch release (make test-torch):
#   .ci/test_torch.sh 2.6.0 2.15.0
# Each release runs in its own environment (.ci/torch_env.sh: that torch, and .venv's transformers, test tools and
# beamsearch), its log in .venv-torch/VERSION/test.log; a summary line per release at the end; exits non-zero if
# any release fails. Extra pytest arguments (a subset of the suite) can follow a `--`:
#   .ci/test_torch.sh 2.6.0 -- tests/test_engine.py
set -uo pipefail
cd "$(dirname "$0")/.."
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ $# -gt 0 ] && shift
status=0
summary=()
for version in "${versions[@]}"; do
    echo "== torch $version"
    python="$(.ci/torch_env.sh "$version")" || { summary+=("$version: environment failed"); status=1; continue; }
    started=$SECONDS
    log="$(dirname "$(dirname "$python")")/test.log"
    "$python" -c 'import torch, transformers; print("torch", torch.__version__, torch.__file__, "transformers",
                                                   transformers.__version__)' > "$log" 2>&1
    if "$python" -m pytest -q -p no:cacheprovider -p no:warnings -rfE "$@" >> "$log" 2>&1; then
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
