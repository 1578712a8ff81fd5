"""The G2P metrics (``evaluation.py``) against values derived by hand."""

from __future__ import annotations

import pytest

from beamsearch.evaluation import edit_distance, read_references, score, strip_stress


def test_read_references_keeps_every_reference_and_skips_blank_lines(tmp_path):
    path = tmp_path / "refs.tsv"
    path.write_bytes(b"read\tR EH1 D\tR IY1 D\r\n\nthe\tDH AH0\n")
    assert read_references(path) == [("read", [["R", "EH1", "D"], ["R", "IY1", "D"]]), ("the", [["DH", "AH0"]])]
    path.write_text("read\tR EH1 D\nlonely\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"refs.tsv:2: no reference after the input"):
        read_references(path)


def test_read_references_drops_a_byte_order_mark(tmp_path):
    path = tmp_path / "refs.tsv"
    path.write_bytes(b"\xef\xbb\xbfits\tIH1 T S\n")
    assert read_references(path) == [("its", [["IH1", "T", "S"]])]


def test_strip_stress_and_edit_distance_by_hand():
    assert strip_stress(["AH0", "K", "S1", "ER2"]) == ["AH", "K", "S", "ER"]
    assert edit_distance(list("kitten"), list("sitting")) == 3  # k->s, e->i, +g
    assert edit_distance([], ["A", "B", "C"]) == 3 and edit_distance(["A", "B"], []) == 2
    assert edit_distance(["A", "B", "C"], ["A", "B", "C"]) == 0
    assert edit_distance(["A", "B", "C"], ["B", "C", "A"]) == 2  # delete A, insert A


def test_several_references_and_an_empty_output():
    hyps = [["K", "AE1", "T"], ["D", "AO1", "G"], [], ["HH", "AH0", "L", "OW1"]]
    refs = [[["K", "AE1", "T"]],
            [["D", "AA1", "G"], ["D", "AO1", "G"]],  # the second reference matches
            [["AH0"]],  # the empty output: wrong, one deletion
            [["HH", "EH0", "L", "OW1"], ["HH", "AH0", "L", "OW1"]]]
    s = score(hyps, refs)
    # 1 of 4 inputs wrong with or without stress; errors 0 + 0 + 1 + 0 over the closest references' 3+3+1+4 tokens
    assert (s.n, s.wer, s.wer_stress) == (4, 25.0, 25.0)
    assert s.per == pytest.approx(100 / 11)


def test_stress_marks_count_only_in_wer_stress_and_per():
    s = score([["K", "AE0", "T"], ["S", "IY1"]], [[["K", "AE1", "T"]], [["S", "IY1"]]])
    # without stress both match; with stress the first does not; PER: one substitution in 3 + 2 tokens
    assert (s.wer, s.wer_stress) == (0.0, 50.0)
    assert s.per == pytest.approx(100 / 5)


def test_per_takes_the_closest_reference_by_rate_then_distance():
    # A B against A B C D: 2 edits in 4 (rate 0.5); against X: 2 edits in 1 (rate 2): the first counts
    assert score([["A", "B"]], [[["A", "B", "C", "D"], ["X"]]]).per == pytest.approx(50.0)
    # A against B (1 in 1) and B C (2 in 2): equal rates, the smaller distance counts: 1 error in 1 token
    assert score([["A"]], [[["B", "C"], ["B"]]]).per == pytest.approx(100.0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        score([["A"], ["B"]], [[["A"]]])
    with pytest.raises(ValueError, match="input 1 has no reference"):
        score([["A"], ["B"]], [[["A"]], []])
    assert score([], []).as_dict() == {"n": 0, "wer": 0.0, "wer_stress": 0.0, "per": 0.0}
