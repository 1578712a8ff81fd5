"""Decoding corpora on a Ray cluster with Ray Data: an actor pool whose workers each load the model once.

``decode_dataset(dataset, model=None, num_beams=5)`` decodes a Ray Dataset of lines (a ``text`` column) and returns
a Ray Dataset; ``beamsearch decode --ray`` (:func:`decode_files`) decodes files into one output file, resumably,
with the bytes the single-process ``beamsearch decode`` writes. Ray is an optional extra
(``pip install 'beamsearch[ray]'``): only this module imports it, and only when called. See docs/ray.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from typing import Any

from .cli.inputs import CLIError, check_readable, scan_files
from .cli.lengths import CutCount, cut_line
from .cli.outputs import check_complete, fingerprint, progress
from .distributed.blocks import BLOCK_LAYOUT, Block, BlockStore, output_fingerprint, read_blocks
from .distributed.workers import BlockDecoder, LineDecoder

INSTALL = "pip install 'beamsearch[ray]'"


def require_ray() -> Any:
    """The ``ray`` module (with Ray Data), or an ImportError that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"beamsearch.ray needs Ray Data ({e}): {INSTALL}") from None
    return ray


def decode_dataset(dataset: Any, model: str | None = None, *, num_workers: int = 1, num_gpus: float = 0,
                   **options: Any) -> Any:
    """Decode a Ray Dataset of lines on an actor pool of ``num_workers`` workers, each loading the model once.

    Args:
        dataset: a ``ray.data.Dataset`` with a ``text`` column (e.g. ``ray.data.read_text``), and optionally
            ``index`` (the record number that ``tsv`` and ``jsonl`` records carry; 0 when absent) and ``source``.
        model: a local Hugging Face model directory (default: the embedded G2P model).
        num_workers: actors in the pool. Each declares ``threads`` CPUs (default 1: torch runs on as many threads
            there) and ``num_gpus`` GPUs.
        num_gpus: GPUs per worker (give ``device="cuda"`` with it).
        **options: ``beamsearch decode``'s flags, underscored: ``num_beams=5``, ``format="tsv"``,
            ``batch_size=64``, ``chunk_size=10000`` (the lines one worker decodes together), ...

    Returns:
        The lazy dataset of the input rows with two more columns: ``prediction`` (the best hypothesis' text) and
        ``record`` (the line's output in ``format``, as ``beamsearch decode`` writes it). Rows come back in the
        order Ray finishes them: ``.sort("index")`` restores the input order.
    """
    ray = require_ray()
    try:
        args = decode_args(model, options)
    except CLIError as e:
        raise ValueError(str(e)) from None
    args.threads = args.threads or 1
    return dataset.map_batches(
        LineDecoder, fn_constructor_kwargs={"args": args}, batch_size=args.chunk_size,
        compute=ray.data.ActorPoolStrategy(size=num_workers), num_cpus=args.threads, num_gpus=num_gpus)




def decode_args(model: str | None, options: dict[str, Any]) -> argparse.Namespace:
    """``beamsearch decode``'s flags with their defaults, ``options`` and ``model`` set (checked as the command
    line checks them)."""
    from .cli.flags import build_parser, validate

    args = build_parser().parse_args(["decode"])
    unknown = sorted(set(options) - set(vars(args)) - {"files", "command"})
    if unknown:
        raise TypeError(f"unknown options {unknown}: the options are beamsearch decode's flags, underscored "
                        "(num_beams=5, format='tsv', ...)")
    vars(args).update(options, model=model)
    validate(args)
    refuse_order_dependent(args)
    return args


def refuse_order_dependent(args: argparse.Namespace) -> None:
    """Sampling draws from one random stream in the single process; blocks decoded in parallel cannot share it."""
    for flag in ("do_sample", "stochastic_beam_search"):
        if getattr(args, flag):
            raise CLIError(f"--{flag.replace('_', '-')} with --ray: samples depend on the order in which blocks are "
                           "decoded, so they could not equal the single process's; decode without --ray")


def decode_files(args: argparse.Namespace, kill: tuple[int, str] | None = None) -> int:
    """``beamsearch decode --ray``: the input files in blocks of ``--chunk-size`` lines on the workers, each
    finished block saved in ``OUTPUT.blocks/`` (resumable with ``--resume``), then joined into ``--output``.

    Args:
        args: the parsed flags of ``beamsearch decode``.
        kill: test hook, see :class:`~beamsearch.distributed.workers.Decoder`.
    """
    if args.output is None:
        raise CLIError("--ray needs --output FILE (its finished blocks and their manifest go to FILE.blocks/)")
    if not args.files or "-" in args.files:
        raise CLIError("--ray needs input files: stdin cannot be split into resumable blocks")
    if getattr(args, "stream", False):
        raise CLIError("--stream and --ray contradict each other: --stream prints one input at a time, --ray decodes "
                       "files in blocks; choose one")
    check_readable(args.files)
    refuse_order_dependent(args)
    from .cli.flags import NOT_IN_FINGERPRINT

    store = BlockStore(args.output, args.format, resume=args.resume, overwrite=args.overwrite)
    files = scan_files(args.files) or []
    blocks_fingerprint = fingerprint(args, files, tuple(k for k in NOT_IN_FINGERPRINT if k not in BLOCK_LAYOUT))
    if store.complete_already:  # refused unless this command made it (here or in a single process)
        check_complete(store.path, output_fingerprint(blocks_fingerprint))
        print(f"beamsearch: {args.output} is complete (no {store.folder.name}/ is left): nothing to resume",
              file=sys.stderr)
        return 0
    store.start(blocks_fingerprint)
    try:
        blocks = list(read_blocks(args.files, args.chunk_size))
        pending = [b for b in blocks if b.number not in store.finished]
        if store.finished:
            print(f"beamsearch: {len(blocks) - len(pending)} of {len(blocks)} blocks were finished before; "
                  f"decoding the other {len(pending)}", file=sys.stderr)
        if pending:
            decode_blocks(args, store, pending, sum(f.lines for f in files), kill)
        store.assemble(len(blocks))
    except BaseException:
        store.abandon()
        raise
    return 0


