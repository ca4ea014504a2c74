"""keras-hub's ``CausalLM.generate`` through our layers' caches (shared by the converted tasks)."""

import numbers

import numpy as np
from keras import ops

from keras_longattn.models import generation as la_generation
from keras_longattn.hub.longify import _LEARNED_POSITIONS


# ---------------------------------------------------------------- generation
class _LongCausalLMMixin:
    """keras-hub's ``CausalLM.generate`` through our layers' caches.

    keras-hub's tasks stack one full-length key/value cache per block,
    ``(B, num_layers, 2, max_length, heads, head_dim)``, prefill it with the
    whole padded ``max_length`` row and then overwrite positions from the
    shortest prompt on. Our caches are each layer's own
    (``layer.init_cache``: a ring of the window for ``LocalAttention``, a
    recurrent state for ``LinearAttention``), which cannot be rewound past
    what they hold. Here the stacked cache is the layers' empty caches and
    keras-hub's sampler starts at position 1: every prompt token goes
    through ``call_with_cache`` once, in order, inside the compiled sampler
    loop (the sampler keeps prompt tokens where ``padding_mask`` is True),
    so ragged prompts and every cache kind give the tokens of a full
    forward pass. keras-hub's ``call_with_cache`` is unchanged (it calls
    each block with ``self_attention_cache`` and
    ``self_attention_cache_update_index``).

    The prompt costs one step per token (keras-hub's compiled function sees
    the shortest prompt's length as a traced value, so it cannot be
    prefilled in one call of static shape). Greedy and beam search give
    keras-hub's tokens; a seeded random sampler (top-k, top-p, random) also
    draws at the prompt steps, so its numbers, not its distribution, differ
    from the original task's. The ``ContrastiveSampler`` (hidden states of
    every prompt position) is refused.

    Checked, as :class:`keras_longattn.models.CausalLanguageModel` checks
    them: :meth:`call_with_cache` refuses float ids, ids outside the
    vocabulary and (GPT-2) positions past the position table, before
    anything is written to the cache (see there for traced inputs);
    :meth:`init_caches` a bad ``batch_size`` or ``max_length``; a
    generation longer than GPT-2's position table (``max_length`` above the
    backbone's ``max_sequence_length``: keras-hub would clamp the positions
    on JAX) is refused before generating, and prompts given without a
    preprocessor must hold ids of the vocabulary.
    """

    def _attention_layers(self):
        return [block._self_attention_layer for block in self.backbone.transformer_layers]

    def _position_table_size(self):
        """The rows of the backbone's learned position table, or None
        (rotary positions: no table)."""
        if isinstance(self.backbone, _LEARNED_POSITIONS):
            return int(self.backbone.max_sequence_length)
        return None

    def _check_max_length(self, max_length):
        table = self._position_table_size()
        if table is not None and max_length > table:
            raise ValueError(
                "`max_length` must be at most the length of the backbone's learned "
                f"position table ({table}, its max_sequence_length; longify's "
                "max_sequence_length extends it). Received: "
                f"max_length={max_length}")

    def init_caches(self, batch_size, max_length):
        """The stacked empty caches of the blocks' attention layers for
        ``batch_size`` sequences of up to ``max_length`` tokens,
        ``(B, num_layers) + layer.cache_shape(B, max_length)[1:]`` (the
        ``cache`` of :meth:`call_with_cache`).

        Raises:
            ValueError: an attention without a decoding cache, a
                ``batch_size`` or ``max_length`` that is not a positive int,
                a ``max_length`` beyond the learned position table (GPT-2).
        """
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"`{name}` must be a positive int. Received: {name}={value!r}")
        self._check_max_length(int(max_length))
        return self._empty_caches(int(batch_size), int(max_length))

    def _empty_caches(self, batch_size, max_length):
        for layer in self._attention_layers():
            reason = layer.decode_refusal()
            if reason is not None:
                raise ValueError(
                    f"{type(self).__name__} cannot generate: the attention of every "
                    f"block is {type(layer).__name__}, which has no decoding cache "
                    f"({reason}). Received: backbone.attention={self.backbone.attention}")
        caches = [layer.init_cache(batch_size, max_length) for layer in self._attention_layers()]
        dtype = caches[0].dtype
        return ops.stack([ops.cast(c, dtype) for c in caches], axis=1)

    def _build_cache(self, token_ids):
        """The empty caches for the padded ``token_ids`` ``(B, max_length)``
        of a generation (its static shape; the position table is checked by
        ``generate_step``)."""
        return self._empty_caches(token_ids.shape[0], token_ids.shape[1])

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """keras-hub's ``call_with_cache`` (one forward pass of new tokens
        through the stacked caches of :meth:`init_caches`), with its inputs
        checked.

        Float (or bool) ``token_ids`` are refused with a ValueError naming the
        dtype; ids outside ``[0, vocabulary_size)`` and, with a learned
        position table (GPT-2), positions past it are refused with a
        ValueError when known at the call, and when the program runs when
        traced (``jax.jit``: ``JaxRuntimeError``; a TensorFlow graph:
        ``InvalidArgumentError``). Under XLA on TensorFlow, which cannot stop
        a program, a refused call returns NaN logits and hidden states and
        the cache it was given, unchanged. ``generate`` feeds checked
        prompts and the sampler's ids without these checks.
        """
        token_ids, bad = la_generation.check_token_ids(
            token_ids, self.backbone.vocabulary_size)
        table = self._position_table_size()
        if table is not None and token_ids.shape[1] is not None:
            cache_update_index, late = la_generation.check_positions(
                cache_update_index, int(token_ids.shape[1]), table,
                "the backbone's max_sequence_length")
            bad = la_generation.any_flag(bad, late)
        logits, hidden_states, new_cache = super().call_with_cache(
            token_ids, cache, cache_update_index)
        return la_generation.refuse_result(bad, logits, hidden_states, new_cache, cache)

    def _decode(self, token_ids, cache, cache_update_index):
        """keras-hub's ``call_with_cache`` without our checks."""
        return super().call_with_cache(token_ids, cache, cache_update_index)

    def generate(self, inputs, max_length=None, stop_token_ids="auto", strip_prompt=False):
        """keras-hub's ``generate``; without a preprocessor, the prompts
        (``{"token_ids", "padding_mask"}`` arrays, padded to the output
        length) are checked first: integer ids in the vocabulary on the
        prompt tokens, and, with a learned position table, an output length
        within it (ValueErrors; the compiled generation checks the length
        too, before generating, whatever the inputs)."""
        if self.preprocessor is None:
            self._check_prompts(inputs)
        return super().generate(inputs, max_length=max_length,
                                stop_token_ids=stop_token_ids, strip_prompt=strip_prompt)

    def _check_prompts(self, inputs):
        if not isinstance(inputs, dict) or "token_ids" not in inputs:
            return  # a dataset, or another structure keras-hub refuses
        try:
            token_ids = np.asarray(ops.convert_to_numpy(inputs["token_ids"]))
            mask = inputs.get("padding_mask")
            mask = None if mask is None else np.asarray(ops.convert_to_numpy(mask))
        except Exception:  # pragma: no cover - not concrete arrays
            return
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise ValueError(
                "`token_ids` of the prompts must be integer token ids. Received: "
                f"token_ids with dtype {token_ids.dtype}")
        if token_ids.ndim:
            self._check_max_length(int(token_ids.shape[-1]))
        real = token_ids if mask is None or mask.shape != token_ids.shape \
            else token_ids[mask.astype(bool)]
        vocabulary = self.backbone.vocabulary_size
        if real.size and (real.min() < 0 or real.max() >= vocabulary):
            value = int(real.min() if real.min() < 0 else real.max())
            raise ValueError(
                f"`token_ids` of the prompts must be token ids in [0, {vocabulary}) "
                f"(the vocabulary size is {vocabulary}). Received: token id {value}")

    def generate_step(self, inputs, stop_token_ids=None):
        """One batch of generation (compiled by keras-hub's
        ``make_generate_function``): ``inputs`` is a dict of ``"token_ids"``
        and ``"padding_mask"`` ``(B, max_length)`` (True on each row's
        prompt, a prefix); returns the same dict with the generated tokens
        and the mask of the tokens up to each row's first new stop token."""
        from keras_hub.src.samplers.contrastive_sampler import ContrastiveSampler
        from keras_hub.src.utils.tensor_utils import any_equal

        if isinstance(self.sampler, ContrastiveSampler):
            raise ValueError(
                f"{type(self).__name__} does not run the ContrastiveSampler (it needs "
                "the hidden states of every prompt position, which a cache fed one "
                "prompt token per step does not give). Received: sampler="
                f"{type(self.sampler).__name__}")
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        if token_ids.shape[1] is not None:  # static: refused before generating
            self._check_max_length(int(token_ids.shape[1]))
        cache = self._build_cache(token_ids)

        def next(prompt, cache, index):
            cache_update_index = index - 1
            batch_size = ops.shape(prompt)[0]
            prompt = ops.slice(prompt, [0, cache_update_index], [batch_size, 1])
            logits, hidden_states, cache = self._decode(prompt, cache, cache_update_index)
            return (ops.squeeze(logits, axis=1), ops.squeeze(hidden_states, axis=1), cache)

        token_ids = self.sampler(
            next=next,
            prompt=token_ids,
            cache=cache,
            index=1,
            mask=padding_mask,
            stop_token_ids=stop_token_ids,
            hidden_states=None,
            model=self,
        )
        if stop_token_ids is not None:
            end_locations = any_equal(token_ids, stop_token_ids, ops.logical_not(padding_mask))
            end_locations = ops.cast(end_locations, "int32")
            cumsum = ops.cast(ops.cumsum(end_locations, axis=-1), "int32")
            overflow = cumsum - end_locations
            padding_mask = ops.logical_not(ops.cast(overflow, "bool"))
        else:
            padding_mask = ops.ones_like(token_ids, dtype="bool")
        return {"token_ids": token_ids, "padding_mask": padding_mask}
