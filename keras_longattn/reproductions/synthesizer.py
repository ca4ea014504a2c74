"""Synthesizer reproduction: probes of the synthetic attention weights on
the layer itself, the content-based recall task and the notebook's claims.

* :func:`probe_layer`: what the attention weights and outputs of one
  :class:`~keras_longattn.layers.SynthesizerAttention` depend on, measured
  by calling the layer on random inputs and on copies with one position
  perturbed: on the input at all, on tokens other than the query's own,
  on later tokens (causal leak), and the same leak without the causal mask
  (the control that shows the probe can see a leak).
* :func:`training_change`: how far each weight of a layer moves in a few
  optimizer steps (the fixed random table must not move, the learned one
  and the mixture weights must).
* :func:`make_pair_recall` and :func:`build_pair_recall_model`:
  content-based recall where every stored key-value pair is one position,
  at a random place, so that finding it needs a query-key comparison.
* :func:`parameter_counts`: trainable parameters of a model, and those of
  its attention projections that its kinds never read.
* :func:`probe_kinds`, :func:`training_changes`, :func:`run_recall` and
  :func:`run_lm`: the notebook's measurements and training loops (the
  notebook calls them; ``classes`` builds an arm with another layer class).
* :func:`synthesizer_claims`: the notebook's claims from its results.
* :data:`PLANTED`: broken variants of the layer trained through the same
  functions at a small size, each failing the claims it targets
  (``tests/notebooks/test_planted_real.py``).

The kinds are the strings of ``SynthesizerAttention(kind=...)``;
``"vanilla"`` is dot-product attention (the paper's Transformer).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping

import keras
import numpy as np
from keras import ops

from keras_longattn.layers import SynthesizerAttention
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import planted

__all__ = [
    "KINDS",
    "MIXTURES",
    "PAPER",
    "PLANTED",
    "PURE_SYNTHETIC",
    "Runs",
    "build_pair_recall_model",
    "compile_model",
    "frequency_guess_accuracy",
    "freeze_unread_projections",
    "lm_ranks",
    "make_pair_recall",
    "mixture_of",
    "parameter_counts",
    "probe_kinds",
    "probe_layer",
    "recall_test_set",
    "run_lm",
    "run_recall",
    "synthesizer_claims",
    "training_change",
    "training_changes",
]

#: The single synthetic kinds (no dot product anywhere).
PURE_SYNTHETIC = ("dense", "random", "fixed_random", "factorized_dense", "factorized_random")
#: The mixtures of the paper's Table 2 (the layer's names).
MIXTURES = ("dense+random", "dense+vanilla", "random+vanilla")
#: Every kind the notebook measures: vanilla, the synthetic kinds, the mixtures.
KINDS = ("vanilla",) + PURE_SYNTHETIC + MIXTURES
#: Kinds whose weights do not read the input at all.
INPUT_FREE = ("random", "fixed_random", "factorized_random")
#: Kinds whose row of weights for a query reads that query's token only.
OWN_TOKEN = ("dense", "factorized_dense", "dense+random")

#: The paper's Table 2 (LM1B perplexity and parameters of the LM models) and
#: Tables 4 and 5 (GLUE and SuperGLUE averages, T5-small setting), by kind
#: ("vanilla" is their Transformer run).
PAPER = {
    "lm1b_ppl": {
        "vanilla": 38.21, "dense": 40.88, "random": 40.60, "fixed_random": 50.52,
        "factorized_dense": 41.20, "factorized_random": 42.40, "dense+random": 42.35,
        "dense+vanilla": 37.27, "random+vanilla": 40.05,
    },
    "lm1b_params": {
        "vanilla": "70M", "dense": "53M", "random": "58M", "fixed_random": "53M",
        "factorized_dense": "53M", "factorized_random": "53M", "dense+random": "58M",
        "dense+vanilla": "70M", "random+vanilla": "70M",
    },
    "glue": {"vanilla": 83.5, "random": 75.1, "dense": 72.0, "dense+vanilla": 82.6,
             "random+vanilla": 84.1},
    "superglue": {"vanilla": 70.3, "random": 61.1, "dense": 58.5, "dense+vanilla": 69.7,
                  "random+vanilla": 72.2},
}


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype="float64")


def probe_layer(layer, length, dim, *, seed=0, samples=4):
    """What the weights and outputs of an attention layer depend on.

    The layer is called (eagerly, on its own call path) on a batch of
    ``1 + length + samples`` sequences of ``length`` random vectors of size
    ``dim``: a base sequence, ``length`` copies of it with position ``j``
    perturbed, and ``samples`` unrelated sequences; once causal without
    weights (the path a model trains with), once causal and once
    bidirectional with ``return_attention_scores=True``.

    Returns:
        A dict of floats:

        * ``input_dependence``: the largest change of any weight between
          the base and the unrelated sequences (both calls with weights);
        * ``other_token``: the largest change of the weights of query ``t``
          when a position ``j != t`` is perturbed (bidirectional);
        * ``own_token``: the largest change of the weights of query ``j``
          when its own position ``j`` is perturbed (bidirectional);
        * ``future_leak``: the largest change of the causal output at a
          position ``t < j`` when ``j`` is perturbed, relative to the
          largest change of any output;
        * ``future_leak_unmasked``: the same, bidirectional (the control:
          positive for every layer that mixes positions).
    """
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(length, dim)).astype("float32")
    bump = rng.normal(size=(length, dim)).astype("float32")
    batch = np.repeat(base[None], length + 1, axis=0)
    for j in range(length):
        batch[j + 1, j] += bump[j]
    others = rng.normal(size=(samples, length, dim)).astype("float32")
    x = np.concatenate([batch, others], axis=0)

    out_causal = _numpy(layer(x, x, use_causal_mask=True))
    _, w_causal = layer(x, x, use_causal_mask=True, return_attention_scores=True)
    out_bi, w_bi = layer(x, x, use_causal_mask=False, return_attention_scores=True)
    # One row of weights per example (a no-op since the layer returns
    # (B, H, T, S) for every kind; kept for older layer versions).
    w_causal, w_bi = (np.broadcast_to(_numpy(w), (len(x),) + tuple(w.shape[1:]))
                      for w in (w_causal, w_bi))
    out_bi = _numpy(out_bi)

    n = length
    input_dependence = max(
        float(np.max(np.abs(w[n + 1:] - w[:1]))) for w in (w_causal, w_bi)
    )
    # Weights of the perturbed copies against the base: (j, H, t, s).
    change = np.max(np.abs(w_bi[1:n + 1] - w_bi[:1]), axis=(1, 3))  # (j, t)
    own = np.eye(n, dtype=bool)
    other_token = float(np.max(change[~own]))
    own_token = float(np.max(change[own]))

    def leak(out):
        delta = np.max(np.abs(out[1:n + 1] - out[:1]), axis=-1)  # (j, t)
        scale = max(float(np.max(delta)), 1e-30)
        before = np.tril(np.ones((n, n), dtype=bool), k=-1)  # t < j
        return float(np.max(delta[before]) / scale)

    return {
        "input_dependence": input_dependence,
        "other_token": other_token,
        "own_token": own_token,
        "future_leak": leak(out_causal),
        "future_leak_unmasked": leak(out_bi),
    }


def training_change(layer, length, dim, *, steps=3, seed=0, learning_rate=0.05, batch=4):
    """How far each weight of ``layer`` moves in ``steps`` Adam steps.

    ``layer`` (unbuilt) is the only layer of a model trained (eagerly: no
    compilation) to map random sequences to random targets, causal.

    Returns:
        ``{weight path inside the layer: largest absolute change}``, e.g.
        ``"synthesizer/random_logits"`` or ``"query/kernel"``, and
        ``"attention_weights"``: the largest change of the layer's causal
        attention weights on the first training sequence.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, dim)).astype("float32")
    y = rng.normal(size=(batch, length, dim)).astype("float32")
    inputs = keras.Input((length, dim))
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    freeze_unread_projections(layer)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse",
                  run_eagerly=True)

    def snapshot():
        out = {w.path.split("/", 1)[-1]: _numpy(w) for w in layer.weights}
        _, weights = layer(x[:1], x[:1], use_causal_mask=True, return_attention_scores=True)
        out["attention_weights"] = _numpy(weights)
        return out

    before = snapshot()
    model.fit(x, y, batch_size=batch, epochs=steps, verbose=0, shuffle=False)
    after = snapshot()
    return {name: float(np.max(np.abs(after[name] - before[name]))) for name in before}


