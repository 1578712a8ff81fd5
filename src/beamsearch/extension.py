"""The compiled extension: the native T5 step (``steps/t5/native.cpp``) and the beam and greedy searches' native
bookkeeping (``strategies/native_search.cpp``), one module built at first use.

- **Built at first use.** ``torch.utils.cpp_extension.load`` compiles the sources once (about 35-60 s) into a
  cache keyed by the sources and where they are, torch, Python, the compiler flags and the CPU (the code is built
  for the CPU it runs on, ``-march=native``, so a binary is never loaded on another CPU or torch):
  ``$BEAMSEARCH_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/beamsearch/native``, else ``~/.cache/beamsearch/native``.
  Later processes load it in a fraction of a second. Where no compiler is available or the build fails, one warning
  says so and the eager paths run. One process at a time builds or loads a folder, under a lock the kernel releases
  when its holder dies (``_build_lock``), so a build killed half-way leaves nothing that makes the next one wait.
- **Turned off** by ``BEAMSEARCH_NATIVE=0`` (then the eager fast step and the Python search run);
  ``BEAMSEARCH_NATIVE_SEARCH=0`` turns off only the search's bookkeeping (the Python search, the native T5 step).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

LOG = logging.getLogger("beamsearch")
HERE = Path(__file__).parent
MODULE_SOURCE = HERE / "extension.cpp"  # the module: registers what the other sources define
COMPILED = (MODULE_SOURCE, HERE / "steps" / "t5" / "native.cpp", HERE / "strategies" / "native_search.cpp")
SOURCES = (*COMPILED, HERE / "steps" / "t5" / "native_kernels.h")  # what a build reads: its key hashes them all
ENVIRONMENT = "BEAMSEARCH_NATIVE"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd")
_OFF = ("0", "false", "no", "off")
_MODULE: list[Any] = []  # [module] once built or loaded, [None] once it failed
_FAILURE: list[str] = []  # why it failed


def native_disabled(variable: str = ENVIRONMENT) -> bool:
    """Whether ``BEAMSEARCH_NATIVE`` (or another switch, ``variable``) turns the native paths off (``0``, ``false``,
    ``no``, ``off``)."""
    return os.environ.get(variable, "").strip().lower() in _OFF


def disabled_reason(variable: str = ENVIRONMENT) -> str:
    return f"{variable}={os.environ[variable]} turns it off"


def extension_reason() -> str | None:
    """Why the extension is not available (None: it is loaded); builds or loads it on the first call."""
    return None if extension() is not None else _FAILURE[0]


def extension() -> Any:
    """The compiled extension, built or loaded on the first call (None where that failed: one warning, then the
    eager paths run)."""
    if not _MODULE:
        try:
            _MODULE.append(_load())
        except Exception as error:  # a compiler's or loader's error of any kind: the eager paths run instead
            lines = str(error).strip().splitlines()
            errors = [line.strip() for line in lines if "error" in line.lower()]  # the compiler's, past the command
            _FAILURE.append((errors[1:] or errors or lines or [type(error).__name__])[0][:300])
            _MODULE.append(None)
            warnings.warn(f"beamsearch: the native extension (the T5 step, the search bookkeeping) is not available "
                          f"({_FAILURE[0]}); the eager fast step and the Python search run instead (set "
                          f"{ENVIRONMENT}=0 to skip the build)", RuntimeWarning, stacklevel=3)
    return _MODULE[0]


def _load() -> Any:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the registry's ninja package (the hf extra) where the system has none
        try:
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        except ImportError:
            pass
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not on PATH (torch.utils.cpp_extension builds with it: pip install ninja)")
    key = build_key()
    folder = cache_root() / key
    folder.mkdir(parents=True, exist_ok=True)
    LOG.info("beamsearch: loading the native extension from %s (built there on first use, about 35-60 s)", folder)
    with _build_lock(folder):
        return cpp_extension.load(name=f"beamsearch_native_{key}", sources=[str(path) for path in COMPILED],
                                  build_directory=str(folder), extra_cflags=list(FLAGS), verbose=False)


TORCH_LOCK = "lock"  # the file torch's cpp_extension.load creates in the build folder while it builds or loads


@contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold the build folder for one process: an ``fcntl.flock`` on ``folder/build.flock``, which the kernel
    releases when the holder exits, however it exits.

    ``cpp_extension.load`` guards the folder with a file of its own (``lock``), created at the start and removed at
    the end of every build and load; a build killed before it ends (SIGTERM, SIGKILL, a job's time limit) leaves it
    behind, and every later load then waits for it forever, silently. Under this lock no other process of ours is
    inside ``load``, so such a file is that leftover: it is removed, with a warning in the log. Where ``fcntl`` is
    missing (Windows) torch's file alone guards the folder."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds (35-60 s) or loads
        try:
            leftover = folder / TORCH_LOCK
            if leftover.exists():
                LOG.warning("beamsearch: removing %s, left by a build of the native extension that was stopped "
                            "before it ended", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cache_root() -> Path:
    """Where built extensions are kept: ``$BEAMSEARCH_NATIVE_CACHE``, else the user's cache folder."""
    if os.environ.get("BEAMSEARCH_NATIVE_CACHE"):
        return Path(os.environ["BEAMSEARCH_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "beamsearch" / "native"


def build_key() -> str:
    """A name for one build: the sources, torch and Python, the compiler and flags, and the CPU (the code is built
    for the CPU it runs on, so that a cache shared between machines never loads one CPU's binary on another).

    The sources' folder is part of it: the build file names the sources by path, so two installs (two checkouts,
    two virtual environments) sharing one folder would each rebuild the other's build, in every new process."""
    parts = [*(path.read_bytes().decode() for path in SOURCES), *(str(path.resolve()) for path in COMPILED),
             torch.__version__, str(torch.version.git_version),
             sys.version, platform.machine(), platform.system(), _cpu(), " ".join(FLAGS), os.environ.get("CXX", "c++")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu() -> str:
    """The CPU's model and feature flags (Linux: the first processor of /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    first = text.split("\n\n")[0]
    return "\n".join(line for line in first.splitlines() if line.startswith(("vendor_id", "model", "cpu family",
                                                                              "flags", "Features", "CPU part")))


def main() -> None:
    """make's install step: build (or find) the extension once, saying which."""
    print("beamsearch: native extension " + ("ready" if extension_reason() is None else
                                             f"not available, the eager paths run ({extension_reason()})"))
