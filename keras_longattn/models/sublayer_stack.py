"""The residual sublayers of a Transformer stack, from a layer pattern."""

from keras_longattn.models import _attention_config
from keras_longattn.models._validation import check_int
from keras_longattn.models._validation import check_rate
from keras_longattn.models.attention_sublayer import AttentionSublayer
from keras_longattn.models.feedforward_sublayer import FeedForwardSublayer
from keras_longattn.models.layer_pattern import validate_layer_pattern


def build_sublayers(
    layer_pattern,
    attention=None,
    *,
    dim,
    num_heads=4,
    feedforward_dim=None,
    dropout=0.0,
    activation="gelu",
    normalize_first=True,
    causal=False,
    rotary_max_wavelength=None,
    sequence_length=None,
    name_prefix="sublayer",
    context=None,
):
    """The residual sublayers of ``layer_pattern``, bottom first.

    Every ``"s"`` becomes an :class:`AttentionSublayer` with its own fresh
    attention layer, every ``"f"`` a :class:`FeedForwardSublayer`. Apply
    them in order to a ``(B, n, dim)`` tensor (masks propagate); pre-norm
    stacks usually end with a final ``LayerNormalization``.

    The attention layers are made from ``attention``:

    * None: ``LocalAttention(num_heads=num_heads, key_dim=dim // num_heads,
      window=128)``;
    * one specification for every ``"s"``: a layer instance (a template,
      cloned through its config: the instance itself and its weights are
      not used), a config dict ``{"class_name": ..., "config": {...}}`` (as
      ``keras.saving.serialize_keras_object(layer)`` gives; the short form
      works for the layers of ``keras_longattn.layers`` and
      ``keras.layers``) or a class name string such as ``"FullAttention"``;
    * a list/tuple with one specification per ``"s"``, bottom first (e.g.
      local attention in the lower layers, full attention in the upper
      ones). The same instance twice in the list is refused: sublayers never
      share an attention layer.

    Configs that lack ``num_heads`` / ``key_dim`` get ``num_heads`` and
    ``dim // num_heads``. Factories (callables) are not accepted, since a
    model must be rebuilt from its config when loaded. ``name`` entries of
    the configs are dropped (Keras names each layer).

    Attention layers that could never run in the stack are refused here,
    from what their classes declare: with ``causal=True`` a layer whose
    ``supports_causal`` is False (``LinformerAttention``,
    ``NystromAttention``, ``AdaMRAAttention``), with ``causal=False`` one
    whose ``supports_bidirectional`` is False, and, when
    ``sequence_length`` is given, a layer with an integer ``max_length``
    below it (``LinformerAttention``, ``SynthesizerAttention``). If an
    attention layer defines ``check_sequence_length(n)`` and
    ``sequence_length`` is given, it is called with ``sequence_length`` and
    may raise ``ValueError`` for a length it cannot take.

    Args:
        layer_pattern: string over ``{"s", "f"}`` with at least one ``"s"``.
        attention: see above.
        dim: model width.
        num_heads: heads of configs that lack ``num_heads``. Defaults to 4.
        feedforward_dim: MLP width. Defaults to ``4 * dim``.
        dropout: residual dropout rate. Defaults to 0.
        activation: MLP activation. Defaults to ``"gelu"``.
        normalize_first: pre-norm (True, default) or post-norm.
        causal: whether the attention sublayers are causal.
        rotary_max_wavelength: when set, written into every attention config
            (rotary positions inside the attention); a layer that cannot take
            it raises ``ValueError``.
        sequence_length: the length the attention layers will see, for the
            ``max_length`` check and the ``check_sequence_length`` hook.
            Optional.
        name_prefix: sublayer ``k`` is named ``f"{name_prefix}_{k}_attention"``
            or ``f"{name_prefix}_{k}_feedforward"``.
        context: for the model builders, the builder arguments behind
            ``causal`` and ``sequence_length``, named in the messages of
            refused attention layers (see
            ``_attention_config.check_capabilities``). Optional.

    Returns:
        A list of ``len(layer_pattern)`` unbuilt layers.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import build_sublayers
    >>> layers = build_sublayers(
    ...     "ssff", ["LocalAttention", "FullAttention"], dim=16, num_heads=2,
    ...     causal=True)
    >>> [type(layer.attention).__name__ for layer in layers[:2]]
    ['LocalAttention', 'FullAttention']
    >>> x = np.zeros((2, 24, 16), "float32")
    >>> for layer in layers:
    ...     x = layer(x)
    >>> tuple(x.shape)
    (2, 24, 16)
    """
    layer_pattern = validate_layer_pattern(layer_pattern)
    dim = check_int("dim", dim)
    num_heads = check_int("num_heads", num_heads)
    feedforward_dim = check_int("feedforward_dim", feedforward_dim, allow_none=True)
    dropout = check_rate("dropout", dropout)
    attention_layers = _attention_config.make_attention_layers(
        attention,
        layer_pattern.count("s"),
        dim=dim,
        num_heads=num_heads,
        rotary_max_wavelength=rotary_max_wavelength,
        sequence_length=sequence_length,
        causal=bool(causal),
        context=context,
    )
    attention_layers = iter(attention_layers)
    sublayers = []
    for k, kind in enumerate(layer_pattern):
        if kind == "s":
            sublayers.append(
                AttentionSublayer(
                    next(attention_layers),
                    dropout=dropout,
                    normalize_first=normalize_first,
                    causal=causal,
                    name=f"{name_prefix}_{k}_attention",
                )
            )
        else:
            sublayers.append(
                FeedForwardSublayer(
                    feedforward_dim=feedforward_dim or 4 * dim,
                    activation=activation,
                    dropout=dropout,
                    normalize_first=normalize_first,
                    name=f"{name_prefix}_{k}_feedforward",
                )
            )
    return sublayers