def make_pair_recall(num, pairs, num_keys, num_values, rng):
    """Content-based recall where each stored key-value pair is one position.

    A sequence holds ``pairs`` positions with distinct keys (drawn from
    ``num_keys``) and random values (of ``num_values``), in random order,
    then a query position that names one of the stored keys with the value
    ``num_values`` ("unknown"). The label is the value stored with the
    query's key. The position that holds it is random, so a layer whose
    weights do not compare the query with the stored positions (a synthetic
    one) cannot point at it: it can only average the stored pairs and guess
    (chance ``1 / num_values``).

    Returns:
        ``((keys, values), labels)``: ``keys`` and ``values`` int32 of
        ``(num, pairs + 1)``, ``labels`` int32 of ``(num,)``.
    """
    if not 1 <= pairs <= num_keys:
        raise ValueError(
            f"`pairs` must be in [1, num_keys={num_keys}]. Received: pairs={pairs}")
    keys = np.argsort(rng.random((num, num_keys)), axis=1)[:, :pairs]
    values = rng.integers(0, num_values, size=(num, pairs))
    asked = rng.integers(0, pairs, size=num)
    rows = np.arange(num)
    query = keys[rows, asked]
    k = np.concatenate([keys, query[:, None]], axis=1).astype("int32")
    v = np.concatenate([values, np.full((num, 1), num_values)], axis=1).astype("int32")
    return (k, v), values[rows, asked].astype("int32")


def frequency_guess_accuracy(values, labels, num_values):
    """Expected accuracy of the best guess that does not find the pair:
    the value stored most often in the sequence (ties split evenly).
    ``values``: the stored values ``(num, pairs)``; ``labels`` ``(num,)``."""
    values = np.asarray(values)
    counts = np.stack([np.sum(values == v, axis=1) for v in range(num_values)], axis=1)
    best = counts == counts.max(axis=1, keepdims=True)
    hit = best[np.arange(len(labels)), np.asarray(labels)]
    return float(np.mean(hit / best.sum(axis=1)))


def build_pair_recall_model(attention, num_keys, num_values, length, dim):
    """One pre-norm Transformer block over ``key + value`` embeddings, read
    at the last (query) position: logits over the ``num_values`` values.

    ``attention`` is a layer instance (called causal)."""
    keys = keras.Input((length,), dtype="int32", name="keys")
    values = keras.Input((length,), dtype="int32", name="values")
    x = (keras.layers.Embedding(num_keys, dim, name="key_embedding")(keys)
         + keras.layers.Embedding(num_values + 1, dim, name="value_embedding")(values))
    h = keras.layers.LayerNormalization(name="attention_norm")(x)
    x = x + attention(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="mlp_norm")(x)
    h = keras.layers.Dense(4 * dim, activation="gelu", name="mlp_in")(h)
    x = x + keras.layers.Dense(dim, name="mlp_out")(h)
    x = keras.layers.LayerNormalization(name="final_norm")(x[:, -1])
    logits = keras.layers.Dense(num_values, name="logits")(x)
    return keras.Model([keys, values], logits, name="pair_recall")


