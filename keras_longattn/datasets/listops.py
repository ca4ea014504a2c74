"""ListOps, as in the Long Range Arena: nested list operations on digits.

An expression looks like ``[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]``
and evaluates to a digit:

* ``MAX`` / ``MIN``: largest / smallest argument;
* ``MED``: median; for an even number of arguments, the floor of the mean
  of the two middle values (LRA's ``int(np.median(...))``);
* ``SM``: sum modulo 10.

Every operator takes 2 to ``max_args`` arguments (as in LRA), each a digit
or a nested expression.
"""

import functools
import random

import numpy as np

from keras_longattn.datasets import _validation as v

#: Tokens, indexed by token id. Id 0 is padding.
LISTOPS_VOCABULARY = (
    ("<pad>",)
    + tuple(str(d) for d in range(10))
    + ("[MAX", "[MIN", "[MED", "[SM", "]")
)
#: Id of the padding token.
LISTOPS_PAD_ID = 0
#: Id of the closing bracket.
LISTOPS_CLOSE_ID = LISTOPS_VOCABULARY.index("]")
_OPERATOR_IDS = tuple(
    LISTOPS_VOCABULARY.index(t) for t in ("[MAX", "[MIN", "[MED", "[SM")
)
#: Smallest expression: an operator with two digit arguments.
_MIN_EXPRESSION_LENGTH = 4


def listops_token_id(token):
    """Returns the id of a ListOps token such as `"7"` or `"[MAX"`.

    Example:

    >>> listops_token_id("0"), listops_token_id("[MAX"), listops_token_id("]")
    (1, 11, 15)
    """
    try:
        return LISTOPS_VOCABULARY.index(token)
    except ValueError:
        raise ValueError(
            f"`token` must be one of {list(LISTOPS_VOCABULARY[1:])}. "
            f"Received: token={token!r}"
        ) from None


def decode_listops(token_ids):
    """Turns a sequence of ListOps token ids back into text.

    Padding (id 0) is dropped.

    Args:
        token_ids: 1D sequence of token ids.

    Returns:
        The expression as a string, tokens separated by spaces.

    Example:

    >>> decode_listops([11, 5, 4, 15, 0, 0])
    '[MAX 4 3 ]'
    """
    return " ".join(
        LISTOPS_VOCABULARY[int(i)] for i in token_ids if int(i) != 0
    )


def _convolve(a, b, size):
    out = np.convolve(a.astype(np.float64), b.astype(np.float64))[:size]
    return out > 0.5


@functools.lru_cache(maxsize=8)
def _tables(max_length, max_depth, max_args):
    """Feasibility tables for expressions of an exact token count.

    Returns `(expr_ok, item_ok, sums_ok)`, lists indexed by depth `d` (1
    for the outermost operator):

    * `expr_ok[d][L]`: an operator at depth `d` can span exactly `L` tokens;
    * `item_ok[d][x]`: an argument of an operator at depth `d` can span
      exactly `x` tokens (a digit, or an operator at depth `d + 1`);
    * `sums_ok[d][k][s]`: `k` such arguments can span exactly `s` tokens.
    """
    size = max_length + 1
    expr_ok = [None] * (max_depth + 2)
    item_ok = [None] * (max_depth + 1)
    sums_ok = [None] * (max_depth + 1)
    expr_ok[max_depth + 1] = np.zeros(size, dtype=bool)
    for d in range(max_depth, 0, -1):
        item = expr_ok[d + 1].copy()
        item[1] = True
        sums = [np.zeros(size, dtype=bool)]
        sums[0][0] = True
        for _ in range(max_args):
            sums.append(_convolve(sums[-1], item, size))
        expr = np.zeros(size, dtype=bool)
        for k in range(2, max_args + 1):
            expr[2:] |= sums[k][:-2]
        expr_ok[d] = expr
        item_ok[d] = item.tolist()
        sums_ok[d] = [s.tolist() for s in sums]
    expr_ok = [None if e is None else e.tolist() for e in expr_ok[:-1]]
    return expr_ok, item_ok, sums_ok


def _evaluate(operator_id, values):
    operator = LISTOPS_VOCABULARY[operator_id]
    if operator == "[MAX":
        return max(values)
    if operator == "[MIN":
        return min(values)
    if operator == "[SM":
        return sum(values) % 10
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) // 2


