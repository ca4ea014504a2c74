"""Byte-level document matching built from the Wikipedia sample."""

import numpy as np

from keras_longattn.datasets import _validation as v
from keras_longattn.datasets.text import load_wiki_articles

#: Seed of the fixed assignment of articles to splits. It does not depend
#: on any argument, so the splits never change.
_ARTICLE_SPLIT_SEED = 1729
_ARTICLE_SPLIT_FRACTIONS = {"valid": 0.1, "test": 0.1}


def wiki_article_splits(path=None):
    """Assigns the articles of the Wikipedia sample to train/valid/test.

    The articles of `load_wiki_articles()` (106 of them) are shuffled by a
    fixed permutation; the first `round(0.1 * 106) = 11` go to `"test"`,
    the next 11 to `"valid"` and the remaining 84 to `"train"`. The
    assignment never changes, whatever the seeds used elsewhere.

    Args:
        path: path to the `.bz2` file. Defaults to `None`, which uses
            `wiki_sample_path()`.

    Returns:
        A dict mapping `"train"`, `"valid"` and `"test"` to sorted lists of
        indices into `load_wiki_articles()`.

    Example:

    >>> splits = wiki_article_splits()
    >>> {name: len(index) for name, index in splits.items()}
    {'train': 84, 'valid': 11, 'test': 11}
    """
    count = len(load_wiki_articles(path))
    order = np.random.default_rng(_ARTICLE_SPLIT_SEED).permutation(count)
    n_test = int(round(count * _ARTICLE_SPLIT_FRACTIONS["test"]))
    n_valid = int(round(count * _ARTICLE_SPLIT_FRACTIONS["valid"]))
    return {
        "train": sorted(order[n_test + n_valid :].tolist()),
        "valid": sorted(order[n_test : n_test + n_valid].tolist()),
        "test": sorted(order[:n_test].tolist()),
    }


def make_document_matching(
    num_pairs, chunk_length=1024, split="train", seed=None, path=None
):
    """Generates byte-level document matching pairs from Wikipedia articles.

    Each sample is a pair of byte chunks of `chunk_length` bytes taken from
    the articles of the Wikipedia sample in gensim's test data (see
    `load_wiki_articles()`); the label is 1 when both chunks come from the
    same article and 0 otherwise. The two chunks of a positive pair do not
    overlap. Only articles of the requested split (see
    `wiki_article_splits()`, a fixed split by article, so that training and
    test articles are disjoint) with at least `2 * chunk_length` bytes are
    used. `ceil(num_pairs / 2)` pairs are positive and the rest negative, in
    random order. Articles are picked uniformly, chunk offsets uniformly.

    Args:
        num_pairs: number of pairs.
        chunk_length: length of each chunk, in bytes. Defaults to `1024`.
        split: `"train"`, `"valid"` or `"test"`. Defaults to `"train"`.
        seed: seed of the generator. Defaults to `None` (not
            reproducible).
        path: path to the `.bz2` file. Defaults to `None`, which uses
            `wiki_sample_path()`.

    Returns:
        Tuple of numpy arrays `(x1, x2, y)`: `x1` and `x2` of shape
        `(num_pairs, chunk_length)`, `uint8` bytes; `y` of shape
        `(num_pairs,)`, `int32` labels in `{0, 1}`.

    Raises:
        DatasetNotFoundError: if gensim's test data is not installed.
        ValueError: if `split` is unknown, or `chunk_length` is so large
            that fewer than two articles of the split are long enough.

    Example:

    >>> x1, x2, y = make_document_matching(6, chunk_length=256, seed=0)
    >>> x1.shape, x2.dtype, int(y.sum())
    ((6, 256), dtype('uint8'), 3)
    """
    num_pairs = v.check_int("num_pairs", num_pairs, min_value=1)
    chunk_length = v.check_int("chunk_length", chunk_length, min_value=1)
    split = v.check_split(split, allow_none=False)
    seed = v.check_seed(seed)
    articles = load_wiki_articles(path)
    index = wiki_article_splits(path)[split]
    texts = [
        np.frombuffer(articles[i][1], dtype=np.uint8)
        for i in index
        if len(articles[i][1]) >= 2 * chunk_length
    ]
    if len(texts) < 2:
        longest = max(len(articles[i][1]) for i in index)
        raise ValueError(
            f"`chunk_length` is too large: fewer than two articles of the "
            f"{split!r} split have 2 * chunk_length bytes (the longest has "
            f"{longest}). Received: chunk_length={chunk_length}"
        )
    rng = np.random.default_rng(seed)
    labels = np.arange(num_pairs) % 2 == 0
    rng.shuffle(labels)
    x1 = np.zeros((num_pairs, chunk_length), dtype=np.uint8)
    x2 = np.zeros((num_pairs, chunk_length), dtype=np.uint8)
    for i, positive in enumerate(labels):
        if positive:
            text = texts[rng.integers(len(texts))]
            # Two non-overlapping chunks, uniformly among such pairs.
            u, w = np.sort(rng.integers(0, len(text) - 2 * chunk_length + 1,
                                        size=2))
            starts = [u, w + chunk_length]
            rng.shuffle(starts)
            first, second = text, text
        else:
            a, b = rng.choice(len(texts), size=2, replace=False)
            first, second = texts[a], texts[b]
            starts = [
                rng.integers(0, len(first) - chunk_length + 1),
                rng.integers(0, len(second) - chunk_length + 1),
            ]
        x1[i] = first[starts[0] : starts[0] + chunk_length]
        x2[i] = second[starts[1] : starts[1] + chunk_length]
    return x1, x2, labels.astype(np.int32)
