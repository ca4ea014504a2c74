"""Autoregressive generation with decoding caches and keras-hub's samplers.

:class:`~keras_longattn.models.causal_language_model.CausalLanguageModel`
uses these helpers for its ``generate()``: the prompt is prefilled through
the attention caches in one call, then each step feeds one token at
``cache_update_index`` and a keras-hub sampler picks the next one, in one
compiled function (``jax.jit`` on JAX, ``tf.function(jit_compile=True)`` on
TensorFlow, eager under ``torch.no_grad()`` on torch), as keras-hub's
``CausalLM.generate`` does.

keras-hub is the optional ``[hub]`` extra: it is imported only when a
sampler is needed.
"""

import itertools
import numbers
from functools import partial

import keras
import numpy as np
from keras import ops

HUB_INSTALL = "pip install keras-longattn[hub]"


def import_keras_hub():
    """``keras_hub``, or an ImportError that says how to install it."""
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(
            "generate() samples with keras-hub's samplers "
            "(keras_hub.samplers), and keras-hub is not installed. Install "
            f"the optional extra: `{HUB_INSTALL}`. ({error})"
        ) from error
    return keras_hub


def get_sampler(sampler):
    """A keras-hub sampler from an instance or its name (``"greedy"``,
    ``"top_k"``, ``"top_p"``, ``"beam"``, ``"random"``), as
    ``keras_hub.samplers.get`` resolves it.

    Refused with a ValueError: other types, unknown names, a ``BeamSampler``
    with ``return_all_beams=True`` (generate returns one sequence per
    prompt) and the ``ContrastiveSampler`` (it needs the hidden states of
    every prompt position, which a cache prefill does not keep)."""
    keras_hub = import_keras_hub()
    samplers = keras_hub.samplers
    if isinstance(sampler, str):
        try:
            resolved = samplers.get(sampler)
        except (KeyError, ValueError) as error:
            raise ValueError(
                "`sampler` must be a keras_hub.samplers.Sampler or the "
                "lowercase name of one ('greedy', 'top_k', 'top_p', 'beam', "
                f"'random'). Received: sampler={sampler!r} ({error})"
            ) from None
        sampler = resolved
    if not isinstance(sampler, samplers.Sampler):
        raise ValueError(
            "`sampler` must be a keras_hub.samplers.Sampler or the lowercase "
            "name of one ('greedy', 'top_k', 'top_p', 'beam', 'random'). "
            f"Received: sampler={sampler!r}"
        )
    if isinstance(sampler, samplers.ContrastiveSampler):
        raise ValueError(
            "generate() does not support keras_hub.samplers.ContrastiveSampler: "
            "it needs the hidden states of every prompt position, which the "
            "cache prefill does not keep. Received: sampler=ContrastiveSampler"
        )
    if isinstance(sampler, samplers.BeamSampler) and sampler.return_all_beams:
        raise ValueError(
            "generate() returns the best beam of each prompt: use "
            "BeamSampler(return_all_beams=False). Received: "
            "return_all_beams=True"
        )
    return sampler


def check_batch_size(batch_size):
    """``batch_size`` as a Python int >= 1, or a ValueError naming it."""
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, numbers.Integral)
        or batch_size < 1
    ):
        raise ValueError(
            "`batch_size` must be a positive int (the number of sequences the "
            f"caches hold). Received: batch_size={batch_size!r}"
        )
    return int(batch_size)


def check_max_length(max_length):
    """``max_length`` as a Python int >= 2, or a ValueError naming it."""
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
        raise ValueError(
            "`max_length` must be an integer (the length of the prompt plus "
            f"the generated tokens). Received: max_length={max_length!r}"
        )
    if max_length < 2:
        raise ValueError(
            "`max_length` must be at least 2 (one prompt token and one new "
            f"token). Received: max_length={max_length}"
        )
    return int(max_length)