def _reads(kind):
    """Which projections the components of ``kind`` read: (query, key)."""
    parts = kind.split("+")
    query = any(p in ("vanilla", "dense", "factorized_dense") for p in parts)
    key = "vanilla" in parts
    return query, key


def _unread_projections(layer):
    query, key = _reads(layer.kind)
    return [dense for used, dense in ((query, layer._query_dense), (key, layer._key_dense))
            if not used]


def freeze_unread_projections(model_or_layer):
    """Makes the query and key projections that a SynthesizerAttention's
    kind never reads non-trainable (they would get no gradient: the paper's
    Synthesizers have no such projections). Call it on a built model or
    layer, before compiling. Returns the number of parameters frozen."""
    layers = [model_or_layer] + _all_layers(model_or_layer)
    frozen = 0
    for layer in layers:
        if isinstance(layer, SynthesizerAttention):
            for dense in _unread_projections(layer):
                dense.trainable = False
                frozen += int(sum(np.prod(w.shape) for w in dense.weights))
    return frozen


def parameter_counts(model):
    """``(trainable, unread)``: the model's trainable parameters, and the
    parameters of its SynthesizerAttention layers' query and key
    projections that their kinds never read (frozen by
    :func:`freeze_unread_projections`, or trainable without a gradient)."""
    trainable = int(sum(np.prod(w.shape) for w in model.trainable_weights))
    unread = 0
    for layer in _all_layers(model):
        if isinstance(layer, SynthesizerAttention):
            for dense in _unread_projections(layer):
                unread += int(sum(np.prod(w.shape) for w in dense.weights))
    return trainable, unread


def _all_layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


# ------------------------------------------------- the notebook's training


def _attention(kind, num_heads, dim, max_length, classes=None):
    """One attention layer of ``kind`` (``num_heads`` heads of ``dim //
    num_heads``), of the class ``classes[kind]`` (default
    :class:`~keras_longattn.layers.SynthesizerAttention`)."""
    cls = (classes or {}).get(kind, SynthesizerAttention)
    return cls(num_heads=num_heads, key_dim=dim // num_heads, kind=kind,
               max_length=max_length)


def probe_kinds(kinds, *, num_heads, length, dim, classes=None):
    """:func:`probe_layer` of one layer of each kind, built under seed 0
    with ``max_length = length``.

    Args:
        kinds: the kinds to probe.
        num_heads, length, dim: heads, positions and width of the probe.
        classes: ``{kind: layer class}`` for kinds built by another
            SynthesizerAttention class (default: the layer itself).

    Returns:
        ``{kind: probe_layer(...) dict}``.
    """
    out = {}
    for kind in kinds:
        keras.utils.set_random_seed(0)
        layer = _attention(kind, num_heads, dim, length, classes)
        out[kind] = probe_layer(layer, length, dim)
    return out


def training_changes(kinds, *, num_heads, length, dim, steps, classes=None):
    """:func:`training_change` of one layer of each kind (built under seed
    0, ``steps`` Adam steps); ``classes`` as in :func:`probe_kinds`.

    Returns:
        ``{kind: training_change(...) dict}``.
    """
    out = {}
    for kind in kinds:
        keras.utils.set_random_seed(0)
        layer = _attention(kind, num_heads, dim, length, classes)
        out[kind] = training_change(layer, length, dim, steps=steps)
    return out


def compile_model(model, steps, learning_rate):
    """Compiles ``model`` with Adam (global norm clipped to 1) under a
    cosine decay from ``learning_rate`` over ``steps`` (to a tenth), and
    sparse categorical cross-entropy on logits. Returns the model."""
    schedule = keras.optimizers.schedules.CosineDecay(
        learning_rate, decay_steps=steps, alpha=0.1)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Runs:
    """One compiled model per kind, restarted for every seed.

    ``start(kind, seed)`` builds a fresh model of ``kind`` under ``seed``
    (``build(kind)``); the first time for a kind it compiles and keeps it,
    later it copies the fresh model's weights into the kept one and zeroes
    its optimizer's variables, so that the train step compiles once per
    kind, not once per seed. ``models[kind]`` is the kept model.
    """

    def __init__(self, build, steps, learning_rate):
        self.build, self.steps, self.models = build, steps, {}
        self.learning_rate = learning_rate

    def start(self, kind, seed):
        keras.utils.set_random_seed(seed)
        fresh = self.build(kind)
        if kind not in self.models:
            self.models[kind] = compile_model(fresh, self.steps, self.learning_rate)
            return self.models[kind]
        model = self.models[kind]
        model.set_weights(fresh.get_weights())
        for variable in model.optimizer.variables:
            variable.assign(keras.ops.zeros(variable.shape, variable.dtype))
        return model


def synthesizer_layers(model):
    """The SynthesizerAttention layers of ``model`` (subclasses included)."""
    return [layer for layer in _all_layers(model) if isinstance(layer, SynthesizerAttention)]


def mixture_of(model):
    """The mean mixture weights over the model's SynthesizerAttention
    layers, as a list (``None`` for a kind of one component)."""
    layers = synthesizer_layers(model)
    if len(layers[0].components) == 1:
        return None
    weights = [_numpy(layer.mixture_weights()) for layer in layers]
    return np.mean(weights, axis=0).tolist()


def recall_test_set(num, pairs, num_keys, num_values, seed=12345):
    """The fixed test sequences of the recall task (:func:`make_pair_recall`
    with the generator of ``seed``)."""
    return make_pair_recall(num, pairs, num_keys, num_values, np.random.default_rng(seed))


