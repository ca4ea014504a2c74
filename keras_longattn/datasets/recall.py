"""Long-range associative recall: find the value stored under a key."""

import numpy as np

from keras_longattn.datasets import _validation as v


def make_associative_recall(
    num_samples,
    sequence_length,
    num_keys=64,
    num_values=64,
    min_distance=None,
    task="classification",
    seed=None,
):
    """Generates long-range associative recall sequences.

    A sequence of `n = sequence_length` tokens holds key-value pairs
    `k v k v ...` followed by a query key in its last position `n - 1`;
    the answer is the value that follows the query key's only occurrence
    among the keys. That occurrence is placed at least `min_distance`
    positions before the query (so the dependency spans beyond any local
    attention window narrower than `min_distance`): its position `p`
    satisfies `(n - 1) - p >= min_distance`, uniformly among the pair slots
    that allow it. The other keys are drawn uniformly from the remaining
    `num_keys - 1` keys (they may repeat), the values uniformly from all
    `num_values` values.

    Layout: the `(n - 1) // 2` pairs fill positions `o .. n - 2`, where
    `o = (n - 1) % 2`; when `n - 1` is odd, position 0 is padding.

    Vocabulary (`1 + num_keys + num_values` tokens): id 0 is padding, ids
    `1 .. num_keys` are the keys and ids
    `num_keys + 1 .. num_keys + num_values` the values.

    Args:
        num_samples: number of sequences.
        sequence_length: length `n` of each sequence, at least 3.
        num_keys: number of distinct keys, at least 2. Defaults to `64`.
        num_values: number of distinct values, at least 2. Defaults to
            `64`.
        min_distance: smallest distance from the query (last position)
            back to the matching key. Defaults to `None`, which means
            `sequence_length // 2`.
        task: `"classification"` or `"lm"`, see Returns. Defaults to
            `"classification"`.
        seed: seed of the generator. Defaults to `None` (not
            reproducible).

    Returns:
        For `task="classification"`, a tuple `(x, y)`: `x` of shape
        `(num_samples, sequence_length)`, `int32` token ids, and `y` of
        shape `(num_samples,)`, the `int32` value index in
        `0 .. num_values - 1` (token id minus `num_keys + 1`).

        For `task="lm"`, a tuple `(x, targets, sample_weight)`: `x` as
        above; `targets` of shape `(num_samples, sequence_length)`, `int32`,
        holding the value's token id at the last position (the token that
        should follow the query key) and 0 elsewhere; `sample_weight` of the
        same shape, `float32`, 1 at the last position and 0 elsewhere, so
        that `model.fit(x, targets, sample_weight=sample_weight)` puts the
        loss on the last position only.

    Raises:
        ValueError: if an argument is out of range, e.g. `min_distance`
            larger than the distance from the query to the first key.

    Example:

    >>> x, y = make_associative_recall(2, 9, num_keys=4, num_values=3,
    ...                                min_distance=4, seed=0)
    >>> x.shape, y.shape
    ((2, 9), (2,))
    >>> query = x[0, -1]
    >>> where = [p for p in range(0, 8, 2) if x[0, p] == query]
    >>> p = where[0]
    >>> len(where), 8 - p >= 4, int(x[0, p + 1]) - 5 == int(y[0])
    (1, True, True)
    """
    num_samples = v.check_int("num_samples", num_samples, min_value=1)
    sequence_length = v.check_int(
        "sequence_length", sequence_length, min_value=3
    )
    num_keys = v.check_int("num_keys", num_keys, min_value=2)
    num_values = v.check_int("num_values", num_values, min_value=2)
    task = v.check_choice("task", task, ("classification", "lm"))
    seed = v.check_seed(seed)
    n = sequence_length
    num_pairs = (n - 1) // 2
    offset = (n - 1) % 2
    longest = (n - 1) - offset  # distance from the query to the first key
    if min_distance is None:
        min_distance = n // 2
    min_distance = v.check_int(
        "min_distance", min_distance, min_value=1, max_value=longest
    )
    # Pair j has its key at offset + 2 j; it may hold the answer when
    # (n - 1) - (offset + 2 j) >= min_distance.
    last_slot = (longest - min_distance) // 2

    rng = np.random.default_rng(seed)
    query = rng.integers(0, num_keys, size=num_samples)
    keys = rng.integers(0, num_keys - 1, size=(num_samples, num_pairs))
    keys += keys >= query[:, None]  # skip the query key
    slot = rng.integers(0, last_slot + 1, size=num_samples)
    rows = np.arange(num_samples)
    keys[rows, slot] = query
    values = rng.integers(0, num_values, size=(num_samples, num_pairs))

    x = np.zeros((num_samples, n), dtype=np.int32)
    x[:, offset : n - 1 : 2] = keys + 1
    x[:, offset + 1 : n - 1 : 2] = values + num_keys + 1
    x[:, n - 1] = query + 1
    answer = values[rows, slot].astype(np.int32)
    if task == "classification":
        return x, answer
    targets = np.zeros((num_samples, n), dtype=np.int32)
    targets[:, -1] = answer + num_keys + 1
    sample_weight = np.zeros((num_samples, n), dtype=np.float32)
    sample_weight[:, -1] = 1.0
    return x, targets, sample_weight