def normalize_prompt(prompt_tokens, padding_mask, max_length, vocab_size):
    """Checks a prompt and lays it out as keras-hub's generate does.

    Returns ``(token_ids, mask, min_length)``: ``token_ids`` int32
    ``(B, max_length)`` with the prompt at the start and zeros after it,
    ``mask`` bool ``(B, max_length)``, True on prompt tokens (the sampler
    keeps them), and the shortest prompt length. Prompts of different
    lengths are right-padded, with ``padding_mask`` True on each row's
    tokens, a prefix of the row."""
    if isinstance(prompt_tokens, dict):
        unknown = sorted(set(prompt_tokens) - {"token_ids", "padding_mask"})
        if unknown or "token_ids" not in prompt_tokens:
            raise ValueError(
                "A dict prompt must have the keys 'token_ids' and optionally "
                f"'padding_mask'. Received: keys={sorted(prompt_tokens)}"
            )
        if padding_mask is not None and "padding_mask" in prompt_tokens:
            raise ValueError(
                "Pass the padding mask once: in the prompt dict or as "
                "`padding_mask`. Received: both"
            )
        padding_mask = prompt_tokens.get("padding_mask", padding_mask)
        prompt_tokens = prompt_tokens["token_ids"]
    tokens = np.asarray(ops.convert_to_numpy(prompt_tokens))
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            "`prompt_tokens` must be an integer array of shape (batch, "
            f"prompt_length). Received: shape={tokens.shape}, "
            f"dtype={tokens.dtype}"
        )
    batch, length = tokens.shape
    if batch < 1 or length < 1:
        raise ValueError(
            "`prompt_tokens` must hold at least one token per sequence. "
            f"Received: shape={tokens.shape}"
        )
    if length >= max_length:
        raise ValueError(
            "The prompt must be shorter than `max_length` (generate writes "
            f"max_length - prompt_length new tokens). Received: prompt_length="
            f"{length}, max_length={max_length}"
        )
    if padding_mask is None:
        mask = np.ones(tokens.shape, bool)
    else:
        mask = np.asarray(ops.convert_to_numpy(padding_mask))
        if mask.shape != tokens.shape:
            raise ValueError(
                "`padding_mask` must have the shape of `prompt_tokens`. "
                f"Received: padding_mask.shape={mask.shape}, "
                f"prompt_tokens.shape={tokens.shape}"
            )
        mask = mask.astype(bool)
        lengths = mask.sum(axis=1)
        prefix = np.arange(length)[None, :] < lengths[:, None]
        if not np.array_equal(mask, prefix):
            rows = np.nonzero((mask != prefix).any(axis=1))[0].tolist()
            raise ValueError(
                "`padding_mask` must mark each prompt as a prefix of its row "
                "(right padding: True on the tokens, then False); rows "
                f"{rows} are not. Received: padding_mask={mask.tolist()}"
            )
        if lengths.min() < 1:
            rows = np.nonzero(lengths < 1)[0].tolist()
            raise ValueError(
                "Every prompt needs at least one token. Received: empty "
                f"prompts in rows {rows} of padding_mask"
            )
    real = tokens[mask]
    if real.size and (real.min() < 0 or real.max() >= vocab_size):
        raise ValueError(
            f"Prompt token ids must be in [0, {vocab_size}) (vocab_size). "
            f"Received: ids from {int(real.min())} to {int(real.max())}"
        )
    token_ids = np.zeros((batch, max_length), "int32")
    token_ids[:, :length] = np.where(mask, tokens, 0)
    full_mask = np.zeros((batch, max_length), bool)
    full_mask[:, :length] = mask
    return token_ids, full_mask, int(mask.sum(axis=1).min())


def _concrete_values(x):
    """``x`` as a NumPy array when its values are known while the call is
    made (NumPy, Python lists, eager tensors), else None (traced)."""
    try:
        return np.asarray(ops.convert_to_numpy(x))
    except Exception:  # a tracer or a graph tensor
        return None


def check_token_ids(token_ids, vocab_size, name="token_ids"):
    """Checks the token ids of a decoding call (``call_with_cache``).

    Float (or bool) ids are refused with a ValueError naming ``name`` and
    the dtype, as is a shape other than ``(batch, length)``. Concrete ids
    (NumPy, lists, eager tensors) outside ``[0, vocab_size)`` are refused
    with a ValueError naming the offending id and the vocabulary size.
    Traced ids (inside ``jax.jit`` or a ``tf.function``) are checked when
    the program runs, with :func:`keras_longattn.ops.checks.refuse_when`.

    Returns:
        ``(token_ids, bad)``: the ids to embed and None when nothing is left
        to do, or, where the backend cannot stop a compiled program (XLA on
        TensorFlow), the ids clipped into the vocabulary and the traced
        boolean scalar ``bad``: the caller must then make its result
        unusable where ``bad`` holds (NaN logits, caches unchanged). On the
        run-time path the ids are clipped too, so that no raw gather error
        (or a NaN row of JAX's out-of-range gather) comes before the
        message.
    """
    if not hasattr(token_ids, "dtype") or not hasattr(token_ids, "shape"):
        token_ids = np.asarray(token_ids)
    dtype = keras.backend.standardize_dtype(token_ids.dtype)
    if "int" not in dtype:
        raise ValueError(
            f"`{name}` must be integer token ids. Received: {name} with dtype "
            f"{dtype}"
        )
    shape = tuple(token_ids.shape)
    if len(shape) != 2:
        raise ValueError(
            f"`{name}` must have shape (batch, length). Received: {name} with "
            f"shape {shape}"
        )
    message = (
        f"`{name}` must be token ids in [0, {vocab_size}) (the vocabulary size "
        f"is {vocab_size}). Received: token id {{value}}"
    )
    values = _concrete_values(token_ids)
    if values is not None:
        if values.size:
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= vocab_size:
                raise ValueError(message.format(value=low if low < 0 else high))
        return token_ids, None
    if 0 in shape:
        return token_ids, None
    from keras_longattn.ops import checks

    low, high = ops.min(token_ids), ops.max(token_ids)
    bad = ops.logical_or(ops.less(low, 0), ops.greater_equal(high, vocab_size))
    value = ops.where(ops.less(low, 0), low, high)
    _, flag = checks.refuse_when(bad, value, message)
    return ops.clip(token_ids, 0, vocab_size - 1), flag