def run_recall(kinds, *, seeds, num_heads, pairs, num_keys, num_values, dim, batch_size,
               learning_rate, steps, test_sequences, classes=None, verbose=True):
    """Trains the recall model (:func:`build_pair_recall_model`) of every
    kind over seeds and scores it on the fixed test set.

    Seed ``s`` starts from the model built under ``s`` and trains on
    ``steps`` batches of fresh sequences from the generator of ``s`` (the
    same for every kind); the unread projections are frozen
    (:func:`freeze_unread_projections`). ``classes`` as in
    :func:`probe_kinds`.

    Returns:
        A dict: ``accuracy`` (kind -> accuracy per seed), ``mixture`` (kind
        -> mixture weights per seed, ``None`` for one component),
        ``params`` (kind -> :func:`parameter_counts`), ``chance`` (``1 /
        num_values``), ``frequency_guess`` (:func:`frequency_guess_accuracy`
        on the test set) and ``seconds``.
    """
    (x_keys, x_values), y_test = recall_test_set(test_sequences, pairs, num_keys,
                                                 num_values)
    length = pairs + 1

    def build(kind):
        model = build_pair_recall_model(_attention(kind, num_heads, dim, length, classes),
                                        num_keys, num_values, length, dim)
        freeze_unread_projections(model)
        return model

    accuracy = {k: [] for k in kinds}
    mixture = {k: [] for k in kinds}
    params = {}
    runs = Runs(build, steps, learning_rate)
    started = time.perf_counter()
    for kind in kinds:
        for seed in range(seeds):
            model = runs.start(kind, seed)
            x_train, y_train = make_pair_recall(batch_size * steps, pairs, num_keys,
                                                num_values, np.random.default_rng(seed))
            model.fit(x_train, y_train, batch_size=batch_size, epochs=1, shuffle=False,
                      verbose=0)
            logits = model.predict([x_keys, x_values], batch_size=256, verbose=0)
            accuracy[kind].append(float(np.mean(np.argmax(logits, -1) == y_test)))
            mixture[kind].append(mixture_of(model))
            if verbose:
                print(f"seed {seed} {kind:>18}: accuracy {accuracy[kind][-1]:.3f}"
                      + (f", mixture {np.round(mixture[kind][-1], 2).tolist()}"
                         if mixture[kind][-1] else ""))
        params[kind] = parameter_counts(runs.models[kind])
    return {
        "accuracy": accuracy, "mixture": mixture, "params": params,
        "chance": 1.0 / num_values,
        "frequency_guess": frequency_guess_accuracy(x_values[:, :-1], y_test, num_values),
        "seconds": time.perf_counter() - started,
    }


def run_lm(kinds, *, seeds, num_heads, length, dim, layers, batch_size, learning_rate,
           steps, valid_windows, classes=None, verbose=True):
    """Trains the byte-level causal LM of every kind over seeds on the
    Wikipedia sample (``load_wiki_sample``) and scores it in bits per byte
    on ``valid_windows`` contiguous held-out windows.

    Seed ``s`` starts from the model built under ``s`` (``layers`` blocks,
    width ``dim``, ``max_length = length``) and trains on ``steps`` random
    windows of the generator of ``s`` (the same for every kind); the unread
    projections are frozen. ``classes`` as in :func:`probe_kinds`.

    Returns:
        A dict: ``bits`` (kind -> bits per byte per seed), ``mixture``,
        ``params`` (as in :func:`run_recall`), ``unigram_bits`` (a unigram
        model of the training bytes on the same windows) and ``seconds``.
    """
    from keras_longattn.datasets import LMWindowDataset, lm_windows, load_wiki_sample
    from keras_longattn.models import bits_per_dim, build_causal_language_model

    train_bytes, valid_bytes, _ = load_wiki_sample()
    x_valid, y_valid = lm_windows(valid_bytes, length, num_windows=valid_windows,
                                  mode="contiguous", dtype="int32")
    byte_counts = np.bincount(train_bytes, minlength=256) + 1.0
    unigram_bits = float(-np.mean(np.log2((byte_counts / byte_counts.sum())[y_valid])))

    def build(kind):
        model = build_causal_language_model(
            vocab_size=256, sequence_length=length, dim=dim, num_layers=layers,
            num_heads=num_heads, attention=_attention(kind, num_heads, dim, length, classes))
        freeze_unread_projections(model)
        return model

    bits = {k: [] for k in kinds}
    mixture = {k: [] for k in kinds}
    params = {}
    runs = Runs(build, steps, learning_rate)
    started = time.perf_counter()
    for kind in kinds:
        for seed in range(seeds):
            model = runs.start(kind, seed)
            model.fit(LMWindowDataset(train_bytes, length, batch_size=batch_size,
                                      num_batches=steps, seed=seed), epochs=1, verbose=0)
            bits[kind].append(float(bits_per_dim(model.evaluate(
                x_valid, y_valid, batch_size=batch_size, verbose=0))))
            mixture[kind].append(mixture_of(model))
            if verbose:
                print(f"seed {seed} {kind:>18}: {bits[kind][-1]:.3f} bits/byte"
                      + (f", mixture {np.round(mixture[kind][-1], 2).tolist()}"
                         if mixture[kind][-1] else ""))
        params[kind] = parameter_counts(runs.models[kind])
    return {"bits": bits, "mixture": mixture, "params": params,
            "unigram_bits": unigram_bits, "seconds": time.perf_counter() - started}


def lm_ranks(bits, margin):
    """The places of each kind in the LM ordering, as far as the seeds
    separate them (lower bits per byte first).

    Kind ``a`` is placed ahead of kind ``b`` only when its mean is lower
    by at least ``margin`` and by more than the spread of either; kinds
    that are not separated share a range of places.

    Args:
        bits: ``{kind: bits per byte per seed}``.
        margin: the least difference of means that orders two kinds.

    Returns:
        ``{kind: "r"}`` for a place that the seeds fix, ``{kind: "r1–r2"}``
        for the range of places the kind can take.
    """
    stats = {k: cl.seed_stats(v) for k, v in bits.items()}

    def ahead(a, b):
        diff = stats[b].mean - stats[a].mean
        return diff >= margin and diff > max(stats[a].spread, stats[b].spread)

    n = len(stats)
    out = {}
    for k in stats:
        low = 1 + sum(ahead(j, k) for j in stats if j != k)
        high = n - sum(ahead(k, j) for j in stats if j != k)
        out[k] = str(low) if low == high else f"{low}–{high}"
    return out


