"""keras_longattn.hub.tokenizers: vocabularies trained offline on the Wikipedia
sample, tokenized by keras-hub's classes."""

import json
import re

import numpy as np
import pytest

pytest.importorskip("keras_hub")
pytest.importorskip("tokenizers")

import keras_hub  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers import models as tokenizer_models  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

from keras_longattn.hub import tokenizers as lt  # noqa: E402
from keras_longattn.datasets import load_wiki_articles  # noqa: E402
from keras_longattn.datasets import wiki_article_splits  # noqa: E402

SIZE = 1024


@pytest.fixture(scope="module")
def held_out_text():
    """A test article, never seen by the trainer."""
    articles = load_wiki_articles()
    index = wiki_article_splits()["test"][0]
    return articles[index][1].decode("utf-8")[:4000]


def _ids(tokenizer, text):
    return np.asarray(tokenizer(text)).tolist()


@pytest.mark.parametrize(
    "model, cls",
    [("gpt2", keras_hub.models.GPT2Tokenizer),
     ("roberta", keras_hub.models.RobertaTokenizer),
     ("bert", keras_hub.models.BertTokenizer)])
def test_class_size_and_special_ids(model, cls):
    tokenizer = lt.wikipedia_tokenizer(model, SIZE)
    assert type(tokenizer) is cls
    assert tokenizer.vocabulary_size() == SIZE
    specials = lt._SPECIAL_TOKENS[model]
    assert [tokenizer.token_to_id(token) for token in specials] == list(range(len(specials)))
    if model == "roberta":
        assert (tokenizer.start_token_id, tokenizer.pad_token_id,
                tokenizer.end_token_id, tokenizer.mask_token_id) == (0, 1, 2, 4)
    if model == "bert":
        assert (tokenizer.pad_token_id, tokenizer.start_token_id,
                tokenizer.end_token_id, tokenizer.mask_token_id) == (0, 2, 3, 4)


@pytest.mark.parametrize("model", ["gpt2", "roberta"])
def test_byte_level_bpe_round_trips_and_compresses(model, held_out_text):
    tokenizer = lt.wikipedia_tokenizer(model, SIZE)
    ids = _ids(tokenizer, held_out_text)
    assert tokenizer.detokenize(ids) == held_out_text
    # Merges that were lost or mangled leave about one token per byte (wiki
    # markup, 1024 tokens: about 0.47 per byte).
    assert len(ids) < 0.65 * len(held_out_text.encode("utf-8"))


@pytest.mark.parametrize("model", ["gpt2", "roberta"])
def test_keras_hub_applies_the_trained_merges_as_the_trainer_does(model, held_out_text):
    # The vocabulary and merges handed to keras-hub, loaded back into a
    # Hugging Face BPE model with GPT-2's byte-level pre-tokenizer: both
    # libraries must split held-out text into the same ids. Runs of
    # whitespace are collapsed first: keras-hub's split regex has no
    # lookahead, so it cuts "  The" into "  " + "The" where GPT-2's regex
    # gives " " + " The" (keras-hub's behaviour with any vocabulary).
    held_out_text = re.sub(r"\s+", " ", held_out_text)
    tokenizer = lt.wikipedia_tokenizer(model, SIZE)
    merges = [tuple(merge.split(" ")) for merge in tokenizer.merges]
    reference = Tokenizer(tokenizer_models.BPE(dict(tokenizer.vocabulary), merges))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert _ids(tokenizer, held_out_text) == reference.encode(held_out_text).ids


def test_word_piece_lowercases_and_splits_words(held_out_text):
    tokenizer = lt.wikipedia_tokenizer("bert", SIZE)
    text = "Anarchism is a Political philosophy."
    ids = _ids(tokenizer, text)
    assert tokenizer.detokenize(ids) == "anarchism is a political philosophy ."
    assert lt._SPECIAL_TOKENS["bert"].index("[UNK]") not in ids
    held_ids = _ids(tokenizer, held_out_text)
    assert len(held_ids) < 0.65 * len(held_out_text.encode("utf-8"))
    unknown = tokenizer.token_to_id("[UNK]")
    assert held_ids.count(unknown) < 0.02 * len(held_ids)


def test_training_is_deterministic_and_depends_on_the_text():
    texts = ["the quick brown fox jumps over the lazy dog"] * 20
    first = lt.train_tokenizer("roberta", texts, 300)
    again = lt.train_tokenizer("roberta", texts, 300)
    assert first.vocabulary == again.vocabulary
    assert first.merges == again.merges
    other = lt.train_tokenizer("roberta", ["colourless green ideas sleep"] * 20, 300)
    assert other.merges != first.merges


def test_bytes_documents_equal_str_documents():
    text = "naïve café au lait " * 10
    from_str = lt.train_tokenizer("gpt2", [text], 300)
    from_bytes = lt.train_tokenizer("gpt2", [text.encode("utf-8")], 300)
    assert from_str.merges == from_bytes.merges
    assert from_bytes.detokenize(from_bytes("naïve café")) == "naïve café"


def test_each_call_returns_a_new_tokenizer_from_the_cached_vocabulary():
    first = lt.wikipedia_tokenizer("gpt2", SIZE)
    second = lt.wikipedia_tokenizer("gpt2", SIZE)
    assert first is not second
    assert json.dumps(first.vocabulary, sort_keys=True) == json.dumps(
        second.vocabulary, sort_keys=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"model": "llama"}, "model='llama'"),
     ({"model": "gpt2", "vocabulary_size": 100}, "vocabulary_size=100"),
     ({"model": "bert", "vocabulary_size": 2.5}, "vocabulary_size=2.5"),
     ({"model": "roberta", "vocabulary_size": True}, "vocabulary_size=True")])
def test_bad_arguments_name_the_argument_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        lt.wikipedia_tokenizer(**kwargs)


@pytest.mark.parametrize(
    "texts, message",
    [("one document", "not one str"),
     ([b"ok", 3], r"texts\[1\] of type int"),
     (["", ""], "2 empty document")])
def test_bad_texts_are_refused(texts, message):
    with pytest.raises(ValueError, match=message):
        lt.train_tokenizer("gpt2", texts, 300)


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(lt, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5
    assert result.failed == 0
