"""``implementation="auto"`` warns, once, when every efficient path refuses
a call and the O(T*S) reference path runs instead."""

import warnings

import numpy as np
import pytest

from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import base_attention


def _refuse_everything(monkeypatch, layer, reason):
    for path in layer._implementation_table.values():
        monkeypatch.setattr(path, "_refusal", lambda layer, context: reason)


def test_auto_warns_once_when_every_path_refuses(monkeypatch):
    monkeypatch.setattr(base_attention, "_WARNED_FALLBACKS", set())
    x = np.random.default_rng(0).standard_normal((1, 12, 8)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=4, window=4)
    layer(x, x)
    assert layer.last_implementation != "reference"
    _refuse_everything(monkeypatch, layer, "a planted refusal")
    with pytest.warns(UserWarning, match="O\\(T\\*S\\) reference path.*a planted refusal"):
        layer(x, x)
    assert layer.last_implementation == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, x)  # the same reasons again: no second warning
        named = LocalAttention(num_heads=2, key_dim=4, window=4, implementation="reference")
        named(x, x)  # a named reference path is what was asked for


def test_no_warning_where_the_reference_costs_the_same(monkeypatch):
    monkeypatch.setattr(base_attention, "_WARNED_FALLBACKS", set())
    x = np.zeros((1, 6, 8), "float32")
    layer = FullAttention(num_heads=2, key_dim=4)
    layer(x, x)
    _refuse_everything(monkeypatch, layer, "a planted refusal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, x)
    assert layer.last_implementation == "reference"