def _fmt(x):
    return f"{x:.1e}"


def _mechanism_claims(probes, changes, margins):
    tol, detect = margins["zero_tolerance"], margins["detect"]
    out = []
    vanilla = probes.get("vanilla")

    free = [k for k in INPUT_FREE if k in probes]
    if free:
        worst = max(probes[k]["input_dependence"] for k in free)
        control = vanilla["input_dependence"] if vanilla else 0.0
        ok = worst <= tol and control >= detect
        out.append(cl.Claim(
            "input_free_weights",
            f"{', '.join(free)}: the attention weights are the same for every input "
            "(largest change between unrelated inputs; vanilla is the control)",
            "not conditioned on any input token (Section 3.2)",
            "; ".join(f"{k} {_fmt(probes[k]['input_dependence'])}" for k in free)
            + f"; vanilla control {_fmt(control)}",
            cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
            f"needs <= {tol} (control >= {detect})"))

    own = [k for k in OWN_TOKEN if k in probes]
    if own:
        worst = max(probes[k]["other_token"] for k in own)
        sees_own = min(probes[k]["own_token"] for k in own)
        control = vanilla["other_token"] if vanilla else 0.0
        ok = worst <= tol and sees_own >= detect and control >= detect
        out.append(cl.Claim(
            "dense_reads_own_token",
            f"{', '.join(own)}: a query's row of weights changes with its own token "
            "only (perturbing any other token leaves it; vanilla is the control)",
            "B_i = F(X_i): each row from its own token (Section 3.1)",
            "; ".join(f"{k} other {_fmt(probes[k]['other_token'])}, own "
                      f"{_fmt(probes[k]['own_token'])}" for k in own)
            + f"; vanilla other {_fmt(control)}",
            cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
            f"other tokens <= {tol}, own token and control >= {detect}"))

    kinds = list(probes)
    if kinds:
        leak = max(probes[k]["future_leak"] for k in kinds)
        control = min(probes[k]["future_leak_unmasked"] for k in kinds)
        ok = leak <= tol and control >= detect
        out.append(cl.Claim(
            "causal_no_leak",
            f"causal: no output reads a later token, for every kind ({len(kinds)}); "
            "the same probe without the causal mask sees a leak",
            "causal masking applies to the synthetic logits (LM1B is autoregressive)",
            f"largest leak {_fmt(leak)} (worst kind "
            f"{max(kinds, key=lambda k: probes[k]['future_leak'])}); without the mask "
            f"at least {_fmt(control)}",
            cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
            f"leak <= {tol} relative, control >= {detect}"))

    if "fixed_random" in changes and "random" in changes:
        fixed = changes["fixed_random"].get("attention_weights", np.inf)
        learned = changes["random"].get("attention_weights", 0.0)
        ok = fixed <= tol and learned >= detect
        out.append(cl.Claim(
            "fixed_random_not_trained",
            "training changes the attention weights of 'random' but not those of "
            "'fixed_random'",
            "Fixed Random: R kept fixed; Random: R trained (Section 3.2)",
            f"fixed {_fmt(fixed)}, random {_fmt(learned)} (largest change of a weight in "
            f"{margins.get('train_steps', '?')} steps)",
            cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
            f"fixed <= {tol}, learned >= {detect}"))

    mixtures = [k for k in changes if "+" in k]
    if mixtures:
        moved = {k: changes[k].get("synthesizer/mixture_logits", 0.0) for k in mixtures}
        ok = min(moved.values()) >= detect
        out.append(cl.Claim(
            "mixture_learned",
            f"{', '.join(mixtures)}: training moves the mixture weights",
            "learned mixture coefficients alpha (Section 3.3)",
            "; ".join(f"{k} {_fmt(v)}" for k, v in moved.items()),
            cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True, f"needs >= {detect}"))
    return out


def _recall_claims(acc, chance, margins):
    out = []
    if "vanilla" not in acc:
        return out
    out.append(cl.at_least(
        "recall_vanilla_solves",
        f"task check: vanilla (dot-product) attention solves the recall "
        f"(accuracy >= {margins['min_vanilla_accuracy']})",
        acc["vanilla"], margins["min_vanilla_accuracy"],
        paper="content-based attention retrieves by content"))
    pure = [k for k in acc if "vanilla" not in k]
    if pure:
        ceiling = chance + margins["max_synthetic_excess"]
        means = {k: cl.seed_stats(acc[k]).mean for k in pure}
        ok = max(means.values()) <= ceiling
        out.append(cl.Claim(
            "recall_synthetic_near_chance",
            f"kinds without the dot product ({', '.join(pure)}) stay near chance "
            f"({chance:.3f}; at most {ceiling:.3f})",
            "GLUE: Random 75.1, Dense 72.0 vs Transformer 83.5 (Table 4)",
            "; ".join(f"{k} {cl.format_stats(cl.seed_stats(acc[k]))}" for k in pure),
            cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
            f"largest mean {max(means.values()):.4f}, ceiling {ceiling:.4f}"))
        for k in pure:
            out.append(cl.compare_means(
                f"recall_vanilla_beats_{k}",
                f"recall: vanilla beats {k} by {margins['recall_margin']} accuracy",
                acc["vanilla"], acc[k], margins["recall_margin"],
                paper="Transformer 83.5 vs Random 75.1, Dense 72.0 (GLUE)",
                labels=("vanilla", k)))
    for k in acc:
        if "+" in k and "vanilla" in k:
            out.append(cl.no_worse_than(
                f"recall_{k}_as_vanilla",
                f"recall: {k} is as good as vanilla (not worse by "
                f"{margins['recall_margin']})",
                acc[k], acc["vanilla"], margins["recall_margin"],
                asserted=margins.get("assert_recall_mixtures", True),
                paper=f"GLUE {PAPER['glue'].get(k, '—')} vs 83.5",
                labels=(k, "vanilla")))
    return out


