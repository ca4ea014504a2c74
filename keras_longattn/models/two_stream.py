"""Two-stream self-attention of permuted language modelling (XLNet's PLM
and MPNet): the masks and a layer that runs both streams through one
attention layer.

Tokens arrive in permuted order: the first ``n - b`` are the non-predicted
ones, the last ``b`` the predicted ones (position embeddings carry each
token's original position). The **content stream** holds a
representation of every token; the **query stream** holds one row per
predicted token, which may know that token's *position* but never its
*content*. Keys and values come from the content stream only.

``kind="mpnet"`` (Song et al. 2020) appends ``b`` mask tokens to the
content stream, one at each predicted position (so that every prediction
sees the positions of the whole sentence: "position compensation"); the
content stream is then ``n + b`` long:

* a non-predicted token, and each appended mask token, sees the
  non-predicted tokens and every mask token;
* predicted token ``t`` (the ``t``-th predicted) sees the non-predicted
  tokens, the predicted tokens up to itself, and the mask tokens from
  ``t + 1`` on;
* the query row of predicted token ``t`` sees the non-predicted tokens,
  the predicted tokens *before* it and the mask tokens from ``t`` on
  (its own mask token included): its position, never its content.

``kind="plm"`` (XLNet) has no mask tokens (content length ``n``): the
content row of predicted token ``t`` sees the non-predicted tokens and the
predicted ones up to ``t``; its query row the non-predicted ones and the
predicted ones before ``t``; non-predicted rows see the non-predicted
tokens.
"""

import keras
import numpy as np

from keras_longattn.layers.masking import check_mask as _check_mask
from keras_longattn.models import _attention_config
from keras_longattn.models._validation import check_int

KINDS = ("mpnet", "plm")


def two_stream_masks(num_tokens, num_predicted, kind="mpnet"):
    """The content and query masks of two-stream attention (True = may
    attend), NumPy booleans.

    Args:
        num_tokens: ``n``, tokens of the permuted sentence.
        num_predicted: ``b``, the predicted tokens (the last ``b``), in
            ``[1, n]``.
        kind: ``"mpnet"`` (mask tokens appended to the content stream) or
            ``"plm"``.

    Returns:
        ``(content_mask, query_mask)``: ``(L, L)`` and ``(b, L)`` with
        ``L = n + b`` (``"mpnet"``) or ``n`` (``"plm"``); columns are the
        content stream's tokens in order (the permuted tokens, then the
        mask tokens).
    """
    n = check_int("num_tokens", num_tokens)
    b = check_int("num_predicted", num_predicted)
    if b > n:
        raise ValueError(
            "`num_predicted` must be at most `num_tokens`. "
            f"Received: num_predicted={num_predicted}, num_tokens={num_tokens}")
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
    c = n - b
    length = n + b if kind == "mpnet" else n
    column = np.arange(length)
    visible_tokens = column < c  # the non-predicted tokens
    # Predicted token t (0-based among the predicted) sits at column c + t,
    # its mask token at column n + t.
    t = np.arange(b)[:, None]
    predicted_upto = (column[None] >= c) & (column[None] < n) & (column[None] - c <= t)
    predicted_before = (column[None] >= c) & (column[None] < n) & (column[None] - c < t)
    content = np.zeros((length, length), bool)
    query = np.zeros((b, length), bool)
    content[:, :] = visible_tokens[None]
    if kind == "mpnet":
        is_mask = column >= n
        masks_after = is_mask[None] & (column[None] - n > t)
        masks_from = is_mask[None] & (column[None] - n >= t)
        content[:c] |= is_mask[None]
        content[n:] |= is_mask[None]
        content[c:n] |= predicted_upto | masks_after
        query[:] = visible_tokens[None] | predicted_before | masks_from
    else:
        content[c:n] |= predicted_upto
        query[:] = visible_tokens[None] | predicted_before
    return content, query


