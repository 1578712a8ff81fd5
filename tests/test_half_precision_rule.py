"""Issue 39's rule for bfloat16 / float16 benchmark rows (benchmarks/suite_graphs.py): a differing best hypothesis
is scored with one teacher-forced float32 forward. The scoring is checked against transformers' own greedy scores
(``output_scores``: the log-softmax of each chosen token, averaged over the generated tokens up to the end token),
and the rule's count and deficit on a hypothesis changed by hand."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from tiny_hf import random_inputs, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
suite_graphs = pytest.importorskip("suite_graphs")


@pytest.mark.parametrize("name", ["t5", "gpt2", "llama"])
def test_teacher_forced_scores_are_generates_own(name: str) -> None:
    model = tiny_model(name)
    ids, mask = random_inputs(model, 4, torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "attention_mask": mask}
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                         output_scores=True)
    start = 1 if model.config.is_encoder_decoder else ids.shape[1]
    chosen = torch.stack([torch.log_softmax(scores.float(), -1).gather(-1, out.sequences[:, start + i, None])[:, 0]
                          for i, scores in enumerate(out.scores)], dim=1)  # [B, steps]
    ended = out.sequences[:, start:] == model.config.eos_token_id
    counted = ~((ended.long().cumsum(dim=1) - ended.long()) > 0)  # up to the first end token, included
    expected = (chosen * counted).sum(dim=1) / counted.sum(dim=1)
    torch.testing.assert_close(suite_graphs.teacher_forced(model, inputs, out.sequences), expected,
                               rtol=1e-5, atol=1e-5)


def test_the_rule_counts_the_differing_rows_and_their_worst_deficit() -> None:
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)  # (the cached model stays float32)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "attention_mask": mask}
    theirs = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert suite_graphs.half_precision_rule(model, inputs, theirs, theirs) == (0, 0.0)
    ours = theirs.clone()
    ours[1, -1] = (ours[1, -1] + 1) % model.config.vocab_size  # another last token
    scorer = copy.deepcopy(model).float()  # the bfloat16 weights, computed in float32
    row = {k: v[1:2] for k, v in inputs.items()}
    want = float(suite_graphs.teacher_forced(scorer, row, theirs[1:2]) - suite_graphs.teacher_forced(scorer, row,
                                                                                                      ours[1:2]))
    rows, deficit = suite_graphs.half_precision_rule(model, inputs, theirs, ours)
    assert rows == 1 and deficit == pytest.approx(want, abs=1e-6)


def test_the_control_measures_transformers_static_cache_against_its_default() -> None:
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    ids, mask = random_inputs(model, 3, torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "attention_mask": mask}
    kwargs = {"max_new_tokens": 6, "do_sample": False, "num_beams": 2}
    theirs = model.generate(**inputs, **kwargs)
    static = model.generate(**inputs, **kwargs, cache_implementation="static")
    assert suite_graphs.control_rule(model, inputs, kwargs, theirs) == suite_graphs.half_precision_rule(
        model, inputs, theirs, static)
