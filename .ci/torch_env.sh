#!/usr/bin/env bash
# A virtual environment with one torch release beside the development one (.venv), for `make test-torch`:
# .venv-torch/VERSION holds torch VERSION and what that release requires (on Linux x86_64 the registry's build is
# the CUDA one, with its NVIDIA libraries: a few GB, which runs on the CPU); everything else (transformers, pytest,
# hypothesis, ray, beamsearch itself) is read from .venv's site-packages, which a .pth file adds after the
# environment's own, so that this torch is the one imported. What it installs is listed in
# .venv-torch/VERSION/installed.txt.
#
#   .ci/torch_env.sh VERSION      (prints the environment's python)
#
# PIP_CONSTRAINT=/dev/null: a machine whose pip configuration caps torch (a constraints file naming the releases on
# its disk) would refuse any other release; the cap is for .venv, not for these environments.
set -euo pipefail
cd "$(dirname "$0")/.."
version="$1"
env=".venv-torch/$version"
base_site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -f "$env/.installed" ]; then
    rm -rf "$env"
    # the interpreter .venv was made with: the .pth below reads .venv's site-packages, built for that Python
    "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$env"
    site="$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # torch first, in an environment that sees nothing else: pip installs every requirement of this release here
    # (its own sympy, networkx, ...), instead of taking .venv's copies made for the pinned release
    PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install -q --disable-pip-version-check "torch==$version" >&2
    "$env/bin/python" -m pip list --path "$site" --format freeze > "$env/installed.txt" 2>/dev/null
    echo "import site; site.addsitedir('$base_site')" > "$site/zz_development_venv.pth"
    "$env/bin/python" - "$version" "$site" <<'PY'
import sys, torch, transformers
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert torch.__file__.startswith(sys.argv[2]), torch.__file__  # this environment's torch, not .venv's
assert transformers.is_torch_available(), "transformers does not accept this torch"
PY
    touch "$env/.installed"
fi
echo "$env/bin/python"