def decode_blocks(args: argparse.Namespace, store: BlockStore, pending: list[Block], total: int,
                  kill: tuple[int, str] | None) -> None:
    """Send the pending blocks to an actor pool and save each one as it comes back (in any order)."""
    ray = connect(args.ray_address)
    cpus, gpus = worker_resources(args, ray)
    workers = min(args.num_workers or default_workers(ray, cpus, gpus), len(pending))
    rows = [{"block": b.number, "first": b.lines[0].index, "texts": [line.text for line in b.lines],
             "sources": [line.source for line in b.lines]} for b in pending]
    # A worker that dies is restarted and the block it was decoding is given to a worker again: Ray Data's actor
    # pool does both by default (without a limit; Ray 2.60 bounds them only through remote options it deprecates).
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        BlockDecoder, fn_constructor_kwargs={"args": args, "kill": kill}, batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=cpus, num_gpus=gpus)
    done = sum(entry["lines"] for entry in store.finished.values())
    bar = progress(total, args.quiet, initial=done)
    warned, lines, busy, start = 0, 0, 0.0, time.perf_counter()
    cut, names = CutCount(), {}
    try:
        for row in dataset.iter_rows():
            store.save(int(row["block"]), str(row["records"]), int(row["lines"]))
            lines, busy = lines + int(row["lines"]), busy + float(row["seconds"])
            block_cut = json.loads(str(row["cut"]))
            cut.add(CutCount(**block_cut["count"]))
            names = block_cut["names"]  # the same for every block
            for message in filter(None, str(row["warnings"]).split("\n")):
                warned += 1
                if warned <= 20:
                    print(f"beamsearch: warning: {message}", file=sys.stderr)
            bar.update(int(row["lines"]))
    except Exception as e:
        raise worker_error(e, len(store.finished)) from None
    bar.close()
    if warned > 20:
        print(f"beamsearch: {warned} warnings in all", file=sys.stderr)
    if not args.quiet:
        print(f"beamsearch: {lines} lines in {len(pending)} blocks on {workers} workers in "
              f"{time.perf_counter() - start:.1f} s; {lines / max(busy, 1e-9):.1f} lines/s per worker while "
              "decoding a block", file=sys.stderr)
        summary = cut_line(cut, names)  # the blocks this run decoded (as a resumed single process counts)
        if summary is not None:
            print(summary, file=sys.stderr)


def default_workers(ray: Any, cpus: float, gpus: float) -> int:
    """As many workers as the cluster's free resources hold: one per GPU, or per ``cpus`` CPUs."""
    free = ray.available_resources()
    return max(1, int(free.get("GPU", 0) // gpus if gpus else free.get("CPU", 1) // cpus))


def worker_resources(args: argparse.Namespace, ray: Any) -> tuple[float, float]:
    """CPUs and GPUs one worker declares: ``--threads`` CPUs (default 1; the worker runs torch on as many threads),
    and one GPU for ``--device cuda`` (or ``auto`` on a cluster with GPUs), which the worker sees as ``cuda``."""
    cpus = args.threads = args.threads or 1  # torch's threads in the worker: sums split alike round alike
    if args.device.startswith("cuda"):
        args.device = "cuda"
        return cpus, 1
    if args.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1:
        return cpus, 1
    return cpus, 0


def connect(address: str | None) -> Any:
    """Join the cluster at ``address`` (``ray start``'s address, or ``auto``), or start a local Ray instance; a
    Ray already initialised in this process (``ray.init`` before calling) is used as it is."""
    try:
        ray = require_ray()
    except ImportError:
        raise CLIError(f"--ray needs Ray: {INSTALL}") from None
    if address not in (None, "auto"):
        check_reachable(address)
    if ray.is_initialized():
        return ray
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=True)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise CLIError(f"--ray-address {address}: {' '.join(str(e).split())[:300]}") from None
    ray.data.DataContext.get_current().enable_progress_bars = False  # the command's own bar counts lines
    for name, level in (("ray.data", logging.WARNING), ("ray.data._internal.progress", logging.ERROR)):
        logging.getLogger(name).setLevel(level)  # Ray Data's plan and timing lines, and a bars-off notice
    return ray


def check_reachable(address: str) -> None:
    """Fail in seconds, with the address in the message, where nothing listens (``ray.init`` retries for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise CLIError(f"--ray-address {address}: expected HOST:PORT (ray start --head prints it) or auto")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise CLIError(f"--ray-address {address}: nothing answers there ({e.strerror or e}); start the cluster's "
                       "head with `ray start --head` and give the address it prints") from None


def worker_error(e: Exception, finished: int) -> CLIError:
    """A failure on a worker as the command line's one-line error: a CLIError raised there keeps its message."""
    seen = e
    while seen is not None:
        if isinstance(seen, CLIError):
            return CLIError(f"{seen} ({finished} finished blocks are kept)", seen.status)
        seen = getattr(seen, "cause", None) or seen.__cause__
    message = " ".join(str(e).split())[:300]
    return CLIError(f"a worker failed ({type(e).__name__}: {message}); {finished} finished blocks are kept: "
                    "continue with --resume", status=1)
