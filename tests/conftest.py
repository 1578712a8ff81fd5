import os
import sys

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# CI (CI=true) runs the property tests on a fixed sequence of examples, so that a run's verdict does not depend on
# which random examples it drew; a local run draws new ones each time (and keeps failures in .hypothesis/), which
# is where new edge cases are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


@pytest.fixture
def steps_run(monkeypatch) -> list[str]:
    """The type name of the state of each step the Hugging Face adapter chose (which step ran)."""
    from beamsearch.adapters import hf as hf_adapter

    names: list[str] = []
    original = hf_adapter.model_step

    def recording(*args, **kwargs):
        step, state = original(*args, **kwargs)
        names.append(type(state).__name__)
        return step, state

    monkeypatch.setattr(hf_adapter, "model_step", recording)
    return names
