"""Ensemble folders: a directory whose ``ensemble.json`` names model directories decoded together.

    {"members": ["teacher0", "teacher1", "teacher3"], "mode": "log"}

``members`` are model directories, relative to the folder (or absolute); ``mode`` is ``log`` (the default: the
members' log-probabilities averaged) or ``prob``, as ``--ensemble-mode``, which overrides it. ``--model FOLDER``
decodes the ensemble: the first member is the main model (its tokenizer and generation config), the others join it
as ``--ensemble`` directories would. So an ensemble ships, and is chosen, as one directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .inputs import CLIError

ENSEMBLE_FILE = "ensemble.json"
MODES = ("log", "prob")


@dataclass(frozen=True)
class EnsembleFile:
    members: list[Path]
    mode: str | None  # None: the file does not say (log unless --ensemble-mode)


def is_ensemble_folder(folder: Path) -> bool:
    return (folder / ENSEMBLE_FILE).is_file()


def read_ensemble_file(folder: Path) -> EnsembleFile:
    """The members and mode of ``folder/ensemble.json``; a clear error for anything else."""
    name = f"--model {folder}: {ENSEMBLE_FILE}"
    if (folder / "config.json").is_file():
        raise CLIError(f"--model {folder}: holds both config.json and {ENSEMBLE_FILE} (a folder is one model, or an "
                       "ensemble of model folders)")
    try:
        spec = json.loads((folder / ENSEMBLE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CLIError(f"{name} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(spec, dict):
        raise CLIError(f'{name} must be a JSON object such as {{"members": ["a", "b"], "mode": "log"}}')
    unknown = sorted(set(spec) - {"members", "mode"})
    if unknown:
        raise CLIError(f"{name}: unknown key {unknown[0]!r} (it takes 'members' and 'mode')")
    members = spec.get("members")
    if not isinstance(members, list) or not members or not all(isinstance(m, str) and m for m in members):
        raise CLIError(f"{name}: 'members' must be a non-empty list of model folders, got {members!r}")
    mode = spec.get("mode")
    if mode is not None and mode not in MODES:
        raise CLIError(f"{name}: 'mode' must be 'log' or 'prob', got {mode!r}")
    paths = [folder / m for m in members]
    for member, path in zip(members, paths, strict=True):
        if is_ensemble_folder(path):
            raise CLIError(f"{name}: the member {member!r} is an ensemble folder itself (list its members instead)")
    return EnsembleFile(paths, mode)
