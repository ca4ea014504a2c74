"""Pre-training objectives of MPNet (Song et al. 2020) and its two
baselines on one encoder: masked (MLM, BERT), permuted (PLM, XLNet) and
masked-and-permuted (MPNet) language modelling.

All three read the same inputs, so that they predict the same tokens: a
sentence in permuted order (``"tokens"``) with each token's original
position (``"positions"``), the last ``b = round(n * predict_ratio)``
tokens predicted (:func:`keras_longattn.models.permute_for_prediction`
makes them; the targets are ``tokens[:, -b:]``):

* ``"mlm"``: the predicted tokens are replaced by the mask token in place
  and one bidirectional stream predicts them (each prediction sees every
  other unmasked token, not the other predicted ones);
* ``"plm"``: two-stream attention without mask tokens (a prediction sees
  the context and the predicted tokens before it, and only its own
  position among the later ones);
* ``"mpnet"``: two-stream attention with mask tokens at the predicted
  positions appended to the content stream (a prediction also sees the
  positions of every later predicted token).

The encoder (:class:`TwoStreamBlock` layers) is the same for the three; a
model's ``encoder_layers`` run as a plain bidirectional encoder afterwards
(:func:`encode`)."""

import keras
from keras import ops

from keras_longattn.models import _attention_config
from keras_longattn.models._validation import check_int
from keras_longattn.models._validation import check_rate
from keras_longattn.models.two_stream import KINDS as TWO_STREAM_KINDS
from keras_longattn.models.two_stream import permutation_split
from keras_longattn.models.two_stream import two_stream_masks

OBJECTIVES = ("mlm", "plm", "mpnet")


