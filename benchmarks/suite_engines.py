"""The engines the suite times, their timing and their peak-memory measurement.

Every engine returns the best hypothesis of each example as a list of generated token ids, cut after the
first end token (start tokens and prompts removed, padding dropped), so that outputs compare across engines.

Peak memory:
- CUDA, torch engines: ``torch.cuda.max_memory_allocated`` over the timed runs, minus what was allocated
  before them (model weights excluded).
- CUDA, CTranslate2: it has its own caching allocator, invisible to torch; the growth of the device's used
  memory (``torch.cuda.mem_get_info``) from before the engine's first call to after its last one. The cache
  keeps its blocks, so this is close to the peak (marked ``~`` in the table).
- CPU: a first pass over every case, before any timing: after each engine's warm-up, one run during which
  the kernel's peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``) is read, minus the
  resident size at the reset. Throughout that pass glibc's malloc returns every large freed block to the
  system (low fixed mmap and trim thresholds, and ``malloc_trim`` before each run, so the baseline does not
  hide memory freed by an earlier engine): the resident size follows live memory, not what the allocator
  keeps for reuse. The timing pass then uses the thresholds glibc's adaptive default reaches after the first
  large free (32 MiB / 64 MiB), as in a user's process: a block freed at one step is reused at the next.
  (Timing with the low thresholds, as this suite once did, made every large temporary a fresh mmap: page
  faults cost the torch engines about 3 ms per [128, 32128] tensor, and CTranslate2, with its own caching
  allocator, nothing.) Growth is process-wide: CTranslate2's threads included, model weights excluded
  (loaded before).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import beamsearch
from beamsearch.adapters.hf import search_model
from beamsearch.steps.chooser import default_fast
from beamsearch.steps.gpt2.lean import LeanGPT2State
from beamsearch.steps.llama.lean import LeanLlamaState
from beamsearch.steps.t5.fast import FastT5State, fast_t5_encode
from beamsearch.steps.t5.lean import LeanT5State


def cut_after_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


# ---------------------------------------------------------------- memory


class _Libc:
    TRIM_THRESHOLD, MMAP_THRESHOLD = -1, -3  # mallopt parameters

    def __init__(self) -> None:
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None

    def return_freed_memory(self, exact: bool) -> None:
        """True: large freed blocks go back to the system, so the resident size follows live memory (the
        memory pass). False: the thresholds glibc's adaptive default reaches, freed blocks reused (timing)."""
        if self.libc is not None:
            mmap, trim = (128 << 10, 128 << 10) if exact else (32 << 20, 64 << 20)
            self.libc.mallopt(self.MMAP_THRESHOLD, mmap)
            self.libc.mallopt(self.TRIM_THRESHOLD, trim)

    def trim(self) -> None:
        if self.libc is not None:
            self.libc.malloc_trim(0)


