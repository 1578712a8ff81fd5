"""beamsearch.ray on a local Ray instance (2 CPUs, started once for the module).

``decode --ray`` must write the bytes the single-process ``decode`` writes (tsv and jsonl, greedy and beam 5), also
when a worker dies halfway through a block and when an interrupted run is resumed from its manifest; bad input
gets one line naming the problem, and loses nothing. The inputs are small (23 lines in blocks of 8) so that the
module takes well under a minute of decoding; most of its time is Ray starting workers.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the embedded model needs transformers")
try:
    import ray
    import ray.data
except ImportError:  # the block store's tests still run
    ray = None

from beamsearch.cli.evaluate import CMUDICT_TEST  # noqa: E402
from beamsearch.cli.flags import build_parser, validate  # noqa: E402
from beamsearch.cli.inputs import CLIError  # noqa: E402
from beamsearch.cli.main import main  # noqa: E402
from beamsearch.distributed.blocks import BlockStore, read_blocks  # noqa: E402
from beamsearch.ray import (  # noqa: E402
    check_reachable,
    decode_dataset,
    decode_files,
    default_workers,
    worker_resources,
)

LAYOUT = ["--chunk-size", "8", "--batch-size", "3"]  # 23 lines: blocks of 8, 8 and 7 lines, model batches of 3
# The same --threads in both runs: torch's matrix products split their sums by thread, so the last bit of a score
# can depend on the thread count (1 and 2 threads print a different 6th decimal for one of these words).
CASES = {
    "tsv-greedy": ["--format", "tsv", "--num-beams", "1", "--threads", "1"],
    "tsv-beam5": ["--format", "tsv", "--num-beams", "5", "--num-return-sequences", "3", "--threads", "1"],
    "jsonl-greedy": ["--format", "jsonl", "--num-beams", "1", "--threads", "1"],
    "jsonl-beam5": ["--format", "jsonl", "--num-beams", "5", "--num-return-sequences", "2", "--threads", "1"],
    "tsv-greedy-2-threads": ["--format", "tsv", "--num-beams", "1", "--threads", "2"],  # one worker of 2 CPUs
}


@pytest.fixture(scope="module")
def local_ray():
    if ray is None:
        pytest.skip("beamsearch.ray needs Ray: pip install 'beamsearch[ray]' (make test installs it)")
    if ray.is_initialized():  # e.g. left by another module
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    """22 CMUdict test words and an empty line (line 5), in one file."""
    listed = [line.split("\t")[0] for line in CMUDICT_TEST.read_text(encoding="utf-8").splitlines()[:22]]
    path = tmp_path_factory.mktemp("inputs") / "words.txt"
    path.write_text("\n".join(listed[:4] + [""] + listed[4:]) + "\n", encoding="utf-8")
    return path


def single_process(words: Path, folder: Path, flags: list[str], layout: list[str] = LAYOUT) -> bytes:
    """The single-process ``decode`` output for ``flags`` (cached per flags: each is decoded once)."""
    out = folder / ("single-" + "-".join(flags + layout).replace("--", "") + ".out")
    if not out.exists():
        assert main(["decode", str(words), *flags, *layout, "-q", "-o", str(out)]) == 0
    return out.read_bytes()


@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("single")


def parsed(argv: list[str]):
    args = build_parser().parse_args(argv)
    validate(args)
    return args


@pytest.mark.parametrize("case", list(CASES))
def test_ray_output_equals_the_single_process_output(local_ray, words, reference_folder, tmp_path, case):
    """Every case's bytes are the single process's. The tsv-greedy case reads the word list saved with a UTF-8
    byte-order mark (as Windows editors save it): dropped on Ray as in the single process, so the list decodes as
    the same list without it (tsv records name no file, so the bytes are those of the list without the mark)."""
    want = single_process(words, reference_folder, CASES[case])
    source, out = words, tmp_path / "ray.out"
    if case == "tsv-greedy":
        source = tmp_path / "marked.txt"
        source.write_bytes("\ufeff".encode("utf-8") + words.read_bytes())
    workers = "1" if "2-threads" in case else "2"
    argv = ["decode", str(source), *CASES[case], *LAYOUT, "-q", "-o", str(out), "--ray", "--num-workers", workers]
    assert main(argv) == 0
    assert out.read_bytes() == want
    assert len(want.splitlines()) >= 23
    assert not (tmp_path / "ray.out.blocks").exists()  # removed once the output is complete


def test_a_worker_killed_mid_block_is_restarted_and_its_block_redone(local_ray, words, reference_folder, tmp_path):
    flags = CASES["jsonl-beam5"]
    want = single_process(words, reference_folder, flags)
    out, marker = tmp_path / "ray.jsonl", tmp_path / "killed"
    args = parsed(["decode", str(words), *flags, *LAYOUT, "-q", "-o", str(out), "--ray", "--num-workers", "2"])
    assert decode_files(args, kill=(1, str(marker))) == 0
    assert marker.exists()  # the worker decoding block 1 did end its process, after 5 of the block's 8 lines
    got = out.read_bytes()
    assert [json.loads(line)["index"] for line in got.splitlines()] == list(range(1, 24))  # none lost, none twice
    assert got == want


def test_the_summary_line_counts_the_cut_outputs_of_every_block(local_ray, words, tmp_path, capsys):
    """decode --ray ends with the single process's line counting the outputs a length limit cut, summed over the
    blocks the workers decoded (both limits bind on these words: the cap at 5 and half the source length)."""
    flags = ["--format", "tsv", "--threads", "1", "--max-new-tokens", "5", "--max-len-a", "0.5", "--max-len-b", "0"]

    def summary(name: str, *extra: str) -> list[str]:
        assert main(["decode", str(words), *flags, *LAYOUT, "-o", str(tmp_path / name), *extra]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "cut at a length limit" in line]

    [single] = summary("single.tsv")
    assert "at max_new_tokens=5" in single and "at the source-tied limit" in single
    assert summary("ray.tsv", "--ray", "--num-workers", "2") == [single]


def test_an_interrupted_run_resumes_from_its_manifest(local_ray, words, reference_folder, tmp_path, monkeypatch,
                                                      capsys):
    flags = CASES["tsv-beam5"]
    want = single_process(words, reference_folder, flags)
    out = tmp_path / "ray.tsv"
    argv = ["decode", str(words), *flags, *LAYOUT, "-q", "-o", str(out), "--ray", "--num-workers", "2"]
    save = BlockStore.save

    def interrupted_after_one(store, number, text, lines):  # the driver is stopped (Ctrl-C) after one block
        save(store, number, text, lines)
        raise KeyboardInterrupt

    monkeypatch.setattr(BlockStore, "save", interrupted_after_one)
    assert main(argv) == 130
    monkeypatch.setattr(BlockStore, "save", save)
    err = capsys.readouterr().err
    folder = tmp_path / "ray.tsv.blocks"
    manifest = json.loads((folder / "manifest.json").read_text())
    [first] = [int(n) for n in manifest["blocks"]]
    assert (folder / manifest["blocks"][str(first)]["file"]).is_file() and not out.exists()
    lines = manifest["blocks"][str(first)]["lines"]  # 8, or 7 for the last block
    assert err == (f"beamsearch: stopped by SIGINT: 1 finished block ({lines} inputs) is kept in {folder}/; continue "
                   f"with: {shlex.join(['beamsearch', *argv, '--resume'])}\n")

    assert main(argv) == 2  # neither --resume nor --overwrite
    assert "left ray.tsv.blocks/; continue it with --resume" in capsys.readouterr().err
    for changed, name in ((["--num-beams", "4"], "--num-beams 5 -> 4"), (["--chunk-size", "9"], "--chunk-size 8 -> 9")):
        assert main([*argv, "--resume", *changed]) == 2
        assert name in capsys.readouterr().err

    saved = []

    def recorded(store, number, text, lines):
        saved.append(number)
        save(store, number, text, lines)

    monkeypatch.setattr(BlockStore, "save", recorded)
    assert main([*argv, "--resume"]) == 0
    assert "1 of 3 blocks were finished before; decoding the other 2" in capsys.readouterr().err
    assert sorted(saved) == sorted({0, 1, 2} - {first})  # the finished block was not decoded again
    assert out.read_bytes() == want
    assert not folder.exists()
    assert main([*argv, "--resume"]) == 0
    assert "is complete" in capsys.readouterr().err


def test_decode_dataset_returns_the_records_of_the_command_line(local_ray, words, reference_folder):
    texts = words.read_text(encoding="utf-8").splitlines()
    dataset = ray.data.from_items([{"index": i, "text": t} for i, t in enumerate(texts, 1)])
    flags = ["--format", "tsv", "--num-beams", "5", "--num-return-sequences", "3", "--threads", "1"]
    # one chunk of all 23 lines, as Ray's one batch of 23 rows: the same model batches
    want = single_process(words, reference_folder, flags, ["--chunk-size", "23", "--batch-size", "3"])
    rows = decode_dataset(dataset, num_workers=1, num_beams=5, num_return_sequences=3, format="tsv",
                          chunk_size=23, batch_size=3).sort("index").take_all()
    assert [row["index"] for row in rows] == list(range(1, 24))
    assert "".join(row["record"] for row in rows).encode() == want
    assert [row["prediction"] for row in rows] == [row["record"].split("\t")[4] for row in rows]
    with pytest.raises(TypeError, match="beams"):
        decode_dataset(dataset, beams=5)
    with pytest.raises(ValueError, match="--do-sample with --ray"):
        decode_dataset(dataset, do_sample=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_input_is_one_line_and_loses_nothing(local_ray, words, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.tsv"
    out.write_text("an earlier output\n")
    base = ["decode", str(words), "-q", "--ray", "-o", str(out), "--overwrite"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"cat\n\xff\n")
    cases = [
        (["decode", str(words), "--ray"], "--ray needs --output FILE"),
        (["decode", "-", "--ray", "-o", str(out)], "--ray needs input files"),
        (["decode", str(tmp_path / "missing.txt"), "--ray", "-o", str(out)], "missing.txt: no such file"),
        (["decode", str(words), "--num-workers", "2"], "--num-workers needs --ray"),
        ([*base, "--do-sample"], "--do-sample with --ray"),
        ([*base, "--stream"], "--stream and --ray contradict each other"),
        ([*base, "--ray-address", f"127.0.0.1:{free_port()}"], "nothing answers there"),
        ([*base, "--ray-address", "head-node"], "expected HOST:PORT"),
        (["decode", str(bad), "-q", "--ray", "-o", str(out), "--overwrite"], "bad.txt:2: invalid UTF-8"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert main(base) == 2
    assert "--ray needs Ray: pip install 'beamsearch[ray]'" in capsys.readouterr().err
    assert out.read_text() == "an earlier output\n"  # untouched, and no block directory left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "out.tsv"]


def test_the_block_store_keeps_intact_blocks_and_joins_them_in_order(tmp_path):
    out = tmp_path / "out.txt"
    fingerprint = {"beamsearch": "0", "inputs": [], "options": {"chunk_size": 2}}
    store = BlockStore(str(out), "txt", resume=False, overwrite=False)
    store.start(fingerprint)
    for number, text in ((2, "e\n"), (0, "a\nb\n"), (1, "c\nd\n")):  # in the order workers finish them
        store.save(number, text, len(text) // 2)
    (store.folder / "block-000001.txt").write_text("c\nX\n")  # altered after it was listed
    again = BlockStore(str(out), "txt", resume=True, overwrite=False)
    again.start(fingerprint)
    assert sorted(again.finished) == [0, 2]  # block 1 is decoded again
    with pytest.raises(CLIError, match=r"blocks \[1\] are not finished"):
        again.assemble(3)
    again.save(1, "c\nd\n", 2)
    again.assemble(3)
    assert out.read_text() == "a\nb\nc\nd\ne\n" and not store.folder.exists()
    with pytest.raises(CLIError, match="exists; use --overwrite"):
        BlockStore(str(out), "txt", resume=False, overwrite=False)


def test_a_changed_option_or_input_is_refused_on_resume(tmp_path):
    out = tmp_path / "out.txt"
    BlockStore(str(out), "txt", resume=False, overwrite=False).start(
        {"beamsearch": "0", "inputs": [{"file": "a", "sha256": "1"}], "options": {"num_beams": 5}})
    resumed = BlockStore(str(out), "txt", resume=True, overwrite=False)
    with pytest.raises(CLIError, match="--num-beams 5 -> 4"):
        resumed.start({"beamsearch": "0", "inputs": [{"file": "a", "sha256": "1"}], "options": {"num_beams": 4}})
    with pytest.raises(CLIError, match="input files differ"):
        resumed.start({"beamsearch": "0", "inputs": [{"file": "a", "sha256": "2"}], "options": {"num_beams": 5}})


def test_blocks_are_the_single_process_chunks(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("".join(f"w{i}\n" for i in range(1, 8)))
    blocks = list(read_blocks([str(path)], 3))
    assert [[line.index for line in b.lines] for b in blocks] == [[1, 2, 3], [4, 5, 6], [7]]
    assert [b.number for b in blocks] == [0, 1, 2] and blocks[1].lines[0].source.endswith("in.txt:4")


class FakeCluster:
    """What ``worker_resources`` and ``default_workers`` ask a Ray cluster: its total and free resources."""

    def __init__(self, resources: dict[str, float]):
        self.resources = resources

    def cluster_resources(self) -> dict[str, float]:
        return self.resources

    available_resources = cluster_resources


def test_workers_declare_their_threads_and_a_gpu_for_cuda(words):
    def resources(argv, cluster):
        args = parsed(["decode", str(words), "--ray", "-o", "x", *argv])
        return worker_resources(args, FakeCluster(cluster)), args.threads, args.device

    assert resources([], {"CPU": 16}) == ((1, 0), 1, "auto")
    assert resources(["--threads", "4"], {"CPU": 16}) == ((4, 0), 4, "auto")
    assert resources(["--device", "cuda:1"], {"CPU": 16}) == ((1, 1), 1, "cuda")  # its one GPU is cuda there
    assert resources([], {"CPU": 16, "GPU": 2}) == ((1, 1), 1, "auto")
    assert resources(["--device", "cpu"], {"CPU": 16, "GPU": 2}) == ((1, 0), 1, "cpu")
    assert default_workers(FakeCluster({"CPU": 16, "GPU": 4}), 1, 1) == 4
    assert default_workers(FakeCluster({"CPU": 16}), 4, 0) == 4
    assert default_workers(FakeCluster({}), 1, 0) == 1


def test_check_reachable_fails_fast():
    with pytest.raises(CLIError, match="nothing answers there"):
        check_reachable(f"127.0.0.1:{free_port()}")


def test_the_core_and_the_command_line_do_not_import_ray():
    code = ("import sys, beamsearch, beamsearch.cli.main, beamsearch.cli.decoding; "
            "sys.exit('ray' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0
