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
* :func:`synthesizer_claims`: the notebook's claims from its results.

The kinds are the strings of ``SynthesizerAttention(kind=...)``;
``"vanilla"`` is dot-product attention (the paper's Transformer).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from keras_longattn.reproductions import claims as cl

__all__ = [
    "MIXTURES",
    "PAPER",
    "PURE_SYNTHETIC",
    "build_pair_recall_model",
    "frequency_guess_accuracy",
    "make_pair_recall",
    "freeze_unread_projections",
    "parameter_counts",
    "probe_layer",
    "synthesizer_claims",
    "training_change",
]

#: The single synthetic kinds (no dot product anywhere).
PURE_SYNTHETIC = ("dense", "random", "fixed_random", "factorized_dense", "factorized_random")
#: The mixtures of the paper's Table 2 (the layer's names).
MIXTURES = ("dense+random", "dense+vanilla", "random+vanilla")
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
    import keras

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
    import keras

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
    import keras

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
    from keras_longattn.layers import SynthesizerAttention

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
    from keras_longattn.layers import SynthesizerAttention

    trainable = int(sum(np.prod(w.shape) for w in model.trainable_weights))
    unread = 0
    for layer in _all_layers(model):
        if isinstance(layer, SynthesizerAttention):
            for dense in _unread_projections(layer):
                unread += int(sum(np.prod(w.shape) for w in dense.weights))
    return trainable, unread


def _all_layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


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
            f"text: fixed_random is the worst kind (behind the next worst, {runner})",
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
