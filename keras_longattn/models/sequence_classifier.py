"""A Transformer sequence classifier over padded token sequences."""

import keras

from keras_longattn.models import _builder_common as common
from keras_longattn.models._validation import check_choice
from keras_longattn.models._validation import check_int
from keras_longattn.models.class_token import ClassToken
from keras_longattn.models.sequence_pooling import SequencePooling

POOLINGS = ("mean", "cls")


def sequence_encoder(
    tokens,
    *,
    vocab_size,
    sequence_length,
    dim,
    pattern,
    attention,
    num_heads,
    feedforward_dim,
    dropout,
    positions,
    pooling,
    normalize_first,
    rotary_max_wavelength,
):
    """Token ids (0 = padding) -> one pooled ``(B, dim)`` vector."""
    x = keras.layers.Embedding(
        vocab_size, dim, mask_zero=True, name="token_embedding"
    )(tokens)
    attention_length = sequence_length
    context = f"sequence_length={sequence_length}"
    if pooling == "cls":
        x = ClassToken(name="class_token")(x)
        attention_length = None if sequence_length is None else sequence_length + 1
        context += ", pooling='cls' (the class token adds a position)"
    x = common.transformer_body(
        x,
        attention_length=attention_length,
        pattern=pattern,
        attention=attention,
        dim=dim,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        normalize_first=normalize_first,
        causal=False,
        positions=positions,
        rotary_max_wavelength=rotary_max_wavelength,
        context=context,
    )
    return SequencePooling("first" if pooling == "cls" else "mean", name="pooling")(x)


def check_encoder_args(
    vocab_size, sequence_length, dim, num_layers, layer_pattern, num_heads,
    feedforward_dim, dropout, positions, pooling,
):
    """Validates the encoder arguments; returns (sequence_length, pattern)."""
    common.check_vocab_size("vocab_size", vocab_size)
    sequence_length = common.check_body_args(
        sequence_length=sequence_length,
        dim=dim,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        positions=positions,
    )
    check_choice("pooling", pooling, POOLINGS)
    pattern = common.resolve_pattern(layer_pattern, num_layers)
    return sequence_length, pattern


def build_sequence_classifier(
    vocab_size,
    sequence_length,
    num_classes,
    dim=64,
    num_layers=None,
    attention=None,
    layer_pattern=None,
    feedforward_dim=None,
    dropout=0.0,
    positions="learned",
    pooling="mean",
    num_heads=4,
    normalize_first=True,
    rotary_max_wavelength=10000.0,
    name="sequence_classifier",
):
    """Builds an (uncompiled) bidirectional Transformer classifier.

    Integer tokens ``(B, n)`` -> logits ``(B, num_classes)``. Token 0 is
    padding: the embedding uses ``mask_zero=True``, the mask reaches every
    attention layer as ``query_mask``/``value_mask`` and the pooling, so the
    output does not depend on what stands at padded positions.

    Pooling:

    * ``"mean"``: the mean of the final vectors over unpadded positions.
    * ``"cls"``: a learned class token is prepended (a global token at
      position 0); the attention then sees ``n + 1`` positions (an
      attention with a ``max_length``, e.g. ``LinformerAttention``, needs
      ``max_length >= n + 1``, and a ``check_sequence_length`` hook is
      called with ``n + 1``) and the class token's final vector is the
      summary.

    Args:
        vocab_size: number of token ids including padding 0, >= 2.
        sequence_length: input length. May be None when ``positions`` is
            not ``"learned"``.
        num_classes: number of classes, >= 2.
        dim: model width. Defaults to 64.
        num_layers: number of attention sublayers (default 2; see
            :func:`build_causal_language_model`).
        attention: attention of every ``"s"`` (see :func:`build_sublayers`).
            Defaults to ``LocalAttention(window=128)``.
        layer_pattern: string over ``{"s", "f"}``. Defaults to
            ``"sf" * num_layers``.
        feedforward_dim: MLP width. Defaults to ``4 * dim``.
        dropout: dropout rate. Defaults to 0.
        positions: ``"learned"`` (default), ``"rotary"`` or None.
        pooling: ``"mean"`` (default) or ``"cls"``.
        num_heads: heads of attention configs that lack them. Defaults to 4.
        normalize_first: pre-norm (True, default) or post-norm blocks.
        rotary_max_wavelength: the rotary wavelength when
            ``positions="rotary"``. Defaults to 10000.
        name: the model's name.

    Returns:
        An uncompiled ``keras.Model``: input ``"tokens"`` int32 ``(B, n)``,
        output logits ``(B, num_classes)`` (train with
        ``SparseCategoricalCrossentropy(from_logits=True)``).

    Raises:
        ValueError: for inconsistent arguments (the message names them) and
            for an attention whose ``max_length`` (``LinformerAttention``,
            ``SynthesizerAttention``) is below the length it would see:
            ``sequence_length``, or ``sequence_length + 1`` with
            ``pooling="cls"``.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import build_sequence_classifier
    >>> model = build_sequence_classifier(
    ...     vocab_size=30, sequence_length=24, num_classes=3, dim=16,
    ...     num_heads=2)
    >>> tokens = np.zeros((2, 24), "int32")  # 0 = padding
    >>> tokens[0, :10] = np.arange(1, 11)
    >>> tokens[1, :3] = [5, 6, 7]
    >>> tuple(model(tokens).shape)
    (2, 3)
    """
    sequence_length, pattern = check_encoder_args(
        vocab_size, sequence_length, dim, num_layers, layer_pattern, num_heads,
        feedforward_dim, dropout, positions, pooling,
    )
    num_classes = check_int("num_classes", num_classes, min_value=2)
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
    if dropout:
        pooled = keras.layers.Dropout(dropout, name="head_dropout")(pooled)
    logits = keras.layers.Dense(num_classes, name="logits")(pooled)
    return keras.Model(tokens, logits, name=name)