def _lm_claims(bits, margins):
    out = []
    m = margins["lm_margin"]
    ppl = PAPER["lm1b_ppl"]
    if "vanilla" not in bits:
        return out
    for k in ("dense+vanilla", "random+vanilla"):
        if k in bits:
            out.append(cl.no_worse_than(
                f"lm_{k}_vs_vanilla",
                f"text: {k} is as good as vanilla (not worse by {m} bits/byte)",
                bits[k], bits["vanilla"], m, higher_is_better=False, asserted=False,
                paper=f"{ppl[k]} vs {ppl['vanilla']} ppl (LM1B)", labels=(k, "vanilla")))
    for k in ("dense", "random"):
        if k in bits:
            out.append(cl.compare_means(
                f"lm_vanilla_beats_{k}", f"text: vanilla is ahead of {k}",
                bits["vanilla"], bits[k], m, higher_is_better=False, asserted=False,
                paper=f"{ppl['vanilla']} vs {ppl[k]} ppl", labels=("vanilla", k)))
    if "fixed_random" in bits and len(bits) > 2:
        others = [k for k in bits if k != "fixed_random"]
        runner = max(others, key=lambda k: cl.seed_stats(bits[k]).mean)
        out.append(cl.compare_means(
            "lm_fixed_random_worst",
            f"text: fixed_random is the worst kind (behind {runner}, the worst of the "
            "other kinds)",
            bits[runner], bits["fixed_random"], m, higher_is_better=False, asserted=False,
            paper=f"50.52 ppl vs {max(v for k, v in ppl.items() if k != 'fixed_random')} "
                  "(the next worst)",
            labels=(runner, "fixed_random")))
    return out


def synthesizer_claims(results: Mapping, margins: Mapping) -> list:
    """The claims of the Synthesizer notebook.

    Args:
        results: ``"probes"`` (kind -> :func:`probe_layer` dict),
            ``"training_change"`` (kind -> :func:`training_change` dict),
            ``"recall_accuracy"`` (kind -> accuracy per seed; may be empty),
            ``"chance"`` (1 / number of values), ``"lm_bits"`` (kind ->
            bits per byte per seed; may be empty).
        margins: ``zero_tolerance`` (what counts as no change),
            ``detect`` (the least change a control must show),
            ``min_vanilla_accuracy``, ``max_synthetic_excess`` (accuracy
            above chance that the synthetic kinds may reach),
            ``recall_margin``, ``assert_recall_mixtures``, ``lm_margin``,
            ``train_steps`` (for the text of a claim).

    Asserted: the mechanism claims and the recall claims; the text claims
    are reported with their verdicts.
    """
    out = _mechanism_claims(results.get("probes") or {},
                            results.get("training_change") or {}, margins)
    acc = results.get("recall_accuracy") or {}
    if acc:
        out += _recall_claims(acc, results["chance"], margins)
    bits = results.get("lm_bits") or {}
    if bits:
        out += _lm_claims(bits, margins)
    return out


# ------------------------------------------------------------ planted bugs
#
# Real broken layers: each is a SynthesizerAttention whose mechanism is
# broken in one way, built in place of one kind and run through the
# notebook's own functions (probe_kinds, training_changes, run_recall).


class ReadsKeys(SynthesizerAttention):
    """Bug: the synthetic logits get a term from the keys' content (a
    random or dense kind that reads the input and the other tokens)."""

    def synthetic_logits(self, query, key, dtype):
        logits = super().synthetic_logits(query, key, dtype)
        column = ops.mean(ops.cast(key, dtype), axis=-1)  # (B, S, H)
        return logits + ops.expand_dims(ops.transpose(column, (0, 2, 1)), 2)


class LeakyCausal(SynthesizerAttention):
    """Bug: the synthesized weights are normalised without the causal mask."""

    def _weights(self, query, key, context, dtype):
        return super()._weights(query, key, dataclasses.replace(context, causal=False), dtype)


class TrainedFixedRandom(SynthesizerAttention):
    """Bug: the fixed random table is trained (the layer reads a trainable
    copy of it)."""

    def build_extra(self, *shapes):
        super().build_extra(*shapes)
        table = ops.convert_to_numpy(self._synthesizer.fixed_random_logits)
        self.trained_table = self.add_weight(
            name="trained_table", shape=table.shape,
            initializer=keras.initializers.Constant(table), trainable=True)

    def synthetic_logits(self, query, key, dtype):
        weights = self._synthesizer
        fixed = weights.fixed_random_logits
        object.__setattr__(weights, "fixed_random_logits", self.trained_table)
        try:
            return super().synthetic_logits(query, key, dtype)
        finally:
            object.__setattr__(weights, "fixed_random_logits", fixed)


class FrozenRandomTable(SynthesizerAttention):
    """Bug: the learned random table is not trained (it stays as drawn)."""

    def build_extra(self, *shapes):
        super().build_extra(*shapes)
        if "random" in self.components:
            self._synthesizer.random_logits.trainable = False


class FrozenMixture(SynthesizerAttention):
    """Bug: the mixture weights are not trained."""

    def build_extra(self, *shapes):
        super().build_extra(*shapes)
        if len(self.components) > 1:
            self._synthesizer.mixture_logits.trainable = False


