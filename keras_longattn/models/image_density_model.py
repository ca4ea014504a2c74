"""Pixels as a sequence: an autoregressive image density model."""

import math

import keras

from keras_longattn.models import _builder_common as common
from keras_longattn.models.shift_right import ShiftRight


def bits_per_dim(nll_nats):
    """Bits per dimension from a mean cross-entropy in nats.

    ``bits_per_dim = nll_nats / ln(2)``, where ``nll_nats`` is the mean
    negative log-likelihood per pixel (per sub-pixel for colour images), e.g.
    the loss of :func:`build_image_density_model` trained with
    ``SparseCategoricalCrossentropy(from_logits=True)``.

    Args:
        nll_nats: a float, a NumPy array or a tensor.

    Returns:
        The same type, in bits.

    Example:

    >>> from keras_longattn.models import bits_per_dim
    >>> round(bits_per_dim(0.6931471805599453), 6)
    1.0
    """
    return nll_nats / math.log(2.0)


def build_image_density_model(
    levels,
    sequence_length,
    dim=64,
    num_layers=None,
    attention=None,
    layer_pattern=None,
    feedforward_dim=None,
    dropout=0.0,
    positions="learned",
    num_heads=4,
    normalize_first=True,
    rotary_max_wavelength=10000.0,
    name="image_density_model",
):
    """Builds an (uncompiled) autoregressive model of pixel sequences.

    A flattened image (raster order; for colour images interleave the
    channels) is a sequence of ``sequence_length`` integers in
    ``[0, levels)``. The model gives, at every position, a softmax over the
    ``levels`` intensities.

    Shift convention: the model takes the pixels *unshifted* and shifts
    them internally: a start token (id ``levels``, outside the data) is put
    in front and the last pixel dropped (:class:`ShiftRight`), then a causal
    Transformer runs. So ``logits[:, i]`` is the distribution of
    ``pixels[:, i]`` given ``pixels[:, :i]`` (pixel 0 is predicted from the
    start token alone), and the targets are the inputs themselves::

        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), ...)
        model.fit(pixels, pixels)
        bits = bits_per_dim(model.evaluate(pixels, pixels))

    (Contrast :func:`build_causal_language_model`, whose ``logits[:, i]``
    predicts token ``i + 1`` and whose data are shifted by the caller.)

    Args:
        levels: number of intensity levels, >= 2 (256 for 8-bit images).
        sequence_length: pixels per image. May be None when ``positions``
            is not ``"learned"``.
        dim: model width. Defaults to 64.
        num_layers: number of attention sublayers (default 2).
        attention: attention of every ``"s"`` (see :func:`build_sublayers`).
            Defaults to ``LocalAttention(window=128)``.
        layer_pattern: string over ``{"s", "f"}``. Defaults to
            ``"sf" * num_layers``.
        feedforward_dim: MLP width. Defaults to ``4 * dim``.
        dropout: dropout rate. Defaults to 0.
        positions: ``"learned"`` (default), ``"rotary"`` or None.
        num_heads: heads of attention configs that lack them. Defaults to 4.
        normalize_first: pre-norm (True, default) or post-norm blocks.
        rotary_max_wavelength: the rotary wavelength when
            ``positions="rotary"``. Defaults to 10000.
        name: the model's name.

    Returns:
        An uncompiled ``keras.Model``: input ``"pixels"`` int32 ``(B, n)``
        with values in ``[0, levels)``, output logits ``(B, n, levels)``.

    Raises:
        ValueError: for inconsistent arguments (the message names them),
            for an attention without a causal mode (``supports_causal``
            False: ``LinformerAttention``, ``NystromAttention``,
            ``AdaMRAAttention``; the model is autoregressive) and for an
            attention whose ``max_length`` is below ``sequence_length``.

    Example:

    >>> import numpy as np
    >>> import keras
    >>> from keras_longattn.models import bits_per_dim
    >>> from keras_longattn.models import build_image_density_model
    >>> model = build_image_density_model(
    ...     levels=4, sequence_length=24, dim=16, num_heads=2)
    >>> pixels = np.random.randint(0, 4, size=(2, 24))  # 2 images of 4x6
    >>> logits = model(pixels)  # logits[:, i]: pixel i given pixels < i
    >>> tuple(logits.shape)
    (2, 24, 4)
    >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    >>> nll = float(keras.ops.convert_to_numpy(loss(pixels, logits)))  # nats
    >>> bool(0.0 < bits_per_dim(nll) < 10.0)
    True
    """
    levels = common.check_vocab_size("levels", levels)
    sequence_length = common.check_body_args(
        sequence_length=sequence_length,
        dim=dim,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        positions=positions,
    )
    pattern = common.resolve_pattern(layer_pattern, num_layers)

    pixels = keras.Input((sequence_length,), dtype="int32", name="pixels")
    shifted = ShiftRight(start_token=levels, name="shift_right")(pixels)
    x = keras.layers.Embedding(levels + 1, dim, name="pixel_embedding")(shifted)
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
            f"sequence_length={sequence_length} (build_image_density_model "
            "calls its attention with use_causal_mask=True)"
        ),
    )
    logits = keras.layers.Dense(levels, name="logits")(x)
    return keras.Model(pixels, logits, name=name)
