import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# CI (CI=true) runs the property tests on a fixed sequence of examples, so that a run's verdict does not depend on
# which random examples it drew; a local run draws new ones each time (and keeps failures in .hypothesis/), which
# is where new edge cases are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")
