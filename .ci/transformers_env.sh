#!/usr/bin/env bash
# A virtual environment with one transformers release beside the development one (.venv), for
# `make test-transformers`: .venv-transformers/VERSION holds transformers VERSION and the tokenizers and
# huggingface_hub it pins; everything else (torch, pytest, hypothesis, beamsearch itself) is read from .venv's
# site-packages, which a .pth file adds after the environment's own. So an environment costs seconds and no
# second torch; what it installs is listed in .venv-transformers/VERSION/installed.txt.
#
#   .ci/transformers_env.sh VERSION      (prints the environment's python)
set -euo pipefail
cd "$(dirname "$0")/.."
version="$1"
env=".venv-transformers/$version"
base_site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -f "$env/.installed" ]; then
    rm -rf "$env"
    # the interpreter .venv was made with: the .pth below reads .venv's site-packages, built for that Python
    "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$env"
    site="$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; site.addsitedir('$base_site')" > "$site/zz_development_venv.pth"
    # pip sees .venv's packages through the .pth file: it installs only what this release needs otherwise
    # (and cannot uninstall .venv's copies, which it reports as outside the environment)
    "$env/bin/python" -m pip install -q --disable-pip-version-check "transformers==$version" \
        -c <(echo "torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')") \
        2>&1 | grep -v "outside environment\|is ignored: it is neither" >&2 || true
    "$env/bin/python" -m pip list --path "$site" --format freeze > "$env/installed.txt" 2>/dev/null
    "$env/bin/python" -c "import transformers, sys; assert transformers.__version__ == sys.argv[1], transformers.__version__" "$version"
    touch "$env/.installed"
fi
echo "$env/bin/python"
