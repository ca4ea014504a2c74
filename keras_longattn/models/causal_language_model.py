"""A byte/character-level causal language model, and its generation."""

import numbers

import keras
import numpy as np
from keras import ops

from keras_longattn.models import _builder_common as common
from keras_longattn.models import generation
from keras_longattn.models.attention_sublayer import AttentionSublayer
from keras_longattn.models.feedforward_sublayer import FeedForwardSublayer
from keras_longattn.models.position_embedding import PositionEmbedding
from keras_longattn.models.reversible_embedding import ReversibleEmbedding
from keras_longattn.models.transformer_block import TransformerBlock

_CACHED = (AttentionSublayer, TransformerBlock)


def _check_chunk_size(chunk_size):
    """``chunk_size`` as None or a Python int >= 1, or a ValueError naming it."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) \
            or chunk_size < 1:
        raise ValueError(
            "`chunk_size` must be None (the whole prompt in one call) or a positive "
            f"integer (tokens per call). Received: chunk_size={chunk_size!r}"
        )
    return int(chunk_size)


class _FunctionCache:
    """Compiled generate functions by sampler (an untracked attribute)."""

    def __init__(self):
        self.functions = {}
        self.named_samplers = {}


@keras.saving.register_keras_serializable(package="keras_longattn")
class CausalLanguageModel(keras.Model):
    """The functional model of :func:`build_causal_language_model`, with
    cached decoding and ``generate()``.

    It is a functional ``keras.Model`` (built with ``inputs`` and
    ``outputs``; it saves, loads and trains like one). On top of the
    forward pass it decodes incrementally through the decoding caches of
    its attention layers (keras-hub's convention: ``cache``,
    ``cache_update_index``, see ``docs/guides/decoding.md``):

    * :meth:`init_caches` makes the empty caches, one per attention
      sublayer;
    * :meth:`call_with_cache` runs new tokens at positions
      ``cache_update_index ..`` against the caches and returns
      ``(logits, hidden_states, caches)``, like keras-hub's
      ``GPT2CausalLM.call_with_cache``;
    * :meth:`prefill` runs a prompt through the caches in chunks of a
      given size (one call per chunk, the same logits and caches as one
      call of the whole prompt); with :meth:`call_with_cache` for the
      steps after it, prefill and decoding are callable apart;
    * :meth:`generate` prefills the prompt in one call, then samples one
      token per step with a keras-hub sampler.

    Decoding needs an attention layer with a cache in every attention
    sublayer (:meth:`decode_refusals` lists the others, with the layer's
    reason). Dropout is off while decoding.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import build_causal_language_model
    >>> model = build_causal_language_model(
    ...     vocab_size=256, sequence_length=24, dim=16, num_layers=1,
    ...     num_heads=2, attention={"class_name": "LocalAttention",
    ...                             "config": {"window": 8}})
    >>> caches = model.init_caches(batch_size=2, max_length=24)
    >>> [tuple(c.shape) for c in caches]  # Local: a ring of 7 positions
    [(2, 2, 7, 2, 8)]
    >>> prompt = np.zeros((2, 5), "int32")
    >>> logits, hidden, caches = model.call_with_cache(prompt, caches, 0)
    >>> step = np.ones((2, 1), "int32")
    >>> logits, hidden, caches = model.call_with_cache(step, caches, 5)
    >>> tuple(logits.shape)
    (2, 1, 256)
    """

    def _decoding_layers(self):
        """The builder's layers in the order ``call_with_cache`` runs them:
        ``(embedding, positions, blocks, final_norm, head)``; positions,
        final_norm and head may be None (no learned positions, post-norm,
        tied embeddings)."""
        embedding = positions = final_norm = head = None
        blocks = []
        for layer in self.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            if isinstance(layer, ReversibleEmbedding) and embedding is None:
                embedding = layer
            elif isinstance(layer, PositionEmbedding) and positions is None:
                positions = layer
            elif isinstance(layer, keras.layers.Dropout) and not blocks:
                continue  # embedding dropout: inactive when decoding
            elif isinstance(layer, _CACHED + (FeedForwardSublayer,)):
                blocks.append(layer)
            elif isinstance(layer, keras.layers.LayerNormalization) and (
                final_norm is None and head is None
            ):
                final_norm = layer
            elif isinstance(layer, keras.layers.Dense) and head is None:
                head = layer
            else:
                raise ValueError(
                    f"{type(self).__name__} decodes the layer stack of "
                    "build_causal_language_model (token embedding, positions, "
                    "sublayers, final norm, logits); it cannot place layer "
                    f"{layer.name!r} ({type(layer).__name__})"
                )
        if embedding is None or not any(isinstance(b, _CACHED) for b in blocks):
            raise ValueError(
                f"{type(self).__name__} needs a ReversibleEmbedding and at least "
                "one attention sublayer to decode. Received: layers "
                f"{[layer.name for layer in self.layers]}"
            )
        return embedding, positions, blocks, final_norm, head

    def _attention_sublayers(self):
        return [b for b in self._decoding_layers()[2] if isinstance(b, _CACHED)]

    def decode_refusals(self):
        """``[(sublayer name, reason)]`` for each attention sublayer whose
        attention cannot decode with a cache (empty when the model can
        generate). The reason is the layer's own ``decode_refusal()``."""
        refusals = []
        for sublayer in self._attention_sublayers():
            attention = sublayer.attention
            refuse = getattr(attention, "decode_refusal", None)
            if not callable(refuse):
                reason = (
                    f"{type(attention).__name__} has no decoding cache (it does "
                    "not take `cache` and `cache_update_index`)"
                )
            else:
                reason = refuse()
            if reason is not None:
                refusals.append((sublayer.name, reason))
        return refusals

    def _check_decodable(self):
        refusals = self.decode_refusals()
        if refusals:
            listed = "; ".join(f"{name}: {reason}" for name, reason in refusals)
            raise ValueError(
                f"{self.name} cannot decode with a cache: every attention layer "
                f"needs one. Refused: {listed}"
            )

    def _check_max_length(self, max_length):
        max_length = generation.check_max_length(max_length)
        positions = self._decoding_layers()[1]
        if positions is not None and max_length > positions.sequence_length:
            raise ValueError(
                "`max_length` must be at most the length of the learned position "
                f"table ({positions.sequence_length}, the model's "
                f"sequence_length). Received: max_length={max_length}"
            )
        return max_length

    def init_caches(self, batch_size, max_length):
        """Empty decoding caches of ``batch_size`` sequences of up to
        ``max_length`` tokens: a tuple with each attention layer's
        ``init_cache(batch_size, max_length)``, bottom first.

        Raises:
            ValueError: for a layer without a cache (naming the sublayer and
                the layer's reason), a ``batch_size`` that is not a positive
                int, a ``max_length`` that is not an int >= 2 or runs beyond
                the learned position table.
        """
        self._check_decodable()
        batch_size = generation.check_batch_size(batch_size)
        max_length = self._check_max_length(max_length)
        return tuple(
            sublayer.attention.init_cache(batch_size, max_length)
            for sublayer in self._attention_sublayers()
        )

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """The forward pass of new tokens with the decoding caches.

        Args:
            token_ids: int ``(B, T)``, the tokens at positions
                ``cache_update_index .. cache_update_index + T - 1``, each in
                ``[0, vocab_size)``.
            cache: the tuple of caches (:meth:`init_caches`, or the one a
                previous call returned).
            cache_update_index: the position of ``token_ids[:, 0]`` (an int,
                or a scalar integer tensor inside a compiled function).

        Returns:
            ``(logits (B, T, vocab_size), hidden_states (B, T, dim),
            new_cache)``: the logits equal those of the full forward pass at
            these positions (up to float rounding).

        Raises:
            ValueError: float (or bool) ``token_ids`` (naming the dtype), ids
                outside ``[0, vocab_size)`` (naming the offending id and the
                vocabulary size), positions beyond the learned position
                table, a ``cache`` that is not one cache per attention
                sublayer.

        Ids and positions known when the call is made are refused at once.
        Traced ones (inside ``jax.jit`` or a ``tf.function``) are checked
        when the program runs: JAX stops it with the message
        (``JaxRuntimeError``), a TensorFlow graph with
        ``InvalidArgumentError``. XLA on TensorFlow (``jit_compile=True``)
        cannot stop a program: there a refused call returns NaN logits and
        hidden states and the caches it was given, unchanged, so that
        nothing it computed can be mistaken for a result or poison later
        steps.
        """
        embedding, positions, _, _, _ = self._decoding_layers()
        token_ids, bad = generation.check_token_ids(token_ids, embedding.input_dim)
        if positions is not None and token_ids.shape[1] is not None:
            cache_update_index, late = generation.check_positions(
                cache_update_index, int(token_ids.shape[1]),
                positions.sequence_length, "the model's sequence_length")
            bad = generation.any_flag(bad, late)
        old_cache = tuple(cache) if isinstance(cache, (tuple, list)) else cache
        logits, hidden_states, new_cache = self._decode(
            token_ids, cache, cache_update_index
        )
        return generation.refuse_result(bad, logits, hidden_states, new_cache, old_cache)

    def prefill(self, token_ids, cache, cache_update_index=0, chunk_size=None):
        """Runs ``token_ids`` through the caches in chunks of at most
        ``chunk_size`` tokens, one :meth:`call_with_cache` per chunk.

        A long prompt in chunks needs the activations of one chunk at a
        time instead of the whole prompt's; the caches and logits equal
        those of a single call (up to float rounding).

        Args:
            token_ids: int ``(B, T)``, the tokens at positions
                ``cache_update_index .. cache_update_index + T - 1``.
            cache: the tuple of caches (:meth:`init_caches`, or the one a
                previous call returned).
            cache_update_index: the position of ``token_ids[:, 0]``.
            chunk_size: tokens per call, or None for the whole of
                ``token_ids`` in one call (the last chunk may be shorter).

        Returns:
            ``(logits (B, T, vocab_size), hidden_states (B, T, dim),
            new_cache)``, as :meth:`call_with_cache` returns them.

        Raises:
            ValueError: a ``chunk_size`` that is not None or a positive int,
                ``token_ids`` that are not ``(B, T)`` with a known ``T``, and
                whatever :meth:`call_with_cache` refuses.
        """
        chunk_size = _check_chunk_size(chunk_size)
        shape = tuple(getattr(token_ids, "shape", ()))
        if len(shape) != 2 or shape[1] is None:
            raise ValueError(
                "`token_ids` must be a (batch, length) array with a known length "
                f"to be split into chunks. Received: shape {shape}"
            )
        length = int(shape[1])
        if chunk_size is None or length <= chunk_size:
            return self.call_with_cache(token_ids, cache, cache_update_index)
        logits, hidden_states = [], []
        for start in range(0, length, chunk_size):
            size = min(chunk_size, length - start)
            chunk_logits, chunk_hidden, cache = self.call_with_cache(
                token_ids[:, start:start + size], cache, cache_update_index + start
            )
            logits.append(chunk_logits)
            hidden_states.append(chunk_hidden)
        return ops.concatenate(logits, axis=1), ops.concatenate(hidden_states, axis=1), cache

    def _decode(self, token_ids, cache, cache_update_index):
        """:meth:`call_with_cache` without the checks of the token ids and
        positions (``generate`` feeds it checked prompts and the sampler's
        ids)."""
        embedding, positions, blocks, final_norm, head = self._decoding_layers()
        n_cached = sum(isinstance(b, _CACHED) for b in blocks)
        if not isinstance(cache, (tuple, list)) or len(cache) != n_cached:
            received = len(cache) if isinstance(cache, (tuple, list)) else type(cache).__name__
            raise ValueError(
                f"`cache` must be a tuple of {n_cached} caches, one per attention "
                f"sublayer (init_caches gives one). Received: {received}"
            )
        x = embedding(token_ids)
        if positions is not None:
            x = positions(x, start_index=cache_update_index)
        caches = iter(cache)
        new_cache = []
        for block in blocks:
            if isinstance(block, _CACHED):
                x, block_cache = block(
                    x,
                    training=False,
                    cache=next(caches),
                    cache_update_index=cache_update_index,
                )
                new_cache.append(block_cache)
            else:
                x = block(x, training=False)
        if final_norm is not None:
            x = final_norm(x)
        logits = embedding(x, reverse=True) if head is None else head(x)
        return logits, x, tuple(new_cache)

    def generate(
        self,
        prompt_tokens,
        max_length,
        sampler="greedy",
        stop_token_ids=None,
        padding_mask=None,
    ):
        """Generates tokens after a prompt with a keras-hub sampler.

        The prompt is prefilled through the caches in one call (all its
        tokens but the last of the shortest prompt), then each step feeds
        one token and the sampler picks the next, up to ``max_length``
        tokens in all. The whole loop is one compiled function: ``jax.jit``
        on JAX, ``tf.function(jit_compile=True)`` on TensorFlow (without
        XLA if the model was compiled with ``jit_compile=False``), eager
        under ``torch.no_grad()`` on torch; eager everywhere when the model
        is compiled with ``run_eagerly=True``. It
        is compiled once per sampler, batch shape, ``max_length`` and
        shortest prompt length, and reused.

        Prompts of different lengths: right-pad them and pass
        ``padding_mask`` (True on each prompt's tokens, a prefix of its
        row), as keras-hub's ``CausalLM`` does; each row keeps its own prompt
        tokens and generates after them.

        Args:
            prompt_tokens: int array ``(B, P)`` with ``P < max_length``, or a
                dict ``{"token_ids": ..., "padding_mask": ...}``.
            max_length: the length of the output (prompt plus new tokens).
                With learned positions, at most the model's
                ``sequence_length``.
            sampler: a ``keras_hub.samplers.Sampler`` (``GreedySampler``,
                ``TopKSampler``, ``TopPSampler``, ``BeamSampler``,
                ``RandomSampler``) or its name (``"greedy"``, ``"top_k"``,
                ``"top_p"``, ``"beam"``, ``"random"``). A named sampler is
                made once per model and name. Defaults to ``"greedy"``.
            stop_token_ids: None (generate up to ``max_length``) or token ids
                that end a sequence; generation stops when every row has
                produced one.
            padding_mask: optional bool ``(B, P)``, True on prompt tokens.

        Returns:
            A dict of NumPy arrays: ``"token_ids"`` int32 ``(B, max_length)``
            (the prompts followed by the generated tokens) and
            ``"padding_mask"`` bool ``(B, max_length)``, True on the prompt
            and the generated tokens up to and including each row's first
            stop token.

        Raises:
            ImportError: keras-hub is not installed
                (``pip install keras-longattn[hub]``).
            ValueError: an attention layer without a decoding cache (naming
                the sublayer and why), a bad ``max_length``, a prompt of
                ``max_length`` tokens or more, a padding mask that is not a
                prefix per row, token ids outside the vocabulary, an unknown
                sampler.
        """
        self._check_decodable()
        max_length = self._check_max_length(max_length)
        vocab_size = self._decoding_layers()[0].input_dim
        token_ids, mask, min_length = generation.normalize_prompt(
            prompt_tokens, padding_mask, max_length, vocab_size
        )
        stop_token_ids = generation.check_stop_token_ids(stop_token_ids, vocab_size)
        function = self._generate_function(sampler)
        token_ids, mask = function(token_ids, mask, stop_token_ids, min_length - 1)
        return {
            "token_ids": np.asarray(ops.convert_to_numpy(token_ids)).astype("int32"),
            "padding_mask": np.asarray(ops.convert_to_numpy(mask)).astype(bool),
        }

    def _generate_function(self, sampler):
        store = self.__dict__.get("_generate_store")
        if store is None:
            store = _FunctionCache()
            object.__setattr__(self, "_generate_store", store)
        if isinstance(sampler, str):
            if sampler not in store.named_samplers:
                store.named_samplers[sampler] = generation.get_sampler(sampler)
            sampler = store.named_samplers[sampler]
        else:
            sampler = generation.get_sampler(sampler)
        key = (id(sampler), self.run_eagerly, generation.use_xla(self))
        entry = store.functions.get(key)
        if entry is None or entry[0] is not sampler:
            entry = (sampler, generation.make_generate_function(self, sampler))
            store.functions[key] = entry
        return entry[1]



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
        An uncompiled :class:`CausalLanguageModel` (a functional
        ``keras.Model``): input ``"tokens"`` int32 ``(B, n)``, output logits
        ``(B, n, vocab_size)``. Its ``generate()`` decodes with the
        attention layers' caches and keras-hub's samplers; its
        ``call_with_cache`` and ``init_caches`` decode step by step.

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

    Train with ``model.compile(optimizer, loss)`` and ``model.fit(x, y)``,
    then generate (with keras-hub installed):
    ``model.generate(prompt, max_length=24, sampler="top_k")["token_ids"]``.
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
    return CausalLanguageModel(tokens, logits, name=name)