def check_positions(cache_update_index, length, table_size, what):
    """Refuses a decoding call whose positions ``cache_update_index ..
    cache_update_index + length - 1`` run past a learned position table of
    ``table_size`` rows (``what`` names it in the message).

    A concrete index is checked now (ValueError); a traced one when the
    program runs (:func:`keras_longattn.ops.checks.refuse_when`).

    Returns:
        ``(cache_update_index, bad)``: the index to decode at and None, or,
        for a traced index, the index clipped into the table (so that no
        slice of the table or cache fails before the message, and XLA gets
        a slice it can compile) with the traced flag where the backend
        cannot stop the program (XLA on TensorFlow; None elsewhere).
    """
    message = (
        f"The positions of `token_ids` must lie in the learned position table "
        f"({table_size} rows, {what}): cache_update_index + length must be at "
        f"most {table_size}. Received: cache_update_index + length = {{value}}"
    )
    index = _concrete_values(cache_update_index)
    if index is not None:
        if index.ndim == 0 and np.issubdtype(index.dtype, np.integer):
            if int(index) + length > table_size:
                raise ValueError(message.format(value=int(index) + length))
        return cache_update_index, None  # other values: the layers refuse them
    if length > table_size:
        raise ValueError(message.format(value=f"at least {length}"))
    from keras_longattn.ops import checks

    end = ops.add(ops.cast(cache_update_index, "int32"), length)
    end, bad = checks.refuse_when(ops.greater(end, table_size), end, message)
    return ops.clip(ops.subtract(end, length), 0, table_size - length), bad


def refuse_result(bad, logits, hidden_states, new_cache, old_cache):
    """The result of a decoding call made unusable where the traced boolean
    scalar ``bad`` holds (a refused call under XLA on TensorFlow, see
    :func:`check_token_ids`): NaN logits and hidden states, and the caches
    as they were before the call. ``bad`` None: unchanged."""
    if bad is None:
        return logits, hidden_states, new_cache
    logits = ops.where(bad, ops.cast(float("nan"), logits.dtype), logits)
    hidden_states = ops.where(
        bad, ops.cast(float("nan"), hidden_states.dtype), hidden_states
    )
    new_cache = keras.tree.map_structure(
        lambda old, new: ops.where(bad, ops.cast(old, new.dtype), new),
        old_cache,
        new_cache,
    )
    return logits, hidden_states, new_cache


def any_flag(*flags):
    """The OR of the traced flags that are not None (None if all are)."""
    flags = [f for f in flags if f is not None]
    if not flags:
        return None
    result = flags[0]
    for flag in flags[1:]:
        result = ops.logical_or(result, flag)
    return result


def check_stop_token_ids(stop_token_ids, vocab_size):
    """``stop_token_ids`` as a tuple of ints in the vocabulary, or None."""
    if stop_token_ids is None:
        return None
    if isinstance(stop_token_ids, numbers.Integral) and not isinstance(
        stop_token_ids, bool
    ):
        stop_token_ids = (stop_token_ids,)
    try:
        ids = tuple(stop_token_ids)
    except TypeError:
        ids = None
    if (
        not ids
        or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids)
        or any(not 0 <= i < vocab_size for i in ids)
    ):
        raise ValueError(
            "`stop_token_ids` must be None or a non-empty list of token ids in "
            f"[0, {vocab_size}). Received: stop_token_ids={stop_token_ids!r}"
        )
    return tuple(int(i) for i in ids)


