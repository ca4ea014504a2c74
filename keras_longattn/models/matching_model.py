"""A two-document matching model (LRA retrieval style)."""

import keras

from keras_longattn.models._validation import check_int
from keras_longattn.models.sequence_classifier import check_encoder_args
from keras_longattn.models.sequence_classifier import sequence_encoder


def build_matching_model(
    vocab_size,
    sequence_length,
    num_classes=2,
    dim=64,
    num_layers=None,
    attention=None,
    layer_pattern=None,
    feedforward_dim=None,
    dropout=0.0,
    positions="learned",
    pooling="mean",
    hidden_dim=None,
    num_heads=4,
    normalize_first=True,
    rotary_max_wavelength=10000.0,
    name="matching_model",
):
    """Builds an (uncompiled) two-tower document matching model.

    Both documents go through one shared encoder (the same weights: a
    nested ``keras.Model`` named ``"encoder"``, built like
    :func:`build_sequence_classifier` without its head), giving pooled
    vectors ``u`` and ``v``; ``[u, v, u * v, u - v]`` then goes through an
    MLP to ``num_classes`` logits, as in the Long Range Arena retrieval
    task. Token 0 is padding in both documents.

    Args:
        vocab_size: number of token ids including padding 0, >= 2.
        sequence_length: length of each document. May be None when
            ``positions`` is not ``"learned"``.
        num_classes: number of classes, >= 2. Defaults to 2.
        dim: model width. Defaults to 64.
        num_layers: number of attention sublayers of the encoder (default 2).
        attention: attention of every ``"s"`` (see :func:`build_sublayers`).
        layer_pattern: string over ``{"s", "f"}``. Defaults to
            ``"sf" * num_layers``.
        feedforward_dim: MLP width of the encoder. Defaults to ``4 * dim``.
        dropout: dropout rate. Defaults to 0.
        positions: ``"learned"`` (default), ``"rotary"`` or None.
        pooling: ``"mean"`` (default) or ``"cls"``.
        hidden_dim: width of the hidden layer of the matching MLP. Defaults
            to ``dim``.
        num_heads: heads of attention configs that lack them. Defaults to 4.
        normalize_first: pre-norm (True, default) or post-norm blocks.
        rotary_max_wavelength: the rotary wavelength when
            ``positions="rotary"``. Defaults to 10000.
        name: the model's name.

    Returns:
        An uncompiled ``keras.Model`` with inputs ``[document_a,
        document_b]`` (int32 ``(B, n)`` each) and logits ``(B,
        num_classes)``.

    Raises:
        ValueError: for inconsistent arguments (the message names them) and
            for an attention whose ``max_length`` (``LinformerAttention``,
            ``SynthesizerAttention``) is below the length it would see:
            ``sequence_length``, or ``sequence_length + 1`` with
            ``pooling="cls"``.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import build_matching_model
    >>> model = build_matching_model(
    ...     vocab_size=30, sequence_length=24, dim=16, num_heads=2)
    >>> a = np.random.randint(1, 30, size=(2, 24))
    >>> b = np.random.randint(1, 30, size=(2, 24))
    >>> b[:, 12:] = 0  # padding
    >>> tuple(model([a, b]).shape)
    (2, 2)
    """
    sequence_length, pattern = check_encoder_args(
        vocab_size, sequence_length, dim, num_layers, layer_pattern, num_heads,
        feedforward_dim, dropout, positions, pooling,
    )
    num_classes = check_int("num_classes", num_classes, min_value=2)
    hidden_dim = check_int("hidden_dim", hidden_dim, allow_none=True) or dim

    tokens = keras.Input((sequence_length,), dtype="int32", name="tokens")
    pooled = sequence_encoder(
        tokens,
        vocab_size=vocab_size,
        sequence_length=sequence_length,
        dim=dim,
        pattern=pattern,
        attention=attention,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        positions=positions,
        pooling=pooling,
        normalize_first=normalize_first,
        rotary_max_wavelength=rotary_max_wavelength,
    )
    encoder = keras.Model(tokens, pooled, name="encoder")

    document_a = keras.Input((sequence_length,), dtype="int32", name="document_a")
    document_b = keras.Input((sequence_length,), dtype="int32", name="document_b")
    u = encoder(document_a)
    v = encoder(document_b)
    features = keras.layers.Concatenate(name="match_features")(
        [
            u,
            v,
            keras.layers.Multiply(name="product")([u, v]),
            keras.layers.Subtract(name="difference")([u, v]),
        ]
    )
    h = keras.layers.Dense(hidden_dim, activation="gelu", name="hidden")(features)
    if dropout:
        h = keras.layers.Dropout(dropout, name="head_dropout")(h)
    logits = keras.layers.Dense(num_classes, name="logits")(h)
    return keras.Model([document_a, document_b], logits, name=name)
