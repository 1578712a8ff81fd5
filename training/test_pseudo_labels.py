"""Pseudo-labelled pairs for self-training (``pseudo_labels.py``, ``train_g2p.py --extra-pairs``), run by hand with
the trainer's other tests:

    PYTHONPATH=runs/pydeps .venv/bin/python -m pytest -q training/test_pseudo_labels.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from g2p_data import Split  # noqa: E402
from pseudo_labels import unlabelled  # noqa: E402
from train_g2p import extra_pairs_words, read_extra_pairs  # noqa: E402

SPLIT = Split(
    train=[("cat", [["K", "AE1", "T"]])],
    dev=[("dog", [["D", "AO1", "G"]])],
    test=[("tag", [["T", "AE1", "G"]])],
)
CHARS, PHONES = list("acdgot'"), ["AE1", "AO1", "D", "G", "K", "T"]


def test_unlabelled_words_skip_known_odd_and_repeated_words_and_keep_the_order():
    words = ["the", "dog", "c3po", "go", "x-ray", "toad", "the", "don't", "'tis", "cat's", "ok"]
    assert unlabelled(words, known={"dog"}, top=10) == ["the", "toad", "don't", "cat's"]
    assert unlabelled(words, known={"dog"}, top=2) == ["the", "toad"]


def test_extra_pairs_are_read_and_keep_their_order(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("cod\tK AO1 D\t0.9000\ntoad\tT AO1 D\t0.7000\n")
    assert read_extra_pairs(path, SPLIT, CHARS, PHONES) == [("cod", "K AO1 D"), ("toad", "T AO1 D")]


@pytest.mark.parametrize("word", ["cat", "dog", "tag"])  # train, dev, test
def test_a_cmudict_word_among_extra_pairs_is_refused_by_name(tmp_path, word):
    path = tmp_path / "pairs.tsv"
    path.write_text(f"cod\tK AO1 D\n{word}\tK AE1 T\n")
    with pytest.raises(ValueError, match=rf"pairs.tsv:2: '{word}' is a CMUdict word"):
        read_extra_pairs(path, SPLIT, CHARS, PHONES)


def test_a_line_without_a_tab_is_refused_by_its_number(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("cod\tK AO1 D\ntoad T AO1 D\n")
    with pytest.raises(ValueError, match="pairs.tsv:2: 'toad T AO1 D' is not word<TAB>phones"):
        read_extra_pairs(path, SPLIT, CHARS, PHONES)


def test_the_model_card_names_extra_pairs_only_when_a_run_had_them():
    assert extra_pairs_words(0) == ""
    assert "67,739 pseudo-labelled pairs" in extra_pairs_words(67_739)


@pytest.mark.parametrize("line", ["coz\tK AO1 Z", "cod\tK AO2 D", "cod\t"])
def test_an_unknown_character_or_phone_or_an_empty_pronunciation_is_refused(tmp_path, line):
    path = tmp_path / "pairs.tsv"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="pairs.tsv:1: .* does not know"):
        read_extra_pairs(path, SPLIT, CHARS, PHONES)