class MixtureWithoutVanilla(SynthesizerAttention):
    """Bug: a mixture's vanilla (dot-product) component gets weight 0; the
    other components keep their learned weights, renormalised."""

    def mixture_weights(self):
        w = super().mixture_weights()
        if len(self.components) == 1:
            return w
        keep = ops.convert_to_tensor(
            [0.0 if c == "vanilla" else 1.0 for c in self.components], dtype=w.dtype)
        w = w * keep
        return w / ops.sum(w)


class WithDotProduct(SynthesizerAttention):
    """Bug: a synthetic kind is given the dot product: the query-key logits
    ``q_t . k_s / sqrt(d)`` are added to its synthetic logits."""

    def synthetic_logits(self, query, key, dtype):
        logits = super().synthetic_logits(query, key, dtype)
        q = ops.cast(query, dtype) * self._inverse_sqrt_key_dim
        return logits + ops.einsum("bthd,bshd->bhts", q, ops.cast(key, dtype))


class DotProductComponent(SynthesizerAttention):
    """Bug: the component dispatch sends a synthetic component to the
    dot-product branch: the logits of every component named in
    :attr:`dispatched` (by default the random tables) are the query-key
    logits ``q_t . k_s / sqrt(d)``; the mixture weights are the layer's."""

    dispatched = ("random", "fixed_random", "factorized_random")

    def synthetic_logits(self, query, key, dtype, query_start=0):
        components = self.components
        object.__setattr__(self, "components", tuple(
            "vanilla" if c in self.dispatched else c for c in components))
        try:
            return super().synthetic_logits(query, key, dtype, query_start)
        finally:
            object.__setattr__(self, "components", components)


class CrossedFactors(SynthesizerAttention):
    """Bug in the factor product of ``factorized_dense``: the factor A of
    query ``t`` is multiplied with the factor B synthesized from the token
    at position ``s`` (``A(x_t) . B(x_s)``, contracted over the factors),
    in place of tiling the query's own two factors over the positions: the
    weights of a query compare it with the other tokens."""

    def synthetic_logits(self, query, key, dtype, query_start=0):
        syn = self._synthesizer
        hidden = ops.relu(ops.cast(query, dtype))
        m = min(self.factors)

        def var(x):
            return ops.cast(ops.convert_to_tensor(x), dtype)

        fa = ops.einsum("bthd,hda->bhta", hidden, var(syn.factor_a_kernel))
        fa = fa + var(syn.factor_a_bias)[None, :, None, :]
        fb = ops.einsum("bshd,hdc->bhsc", hidden, var(syn.factor_b_kernel))
        fb = fb + var(syn.factor_b_bias)[None, :, None, :]
        return ops.einsum("bhta,bhsa->bhts", fa[..., :m], fb[..., :m])


class _BuiltAs(SynthesizerAttention):
    """A layer asked for one kind that builds :attr:`built_kind` instead."""

    built_kind = "fixed_random"

    def __init__(self, *args, kind=None, **kwargs):
        super().__init__(*args, kind=self.built_kind, **kwargs)


class FixedRandomAsVanilla(_BuiltAs):
    """Bug in the control: the vanilla arm is a fixed random layer, which
    cannot show a dependence on the input or on other tokens."""

    built_kind = "fixed_random"


class DenseAsVanilla(_BuiltAs):
    """Bug: the vanilla arm is a dense synthesizer (no query-key comparison)."""

    built_kind = "dense"


#: The small size of the planted runs (the notebook's functions and claims);
#: the recall task trains every kind, as the full-size run does, so that
#: each per-kind recall claim exists here and has its variant.
PLANTED_SIZE = dict(
    num_heads=2, probe_length=8, probe_dim=8, train_steps=2,
    train_kinds=("fixed_random", "random", "random+vanilla"),
    recall_kinds=KINDS, seeds=2,
    recall=dict(pairs=8, num_keys=16, num_values=32, dim=32, batch_size=32,
                learning_rate=1e-2, steps=120, test_sequences=256),
)
#: The margins of the planted runs (the notebook's; the recall task's chance
#: is 1/32 here).
PLANTED_MARGINS = dict(
    zero_tolerance=1e-6, detect=1e-3, min_vanilla_accuracy=0.8, max_synthetic_excess=0.2,
    recall_margin=0.5, assert_recall_mixtures=True, lm_margin=0.05, train_steps=2)

#: Variant name -> (stage, kind, class): the arm of ``kind`` in the probes
#: (``"probe"``), the training probe (``"train"``) or the recall task
#: (``"recall"``) is built by ``class``.
_PLANTED_ARMS = {
    "fixed_random_reads_input": ("probe", "fixed_random", ReadsKeys),
    "dense_reads_other_tokens": ("probe", "dense", ReadsKeys),
    "dense_without_causal_mask": ("probe", "dense", LeakyCausal),
    "random_vanilla_without_causal_mask": ("probe", "random+vanilla", LeakyCausal),
    "blind_vanilla_control": ("probe", "vanilla", FixedRandomAsVanilla),
    "trained_fixed_random": ("train", "fixed_random", TrainedFixedRandom),
    "frozen_random_table": ("train", "random", FrozenRandomTable),
    "frozen_mixture": ("train", "random+vanilla", FrozenMixture),
    "vanilla_as_dense": ("recall", "vanilla", DenseAsVanilla),
    "dense_with_dot_product": ("recall", "dense", WithDotProduct),
    "mixture_without_vanilla": ("recall", "random+vanilla", MixtureWithoutVanilla),
    "random_as_dot_product": ("recall", "random", DotProductComponent),
    "fixed_random_with_dot_product": ("recall", "fixed_random", WithDotProduct),
    "factorized_dense_crossed_factors": ("recall", "factorized_dense", CrossedFactors),
    "factorized_random_as_dot_product": ("recall", "factorized_random", DotProductComponent),
    "dense_random_as_dot_product": ("recall", "dense+random", DotProductComponent),
    "dense_vanilla_without_vanilla": ("recall", "dense+vanilla", MixtureWithoutVanilla),
}