ALLOCATOR = _Libc()


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory growth of a block of work, in MiB (None when the platform cannot tell)."""

    def __init__(self, device: str, foreign_allocator: bool = False) -> None:
        self.device, self.foreign = device, foreign_allocator
        self.mib: float | None = None
        self.approximate = False

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if self.foreign:
                self.free_before = torch.cuda.mem_get_info()[0]
            else:
                torch.cuda.reset_peak_memory_stats()
                self.allocated_before = torch.cuda.memory_allocated()
            return self
        ALLOCATOR.trim()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
            self.rss_before = _status_kb("VmRSS")
        except OSError:
            self.rss_before = None
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            if self.foreign:
                self.mib = max(0, self.free_before - torch.cuda.mem_get_info()[0]) / 2**20
                self.approximate = True
            else:
                self.mib = (torch.cuda.max_memory_allocated() - self.allocated_before) / 2**20
            return
        peak = _status_kb("VmHWM")
        if self.rss_before is not None and peak is not None:
            self.mib = max(0, peak - self.rss_before) / 1024


# ---------------------------------------------------------------- timing


@dataclass
class Timing:
    seconds: float | None = None  # median over the repeats
    outputs: list[list[int]] | None = None
    memory_mib: float | None = None
    memory_approximate: bool = False
    error: str | None = None
    all_seconds: list[float] = field(default_factory=list)
    cold_seconds: float | None = None  # the first call, where it is timed apart (suite_graphs.graph_timing)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(run: Callable[[], list[list[int]]], repeats: int, device: str, foreign_allocator: bool = False,
          warm: bool = False, memory_only: bool = False) -> Timing:
    """Warm up once (unless ``warm``: the caller already ran it), then the median of ``repeats`` runs, with the
    peak memory over them on CUDA. ``memory_only`` (CPU): one run after the warm-up, measuring peak memory only
    (the suite's first pass, with the allocator returning freed memory: see the module docstring)."""
    if device == "cuda" and foreign_allocator:  # CTranslate2's cache grows during the warm-up: measure from it
        memory = PeakMemory(device, foreign_allocator)
        memory.__enter__()
        outputs = run()
    else:
        outputs = None if warm else run()
        memory = PeakMemory(device, foreign_allocator).__enter__() if device == "cuda" else None
    if memory_only:
        with PeakMemory(device, foreign_allocator) as memory:
            outputs = run()
        return Timing(None, outputs, memory.mib, memory.approximate)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        outputs = run()
        _sync(device)
        times.append(time.perf_counter() - start)
    if memory is None:
        return Timing(statistics.median(times), outputs, all_seconds=times)
    memory.__exit__(None, None, None)
    return Timing(statistics.median(times), outputs, memory.mib, memory.approximate, all_seconds=times)


# ---------------------------------------------------------------- engines


def _best_generated(sequences: torch.Tensor, skip: int, eos: int) -> list[list[int]]:
    return [cut_after_eos(row[skip:].tolist(), eos) for row in sequences.cpu()]


def hf_engine(workload, inputs: dict, kwargs: dict) -> Callable[[], list[list[int]]]:
    model = workload.model

    @torch.no_grad()
    def run():
        out = model.generate(**inputs, **kwargs)
        skip = 1 if workload.encoder_decoder else inputs["input_ids"].shape[1]
        return _best_generated(out, skip, workload.eos_token_id)

    return run


def beamsearch_engine(workload, inputs: dict, kwargs: dict, model=None) -> Callable[[], list[list[int]]]:
    model = workload.model if model is None else model

    @torch.no_grad()
    def run():
        out = beamsearch.generate(model, **inputs, **kwargs)
        skip = 1 if workload.encoder_decoder else inputs["input_ids"].shape[1]
        return _best_generated(out, skip, workload.eos_token_id)

    return run


def beamsearch_ct2_semantics(workload, inputs: dict, num_beams: int) -> list[list[int]]:
    """Ours under ``semantics="ct2"`` with CTranslate2's options: what CTranslate2 should return exactly."""
    ct2 = workload.ct2_kwargs(num_beams)
    result = search_model(workload.model, **inputs, semantics="ct2", num_beams=num_beams, patience=ct2["patience"],
                          length_penalty=ct2["length_penalty"], max_new_tokens=ct2["max_length"],
                          min_new_tokens=ct2["min_length"], do_sample=False)
    best = result.sequences[:, 0, result.prompt_length :]
    return [cut_after_eos(row.tolist(), workload.eos_token_id) for row in best.cpu()]


def count_forwards(model: torch.nn.Module, run: Callable[[], object]) -> int:
    """How many times ``run`` calls the model's output layer or the fast T5 step's decoder (the number of decoding
    steps; the lean T5 step does not call the model's ``forward``, the fast one not its output layer either)."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    fast_decode = FastT5State.__dict__["decode"]

    def decode(state, *args):
        if state.model is model:
            calls[0] += 1
        return fast_decode(state, *args)

    handle = model.get_output_embeddings().register_forward_pre_hook(hook)
    FastT5State.decode = decode
    try:
        run()
    finally:
        handle.remove()
        FastT5State.decode = fast_decode
    return calls[0]


def _best(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax ``[N]``, through ``max`` as our greedy search takes it (argmax is slower on CPU)."""
    return logits.max(dim=-1).indices


def floor_engine(workload, inputs: dict, num_beams: int, steps: int) -> Callable[[], list[list[int]]]:
    """The same model forwards with the KV cache and no search: the prompt (encoder, first decoder step, or
    the decoder-only prefill) once per example, then ``steps - 1`` steps of B*K rows, each feeding the row's
    argmax. No log-softmax, top-k, beam bookkeeping or cache reordering. On T5, GPT-2 and Llama models it runs the
    step ours runs (the fast step on float32 T5 models, else the lean step), so that ours/floor is the search's
    overhead."""
    from transformers.modeling_outputs import BaseModelOutput

    model, k = workload.model, num_beams
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    size = ids.shape[0]

    @torch.no_grad()
    def run_encoder_decoder():
        hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        start = torch.full((size, 1), workload.start_token_id, dtype=torch.long, device=ids.device)
        out = model(encoder_outputs=BaseModelOutput(last_hidden_state=hidden), attention_mask=mask,
                    decoder_input_ids=start, use_cache=True)
        cache, token = out.past_key_values, _best(out.logits[:, -1])[:, None]
        encoder_mask = mask
        if k > 1:
            cache.batch_repeat_interleave(k)
            hidden = hidden.repeat_interleave(k, dim=0)
            encoder_mask = mask.repeat_interleave(k, dim=0)
            token = token.repeat_interleave(k, dim=0)
        encoded = BaseModelOutput(last_hidden_state=hidden)
        tokens = [token]
        for _ in range(steps - 1):
            out = model(encoder_outputs=encoded, attention_mask=encoder_mask, decoder_input_ids=token,
                        past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, _best(out.logits[:, -1])[:, None]
            tokens.append(token)
        return torch.cat(tokens, 1)

    @torch.no_grad()
    def run_decoder_only():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, token = out.past_key_values, _best(out.logits[:, -1])[:, None]
        attention, last = mask, positions[:, -1:]
        if k > 1:
            cache.batch_repeat_interleave(k)
            attention = attention.repeat_interleave(k, dim=0)
            last = last.repeat_interleave(k, dim=0)
            token = token.repeat_interleave(k, dim=0)
        tokens = [token]
        for _ in range(steps - 1):
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], 1)
            last = last + 1
            out = model(input_ids=token, attention_mask=attention, position_ids=last, past_key_values=cache,
                        use_cache=True)
            cache, token = out.past_key_values, _best(out.logits[:, -1])[:, None]
            tokens.append(token)
        return torch.cat(tokens, 1)

    @torch.no_grad()
    def run_lean_t5():  # the same step as ours on T5 (the fast step on float32 models), without search or reorder
        if default_fast(model):
            state = FastT5State(model, fast_t5_encode(model, ids, mask), mask, steps + 1)
        else:
            hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
            state = LeanT5State(model, hidden, mask, steps + 1)
        state.reorder(torch.arange(size, device=ids.device).repeat_interleave(k))
        start = torch.full((size * k, 1), workload.start_token_id, dtype=torch.long, device=ids.device)
        token = _best(state.prefill(start))
        tokens = [token]
        for _ in range(steps - 1):
            token = _best(state.forward(token))
            tokens.append(token)
        return torch.stack(tokens, 1)

    @torch.no_grad()
    def run_lean_decoder_only(state_class):
        """The same step as ours on GPT-2 and Llama: the prompt once per example, then the lean step."""
        from transformers import DynamicCache

        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as transformers' generate
        kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": True, "logits_to_keep": 1,
                  "past_key_values": DynamicCache(config=model.config)}
        state = state_class(model, kwargs, model.generation_config, ids.shape[1] + steps)
        state.reorder(torch.arange(size, device=ids.device).repeat_interleave(k))
        token = _best(state.prefill(ids.repeat_interleave(k, dim=0)))
        tokens = [token]
        for _ in range(steps - 1):
            token = _best(state.forward(token))
            tokens.append(token)
        return torch.stack(tokens, 1)

    if workload.encoder_decoder:
        body = run_lean_t5 if workload.lean_t5 else run_encoder_decoder
    elif workload.lean_gpt2:
        body = functools.partial(run_lean_decoder_only, LeanGPT2State)
    elif workload.lean_llama:
        body = functools.partial(run_lean_decoder_only, LeanLlamaState)
    else:
        body = run_decoder_only

    def run():
        tokens = body()
        return [row.tolist() for row in tokens[::k].cpu()]  # not comparable: argmax without search

    return run


