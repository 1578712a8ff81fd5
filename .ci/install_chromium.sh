#!/usr/bin/env bash
# Chromium for tests/test_trace_browser.py (the search-tree page drawn in a real headless browser): Debian's
# `chromium` package, installed where no Chromium is on PATH (a fresh machine has none). It needs root, or sudo
# without a password; without them, or when apt-get fails twice, it exits non-zero, so that CI does not go on
# without the browser test (under CI=true that test fails where no browser is found).
set -euo pipefail
for browser in chromium chromium-headless-shell chromium-browser google-chrome chrome; do
    if command -v "$browser" >/dev/null; then
        echo "Chromium: $(command -v "$browser")"
        exit 0
    fi
done
as_root=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        echo "install_chromium: no Chromium on PATH and no root for apt-get (apt-get install chromium)" >&2
        exit 1
    fi
fi
for attempt in 1 2; do
    if "${as_root[@]}" apt-get update -qq && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq chromium >/dev/null; then
        echo "Chromium: installed $(chromium --version 2>/dev/null || echo '(no version)')"
        exit 0
    fi
    echo "install_chromium: apt-get failed (attempt $attempt)" >&2
    sleep 10
done
exit 1