@keras.saving.register_keras_serializable(package="keras_longattn")
class TwoStreamBlock(keras.layers.Layer):
    """A pre-norm Transformer block over both streams: norm, attention
    (shared by the streams: the content stream attends itself, the query
    stream attends the content stream, under :func:`two_stream_masks` of
    ``kind``), residual; norm, feed-forward, residual. With no query stream
    it is an ordinary bidirectional block.

    Args:
        attention: the attention layer (instance, config or class name); it
            must take a dense ``attention_mask``. Defaults to
            ``FullAttention(num_heads, dim // num_heads)``.
        num_heads: heads of the default attention. Defaults to 4.
        kind: ``"mpnet"`` or ``"plm"``: the masks of the two streams.
        feedforward_dim: hidden width. Defaults to 4 times the input width.
        dropout: dropout on both residual branches. Defaults to 0.
        **kwargs: base layer arguments.

    Call arguments:
        content: ``(B, L, dim)``.
        query: ``(B, b, dim)`` or None (content stream only, no mask).
        training: dropout.

    Returns:
        ``(content, query)`` (``query`` None when not given).
    """

    def __init__(self, attention=None, num_heads=4, kind="mpnet", feedforward_dim=None,
                 dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        if kind not in TWO_STREAM_KINDS:
            raise ValueError(f"`kind` must be one of {TWO_STREAM_KINDS}. Received: kind={kind!r}")
        self.kind = kind
        self.num_heads = check_int("num_heads", num_heads)
        self.feedforward_dim = check_int("feedforward_dim", feedforward_dim, allow_none=True)
        self.dropout = check_rate("dropout", dropout)
        self._attention_spec = attention
        self.attention = None
        if attention is not None:
            self._set_attention(attention)

    def _set_attention(self, spec):
        layer = _attention_config.deserialize_attention(spec)
        if not getattr(layer, "supports_attention_mask", False):
            raise ValueError(
                "TwoStreamBlock needs an attention layer that takes a dense "
                f"`attention_mask`. Received: attention={type(layer).__name__}")
        self.attention = _attention_config.adopt(layer, self)

    def build(self, content_shape, query_shape=None):
        dim = int(content_shape[-1])
        if self.attention is None:
            self._set_attention({"class_name": "FullAttention", "config": {
                "num_heads": self.num_heads, "key_dim": max(1, dim // self.num_heads)}})
        shape = tuple(content_shape)
        if not self.attention.built:
            self.attention.build(shape, shape)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy,
                                                     name="norm1")
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy,
                                                     name="norm2")
        hidden = self.feedforward_dim or 4 * dim
        self.hidden = keras.layers.Dense(hidden, activation="gelu", dtype=self.dtype_policy,
                                         name="hidden")
        self.output_dense = keras.layers.Dense(dim, dtype=self.dtype_policy, name="output")
        self.drop = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)
        for layer in (self.norm1, self.norm2):
            layer.build(shape)
        self.hidden.build(shape)
        self.output_dense.build(shape[:-1] + (hidden,))
        self.built = True

    def _masks(self, L, b):
        n = L - b if self.kind == "mpnet" else L
        content, query = two_stream_masks(n, b, self.kind)
        return ops.convert_to_tensor(content), ops.convert_to_tensor(query)

    def _feedforward(self, x, training):
        return x + self.drop(self.output_dense(self.hidden(self.norm2(x))), training=training)

    def call(self, content, query=None, training=None):
        batch = ops.shape(content)[0]
        h = self.norm1(content)
        if query is None:
            attended = self.attention(h, h, training=training)
            content = content + self.drop(attended, training=training)
            return self._feedforward(content, training), None
        L, b = content.shape[1], query.shape[1]
        content_mask, query_mask = self._masks(L, b)
        g = self.norm1(query)
        c_out = self.attention(h, h, attention_mask=ops.broadcast_to(content_mask[None],
                                                                     (batch, L, L)),
                               training=training)
        q_out = self.attention(g, h, attention_mask=ops.broadcast_to(query_mask[None],
                                                                     (batch, b, L)),
                               training=training)
        content = self._feedforward(content + self.drop(c_out, training=training), training)
        query = self._feedforward(query + self.drop(q_out, training=training), training)
        return content, query

    def compute_output_shape(self, content_shape, query_shape=None):
        return tuple(content_shape), None if query_shape is None else tuple(query_shape)

    def get_config(self):
        config = super().get_config()
        config.update({
            "attention": keras.saving.serialize_keras_object(self.attention)
            if self.attention is not None else self._attention_spec,
            "num_heads": self.num_heads,
            "kind": self.kind,
            "feedforward_dim": self.feedforward_dim,
            "dropout": self.dropout,
        })
        return config


@keras.saving.register_keras_serializable(package="keras_longattn")
class PretrainingModel(keras.Model):
    """A pre-training model of :func:`build_pretraining_model` (MLM, PLM or
    MPNet on one encoder). ``inputs``: ``{"tokens": (B, n) int, "positions":
    (B, n) int}``; output: logits ``(B, b, vocab_size)`` of the last ``b``
    tokens.

    ``n`` is at most ``sequence_length`` (the position table): longer
    inputs are refused with a ValueError naming the input, its length and
    the maximum when their static length is known (always on JAX and
    torch), else when the program runs (a TensorFlow graph's
    ``InvalidArgumentError``; under XLA, which cannot stop a program, the
    logits are NaN)."""

    def __init__(self, vocab_size, sequence_length, dim=64, num_layers=2, num_heads=4,
                 objective="mpnet", predict_ratio=0.15, mask_token_id=None, attention=None,
                 dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = check_int("vocab_size", vocab_size)
        self.sequence_length = check_int("sequence_length", sequence_length)
        self.dim = check_int("dim", dim)
        self.num_layers = check_int("num_layers", num_layers)
        self.num_heads = check_int("num_heads", num_heads)
        if objective not in OBJECTIVES:
            raise ValueError(
                f"`objective` must be one of {OBJECTIVES}. Received: objective={objective!r}")
        self.objective = objective
        self.predict_ratio = float(predict_ratio)
        self.num_predicted = permutation_split(self.sequence_length, predict_ratio)
        if mask_token_id is None:
            mask_token_id = self.vocab_size - 1
        if not 0 <= int(mask_token_id) < self.vocab_size:
            raise ValueError(
                f"`mask_token_id` must be a token id in [0, {self.vocab_size}). "
                f"Received: mask_token_id={mask_token_id}")
        self.mask_token_id = int(mask_token_id)
        self.dropout = check_rate("dropout", dropout)
        self.attention_spec = attention
        self.token_embedding = keras.layers.Embedding(self.vocab_size, self.dim,
                                                      name="token_embedding")
        self.position_embedding = keras.layers.Embedding(self.sequence_length, self.dim,
                                                         name="position_embedding")
        kind = "plm" if objective == "plm" else "mpnet"
        self.encoder_layers = [
            TwoStreamBlock(attention=attention, num_heads=self.num_heads, kind=kind,
                           dropout=self.dropout, name=f"block_{i}")
            for i in range(self.num_layers)]
        self.final_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")
        self.head = keras.layers.Dense(self.vocab_size, name="head")

    def _check_length(self, name, x):
        """Refuses ``x`` (``(B, n)``) with more tokens than the position
        table holds (``sequence_length``): a ValueError naming ``name``, the
        length and the maximum when the static length is known, else a
        check when the program runs
        (:func:`keras_longattn.ops.checks.refuse_when`).

        Returns None, or the traced flag where the backend cannot stop a
        compiled program (XLA on TensorFlow): the caller then returns NaN
        logits."""
        message = (
            f"`{name}` must hold at most {self.sequence_length} tokens "
            f"(sequence_length, the length of the position table "
            f"{self.name.replace('{', '{{').replace('}', '}}')} "
            f"was built for). Received: {name} of length {{value}}"
        )
        shape = tuple(x.shape)
        if len(shape) != 2:
            raise ValueError(
                f"`{name}` must have shape (batch, length). Received: {name} "
                f"with shape {shape}")
        n = shape[1]
        if n is not None:
            if n > self.sequence_length:
                raise ValueError(message.format(value=n))
            return None
        from keras_longattn.ops import checks

        n = ops.shape(x)[1]
        _, bad = checks.refuse_when(
            ops.greater(n, self.sequence_length), ops.cast(n, "int32"), message)
        return bad

    def call(self, inputs, training=None):
        bad = [self._check_length(name, inputs[name]) for name in ("tokens", "positions")]
        bad = [flag for flag in bad if flag is not None]
        lengths = (inputs["tokens"].shape[1], inputs["positions"].shape[1])
        if None not in lengths and lengths[0] != lengths[1]:
            raise ValueError(
                "`tokens` and `positions` must have the same length (each "
                "token's position). Received: tokens of length "
                f"{lengths[0]}, positions of length {lengths[1]}")
        tokens = ops.cast(inputs["tokens"], "int32")
        positions = ops.cast(inputs["positions"], "int32")
        if bad:  # XLA on TensorFlow: a table row in range, NaN logits.
            positions = ops.clip(positions, 0, self.sequence_length - 1)
        logits = self._logits(tokens, positions, training)
        for flag in bad:
            logits = ops.where(flag, ops.cast(float("nan"), logits.dtype), logits)
        return logits

    def _logits(self, tokens, positions, training):
        b = self.num_predicted
        pos = self.position_embedding(positions)
        mask_vector = self.token_embedding(ops.full((1, 1), self.mask_token_id, "int32"))
        if self.objective == "mlm":
            n = tokens.shape[1]
            predicted = ops.arange(n) >= n - b
            shown = ops.where(predicted[None], self.mask_token_id, tokens)
            x = self.token_embedding(shown) + pos
            for block in self.encoder_layers:
                x, _ = block(x, training=training)
            out = x[:, -b:]
        else:
            content = self.token_embedding(tokens) + pos
            query = mask_vector + pos[:, -b:]
            if self.objective == "mpnet":
                content = ops.concatenate([content, query], axis=1)
            for block in self.encoder_layers:
                content, query = block(content, query, training=training)
            out = query
        return self.head(self.final_norm(out))

    def encode(self, tokens, training=None):
        """The encoder as a plain bidirectional encoder: ``(B, n)`` tokens
        in order -> ``(B, n, dim)``, ``n`` at most ``sequence_length``."""
        bad = self._check_length("tokens", tokens)
        tokens = ops.cast(tokens, "int32")
        positions = ops.arange(tokens.shape[1], dtype="int32")[None]
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.encoder_layers:
            x, _ = block(x, training=training)
        x = self.final_norm(x)
        if bad is not None:
            x = ops.where(bad, ops.cast(float("nan"), x.dtype), x)
        return x

    def get_config(self):
        return {
            "vocab_size": self.vocab_size,
            "sequence_length": self.sequence_length,
            "dim": self.dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "objective": self.objective,
            "predict_ratio": self.predict_ratio,
            "mask_token_id": self.mask_token_id,
            "attention": self.attention_spec,
            "dropout": self.dropout,
            "name": self.name,
        }


def build_pretraining_model(vocab_size, sequence_length, dim=64, num_layers=2, num_heads=4,
                            objective="mpnet", predict_ratio=0.15, mask_token_id=None,
                            attention=None, dropout=0.0, name=None):
    """Builds an (uncompiled) :class:`PretrainingModel` for ``objective``
    (``"mlm"``, ``"plm"`` or ``"mpnet"``), built for ``sequence_length``
    tokens. Train with ``SparseCategoricalCrossentropy(from_logits=True)``
    on ``y = tokens[:, -b:]`` (``model.num_predicted`` is ``b``).

    Raises:
        ValueError: an unknown objective, a ``predict_ratio`` outside
            ``(0, 1]``, a ``mask_token_id`` outside the vocabulary, an
            attention layer without a dense ``attention_mask``. Calling the
            model with more than ``sequence_length`` tokens is a ValueError
            too (see :class:`PretrainingModel`).
    """
    model = PretrainingModel(vocab_size, sequence_length, dim=dim, num_layers=num_layers,
                             num_heads=num_heads, objective=objective,
                             predict_ratio=predict_ratio, mask_token_id=mask_token_id,
                             attention=attention, dropout=dropout,
                             name=name or f"{objective}_pretraining")
    n = model.sequence_length
    model({"tokens": ops.zeros((1, n), "int32"), "positions": ops.zeros((1, n), "int32")})
    return model
