"""Output formats of ``beamsearch decode`` and the incremental, resumable output file.

Every input gives one record, written in input order:

* ``text``: one line, the best hypothesis; one that did not finish (it reached the length limit, or the search
  stopped first) is followed by a tab and ``[unfinished: max_length]`` (or ``[unfinished: none]``).
* ``tsv``: one line per hypothesis, ``index<TAB>input<TAB>rank<TAB>score<TAB>hypothesis<TAB>finish`` where
  ``finish`` is the finish reason (``eos``, ``max_length``, ``stop_criterion``, ``none``; an empty input
  gives ``index<TAB><TAB>1<TAB><TAB><TAB>``).
* ``jsonl``: one JSON object, ``{"index", "source", "input", "hypotheses": [{"text", "tokens", "score",
  "sum_log_probs", "token_log_probs", "finish_reason"}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .inputs import CLIError, InputFile, Line
from .interrupts import signals_held

FORMATS = ("text", "tsv", "jsonl")
FINISHED = ("eos", "stop_criterion")  # finish reasons of a hypothesis that ended by itself


def is_unfinished(hyp: dict[str, Any]) -> bool:
    """Whether a hypothesis (a ``to_dicts`` record) stopped without ending: at the length limit, or cut short."""
    return hyp["finish_reason"] not in FINISHED


def format_record(fmt: str, line: Line, hyps: list[dict[str, Any]]) -> str:
    """The output text for one input (ending with a newline)."""
    if fmt == "text":
        if not hyps:
            return "\n"
        best = hyps[0]
        return best["text"] + (f"\t[unfinished: {best['finish_reason']}]" if is_unfinished(best) else "") + "\n"
    if fmt == "tsv":
        shown = " ".join(line.text.split("\t"))
        if not hyps:
            return f"{line.index}\t{shown}\t1\t\t\t\n"
        return "".join(f"{line.index}\t{shown}\t{r}\t{h['score']:.6f}\t{h['text']}\t{h['finish_reason']}\n"
                       for r, h in enumerate(hyps, 1))
    record = {"index": line.index, "source": line.source, "input": line.text, "hypotheses": hyps}
    return json.dumps(record, ensure_ascii=False) + "\n"


def check_output_path(path: str, leftover: Path, leftover_name: str, resume: bool, overwrite: bool) -> None:
    """What every output file is checked for before anything is written (the single process's ``FILE.partial``, the
    Ray path's ``FILE.blocks/``): a writable place, and no earlier output or interrupted run replaced unasked."""
    target = Path(path)
    if target.is_dir():
        raise CLIError(f"--output {path}: is a directory")
    if not target.parent.is_dir():
        raise CLIError(f"--output {path}: its directory does not exist")
    if resume and overwrite:
        raise CLIError("--resume and --overwrite contradict each other: choose one")
    if not resume and not overwrite:
        if leftover.exists():
            raise CLIError(f"--output {path}: an interrupted run left {leftover_name}; continue it with --resume or "
                           "start over with --overwrite")
        if target.exists() and target.stat().st_size > 0:
            raise CLIError(f"--output {path} exists; use --overwrite to replace it (it is kept until the new output "
                           "is complete)")


class Output:
    """Where records go: stdout, or a file that is never left half-replaced.

    A file output is written to ``PATH.partial`` next to it, one record at a time (each flushed to the operating
    system as it is written, so a killed process loses at most the record being written; fsynced at most once a
    second and at the end), and renamed to ``PATH`` only when every input is decoded: an existing ``PATH``
    (``overwrite``) is untouched until then. ``PATH.resume.json`` beside it holds the fingerprint of the run
    (inputs, the options that change outputs, format, version); ``resume`` continues the partial file only if
    the new run's fingerprint is the same, after cutting off a partly written last record. It stays beside the
    complete ``PATH`` with ``PATH``'s SHA-256 added, so that ``resume`` of a complete output is accepted (nothing
    to do) only when the same command made it (:func:`check_complete`). Nothing is created before :meth:`start`
    (called once the model has loaded), so a failed load leaves no file.
    """

    def __init__(self, path: str | None, fmt: str, resume: bool = False, overwrite: bool = False):
        self.path = None if path is None else Path(path)
        self.fmt = fmt
        self.resume = resume
        self.done = 0  # records of an interrupted run that this one continues
        self.written = 0  # records this run wrote
        self.started = False
        self.fingerprint: dict[str, Any] | None = None
        self.stream: TextIO | None = None
        self.last_sync = 0.0
        if self.path is None:
            if resume:
                raise CLIError("--resume needs --output FILE")
            self.stream = sys.stdout
            return
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.sidecar = fingerprint_file(self.path)
        check_output_path(path, self.partial, self.partial.name, resume, overwrite)

    @property
    def complete_already(self) -> bool:
        """``--resume`` of a run that finished: ``PATH`` is there and no partial file is left (then
        :func:`check_complete` says whether the same command made it)."""
        return self.resume and self.path is not None and is_complete(self.path, self.partial)

    def start(self, fingerprint: dict[str, Any] | None) -> None:
        """Open the partial file (new, or continued after checking ``fingerprint`` with ``resume``); None (stdin,
        which cannot be resumed): no fingerprint is kept."""
        if self.path is None:
            return
        self.fingerprint = fingerprint
        self.started = True
        try:
            if self.resume and self.partial.exists():
                check_fingerprint(self.sidecar, fingerprint)
                self.done = _recover(self.partial, self.fmt)
                self.stream = self.partial.open("a", encoding="utf-8", newline="\n")
            else:
                self.stream = self.partial.open("w", encoding="utf-8", newline="\n")
                if fingerprint is not None:
                    _write_json(self.sidecar, fingerprint)
        except OSError as e:
            raise CLIError(f"--output {self.path}: cannot be written ({e.strerror})", status=1) from None

    def write(self, text: str) -> None:
        """Write one input's record (whole: SIGINT or SIGTERM stops the run after it, not inside it)."""
        if self.path is None:  # stdout: a closed pipe (BrokenPipeError) ends the command quietly, in main
            with signals_held():
                self.stream.write(text)
                self.written += 1
            return
        try:
            with signals_held():
                self.stream.write(text)
                self.stream.flush()  # to the operating system: survives the process being killed
                self.written += 1
            if time.monotonic() - self.last_sync > 1.0:
                self.sync()
        except OSError as e:
            raise self._write_error(e) from None

    def sync(self) -> None:
        """Flush and fsync the partial file (file outputs only)."""
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.last_sync = time.monotonic()

    def finish(self) -> None:
        """Every input is decoded: make ``PATH`` the complete output, atomically, its fingerprint kept beside it."""
        if self.path is None:
            self.stream.flush()
            return
        try:
            self.sync()
            self.stream.close()
            if self.fingerprint is not None:
                record_complete(self.path, self.fingerprint, self.partial)
            os.replace(self.partial, self.path)
            sync_directory(self.path.parent)
        except OSError as e:
            raise self._write_error(e) from None

    def abandon(self) -> None:
        """A failure: keep what was written in the partial file, for ``--resume``."""
        if self.path is None or self.stream is None or self.stream.closed:
            return
        try:
            self.stream.flush()
            os.fsync(self.stream.fileno())
        except OSError:
            pass  # the disk may be full: what reached the file is kept, a cut last record is trimmed on resume
        finally:
            try:
                self.stream.close()
            except OSError:
                pass
        if self.partial.stat().st_size == 0:  # nothing decoded (e.g. a bad option found at the first batch)
            self.partial.unlink(missing_ok=True)
            self.sidecar.unlink(missing_ok=True)

    def kept(self, total: int | None) -> str | None:
        """After :meth:`abandon`: what the stopped run leaves, as a phrase (None: nothing), ``total`` inputs in all
        where known."""
        of = "" if total is None else f" of {total}"
        if self.path is None:
            return f"{self.written}{of} inputs were written to stdout"
        if not self.partial.exists():
            return None
        if not self.started:  # stopped before it opened the interrupted run's partial file
            return f"{self.partial} is kept as the interrupted run left it"
        return f"{self.done + self.written}{of} inputs are written in {self.partial}"

    def _write_error(self, e: OSError) -> CLIError:
        return CLIError(f"cannot write {self.partial} ({e.strerror or e}); the records written so far are kept: "
                        "make room and continue with --resume", status=1)


def fingerprint(args: Any, inputs: list[InputFile], skip: tuple[str, ...]) -> dict[str, Any]:
    """What ``--resume`` must find unchanged: the inputs' bytes, the options that change outputs (every parsed
    argument but ``skip``), the format and the version of beamsearch."""
    from .. import __version__

    files = [{"file": str(Path(f.path).resolve()), "sha256": f.sha256} for f in inputs]
    options = {k: v for k, v in sorted(vars(args).items()) if k not in skip}
    return {"beamsearch": __version__, "inputs": files, "options": json.loads(json.dumps(options, default=str))}


def fingerprint_file(output: Path) -> Path:
    """Where the fingerprint of the run writing ``output`` is kept: ``OUTPUT.resume.json`` beside it."""
    return output.with_name(output.name + ".resume.json")


def fingerprint_difference(have: dict[str, Any], want: dict[str, Any], whose: str) -> str | None:
    """What differs between the fingerprint ``have`` (``whose``: which run's, e.g. "the interrupted run's") and
    this run's ``want``, as a phrase naming it: version, input files, or each changed option (old -> new)."""
    if have.get("beamsearch") != want["beamsearch"]:
        return f"the beamsearch versions differ from {whose} ({have.get('beamsearch')} -> {want['beamsearch']})"
    if have.get("inputs") != want["inputs"]:
        return f"the input files differ from {whose} (names or contents)"
    old, new = have.get("options", {}), want["options"]
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if changed:
        shown = ", ".join(f"--{k.replace('_', '-')} {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        return f"the options differ from {whose} ({shown})"
    return None


def check_fingerprint(sidecar: Path, want: dict[str, Any]) -> None:
    """``--resume`` of an interrupted run: refused unless its fingerprint (``sidecar``) is this run's."""
    try:
        have = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise CLIError(f"--resume: {sidecar} is missing or unreadable, so the partial output cannot be checked "
                       "against this run; start over with --overwrite") from None
    difference = fingerprint_difference(have, want, "the interrupted run's")
    if difference:
        raise CLIError(f"--resume: {difference}; resume with the same inputs and options, or start over with "
                       "--overwrite")


def is_complete(output: Path, leftover: Path) -> bool:
    """Whether ``output`` is a finished run's: it is there, no run left ``leftover`` (its ``.partial`` file or
    ``.blocks/`` directory), and it is not an empty file without a fingerprint (no output, as for
    :func:`check_output_path`, e.g. a file the shell created)."""
    if not output.exists() or leftover.exists():
        return False
    return output.stat().st_size > 0 or fingerprint_file(output).exists()


def record_complete(output: Path, fingerprint: dict[str, Any], content: Path) -> None:
    """Keep the fingerprint of the run that made ``output`` beside it, with the SHA-256 of ``content`` (the file
    about to be renamed to ``output``), for :func:`check_complete`."""
    _write_json(fingerprint_file(output), dict(fingerprint, output_sha256=file_sha256(content)))


def check_complete(output: Path, want: dict[str, Any]) -> None:
    """``--resume`` of a complete output: accepted (nothing to do) only when this run's fingerprint ``want`` made
    it, as the fingerprint kept beside it says, and it is still the file that fingerprint was written for."""
    sidecar = fingerprint_file(output)
    advice = "replace it with --overwrite instead of --resume, or remove it"
    try:
        have = json.loads(sidecar.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CLIError(f"--resume: {output} is complete but has no fingerprint ({sidecar.name}; made by hand, from "
                       f"stdin or by an older beamsearch), so it cannot be checked against this command; "
                       f"{advice}") from None
    except (OSError, ValueError):
        raise CLIError(f"--resume: {output} is complete but its fingerprint {sidecar.name} is unreadable, so it "
                       f"cannot be checked against this command; {advice}") from None
    difference = fingerprint_difference(have, want, "those it was made with")
    if difference:
        raise CLIError(f"--resume: {output} is complete, but {difference}; {advice}")
    if have.get("output_sha256") != file_sha256(output):
        raise CLIError(f"--resume: {output} is not the file {sidecar.name} fingerprints (it was changed or replaced "
                       f"after that run, or that run did not finish); {advice}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsynced, renamed over it."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def sync_directory(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _recover(path: Path, fmt: str) -> int:
    """Cut the file after its last complete record and return the number of complete records."""
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    lines = keep.decode("utf-8", errors="replace").splitlines(keepends=True)
    if fmt == "tsv":
        indices = []
        for n, line in enumerate(lines, 1):
            head = line.split("\t", 1)[0]
            if not head.isdigit():
                raise CLIError(f"--resume: {path}:{n} is not a line of --format tsv output")
            indices.append(int(head))
        # the last index may have been cut between two of its hypotheses: drop it and decode it again
        last = indices[-1] if indices else 0
        n_keep = sum(i != last for i in indices)
        done = len(set(indices[:n_keep]))
        if indices[:n_keep] and indices[n_keep - 1] != done:
            raise CLIError(f"--resume: {path} does not hold records 1..{done} in order")
        keep = "".join(lines[:n_keep]).encode("utf-8")
    else:
        if fmt == "jsonl":
            for n, line in enumerate(lines, 1):
                try:
                    index = json.loads(line)["index"]
                except (ValueError, KeyError, TypeError):
                    raise CLIError(f"--resume: {path}:{n} is not a line of --format jsonl output") from None
                if index != n:
                    raise CLIError(f"--resume: {path}:{n} holds record {index}, expected {n}")
        done = len(lines)
    if len(keep) != len(data):
        with path.open("r+b") as f:
            f.truncate(len(keep))
    return done


def progress(total: int | None, quiet: bool, initial: int = 0) -> Any:
    """A tqdm bar on stderr, off with --quiet or when stderr is not a terminal."""
    from tqdm.auto import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=disable, file=sys.stderr, unit="line", dynamic_ncols=True)
