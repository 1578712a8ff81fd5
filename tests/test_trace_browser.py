"""The search-tree page in a real headless browser: it draws one SVG node per trace node, and a screenshot is taken.

Needs a Chromium binary: CI's ``.ci/run`` installs Debian's ``chromium`` first (``.ci/install_chromium.sh``), and
under ``CI=true`` a missing browser fails this test; elsewhere it skips, with the reason (``make test`` says so in one
line before the suite runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from beamsearch.cli.main import main

BROWSERS = ("chromium", "chromium-headless-shell", "chromium-browser", "google-chrome", "chrome")
BROWSER = next((path for path in map(shutil.which, BROWSERS) if path), None)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
pytestmark = pytest.mark.skipif(BROWSER is None and not IN_CI, reason="no Chromium binary on PATH (apt-get install "
                                "chromium, or .ci/install_chromium.sh): the page cannot be checked in a browser here")
# no network (only package registries are reachable here): Chromium's own background connections would be refused,
# many at a time, and slow its start; a fresh profile per run, so that two runs do not share one
QUIET = ("--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-default-apps")


def run_browser(*arguments: str) -> subprocess.CompletedProcess:
    assert BROWSER is not None, "CI runs this test in a browser: .ci/run installs Chromium (.ci/install_chromium.sh)"
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *QUIET,
                   f"--user-data-dir={profile}", *arguments]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


@pytest.mark.parametrize("word, options", [("pneumonia", []), ("nananananananana", ["--loop-guard", "0"])])
def test_the_page_draws_every_node_of_the_trace(tmp_path, capsys, word, options):
    page, data = tmp_path / "tree.html", tmp_path / "trace.json"
    assert main(["trace", word, "--html", str(page), "--json", str(data), *options]) == 0
    trace = json.loads(data.read_text())
    nodes = trace["examples"][0]["nodes"]
    assert capsys.readouterr().out.strip()  # the best output

    dom = run_browser("--dump-dom", page.as_uri()).stdout
    drawn = re.search(r'data-drawn-nodes="(\d+)"', dom)
    assert drawn, "the page's script did not run"
    assert int(drawn.group(1)) == len(nodes) == len(re.findall(r"data-node-id=", dom))

    picture = tmp_path / "tree.png"
    run_browser(f"--screenshot={picture}", "--window-size=1200,480", page.as_uri())
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
