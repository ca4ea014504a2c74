"""The Keras layer that runs a peer implementation in the benchmark (see
:mod:`keras_longattn.benchmarks.peers`). Imported by the worker only."""

import keras

from .peers import PEERS
from .peers import unavailable_reason

__all__ = ["PeerAttention"]


class PeerAttention(keras.layers.Layer):
    """A peer's attention between MultiHeadAttention-like projections
    (torch backend only).

    Args:
        num_heads: number of heads H.
        key_dim: size d of each head (query, key and value).
        peer: ``"local-attention"`` or ``"routing-transformer"``.
        window: window size of ``local-attention``. Defaults to 256.
        num_clusters: clusters of ``routing-transformer`` (its window is
            ``n // num_clusters``). Defaults to ``round(sqrt(n))``.
        **kwargs: ``keras.layers.Layer`` arguments.

    Call arguments:
        ``query`` ``(B, T, dim)``, ``value`` ``(B, S, dim)``, ``key``,
        ``use_causal_mask``, ``training`` (the routing peer updates its
        centroids in training). :meth:`attend` takes projected heads
        ``(B, n, H, d)``, as the project's layers.
    """

    def __init__(self, num_heads, key_dim, peer, *, window=256, num_clusters=None, **kwargs):
        super().__init__(**kwargs)
        if peer not in PEERS:
            raise ValueError(f"`peer` must be one of {tuple(PEERS)}. Received: peer={peer!r}")
        for arg, value in (("num_heads", num_heads), ("key_dim", key_dim), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{arg}` must be a positive integer. Received: {arg}={value!r}")
        if num_clusters is not None and (
            isinstance(num_clusters, bool) or not isinstance(num_clusters, int) or num_clusters < 1
        ):
            raise ValueError(
                "`num_clusters` must be a positive integer or None. "
                f"Received: num_clusters={num_clusters!r}"
            )
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.peer = peer
        self.window = window
        self.num_clusters = num_clusters
        # Plain dict outside Keras' tracking: the peer modules hold no
        # trainable weight (centroids are buffers).
        object.__setattr__(self, "_modules_by_call", {})

    def build(self, query_shape, value_shape=None, key_shape=None):
        reason = unavailable_reason(self.peer, keras.backend.backend())
        if reason is not None:
            raise ImportError(reason)
        dim = query_shape[-1]
        inner = self.num_heads * self.key_dim
        self._query_dense = keras.layers.Dense(inner, name="query")
        self._key_dense = keras.layers.Dense(inner, name="key")
        self._value_dense = keras.layers.Dense(inner, name="value")
        self._output_dense = keras.layers.Dense(dim, name="attention_output")
        value_shape = value_shape or query_shape
        self._query_dense.build(query_shape)
        self._key_dense.build(key_shape or value_shape)
        self._value_dense.build(value_shape)
        self._output_dense.build(tuple(query_shape[:-1]) + (inner,))
        self.built = True

    def _module(self, causal, length):
        key = (bool(causal), int(length))
        module = self._modules_by_call.get(key)
        if module is not None:
            return module
        if self.peer == "local-attention":
            from local_attention import LocalAttention

            module = LocalAttention(
                window_size=self.window, causal=bool(causal), autopad=True
            )
        else:
            from routing_transformer.routing_transformer import KmeansAttention

            clusters = self.num_clusters or max(1, round(length ** 0.5))
            module = KmeansAttention(
                clusters, max(1, length // clusters), self.num_heads, self.key_dim,
                causal=bool(causal),
            )
        self._modules_by_call[key] = module
        return module

    def attend(self, query, key, value, use_causal_mask=False, training=None):
        """The peer's attention on projected heads ``(B, n, H, d)``."""
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        module = self._module(use_causal_mask, q.shape[2])
        module.train(bool(training))
        out = module(q, k, v)
        if isinstance(out, tuple):  # KmeansAttention: (out, auxiliary loss)
            out = out[0]
        return out.permute(0, 2, 1, 3)

    def call(self, query, value, key=None, use_causal_mask=False, training=None):
        key = value if key is None else key
        heads = (self.num_heads, self.key_dim)

        def split(x, dense):
            y = dense(x)
            return keras.ops.reshape(y, tuple(y.shape[:2]) + heads)

        out = self.attend(
            split(query, self._query_dense),
            split(key, self._key_dense),
            split(value, self._value_dense),
            use_causal_mask=use_causal_mask,
            training=training,
        )
        out = keras.ops.reshape(out, tuple(out.shape[:2]) + (self.num_heads * self.key_dim,))
        return self._output_dense(out)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "peer": self.peer,
                "window": self.window,
                "num_clusters": self.num_clusters,
            }
        )
        return config
