"""Fake models with known behaviour for strategy tests: prefix-hashed logits and a small GRU decoder."""

from __future__ import annotations

import torch


class PrefixModel:
    """Logits that depend on the whole prefix through a hash into a fixed random table.

    ``step(tokens [N, t], state) -> (logits [N, V], state)``; the state is unused (None), so the
    model is its own uncached reference.
    """

    def __init__(self, vocab_size: int, seed: int = 0, sharpness: float = 2.0, table_size: int = 997):
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.table = torch.randn(table_size, vocab_size, generator=generator) * sharpness
        self.primes = torch.tensor([31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101] * 8)

    def logits_for(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [N, t]`` -> ``[N, V]``."""
        weights = self.primes[: tokens.shape[1]] ** torch.arange(1, tokens.shape[1] + 1).clamp(max=3)
        keys = (tokens * weights).sum(dim=1) % self.table.shape[0]
        return self.table[keys]

    def __call__(self, tokens: torch.Tensor, state):
        return self.logits_for(tokens), state

    def log_probs_of(self, sequence: list[int], prompt_length: int) -> list[float]:
        """Teacher-forced log-probs of each generated token of one sequence."""
        out = []
        for position in range(prompt_length, len(sequence)):
            prefix = torch.tensor([sequence[:position]])
            out.append(float(torch.log_softmax(self.logits_for(prefix), dim=-1)[0, sequence[position]]))
        return out


class GRUDecoder(torch.nn.Module):
    """A tiny GRU decoder over an 'encoder memory', with a nested-dict state.

    Cached: ``step_cached`` consumes only the last token and carries ``{"hidden": [N, H],
    "memory": {"summary": [N, H]}}``. Uncached: ``step_uncached`` reruns the whole prefix.
    """

    def __init__(self, vocab_size: int = 12, hidden: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab_size, hidden)
        self.cell = torch.nn.GRUCell(hidden, hidden)
        self.out = torch.nn.Linear(hidden, vocab_size)
        with torch.no_grad():
            self.out.weight.mul_(4.0)

    def initial_state(self, source: torch.Tensor) -> dict:
        """``source [B, S]`` -> state for B rows."""
        summary = torch.tanh(self.embed(source).mean(dim=1))  # [B, H]
        return {"hidden": summary.clone(), "memory": {"summary": summary}, "steps": 0}

    @torch.no_grad()
    def step_cached(self, tokens: torch.Tensor, state: dict):
        hidden = state["hidden"]
        if state["steps"] == 0:
            for position in range(tokens.shape[1]):
                hidden = self.cell(self.embed(tokens[:, position]) + state["memory"]["summary"], hidden)
        else:
            hidden = self.cell(self.embed(tokens[:, -1]) + state["memory"]["summary"], hidden)
        new_state = {"hidden": hidden, "memory": state["memory"], "steps": state["steps"] + 1}
        return self.out(hidden), new_state

    @torch.no_grad()
    def step_uncached(self, tokens: torch.Tensor, state: dict):
        hidden = state["memory"]["summary"]
        for position in range(tokens.shape[1]):
            hidden = self.cell(self.embed(tokens[:, position]) + state["memory"]["summary"], hidden)
        return self.out(hidden), state


HOST_CONVERSIONS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


def count_host_conversions(monkeypatch) -> list[str]:
    """Count tensor -> Python conversions (host synchronisations) until ``monkeypatch.undo()``.

    Returns the list the counters append the conversion's name to.
    """
    conversions: list[str] = []
    for method in HOST_CONVERSIONS:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _name=method, **kw):
            conversions.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return conversions


class RowCounter:
    """Records how many rows each decoding step of a Hugging Face model computes.

    Hooks the output layer, which both the generic step (``model(...)``) and the lean steps call once per step
    with the rows first, and the fast T5 step's decoder (which runs its own packed output layer).
    """

    def __init__(self, model):
        from beamsearch.steps.t5.fast import FastT5State

        self.rows: list[int] = []
        self.handle = model.get_output_embeddings().register_forward_pre_hook(self.record)
        self.fast_decode = FastT5State.__dict__["decode"]
        counter = self

        def decode(state, tokens, position):
            if state.model is model:
                counter.rows.append(tokens.shape[0])
            return counter.fast_decode(state, tokens, position)

        FastT5State.decode = decode

    def record(self, module, args):
        self.rows.append(args[0].shape[0])

    def close(self):
        from beamsearch.steps.t5.fast import FastT5State

        self.handle.remove()
        FastT5State.decode = self.fast_decode
        return self.rows
