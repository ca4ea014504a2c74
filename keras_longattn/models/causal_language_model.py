"""A byte/character-level causal language model."""

import keras

from keras_longattn.models import _builder_common as common
from keras_longattn.models.reversible_embedding import ReversibleEmbedding


def build_causal_language_model(
    vocab_size=256,
    sequence_length=512,
    dim=64,
    num_layers=None,
    attention=None,
    layer_pattern=None,
    feedforward_dim=None,
    dropout=0.0,
    positions="learned",
    tie_embeddings=False,
    num_heads=4,
    normalize_first=True,
    rotary_max_wavelength=10000.0,
    name="causal_language_model",
):
    """Builds an (uncompiled) causal Transformer language model.

    Integer tokens ``(B, n)`` -> logits ``(B, n, vocab_size)``. The
    attention is causal, so ``logits[:, i]`` depends on ``tokens[:, :i+1]``
    only and predicts the *next* token ``i + 1``: train on
    ``x = seq[:, :-1]``, ``y = seq[:, 1:]`` with
    ``SparseCategoricalCrossentropy(from_logits=True)``. No token is treated
    as padding (byte 0 is a valid byte).

    Architecture: token embedding, positions, dropout, the residual
    sublayers of ``layer_pattern`` (see :func:`build_sublayers`), a final
    ``LayerNormalization`` (pre-norm only), and a ``Dense(vocab_size)`` head
    or, with ``tie_embeddings``, the transposed token embedding.

    Args:
        vocab_size: number of token ids, >= 2. Defaults to 256 (bytes).
        sequence_length: input length (the length of the learned position
            table). May be None when ``positions`` is not ``"learned"``
            (any length). Defaults to 512.
        dim: model width. Defaults to 64.
        num_layers: number of attention sublayers. Defaults to 2; with
            ``layer_pattern`` it may be omitted, and must equal the number of
            ``"s"`` if given.
        attention: the attention of every ``"s"``: None (default:
            ``LocalAttention(num_heads, key_dim=dim // num_heads,
            window=128)``), one layer instance (cloned per sublayer) or
            config dict or class name, or a list with one entry per ``"s"``.
            See :func:`build_sublayers`.
        layer_pattern: string over ``{"s", "f"}``, bottom first. Defaults to
            ``"sf" * num_layers``; see :func:`sandwich_pattern`.
        feedforward_dim: MLP width. Defaults to ``4 * dim``.
        dropout: dropout rate (embeddings and residual branches). Defaults
            to 0.
        positions: ``"learned"`` (absolute position table, default),
            ``"rotary"`` (``rotary_max_wavelength`` is set in every
            attention config; attention that cannot take it, e.g. an odd
            ``key_dim``, raises ``ValueError``) or None.
        tie_embeddings: share the token embedding with the output
            projection. Defaults to False.
        num_heads: heads of attention configs that lack ``num_heads``.
            Defaults to 4.
        normalize_first: pre-norm (True, default) or post-norm blocks.
        rotary_max_wavelength: the rotary wavelength when
            ``positions="rotary"``. Defaults to 10000.
        name: the model's name.

    Returns:
        An uncompiled ``keras.Model``: input ``"tokens"`` int32 ``(B, n)``,
        output logits ``(B, n, vocab_size)``.

    Raises:
        ValueError: for inconsistent arguments (the message names them),
            for an attention without a causal mode (``supports_causal``
            False: ``LinformerAttention``, ``NystromAttention``,
            ``AdaMRAAttention``), for an attention whose ``max_length`` is
            below ``sequence_length``, and for a ``sequence_length`` the
            attention refuses through its ``check_sequence_length(n)`` hook.

    Example:

    >>> import numpy as np
    >>> import keras
    >>> from keras_longattn.models import build_causal_language_model
    >>> model = build_causal_language_model(
    ...     vocab_size=256, sequence_length=24, dim=16, num_layers=2,
    ...     num_heads=2, attention={"class_name": "LocalAttention",
    ...                             "config": {"window": 8}})
    >>> seq = np.random.randint(0, 256, size=(2, 25))  # bytes
    >>> x, y = seq[:, :-1], seq[:, 1:]  # logits[:, i] predicts token i + 1
    >>> logits = model(x)
    >>> tuple(logits.shape)
    (2, 24, 256)
    >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    >>> bool(loss(y, logits) > 0)
    True

    Train with ``model.compile(optimizer, loss)`` and ``model.fit(x, y)``.
    """
    vocab_size = common.check_vocab_size("vocab_size", vocab_size)
    sequence_length = common.check_body_args(
        sequence_length=sequence_length,
        dim=dim,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        positions=positions,
    )
    pattern = common.resolve_pattern(layer_pattern, num_layers)

    tokens = keras.Input((sequence_length,), dtype="int32", name="tokens")
    embedding = ReversibleEmbedding(vocab_size, dim, name="token_embedding")
    x = embedding(tokens)
    x = common.transformer_body(
        x,
        attention_length=sequence_length,
        pattern=pattern,
        attention=attention,
        dim=dim,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        normalize_first=normalize_first,
        causal=True,
        positions=positions,
        rotary_max_wavelength=rotary_max_wavelength,
        context=(
            f"sequence_length={sequence_length} (build_causal_language_model "
            "calls its attention with use_causal_mask=True)"
        ),
    )
    if tie_embeddings:
        logits = embedding(x, reverse=True)
    else:
        logits = keras.layers.Dense(vocab_size, name="logits")(x)
    return keras.Model(tokens, logits, name=name)