@functools.lru_cache(maxsize=None)
def _planted_probe(kind, cls):
    size = PLANTED_SIZE
    return probe_kinds([kind], num_heads=size["num_heads"], length=size["probe_length"],
                       dim=size["probe_dim"], classes={kind: cls})[kind]


@functools.lru_cache(maxsize=None)
def _planted_change(kind, cls):
    size = PLANTED_SIZE
    return training_changes([kind], num_heads=size["num_heads"],
                            length=size["probe_length"], dim=size["probe_dim"],
                            steps=size["train_steps"], classes={kind: cls})[kind]


@functools.lru_cache(maxsize=None)
def _planted_recall(kind, cls):
    size = PLANTED_SIZE
    run = run_recall([kind], seeds=size["seeds"], num_heads=size["num_heads"],
                     classes={kind: cls}, verbose=False, **size["recall"])
    return tuple(run["accuracy"][kind]), run["chance"]


def _planted_run(variant=None):
    """The notebook's claims at the small size of :data:`PLANTED_SIZE`, with
    the real layers (``variant=None``) or with the arm of the variant built
    by its broken class (:data:`_PLANTED_ARMS`); every arm is cached, so
    the set trains each arm once per process."""
    swap = {}
    if variant is not None:
        stage, kind, cls = _PLANTED_ARMS[variant]
        swap = {(stage, kind): cls}

    def cls(stage, kind):
        return swap.get((stage, kind), SynthesizerAttention)

    size = PLANTED_SIZE
    probes = {k: _planted_probe(k, cls("probe", k)) for k in KINDS}
    changes = {k: _planted_change(k, cls("train", k)) for k in size["train_kinds"]}
    recall, chance = {}, None
    for k in size["recall_kinds"]:
        values, chance = _planted_recall(k, cls("recall", k))
        recall[k] = list(values)
    results = {"probes": probes, "training_change": changes, "recall_accuracy": recall,
               "chance": chance, "lm_bits": {}}
    return synthesizer_claims(results, PLANTED_MARGINS)


PLANTED = planted.PlantedSet("synthesizer", run=_planted_run, variants=(
    planted.PlantedVariant(
        "fixed_random_reads_input",
        "a fixed_random layer whose logits also read the keys' content",
        ("input_free_weights",)),
    planted.PlantedVariant(
        "dense_reads_other_tokens",
        "a dense layer whose logits also read the other tokens' keys",
        ("dense_reads_own_token",)),
    planted.PlantedVariant(
        "dense_without_causal_mask",
        "a dense layer that normalises its weights without the causal mask",
        ("causal_no_leak",)),
    planted.PlantedVariant(
        "random_vanilla_without_causal_mask",
        "a random+vanilla layer that normalises its weights without the causal mask",
        ("causal_no_leak",)),
    planted.PlantedVariant(
        "blind_vanilla_control",
        "the vanilla control of the probes is a fixed_random layer",
        ("input_free_weights", "dense_reads_own_token")),
    planted.PlantedVariant(
        "trained_fixed_random",
        "a fixed_random layer that trains its table",
        ("fixed_random_not_trained",)),
    planted.PlantedVariant(
        "frozen_random_table",
        "a random layer whose learned table is never trained",
        ("fixed_random_not_trained",)),
    planted.PlantedVariant(
        "frozen_mixture",
        "a random+vanilla layer whose mixture weights are never trained",
        ("mixture_learned",)),
    planted.PlantedVariant(
        "vanilla_as_dense",
        "the vanilla arm of the recall task is a dense synthesizer (no dot product)",
        ("recall_vanilla_solves", "recall_vanilla_beats_dense")),
    planted.PlantedVariant(
        "dense_with_dot_product",
        "the dense arm of the recall task is given the query-key dot product",
        ("recall_synthetic_near_chance", "recall_vanilla_beats_dense")),
    planted.PlantedVariant(
        "mixture_without_vanilla",
        "a random+vanilla layer whose vanilla component has weight 0",
        ("recall_random+vanilla_as_vanilla",)),
    # One variant per kind of the recall task's per-kind claims: a kind
    # without the dot product that gets a query-key comparison after all
    # (so vanilla no longer beats it), and a mixture that loses its own.
    planted.PlantedVariant(
        "random_as_dot_product",
        "a random layer whose component dispatch computes the dot product in place of "
        "its learned table",
        ("recall_synthetic_near_chance", "recall_vanilla_beats_random")),
    planted.PlantedVariant(
        "fixed_random_with_dot_product",
        "a fixed_random layer given the query-key dot product on top of its table",
        ("recall_synthetic_near_chance", "recall_vanilla_beats_fixed_random")),
    planted.PlantedVariant(
        "factorized_dense_crossed_factors",
        "a factorized_dense layer whose factor product multiplies query t's factor A with "
        "the factor B of token s (A(x_t) . B(x_s)) instead of tiling the query's own "
        "factors",
        ("recall_synthetic_near_chance", "recall_vanilla_beats_factorized_dense")),
    planted.PlantedVariant(
        "factorized_random_as_dot_product",
        "a factorized_random layer whose component dispatch computes the dot product in "
        "place of the product of its two tables",
        ("recall_synthetic_near_chance", "recall_vanilla_beats_factorized_random")),
    planted.PlantedVariant(
        "dense_random_as_dot_product",
        "a dense+random layer whose random component is computed by the dot-product "
        "branch",
        ("recall_synthetic_near_chance", "recall_vanilla_beats_dense+random")),
    planted.PlantedVariant(
        "dense_vanilla_without_vanilla",
        "a dense+vanilla layer whose vanilla component has weight 0",
        ("recall_dense+vanilla_as_vanilla",)),
))
