"""Layers built from Keras's own attention layers, with their weights:
``from_multi_head_attention`` and ``from_grouped_query_attention`` of every
keras_longattn layer (a mixin of :class:`keras_longattn.layers.BaseAttention`).
A source with a ``sliding_window`` becomes the layer registered as
:attr:`ConversionMixin.sliding_window_class` (``LocalAttention`` registers
itself), so that this module imports no layer."""

#: Constructor arguments of ``keras.layers.MultiHeadAttention`` that carry
#: over to a keras_longattn layer.
_MHA_CONFIG_KEYS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "dropout",
    "use_bias",
    "output_shape",
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "seed",
)


class ConversionMixin:
    """The constructors from Keras's attention layers."""

    #: The layer class of a source with a ``sliding_window`` (set by
    #: ``keras_longattn.layers.local_attention``).
    sliding_window_class = None

    @classmethod
    def from_multi_head_attention(cls, mha, **kwargs):
        """Builds a layer of this class with the weights of a built
        ``keras.layers.MultiHeadAttention``.

        Args:
            mha: a built ``keras.layers.MultiHeadAttention`` (default
                ``attention_axes``, rank-3 inputs).
            **kwargs: constructor arguments of this class (e.g. ``window``),
                which also override the values taken from ``mha``.
        """
        if not mha.built:
            raise ValueError(
                "`mha` must be built (called once) before its weights can be "
                f"copied. Received: mha={mha.name!r} (not built)"
            )
        config = mha.get_config()
        args = {k: config[k] for k in _MHA_CONFIG_KEYS if k in config}
        args.update(kwargs)
        return cls._with_weights_of(mha, args, config.get("sliding_window"))

    @classmethod
    def from_grouped_query_attention(cls, gqa, **kwargs):
        """Builds a layer of this class with the weights of a built
        ``keras.layers.GroupQueryAttention`` (``num_query_heads`` heads of
        ``head_dim``, ``num_key_value_heads`` key/value heads).

        A ``sliding_window`` of ``gqa`` is mapped as by
        :meth:`from_multi_head_attention`; a gated ``gqa``
        (``use_gate=True``) is refused.
        """
        if not gqa.built:
            raise ValueError(
                "`gqa` must be built (called once) before its weights can be "
                f"copied. Received: gqa={gqa.name!r} (not built)"
            )
        config = gqa.get_config()
        if config.get("use_gate"):
            raise ValueError(
                "keras_longattn layers have no output gate: a GroupedQueryAttention "
                "with use_gate=True cannot be copied. Received: use_gate=True")
        args = {
            "num_heads": config["num_query_heads"],
            "key_dim": config["head_dim"],
            "num_key_value_heads": config["num_key_value_heads"],
        }
        for name in _MHA_CONFIG_KEYS:
            if name in config and name not in ("num_heads", "key_dim", "value_dim",
                                               "output_shape"):
                args[name] = config[name]
        args.update(kwargs)
        return cls._with_weights_of(gqa, args, config.get("sliding_window"))

    @classmethod
    def _with_weights_of(cls, source, args, sliding_window):
        """A layer of ``cls`` (LocalAttention for FullAttention with a
        sliding window) from ``args``, built and holding ``source``'s
        weights."""
        target = cls
        if sliding_window is not None:
            window_class = ConversionMixin.sliding_window_class
            if cls.__name__ in ("BaseAttention", "FullAttention"):
                target = window_class
            if window_class is None or not issubclass(target, window_class):
                raise ValueError(
                    f"The source layer attends within sliding_window={sliding_window} "
                    f"positions, which is LocalAttention's pattern, not "
                    f"{cls.__name__}'s: use LocalAttention (or FullAttention, which "
                    "maps it to LocalAttention). "
                    f"Received: sliding_window={sliding_window}")
            # |i - j| <= sliding_window - 1, as Keras's band.
            reach = int(sliding_window) - 1
            args = {"window": 2 * reach + 1, "look_back": reach, "look_ahead": reach,
                    **args}
        layer = target(**args)
        dims = [
            source._query_dense.kernel.shape[0],
            source._value_dense.kernel.shape[0],
            source._key_dense.kernel.shape[0],
        ]
        layer.build(*[(None, None, int(d)) for d in dims])
        layer.set_weights(source.get_weights())
        return layer
