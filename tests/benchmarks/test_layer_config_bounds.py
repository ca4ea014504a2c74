"""``${...}`` placeholders of benchmark layer configs keep every number
bounded: no integer beyond ±2**64 is ever built (powers are refused before
they are computed), and no float is infinite or NaN."""

import pytest

from keras_longattn.benchmarks import layer_config
from keras_longattn.benchmarks.layer_config import LayerConfigError

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

VARIABLES = {"seq_len": 4096, "batch": 1, "num_heads": 4, "key_dim": 64,
             "head_dim": 64, "window": 256}


@pytest.mark.parametrize("expression, culprit", [
    # Each power has an exponent <= 64, but the result grows to 16.8M bits.
    ("(((2**64)**64)**64)**64", r"'\(2 \*\* 64\) \*\* 64'"),
    ("(seq_len ** 4) ** 4", r"'\(seq_len \*\* 4\) \*\* 4'"),
    ("3 ** 41", r"'3 \*\* 41'"),
    ("(-2) ** 65", r"exponent 65"),
    ("(2 ** 64) * (2 ** 64)", r"'2 \*\* 64 \* 2 \*\* 64'"),
    ("2 ** 64 + 1", r"'2 \*\* 64 \+ 1'"),
    ("18446744073709551617", r"'18446744073709551617'"),
    ("int(1e300)", r"'int\(1e\+300\)'"),
    ("max(1, (2 ** 40) ** 2)", r"'\(2 \*\* 40\) \*\* 2'"),
])
def test_integers_beyond_2_to_the_64_are_refused(expression, culprit):
    with pytest.raises(LayerConfigError, match=(
            r"invalid placeholder '\$\{" + _escaped(expression) + r"\}': .*"
            + culprit + r".*too large")):
        layer_config.evaluate_placeholder(expression, VARIABLES)


@pytest.mark.parametrize("expression, culprit", [
    ("1e308 * 10", r"'1e\+308 \* 10' gives inf"),
    ("2.0 ** 64 ** 1", None),  # finite: accepted
    ("(-8) ** 0.5", r"'\(-8\) \*\* 0.5' is not a real number"),
    ("1e300 ** 2", r"in '1e\+300 \*\* 2'"),
])
def test_floats_stay_finite_and_real(expression, culprit):
    if culprit is None:
        assert layer_config.evaluate_placeholder(expression, VARIABLES) == 2.0 ** 64
        return
    with pytest.raises(LayerConfigError, match=culprit):
        layer_config.evaluate_placeholder(expression, VARIABLES)


def test_values_at_the_bound_are_accepted():
    evaluate = layer_config.evaluate_placeholder
    assert evaluate("2 ** 64", VARIABLES) == 2 ** 64
    assert evaluate("-(2 ** 64)", VARIABLES) == -(2 ** 64)
    assert evaluate("(-2) ** 64", VARIABLES) == 2 ** 64
    assert evaluate("(2 ** 32) ** 2", VARIABLES) == 2 ** 64
    assert evaluate("3 ** 40", VARIABLES) == 3 ** 40
    assert evaluate("2 ** -64", VARIABLES) == 2.0 ** -64
    assert evaluate("seq_len ** 2 // window", VARIABLES) == 4096 ** 2 // 256
    assert layer_config.MAX_PLACEHOLDER_INT == 2 ** 64


def test_a_config_with_an_unbounded_placeholder_is_refused_when_given():
    with pytest.raises(LayerConfigError, match=(
            r"config of 'LocalAttention': invalid placeholder "
            r"'\$\{\(\(2\*\*64\)\*\*64\)\*\*64\}'.*too large")):
        layer_config.spec_from_dict({"class_name": "LocalAttention",
                                     "config": {"window": "${((2**64)**64)**64}"}})


def test_errors_inside_function_arguments_are_reported_once():
    with pytest.raises(LayerConfigError) as info:
        layer_config.evaluate_placeholder("max(1, (2 ** 64) ** 64)", VARIABLES)
    assert str(info.value).count("invalid placeholder") == 1


def test_deep_nesting_is_refused():
    with pytest.raises(LayerConfigError, match="nested too deeply"):
        layer_config.evaluate_placeholder("-" * 100_000 + "1", VARIABLES)


def _escaped(expression):
    import re

    return re.escape(expression)
