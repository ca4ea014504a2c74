"""keras-hub tokenizers with vocabularies trained offline on local text.

keras-hub's own vocabulary trainers (``compute_word_piece_vocabulary``,
``compute_sentence_piece_proto``) need tensorflow-text, which this project
cannot install beside tensorflow-cpu, and its presets need the network. Here
the vocabulary is trained with Hugging Face ``tokenizers`` (a Rust library
with wheels for every platform) and handed to keras-hub's tokenizer classes,
which then tokenize on every backend:

* ``"gpt2"``: byte-level BPE (GPT-2's pre-tokenizing regex and byte
  alphabet) for ``keras_hub.models.GPT2Tokenizer``, special token
  ``<|endoftext|>``;
* ``"roberta"``: the same byte-level BPE with RoBERTa's special tokens
  (``<s>``, ``<pad>``, ``</s>``, ``<unk>``, ``<mask>``) for
  ``keras_hub.models.RobertaTokenizer``;
* ``"bert"``: lower-cased WordPiece (``[PAD]``, ``[UNK]``, ``[CLS]``,
  ``[SEP]``, ``[MASK]``) for ``keras_hub.models.BertTokenizer``.

keras-hub applies the trained merges as the trainer does, except on runs of
whitespace: its split regex has no lookahead, so ``"  The"`` becomes
``"  "`` + ``"The"`` where GPT-2's regex gives ``" "`` + ``" The"`` (as with
any vocabulary loaded into keras-hub's BPE tokenizers).

:func:`wikipedia_tokenizer` trains on the training articles of the Wikipedia
sample that ships in gensim's test data
(:func:`keras_longattn.datasets.wiki_article_splits`), so nothing is
downloaded. Offline it needs gensim installed (the ``[hub]`` extra lists it,
as does ``[notebooks]``): the sample is the file
``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``
of gensim's wheel (1.7 MB, 206 pages), found on disk without importing
gensim; without it :func:`wikipedia_tokenizer` raises
``keras_longattn.datasets.DatasetNotFoundError``. :func:`train_tokenizer`
on your own texts needs no gensim. Llama and Mistral use SentencePiece,
whose keras-hub tokenizer runs through tensorflow-text at call time; they
are not offered.

Needs keras-hub and tokenizers, and gensim's test data for
:func:`wikipedia_tokenizer` (``pip install keras-longattn[hub]``).
"""

import functools
import json
import numbers

try:
    import keras_hub
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models as tokenizer_models
    from tokenizers import normalizers
    from tokenizers import pre_tokenizers
    from tokenizers import trainers
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "keras_longattn.hub.tokenizers trains keras-hub tokenizers and needs "
        "keras-hub and tokenizers: pip install keras-longattn[hub]"
    ) from error

__all__ = ["MODELS", "train_tokenizer", "wikipedia_tokenizer"]

#: The special tokens of each model's vocabulary, in id order (ids 0, 1, ...).
_SPECIAL_TOKENS = {
    "gpt2": ("<|endoftext|>",),
    "roberta": ("<s>", "<pad>", "</s>", "<unk>", "<mask>"),
    "bert": ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
}

#: The models :func:`train_tokenizer` builds a tokenizer for.
MODELS = tuple(_SPECIAL_TOKENS)

#: Byte-level BPE starts from the 256 byte symbols: a vocabulary needs them,
#: the special tokens and room for merges.
_BYTE_ALPHABET = 256


def _check_model(model):
    if model not in _SPECIAL_TOKENS:
        raise ValueError(
            f"`model` must be one of {list(MODELS)}. Received: model={model!r}")
    return model


def _minimum_size(model):
    if model == "bert":
        return len(_SPECIAL_TOKENS[model]) + 100
    return _BYTE_ALPHABET + len(_SPECIAL_TOKENS[model]) + 1


def _check_vocabulary_size(model, vocabulary_size):
    minimum = _minimum_size(model)
    if (
        isinstance(vocabulary_size, bool)
        or not isinstance(vocabulary_size, numbers.Integral)
        or vocabulary_size < minimum
    ):
        raise ValueError(
            f"`vocabulary_size` must be an int of at least {minimum} for "
            f"model={model!r} (the special tokens and the base alphabet need "
            f"room). Received: vocabulary_size={vocabulary_size!r}")
    return int(vocabulary_size)


def _check_texts(texts):
    if isinstance(texts, (str, bytes)):
        raise ValueError(
            "`texts` must be an iterable of documents (str or UTF-8 bytes), "
            f"not one {type(texts).__name__}. Received: texts={texts[:40]!r}...")
    decoded = []
    for index, text in enumerate(texts):
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if not isinstance(text, str):
            raise ValueError(
                "`texts` must hold str or UTF-8 bytes documents. Received: "
                f"texts[{index}] of type {type(text).__name__}")
        decoded.append(text)
    if not any(decoded):
        raise ValueError(
            "`texts` must hold at least one non-empty document to train a "
            f"vocabulary on. Received: {len(decoded)} empty document(s)")
    return decoded