class _Builder:
    """Builds random expressions of an exact token count."""

    def __init__(self, rng, tables, max_args, leaf_probability=0.5):
        self.rng = rng
        self.expr_ok, self.item_ok, self.sums_ok = tables
        self.max_args = max_args
        self.leaf_probability = leaf_probability

    def _pick_size(self, budget, remaining, depth):
        """Size of one argument out of `remaining` that share `budget`."""
        item_ok = self.item_ok[depth]
        rest_ok = self.sums_ok[depth][remaining - 1]
        high = budget - (remaining - 1)
        if self.rng.random() < self.leaf_probability and rest_ok[budget - 1]:
            return 1
        fair_share = 2 * budget // remaining
        target = self.rng.randint(1, max(1, min(high, fair_share)))
        for offset in range(high):
            for x in (target + offset, target - offset):
                if 1 <= x <= high and item_ok[x] and rest_ok[budget - x]:
                    return x
        raise AssertionError("infeasible split")  # unreachable

    def build(self, length, depth, out):
        """Appends an expression of exactly `length` tokens to `out`."""
        rng = self.rng
        operator_id = rng.choice(_OPERATOR_IDS)
        out.append(operator_id)
        budget = length - 2
        sums_ok = self.sums_ok[depth]
        counts = [
            k for k in range(2, self.max_args + 1) if sums_ok[k][budget]
        ]
        remaining = rng.choice(counts)
        sizes = []
        while remaining > 1:
            x = self._pick_size(budget, remaining, depth)
            sizes.append(x)
            budget -= x
            remaining -= 1
        sizes.append(budget)
        rng.shuffle(sizes)
        values = []
        for size in sizes:
            if size == 1:
                digit = rng.randrange(10)
                out.append(digit + 1)
                values.append(digit)
            else:
                values.append(self.build(size, depth + 1, out))
        out.append(LISTOPS_CLOSE_ID)
        return _evaluate(operator_id, values)


def make_listops(
    num_samples,
    min_length=500,
    max_length=2000,
    max_depth=10,
    max_args=10,
    seed=None,
):
    """Generates ListOps expressions and their values, as in LRA.

    The length (number of tokens) of each expression is drawn uniformly
    from the lengths in `[min_length, max_length]` that an expression with
    the given `max_depth` and `max_args` can have, and the expression is
    then built top-down to have exactly that length: each operator draws its
    number of arguments (2 to `max_args`) and splits its token budget among
    them using precomputed feasibility tables, so there is no rejection
    sampling and every sample lands in the requested range. LRA used
    `min_length=500`, `max_length=2000`, `max_depth=10`, `max_args=10`.

    Vocabulary (`LISTOPS_VOCABULARY`, 16 tokens): id 0 is padding, ids
    1..10 the digits 0..9 (digit `d` is id `d + 1`), ids 11..14 `[MAX`,
    `[MIN`, `[MED`, `[SM` and id 15 the closing `]`. Depth counts nested
    operators: `[MAX 1 2 ]` has depth 1.

    Use different seeds for training and test sets.

    Args:
        num_samples: number of expressions.
        min_length: smallest number of tokens of an expression. Defaults to
            `500`.
        max_length: largest number of tokens of an expression; sequences
            are padded with 0 to this length. Defaults to `2000`.
        max_depth: largest nesting depth of operators. Defaults to `10`.
        max_args: largest number of arguments of an operator (at least 2).
            Defaults to `10`.
        seed: seed of the generator. Defaults to `None` (not
            reproducible).

    Returns:
        Tuple of numpy arrays `(x, y)`: `x` of shape
        `(num_samples, max_length)`, `int32` token ids padded with 0; `y` of
        shape `(num_samples,)`, `int32` values 0..9.

    Raises:
        ValueError: if an argument is out of range, or if no expression
            with the given `max_depth` and `max_args` has a length in
            `[min_length, max_length]` (the shortest expression,
            e.g. `[SM 1 2 ]`, has 4 tokens).

    Example:

    >>> x, y = make_listops(3, min_length=10, max_length=30, max_depth=3,
    ...                     max_args=5, seed=0)
    >>> x.shape, y.shape, x.dtype
    ((3, 30), (3,), dtype('int32'))
    >>> all(10 <= n <= 30 for n in (x != 0).sum(axis=1))
    True
    >>> decode_listops(x[0]).startswith("[")
    True
    """
    num_samples = v.check_int("num_samples", num_samples, min_value=1)
    min_length = v.check_int("min_length", min_length, min_value=1)
    max_length = v.check_int("max_length", max_length, min_value=1)
    max_depth = v.check_int("max_depth", max_depth, min_value=1)
    max_args = v.check_int("max_args", max_args, min_value=2)
    seed = v.check_seed(seed)
    if max_length < min_length:
        raise ValueError(
            "`max_length` must be >= `min_length`. Received: "
            f"min_length={min_length}, max_length={max_length}"
        )
    if max_length < _MIN_EXPRESSION_LENGTH:
        raise ValueError(
            f"`max_length` must be >= {_MIN_EXPRESSION_LENGTH}, the length "
            f"of the shortest expression (e.g. `[SM 1 2 ]`). Received: "
            f"max_length={max_length}"
        )
    tables = _tables(max_length, max_depth, max_args)
    expr_ok = tables[0][1]
    lengths = [n for n in range(min_length, max_length + 1) if expr_ok[n]]
    if not lengths:
        raise ValueError(
            "No expression with the given `max_depth` and `max_args` has a "
            "length in [min_length, max_length]. Received: "
            f"min_length={min_length}, max_length={max_length}, "
            f"max_depth={max_depth}, max_args={max_args}"
        )
    rng = random.Random(seed)
    builder = _Builder(rng, tables, max_args)
    x = np.zeros((num_samples, max_length), dtype=np.int32)
    y = np.zeros((num_samples,), dtype=np.int32)
    for i in range(num_samples):
        tokens = []
        y[i] = builder.build(rng.choice(lengths), 1, tokens)
        x[i, : len(tokens)] = tokens
    return x, y
