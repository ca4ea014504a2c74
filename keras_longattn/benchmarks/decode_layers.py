"""The layers of the decoding benchmark (``keras-longattn decode-bench``):
each short name of :data:`LAYERS` built as the benchmark measures it, its
cache, one cached call, the forward pass it must equal, and the compiled
one-token step; the peer (keras-hub's ``CachedMultiHeadAttention`` under a
dense band mask) is built and called like the layers."""

from __future__ import annotations

#: The peer: keras-hub's cached multi-head attention with a dense band mask.
PEER = "hub_sliding_window"
#: Layers this benchmark knows, in report order.
LAYERS = ("full", "local", "linear", "performer", "sparse", "longformer", "bigbird", "routing",
          "synthesizer", PEER)
#: Global tokens of the ``longformer`` layer (the first positions).
LONGFORMER_GLOBAL_TOKENS = 16


def routing_clusters(context: int) -> int:
    """Centroids per head of the ``routing`` layer at ``context`` positions:
    ``max(1, round(sqrt(context)))``, the Routing Transformer's choice
    (O(n^1.5) for its forward pass)."""
    return max(1, round(context ** 0.5))


def build_layer(name: str, num_heads: int, head_dim: int, window: int, seed: int = 0,
                context: int | None = None):
    """An unbuilt layer for ``name`` (one of :data:`LAYERS`).

    ``context`` is the number of positions the layer decodes to: the
    ``routing`` layer's number of centroids (:func:`routing_clusters`) and
    the ``synthesizer``'s ``max_length`` (its dense projection has one
    output per position) depend on it; the other layers ignore it.

    Raises:
        ValueError: for an unknown ``name``, or no ``context`` for
            ``routing`` and ``synthesizer``.
        ImportError: for the peer when keras-hub is not installed.
    """
    import keras

    keras.utils.set_random_seed(seed)
    if name == PEER:
        import keras_hub

        return keras_hub.layers.CachedMultiHeadAttention(num_heads=num_heads, key_dim=head_dim)
    from keras_longattn import layers

    if name == "full":
        return layers.FullAttention(num_heads=num_heads, key_dim=head_dim)
    if name == "local":
        return layers.LocalAttention(num_heads=num_heads, key_dim=head_dim, window=window)
    if name == "linear":
        return layers.LinearAttention(num_heads=num_heads, key_dim=head_dim)
    if name == "performer":
        return layers.PerformerAttention(num_heads=num_heads, key_dim=head_dim, seed=seed)
    if name == "sparse":
        return layers.SparseAttention(num_heads=num_heads, key_dim=head_dim, pattern="strided",
                                      block_length=window)
    if name == "longformer":
        return layers.LongformerAttention(num_heads=num_heads, key_dim=head_dim, window=window,
                                          global_tokens=LONGFORMER_GLOBAL_TOKENS)
    if name == "bigbird":
        return layers.BigBirdAttention(num_heads=num_heads, key_dim=head_dim,
                                       block_size=max(1, window // 4), seed=seed)
    if name in ("routing", "synthesizer") and (not isinstance(context, int) or context < 2):
        raise ValueError(f"`context` must be an integer >= 2 for the {name} layer. "
                         f"Received: context={context!r}")
    if name == "routing":
        return layers.RoutingAttention(num_heads=num_heads, key_dim=head_dim, window=window,
                                       num_clusters=routing_clusters(context),
                                       causal_routing="token", seed=seed)
    if name == "synthesizer":
        return layers.SynthesizerAttention(num_heads=num_heads, key_dim=head_dim,
                                           kind="dense+vanilla", max_length=context)
    raise ValueError(f"`name` must be one of {', '.join(LAYERS)}. Received: name={name!r}")


def band_mask(batch: int, query_start, query_length: int, context: int, window: int):
    """keras-hub's dense sliding-window mask, ``(batch, query_length,
    context)``: query ``i`` (position ``query_start + i``) reads key ``j``
    when ``p - window < j <= p``; ``query_start`` may be a traced scalar."""
    from keras import ops

    positions = ops.arange(query_length, dtype="int32") + ops.cast(query_start, "int32")
    rows = ops.expand_dims(positions, 1)
    cols = ops.expand_dims(ops.arange(context, dtype="int32"), 0)
    mask = ops.logical_and(cols <= rows, cols > rows - window)
    return ops.broadcast_to(ops.expand_dims(mask, 0), (batch, query_length, context))


def _init_cache(layer, name: str, batch: int, context: int, num_heads: int, head_dim: int):
    from keras import ops

    if name == PEER:
        return ops.zeros((batch, 2, context, num_heads, head_dim), "float32")
    return layer.init_cache(batch, context)


def _call(layer, name: str, tokens, cache, index, context: int, window: int):
    """One cached call on ``tokens`` at ``index``: ``(output, cache)``."""
    if name == PEER:
        mask = band_mask(tokens.shape[0], index, tokens.shape[1], context, window)
        return layer(tokens, tokens, attention_mask=mask, cache=cache, cache_update_index=index)
    return layer(tokens, tokens, use_causal_mask=True, cache=cache, cache_update_index=index)


def full_forward(layer, name: str, x, window: int):
    """The layer's forward pass over all of ``x`` without a cache (causal;
    the band mask for the peer)."""
    if name == PEER:
        n = x.shape[1]
        return layer(x, x, attention_mask=band_mask(x.shape[0], 0, n, n, window))
    return layer(x, x, use_causal_mask=True)


def decode_step_function(layer, name: str, context: int, window: int, backend: str):
    """The compiled one-token step ``step(token, cache, index) -> (out, cache)``
    and how it was compiled (``"jax.jit"``, ``"tf.function(jit_compile)"``
    or ``"eager"``)."""

    def step(token, cache, index):
        return _call(layer, name, token, cache, index, context, window)

    if backend == "jax":
        import jax

        return jax.jit(step, donate_argnums=(1,)), "jax.jit"
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(step, jit_compile=True), "tf.function(jit_compile)"
    return step, "eager"


def _build(layer, name: str, batch: int, dim: int, window: int, seed: int):
    import numpy as np

    x = np.random.default_rng(seed).normal(size=(batch, min(window, 16) + 1, dim)).astype("float32")
    full_forward(layer, name, x, window)