def generate_step(model, sampler, token_ids, mask, stop_token_ids, prefill_length):
    """The compilable generation of one batch.

    ``token_ids`` int32 ``(B, max_length)`` and ``mask`` bool (True on
    prompt tokens), as :func:`normalize_prompt` lays them out. The first
    ``prefill_length`` tokens (every prompt's tokens but the last of the
    shortest) fill the caches in one call; then each step feeds the token
    at ``index - 1`` and the sampler writes position ``index`` (keeping
    prompt tokens where ``mask`` is True). Returns ``(token_ids, mask)``
    with ``mask`` True on the prompt and the generated tokens up to and
    including the first stop token of each row.

    The steps call ``model._decode``, ``call_with_cache`` without its checks
    of the ids and positions: the prompt was checked by
    :func:`normalize_prompt`, ``max_length`` against the position table,
    and the sampler writes ids of the vocabulary."""
    batch_size, max_length = token_ids.shape[0], token_ids.shape[1]
    caches = model.init_caches(batch_size, max_length)
    if prefill_length > 0:
        _, _, caches = model._decode(token_ids[:, :prefill_length], caches, 0)

    def next(prompt, cache, index):
        cache_update_index = index - 1
        rows = ops.shape(prompt)[0]
        step = ops.slice(prompt, [0, cache_update_index], [rows, 1])
        logits, hidden_states, cache = model._decode(step, cache, cache_update_index)
        return ops.squeeze(logits, axis=1), ops.squeeze(hidden_states, axis=1), cache

    token_ids = sampler(
        next=next,
        prompt=token_ids,
        cache=caches,
        index=prefill_length + 1,
        mask=mask,
        stop_token_ids=stop_token_ids,
        hidden_states=None,
        model=model,
    )
    if stop_token_ids is None:
        return token_ids, ops.ones_like(token_ids, dtype="bool")
    generated = ops.logical_not(mask)
    stops = ops.zeros_like(generated)
    for stop in stop_token_ids:
        stops = ops.logical_or(stops, ops.equal(token_ids, stop))
    stops = ops.cast(ops.logical_and(stops, generated), "int32")
    after = ops.cumsum(stops, axis=-1) - stops  # > 0 after the first stop
    return token_ids, ops.equal(after, 0)


def use_xla(model):
    """Whether TensorFlow generation compiles with XLA: the model's
    ``jit_compile`` once ``compile()`` has set it, else True (Keras would
    resolve ``"auto"`` to False on a CPU-only machine; generation's
    fixed-shape loop compiles there too)."""
    chosen = getattr(model, "_jit_compile", None)
    return True if chosen is None else bool(chosen)


def make_generate_function(model, sampler):
    """``fn(token_ids, mask, stop_token_ids, prefill_length)`` ->
    ``(token_ids, mask)``: :func:`generate_step` compiled for the backend
    as keras-hub's ``CausalLM.make_generate_function`` does (``jax.jit``
    with the variables passed as state and the sampler's seed state
    written back; ``tf.function``, with XLA unless the model was compiled
    with ``jit_compile=False`` (:func:`use_xla`); torch eager under
    ``no_grad``). ``model.run_eagerly`` runs it eagerly."""
    step = partial(generate_step, model, sampler)
    backend = keras.config.backend()
    if backend == "torch":
        import torch

        def torch_function(token_ids, mask, stop_token_ids, prefill_length):
            with torch.no_grad():
                return step(
                    ops.convert_to_tensor(token_ids),
                    ops.convert_to_tensor(mask),
                    stop_token_ids,
                    prefill_length,
                )

        return torch_function
    if model.run_eagerly or backend not in ("jax", "tensorflow"):
        return lambda t, m, s, p: step(
            ops.convert_to_tensor(t), ops.convert_to_tensor(m), s, p
        )
    if backend == "tensorflow":
        import tensorflow as tf

        tf_compiled = tf.function(step, jit_compile=use_xla(model))

        def tf_function(token_ids, mask, stop_token_ids, prefill_length):
            return tf_compiled(
                tf.convert_to_tensor(token_ids),
                tf.convert_to_tensor(mask),
                stop_token_ids,
                prefill_length,
            )

        return tf_function

    import jax

    @partial(jax.jit, static_argnames=["stop_token_ids", "prefill_length"])
    def compiled(token_ids, mask, state, stop_token_ids, prefill_length):
        sampler_values, trainable_values, non_trainable_values = state
        mapping = itertools.chain(
            zip(sampler.variables, sampler_values),
            zip(model.trainable_variables, trainable_values),
            zip(model.non_trainable_variables, non_trainable_values),
        )
        with keras.StatelessScope(state_mapping=mapping) as scope:
            outputs = step(token_ids, mask, stop_token_ids, prefill_length)
        new_sampler_values = []
        for variable, old in zip(sampler.variables, sampler_values):
            value = scope.get_current_value(variable)
            new_sampler_values.append(old if value is None else value)
        return outputs, new_sampler_values

    def jax_function(token_ids, mask, stop_token_ids, prefill_length):
        state = (
            [v.value for v in sampler.variables],
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
        )
        outputs, sampler_values = compiled(
            ops.convert_to_tensor(token_ids),
            ops.convert_to_tensor(mask),
            state,
            stop_token_ids=stop_token_ids,
            prefill_length=prefill_length,
        )
        # Only the sampler's seed state changes during generation.
        for variable, value in zip(sampler.variables, sampler_values):
            variable.assign(value)
        return outputs

    return jax_function