def _train_byte_level_bpe(texts, vocabulary_size, special_tokens):
    tokenizer = Tokenizer(tokenizer_models.BPE())
    # GPT-2's pre-tokenizing regex and byte-to-unicode alphabet: the ones
    # keras-hub's BytePairTokenizer applies before its merges.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocabulary_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [
        merge if isinstance(merge, str) else " ".join(merge)
        for merge in model["merges"]
    ]
    return dict(model["vocab"]), merges


def _train_word_piece(texts, vocabulary_size, special_tokens):
    tokenizer = Tokenizer(tokenizer_models.WordPiece(unk_token="[UNK]"))
    # BERT's uncased normalisation and splitting on whitespace and
    # punctuation, as keras-hub's BertTokenizer(lowercase=True) does.
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True,
        lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocabulary_size,
        special_tokens=list(special_tokens),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    vocabulary = tokenizer.get_vocab()
    return [token for token, _ in sorted(vocabulary.items(), key=lambda item: item[1])]


def train_tokenizer(model, texts, vocabulary_size=2048):
    """A keras-hub tokenizer for ``model`` with a vocabulary trained on ``texts``.

    Args:
        model: ``"gpt2"``, ``"roberta"`` (byte-level BPE) or ``"bert"``
            (lower-cased WordPiece).
        texts: an iterable of documents, each ``str`` or UTF-8 ``bytes``.
        vocabulary_size: the size of the vocabulary, special tokens
            included (the trainer may stop short of it on little text).
            At least 262 for ``"gpt2"`` and ``"roberta"`` (the 256 bytes and
            the special tokens), 105 for ``"bert"``. Defaults to 2048.

    Returns:
        A ``keras_hub.models.GPT2Tokenizer``, ``RobertaTokenizer`` or
        ``BertTokenizer`` (``lowercase=True``). The special tokens take the
        first ids: ``<|endoftext|>`` = 0 (GPT-2);
        ``<s>``, ``<pad>``, ``</s>``, ``<unk>``, ``<mask>`` = 0..4 (RoBERTa);
        ``[PAD]``, ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` = 0..4 (BERT).

    Raises:
        ValueError: an unknown ``model``, a ``vocabulary_size`` below the
            minimum, or ``texts`` that is a single string or holds no text.

    Example:

    >>> tokenizer = train_tokenizer("gpt2", ["the cat sat on the mat"] * 50,
    ...                             vocabulary_size=300)
    >>> tokenizer.detokenize(tokenizer("the cat sat"))
    'the cat sat'
    """
    model = _check_model(model)
    vocabulary_size = _check_vocabulary_size(model, vocabulary_size)
    texts = _check_texts(texts)
    special_tokens = _SPECIAL_TOKENS[model]
    if model == "bert":
        vocabulary = _train_word_piece(texts, vocabulary_size, special_tokens)
        return keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
    vocabulary, merges = _train_byte_level_bpe(texts, vocabulary_size, special_tokens)
    if model == "gpt2":
        return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    return keras_hub.models.RobertaTokenizer(vocabulary=vocabulary, merges=merges)


@functools.lru_cache(maxsize=8)
def _wikipedia_vocabulary(model, vocabulary_size):
    from keras_longattn.datasets import load_wiki_articles
    from keras_longattn.datasets import wiki_article_splits

    articles = load_wiki_articles()
    texts = [articles[index][1] for index in wiki_article_splits()["train"]]
    tokenizer = train_tokenizer(model, texts, vocabulary_size)
    if model == "bert":
        return tokenizer.get_vocabulary(), None
    return tokenizer.vocabulary, tokenizer.merges


def wikipedia_tokenizer(model, vocabulary_size=2048):
    """A keras-hub tokenizer trained on the Wikipedia sample, offline.

    The vocabulary is trained (:func:`train_tokenizer`) on the texts of the
    84 training articles of :func:`keras_longattn.datasets.wiki_article_splits`
    (the Wikipedia sample in gensim's test data; the valid and test articles
    stay unseen). Training is deterministic and takes a few seconds; the
    vocabulary is cached per ``(model, vocabulary_size)`` for the process,
    and each call returns a new tokenizer built from it.

    Args:
        model: ``"gpt2"``, ``"roberta"`` or ``"bert"``.
        vocabulary_size: the vocabulary's size, special tokens included.
            Defaults to 2048.

    Returns:
        The keras-hub tokenizer of :func:`train_tokenizer`.

    Raises:
        ValueError: an unknown ``model`` or a ``vocabulary_size`` below the
            minimum.
        keras_longattn.datasets.DatasetNotFoundError: gensim's test data is
            not installed.

    Example:

    >>> tokenizer = wikipedia_tokenizer("roberta", vocabulary_size=1024)
    >>> tokenizer.vocabulary_size()
    1024
    >>> tokenizer.detokenize(tokenizer("Anarchism is a political philosophy"))
    'Anarchism is a political philosophy'
    """
    model = _check_model(model)
    vocabulary_size = _check_vocabulary_size(model, vocabulary_size)
    vocabulary, merges = _wikipedia_vocabulary(model, vocabulary_size)
    if model == "bert":
        return keras_hub.models.BertTokenizer(vocabulary=list(vocabulary), lowercase=True)
    cls = keras_hub.models.GPT2Tokenizer if model == "gpt2" else keras_hub.models.RobertaTokenizer
    return cls(vocabulary=dict(vocabulary), merges=list(merges))