@keras.saving.register_keras_serializable(package="keras_longattn")
class TwoStreamAttention(keras.layers.Layer):
    """Both streams of two-stream self-attention through one attention
    layer (shared projections): the content stream attends the content
    stream under ``content_mask``, the query stream attends the content
    stream under ``query_mask``.

    Args:
        attention: the attention layer (an instance, a config dict or a
            class name, as :class:`AttentionSublayer` takes it); it must
            accept a dense ``attention_mask`` (``supports_attention_mask``;
            e.g. :class:`keras_longattn.layers.FullAttention`). Defaults to
            ``FullAttention(num_heads, key_dim)``.
        num_heads: heads of the default attention. Defaults to 4.
        key_dim: head size of the default attention. Defaults to 16.
        **kwargs: base ``keras.layers.Layer`` arguments.

    Call arguments:
        content: ``(B, L, dim)``.
        query: ``(B, b, dim)``.
        content_mask: boolean ``(L, L)`` or ``(B, L, L)``
            (:func:`two_stream_masks`), True = may attend; integer 0/1
            is accepted, a float dtype refused (ValueError), as the
            layers' ``attention_mask``.
        query_mask: boolean ``(b, L)`` or ``(B, b, L)``, likewise.
        training: dropout.

    Returns:
        ``(content_out (B, L, dim), query_out (B, b, dim))``.
    """

    def __init__(self, attention=None, num_heads=4, key_dim=16, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = check_int("num_heads", num_heads)
        self.key_dim = check_int("key_dim", key_dim)
        if attention is None:
            attention = {"class_name": "FullAttention",
                         "config": {"num_heads": self.num_heads, "key_dim": self.key_dim}}
        layer = _attention_config.deserialize_attention(attention)
        if not getattr(layer, "supports_attention_mask", False):
            raise ValueError(
                "TwoStreamAttention needs an attention layer that takes a dense "
                f"`attention_mask` (supports_attention_mask). Received: attention="
                f"{type(layer).__name__}")
        self.attention = _attention_config.adopt(layer, self)

    def build(self, content_shape, query_shape=None):
        if not self.attention.built:
            self.attention.build(tuple(content_shape), tuple(content_shape))
        self.built = True

    @staticmethod
    def _batched(mask, batch, name, rows, length):
        mask = keras.ops.convert_to_tensor(mask)
        shape = tuple(mask.shape)
        if shape[-2:] != (rows, length) or len(shape) not in (2, 3):
            raise ValueError(
                f"`{name}` must have shape ({rows}, {length}) or (batch, {rows}, {length}). "
                f"Received: {name}.shape={shape}")
        # The layers' own check of a mask's dtype: boolean or integer 0/1,
        # never a float cast to bool (where 0.5 would attend).
        _check_mask(name, mask, shape[:-2] + (rows, length), "BTS"[-len(shape):])
        mask = keras.ops.cast(mask, "bool")
        if len(shape) == 2:
            mask = keras.ops.broadcast_to(mask[None], (batch, rows, length))
        return mask

    def call(self, content, query, content_mask, query_mask, training=None):
        batch = keras.ops.shape(content)[0]
        L, b = content.shape[1], query.shape[1]
        content_mask = self._batched(content_mask, batch, "content_mask", L, L)
        query_mask = self._batched(query_mask, batch, "query_mask", b, L)
        content_out = self.attention(content, content, attention_mask=content_mask,
                                     training=training)
        query_out = self.attention(query, content, attention_mask=query_mask,
                                   training=training)
        return content_out, query_out

    def compute_output_shape(self, content_shape, query_shape, *args):
        return tuple(content_shape), tuple(query_shape)

    def get_config(self):
        config = super().get_config()
        config.update({
            "attention": keras.saving.serialize_keras_object(self.attention),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
        })
        return config


def permutation_split(length, predict_ratio):
    """``b``, the number of predicted tokens of a sentence of ``length``
    tokens: ``round(length * predict_ratio)``, at least 1."""
    length = check_int("length", length)
    ratio = float(predict_ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(
            f"`predict_ratio` must be in (0, 1]. Received: predict_ratio={predict_ratio!r}")
    return max(1, min(length, int(round(length * ratio))))


def permute_for_prediction(tokens, predict_ratio, seed=0):
    """Permuted inputs of two-stream pre-training: for integer tokens
    ``(B, n)``, a random permutation per example (``seed``).

    Returns:
        A dict of NumPy arrays: ``"tokens"`` ``(B, n)`` in permuted order,
        ``"positions"`` ``(B, n)`` their original positions, and
        ``"num_predicted"`` ``b`` (the last ``b`` permuted tokens are
        predicted: ``tokens[:, -b:]`` are the targets).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"`tokens` must be (batch, length). Received: shape={tokens.shape}")
    check_int("seed", seed, min_value=0)
    b = permutation_split(tokens.shape[1], predict_ratio)
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random(tokens.shape), axis=1)
    return {"tokens": np.take_along_axis(tokens, order, axis=1),
            "positions": order.astype("int32"), "num_predicted": b}
