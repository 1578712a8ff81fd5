"""Stopping criteria: parity with the transformers classes and with ``_get_stopping_criteria``.

Tokenizers are built offline (trained in memory with ``tokenizers``). Shape legend: N rows, t tokens.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from beamsearch import stopping as bs
from beamsearch.options import SearchOptions

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.generation.stopping_criteria")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stop! Don't stop the music, stopper.",
    "naïve café déjà vu 東京 über straße",
    "stopping stopped stops, hello world. the end\nnew line",
    "laser topper top op opera stop-gap 12 + 34 = 46",
]


def _train(model, pre_tokenizer, decoder, trainer):
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator(TEXTS * 3, trainer)
    return tok


def _byte_level_bpe():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return _train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                  trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|endoftext|>"]))


def _metaspace(byte_fallback: bool):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if byte_fallback:  # Llama-style: "<0xNN>" tokens, decoded by ByteFallback
        decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    else:
        decoder, special = decoders.Metaspace(), ["<unk>", "<s>", "</s>"]
    return _train(models.BPE(byte_fallback=byte_fallback, unk_token="<unk>"), pre_tokenizers.Metaspace(),
                  decoder, trainers.BpeTrainer(vocab_size=len(special) + 150, special_tokens=special))


def _wordpiece():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    return _train(models.WordPiece(unk_token="[UNK]"), pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(),
                  trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"]))


class FakeTokenizer:
    """A plain-Python tokenizer (no backend) with an empty-text token and gaps between ids."""

    PIECES = [*"abcdefghijklmnopqrstuvwxyz ", "st", "op", "stop", "at", "opera", "tion", "sto", "pper", "las",
              "topper", "top", "to", "pped", "<e>", "", "s!", "!", "Stop"]

    def __init__(self):
        self.vocab = {piece: 3 * i + 1 for i, piece in enumerate(self.PIECES)}
        self.inverse = {i: p for p, i in self.vocab.items()}

    def get_vocab(self):
        return dict(self.vocab)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab[c] for c in text]}

    def _convert_id_to_token(self, index):
        return self.inverse[index]

    def convert_ids_to_tokens(self, ids):
        return [self.inverse[i] for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join("" if t == "<e>" else t for t in tokens)

    def encode(self, text, add_special_tokens=False):  # greedy longest match; unknown characters dropped
        ids, i = [], 0
        while i < len(text):
            piece = max((p for p in self.PIECES if p and text.startswith(p, i)), key=len, default="?")
            ids += [self.vocab[piece]] if piece in self.vocab else []
            i += len(piece)
        return ids


@pytest.fixture(scope="module")
def tokenizer_zoo():
    """name -> tokenizer; one per stop-string matching mode (byte-level, byte-fallback, plain text)."""
    from transformers import GPT2TokenizerFast, LlamaTokenizerFast, PreTrainedTokenizerFast

    bpe = _byte_level_bpe()
    vocab, merges = bpe.get_vocab(), [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    with_added = PreTrainedTokenizerFast(tokenizer_object=_byte_level_bpe())
    with_added.add_tokens(["<tool>", "ß!"])
    return {
        "byte_level": PreTrainedTokenizerFast(tokenizer_object=bpe),
        "byte_level_added": with_added,
        "gpt2": GPT2TokenizerFast(vocab=vocab, merges=merges),
        "llama": LlamaTokenizerFast(vocab=vocab, merges=merges),
        "byte_fallback": PreTrainedTokenizerFast(tokenizer_object=_metaspace(True)),
        "metaspace": PreTrainedTokenizerFast(tokenizer_object=_metaspace(False)),
        "wordpiece": PreTrainedTokenizerFast(tokenizer_object=_wordpiece()),
        "fake": FakeTokenizer(),
    }


STOP_SETS = [
    ["stop"],
    ["op", " the", "!"],
    ["topping stops", "e"],  # a long one (window) next to a one-character one
    ["東京", "é", "ß"],  # multi-byte characters: tokens may hold parts of them
    ["lazy dog.", "\n", "s, h"],
]


def _relevant_ids(tokenizer, stops) -> list[int]:
    """Ids that make (partial) matches likely: the encodings of every piece of every stop string."""
    ids = set()
    for stop in stops:
        for i in range(len(stop)):
            for j in range(i + 1, len(stop) + 1):
                for text in (stop[i:j], " " + stop[i:j], stop[i:j] + "x", "a" + stop[i:j]):
                    ids.update(tokenizer.encode(text, add_special_tokens=False))
    return sorted(ids)


def _random_rows(tokenizer, stops, seed: int, rows: int = 400) -> list[torch.Tensor]:
    """Batches [N, t] of token ids: random vocabulary, stop-string pieces, and prefixes of encoded texts."""
    rng = random.Random(seed)
    vocab_ids = sorted(tokenizer.get_vocab().values())
    unknown = [max(vocab_ids) + 1, max(vocab_ids) + 2, max(vocab_ids) + 7]  # out of the vocabulary
    relevant = _relevant_ids(tokenizer, stops)
    batches = []
    for length in (1, 2, 3, 5, 9, 16):
        batch = []
        for _ in range(rows):
            pool = rng.choice([relevant, relevant, vocab_ids + unknown])
            batch.append([rng.choice(pool) for _ in range(length)])
        batches.append(torch.tensor(batch))
    words = [*stops, *(s[: len(s) // 2] for s in stops), *(s[len(s) // 2:] for s in stops), " ", "the ", "ab", "x"]
    for _ in range(4):
        text = "".join(rng.choice(words) for _ in range(12)) + "".join(rng.choice(TEXTS).split()[:3])
        ids = tokenizer.encode(text, add_special_tokens=False)
        width = min(len(ids), 8)
        batches.append(torch.tensor([ids[k - width:k] for k in range(width, len(ids) + 1)]))
    return batches


@pytest.mark.parametrize("name", ["byte_level", "byte_level_added", "gpt2", "llama", "byte_fallback",
                                  "metaspace", "wordpiece", "fake"])
def test_stop_strings_match_transformers(tokenizer_zoo, name):
    tokenizer = tokenizer_zoo[name]
    hits = total = spanning = 0
    for k, stops in enumerate(STOP_SETS):
        try:
            theirs = hf.StopStringCriteria(tokenizer, stops)
        except ValueError:  # no token can end any stop string: we must refuse too
            with pytest.raises(ValueError, match="stop_strings"):
                bs.StopStringCriteria(tokenizer, stops)
            continue
        ours = bs.StopStringCriteria(tokenizer, stops)
        assert ours.stop_strings == tuple(stops)
        for input_ids in _random_rows(tokenizer, stops, seed=k):
            expected = theirs(input_ids, None)
            got = ours(input_ids, None)
            assert got.dtype == torch.bool and got.shape == (input_ids.shape[0],)
            bad = (got != expected).nonzero()[:, 0].tolist()
            assert not bad, (stops, [input_ids[i].tolist() for i in bad[:3]], expected[bad[:3]])
            hits, total = hits + int(expected.sum()), total + len(expected)
            spanning += int((expected & ~theirs(input_ids[:, -1:], None)).sum())
    assert 0.05 < hits / total < 0.95  # both outcomes are well exercised
    assert spanning > 20  # and many matches need more than the last token


FAKE_CASES = [  # from the transformers docstring: the stop string must overlap the last token
    (["st", "op"], True), (["stop"], True), (["st", "opera"], True), (["sto", "pper"], True),
    (["las", "topper"], True), (["s", "to", "pped"], True), (["a", "s", "to", "pped"], True),
    (["stop", "at"], False), (["st", "op", "at"], False), (["st", "opera", "tion"], False),
    (["s", "<e>", "top"], True), (["st", "op", "<e>"], False), (["<e>"], False),
    (["s", "<e>", "<e>", "<e>", "top"], False),  # the empty tokens use up the window of len("stop") tokens
]


@pytest.mark.parametrize(("pieces", "expected"), FAKE_CASES)
def test_stop_string_hand_cases(tokenizer_zoo, pieces, expected):
    tokenizer = tokenizer_zoo["fake"]
    input_ids = torch.tensor([[tokenizer.vocab[p] for p in pieces]])
    assert bs.StopStringCriteria(tokenizer, "stop")(input_ids, None).tolist() == [expected]
    assert hf.StopStringCriteria(tokenizer, "stop")(input_ids, None).tolist() == [expected]


def test_negative_and_empty_inputs(tokenizer_zoo):
    criterion = bs.StopStringCriteria(tokenizer_zoo["fake"], ["stop", "!"])
    stop = tokenizer_zoo["fake"].vocab["stop"]
    assert criterion(torch.tensor([[-1, stop], [stop, -5], [stop, stop]]), None).tolist() == [True, False, True]
    assert criterion(torch.zeros(3, 0, dtype=torch.long), None).tolist() == [False] * 3


def test_byte_alphabet_is_the_gpt2_one():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert bs._byte_alphabet() == {char: byte for byte, char in bytes_to_unicode().items()}


@pytest.mark.parametrize("name", ["byte_level", "gpt2", "llama", "byte_fallback", "metaspace", "wordpiece"])
def test_matching_mode_as_transformers(tokenizer_zoo, name):
    tokenizer = tokenizer_zoo[name]
    assert bs._matching_mode(tokenizer) == hf.StopStringCriteria._get_stop_string_matching_mode(tokenizer)


def _id_batches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for rows, length in [(1, 1), (3, 4), (5, 9), (2, 20)]:
        yield torch.randint(0, 6, (rows, length), generator=gen)


@pytest.mark.parametrize("max_length", [0, 1, 4, 9, 30])
def test_max_length_matches_transformers(max_length):
    for input_ids in _id_batches(max_length):
        expected = hf.MaxLengthCriteria(max_length)(input_ids, None)
        assert torch.equal(bs.MaxLengthCriteria(max_length)(input_ids, None), expected)


def test_max_length_position_warning():
    criterion = bs.MaxLengthCriteria(10, max_position_embeddings=3)
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        criterion(torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize(("max_time", "age"), [(5.0, 10.0), (20, 10.0), (0.5, 0.0)])
def test_max_time_matches_transformers(max_time, age):
    start = time.time() - age
    for input_ids in _id_batches(1):
        expected = hf.MaxTimeCriteria(max_time, initial_timestamp=start)(input_ids, None)
        assert torch.equal(bs.MaxTimeCriteria(max_time, initial_timestamp=start)(input_ids, None), expected)
    assert not bs.MaxTimeCriteria(60.0)(torch.zeros(2, 3, dtype=torch.long)).any()


@pytest.mark.parametrize("eos", [0, [3], [1, 5], torch.tensor([2, 4]), torch.tensor(5)])
def test_eos_matches_transformers(eos):
    for input_ids in _id_batches(7):
        for new_tokens in (1, 2):
            expected = hf.EosTokenCriteria(eos)(input_ids, None, new_token_length=new_tokens)
            got = bs.EosTokenCriteria(eos)(input_ids, None, new_token_length=new_tokens)
            assert torch.equal(got, expected)


def test_list_is_the_or_and_mixes_with_transformers():
    ids = torch.tensor([[1, 2, 3], [1, 2, 5], [1, 9, 9]])
    ours = bs.StoppingCriteriaList([bs.EosTokenCriteria(5), hf.EosTokenCriteria(3)])
    assert ours(ids, None).tolist() == [True, True, False]
    assert ours.max_length is None
    assert bs.StoppingCriteriaList()(ids, None).tolist() == [False] * 3
    assert bs.StoppingCriteriaList([ours, hf.MaxLengthCriteria(7)]).max_length == 7
    assert bs.StoppingCriteriaList([bs.MaxLengthCriteria(4), hf.MaxLengthCriteria(7)]).max_length == 4
    theirs = hf.StoppingCriteriaList([bs.EosTokenCriteria(5), bs.MaxLengthCriteria(3)])  # ours inside theirs
    assert theirs(ids, None).tolist() == [True] * 3


class UserCriterion:
    def __call__(self, input_ids, scores=None, **kwargs):
        return input_ids[:, -1] == 9


@pytest.fixture(scope="module")
def tiny_gpt2(tokenizer_zoo):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=len(tokenizer_zoo["byte_level"]))
    return GPT2LMHeadModel(config).eval()


BUILD_CASES = [
    ({}, 3, None),
    ({"max_new_tokens": 4, "eos_token_id": [2, 7]}, 5, None),
    ({"max_time": 3.0, "stop_strings": ["stop", "!"], "eos_token_id": 1}, 2, None),
    ({"stop_strings": "the", "eos_token_id": 1}, 2, "max_length"),
    ({"max_time": 3.0, "eos_token_id": 1}, 2, "same_kinds"),
    ({"stop_strings": ["o"], "eos_token_id": [1, 4], "max_length": 8}, 2, "mixed"),
]


def _user_criteria(kind):
    if kind == "max_length":
        return [hf.MaxLengthCriteria(6)]
    if kind == "same_kinds":
        return [UserCriterion(), hf.EosTokenCriteria(9), hf.MaxTimeCriteria(5.0), hf.EosTokenCriteria(8)]
    if kind == "mixed":
        return [UserCriterion(), hf.MaxLengthCriteria(5), UserCriterion()]
    return []


@pytest.mark.parametrize(("kwargs", "prompt_length", "user"), BUILD_CASES)
def test_build_matches_get_stopping_criteria(tokenizer_zoo, tiny_gpt2, kwargs, prompt_length, user):
    from transformers import GenerationConfig

    tokenizer = tokenizer_zoo["byte_level"]
    options = SearchOptions.create(**kwargs)
    config = GenerationConfig(**{k: v for k, v in kwargs.items() if k != "max_new_tokens"})
    config.max_length = options.resolved_max_length(prompt_length)  # as generate() resolves it
    tiny_gpt2._prepare_special_tokens(config, False, device="cpu")
    custom = _user_criteria(user)
    theirs = tiny_gpt2._get_stopping_criteria(config, hf.StoppingCriteriaList(custom), tokenizer=tokenizer)
    ours = bs.build_stopping_criteria(options, prompt_length, tokenizer, custom)
    assert isinstance(ours, bs.StoppingCriteriaList)
    assert [type(c).__name__ for c in ours] == [type(c).__name__ for c in theirs]
    for mine, their in zip(ours, theirs, strict=True):
        assert (mine is their) == any(their is c for c in custom)  # the same user objects, at the same places
    assert ours.max_length == theirs.max_length
    gen = torch.Generator().manual_seed(prompt_length)
    for length in range(1, 10):
        ids = torch.randint(0, len(tokenizer), (64, length), generator=gen)
        ids[::3, -1] = 9
        assert torch.equal(ours(ids, None), theirs(ids, None))


def test_build_stop_strings_need_a_tokenizer():
    options = SearchOptions.create(stop_strings=["x"])
    with pytest.raises(ValueError, match="stop_strings.*tokenizer"):
        bs.build_stopping_criteria(options, 3)
    assert [type(c) for c in bs.build_stopping_criteria(SearchOptions.create(), 3, user_criteria=None)] == [
        bs.MaxLengthCriteria]


@pytest.mark.parametrize(("make", "name"), [
    (lambda tok: bs.MaxLengthCriteria(-1), "max_length"),
    (lambda tok: bs.MaxLengthCriteria(2.5), "max_length"),
    (lambda tok: bs.MaxLengthCriteria(True), "max_length"),
    (lambda tok: bs.MaxTimeCriteria(0), "max_time"),
    (lambda tok: bs.MaxTimeCriteria("1"), "max_time"),
    (lambda tok: bs.EosTokenCriteria([]), "eos_token_id"),
    (lambda tok: bs.EosTokenCriteria(-1), "eos_token_id"),
    (lambda tok: bs.EosTokenCriteria(["a"]), "eos_token_id"),
    (lambda tok: bs.EosTokenCriteria(torch.tensor([0.5])), "eos_token_id"),
    (lambda tok: bs.StopStringCriteria(tok, []), "stop_strings"),
    (lambda tok: bs.StopStringCriteria(tok, ["ok", ""]), "stop_strings"),
    (lambda tok: bs.StopStringCriteria(tok, 5), "stop_strings"),
    (lambda tok: bs.StopStringCriteria(None, "stop"), "tokenizer"),
    (lambda tok: bs.StopStringCriteria(tok, "¿¿"), "stop_strings"),  # no token can end it
])
def test_invalid_arguments_name_the_argument(tokenizer_zoo, make, name):
    with pytest.raises(ValueError, match=name):
        make(tokenizer_zoo["fake"])


def test_classify_stop():
    ids = torch.tensor([[4, 2], [4, 7], [4, 3], [4, 2]])
    stopped = torch.tensor([True, True, True, False])
    reason = bs.FinishReason
    assert bs.classify_stop(ids, stopped, (2, 3), max_length=5).tolist() == [
        reason.EOS, reason.STOP_CRITERION, reason.EOS, reason.NONE]
    assert bs.classify_stop(ids, stopped, (2,), max_length=2).tolist() == [
        reason.EOS, reason.MAX_LENGTH, reason.MAX_LENGTH, reason.NONE]
    assert bs.classify_stop(ids, stopped, None, max_length=2).tolist() == [reason.MAX_LENGTH] * 3 + [reason.NONE]
    assert bs.classify_stop(ids, stopped, 7, max_length=9).tolist() == [
        reason.STOP_CRITERION, reason.EOS, reason.STOP_CRITERION, reason.NONE]
    assert bs.classify_stop(ids, stopped, None, 9).dtype == torch.long
    assert bs.FinishReason is __import__("beamsearch").FinishReason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_criteria_follow_the_device(tokenizer_zoo):
    tokenizer = tokenizer_zoo["byte_level"]
    criteria = bs.StoppingCriteriaList([bs.MaxLengthCriteria(9), bs.EosTokenCriteria([1, 2]),
                                        bs.StopStringCriteria(tokenizer, ["stop", " the"])])
    ids = torch.randint(0, len(tokenizer), (64, 6), generator=torch.Generator().manual_seed(0))
    expected = criteria(ids, None)
    got = criteria(ids.cuda(), None)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), expected)
