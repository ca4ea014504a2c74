import numpy as np
from keras.ops import convert_to_numpy as to_np
import pytest

from keras_longattn import ops as la_ops


def dense(pattern, t, s):
    return to_np(pattern.dense_mask(t, s))


def test_causal_is_lower_triangular():
    np.testing.assert_array_equal(dense(la_ops.CausalPattern(), 5, 7), np.tril(np.ones((5, 7), bool)))


def test_full_is_all_true():
    assert dense(la_ops.FullPattern(), 3, 4).all()


@pytest.mark.parametrize("back, ahead", [(0, 0), (2, 0), (0, 3), (3, 1)])
def test_local_matches_loop(back, ahead):
    n = 9
    expected = np.array([[i - back <= j <= i + ahead for j in range(n)] for i in range(n)])
    np.testing.assert_array_equal(dense(la_ops.LocalPattern(back, ahead), n, n), expected)


def test_composition():
    local = la_ops.LocalPattern(2, 2)
    causal = la_ops.CausalPattern()
    np.testing.assert_array_equal(
        dense(local & causal, 6, 6), dense(la_ops.LocalPattern(2, 0), 6, 6)
    )
    union = dense(la_ops.LocalPattern(0, 0) | causal, 4, 4)
    np.testing.assert_array_equal(union, np.tril(np.ones((4, 4), bool)))
    assert (local & causal).is_causal and not local.is_causal


def test_patterns_compare_by_value():
    assert la_ops.LocalPattern(1, 2) == la_ops.LocalPattern(1, 2)
    assert la_ops.LocalPattern(1, 2) != la_ops.LocalPattern(2, 1)
    assert "look_back=1" in repr(la_ops.LocalPattern(1, 2))


@pytest.mark.parametrize(
    "window, back, ahead, causal, expected",
    [
        (5, None, None, True, (4, 0)),
        (5, None, None, False, (2, 2)),
        (4, None, None, False, (2, 2)),
        (None, 3, None, False, (3, 3)),
        (8, 1, 2, False, (1, 2)),
        (8, 1, 2, True, (1, 0)),
    ],
)
def test_resolve_window(window, back, ahead, causal, expected):
    assert la_ops.resolve_window(window, back, ahead, causal) == expected


def test_bad_pattern_arguments():
    with pytest.raises(ValueError, match="look_back=-1"):
        la_ops.LocalPattern(-1, 0)
    with pytest.raises(ValueError, match="window=0"):
        la_ops.resolve_window(0, None, None, True)
    with pytest.raises(TypeError, match="AttentionPattern"):
        la_ops.Intersection(la_ops.CausalPattern(), "causal")