# ---------------------------------------------------------------- CTranslate2


class CT2:
    """CTranslate2 converted offline from the workload's model directory, float32 and int8."""

    def __init__(self, device: str, threads: int, work: Path) -> None:
        self.device, self.threads, self.work = device, threads, work
        self.notes: list[str] = []
        try:
            import ctranslate2
        except Exception as error:  # noqa: BLE001 - any import failure only skips CTranslate2
            self.module = None
            self.notes.append(f"CTranslate2 skipped: cannot import it ({type(error).__name__}: {error})")
            return
        self.module = ctranslate2
        if device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
            self.notes.append("CTranslate2 skipped: this build sees no CUDA device (pip's wheel needs CUDA 12 libs)")
            self.module = None

    @property
    def available(self) -> bool:
        return self.module is not None

    def load(self, workload, quantization: str):
        """A Translator (encoder-decoder) or Generator (decoder-only); None with a note if it fails."""
        if self.module is None:
            return None
        out_dir = self.work / f"{workload.name}-ct2-{quantization}"
        try:
            if not (out_dir / "model.bin").exists():
                converter = self.module.converters.TransformersConverter(str(workload.hf_dir))
                converter.convert(str(out_dir), quantization=quantization, force=True)
            kind = self.module.Translator if workload.encoder_decoder else self.module.Generator
            options = {"intra_threads": self.threads, "inter_threads": 1} if self.device == "cpu" else {}
            return kind(str(out_dir), device=self.device, compute_type=quantization, **options)
        except Exception as error:  # noqa: BLE001 - a failed conversion or load only skips that row
            self.notes.append(f"CTranslate2 {quantization} skipped for {workload.name}: {type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}")
            return None

    @staticmethod
    def engine(workload, model, size: int, num_beams: int) -> Callable[[], list[list[int]]]:
        tokens = workload.token_lists(size)
        options = workload.ct2_kwargs(num_beams)
        index = {name: i for i, name in enumerate(workload.vocabulary)}
        end = workload.vocabulary[workload.eos_token_id]

        if workload.encoder_decoder:
            def call():
                return model.translate_batch(
                    tokens, beam_size=options["beam_size"], patience=options["patience"],
                    length_penalty=options["length_penalty"], num_hypotheses=1,
                    return_end_token=True, max_decoding_length=options["max_length"],
                    min_decoding_length=options["min_length"], end_token=end)
        else:
            def call():
                return model.generate_batch(
                    tokens, beam_size=options["beam_size"], patience=options["patience"],
                    length_penalty=options["length_penalty"], num_hypotheses=1, return_end_token=True,
                    max_length=options["max_length"], min_length=options["min_length"], end_token=end,
                    include_prompt_in_result=False)

        def run():
            results = call()
            best = [r.hypotheses[0] if workload.encoder_decoder else r.sequences[0] for r in results]
            return [cut_after_eos([index[t] for t in tokens], workload.eos_token_id) for tokens in best]

        return run
