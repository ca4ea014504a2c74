"""Adaptively Sparse Transformers reproduction: softmax, 1.5-entmax and a
learned α per head on an associative-recall task, the exact zeros of the
weights and the learned α per head and layer, a masking probe, and the
notebook's claims.

* :data:`PAPER`: what the paper reports (qualitative: the project's notes
  hold none of its BLEU numbers).
* :func:`make_recall` and :class:`RecallConfig`: sequences of key-value
  pairs followed by a query naming one stored key; the label is the value
  stored with it (one position of the sequence holds the answer, so a head
  that finds it can put all its weight there).
* :func:`arm_attention`, :func:`build_recall_model`, :func:`train_arm` and
  :func:`run_arms`: the classifiers of the three arms (``"softmax"``,
  ``"entmax15"``, ``"learned"``), trained over seeds, with the accuracy,
  the share of exact zeros in the weights per layer and head
  (:func:`zero_shares`) and the learned α per layer and head before and
  after training.
* :func:`mask_probe`: whether a fresh layer gives exactly zero weight to
  masked keys (causal and padding masks), rows summing to 1, and outputs
  that do not move when masked inputs change.
* :func:`entmax_claims`: the notebook's claims from its results.
* :data:`PLANTED`: real broken layers (:class:`AlphaStuckAtOne`,
  :class:`FrozenScoresEntmax`, :class:`MaskIgnoringEntmax`, a "softmax"
  control built as 1.5-entmax) trained or probed through the functions
  above at a small size by ``tests/notebooks/test_planted_real.py``.

The softmax arm is ``EntmaxAttention(alpha=1)``, not ``FullAttention``: the
same layer class, projections, reference path and call as the entmax arms,
with only the normaliser changed (α = 1 runs the masked softmax), so that
the arms differ by the mechanism alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping

import keras
import numpy as np
from keras import ops

from keras_longattn.layers import EntmaxAttention
from keras_longattn.ops import entmax as entmax_ops
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import planted

__all__ = [
    "ARMS",
    "PAPER",
    "PLANTED",
    "PLANTED_CONFIG",
    "VARIANT_ARMS",
    "AlphaStuckAtOne",
    "FrozenScoresEntmax",
    "MaskIgnoringEntmax",
    "RecallConfig",
    "arm_attention",
    "attention_layers",
    "attention_weights",
    "build_recall_model",
    "compile_model",
    "entmax_claims",
    "layer_alphas",
    "make_recall",
    "mask_probe",
    "predict_with_weights",
    "run_arms",
    "train_arm",
    "zero_shares",
]

#: What the paper reports (Correia, Niculae & Martins, EMNLP 2019). Its BLEU
#: numbers (IWSLT'17 de->en, KFTT ja->en, WMT'16 ro->en, WMT'14 en->de) are
#: not in the project's notes, so none is quoted here; the findings are.
PAPER = {
    "translation": "adaptive α-entmax at or slightly above softmax and 1.5-entmax in BLEU "
                   "on four translation pairs",
    "alpha": "learned α spread over (1, 2]: some heads near softmax, others sparse",
    "zeros": "entmax weights have exact zeros (softmax weights never do)",
}

#: The arms: ``EntmaxAttention`` with α = 1 (softmax), α = 1.5, and one
#: learned α per head (starting at 1.5).
ARMS = ("softmax", "entmax15", "learned")
_ARM_ALPHA = {"softmax": 1.0, "entmax15": 1.5, "learned": "learned"}


# ----------------------------------------------------------------- task
def make_recall(num, pairs, num_keys, num_values, seed=0):
    """Associative recall: ``pairs`` positions holding distinct keys (of
    ``num_keys``) with random values (of ``num_values``), in random order,
    then a query position naming one of the stored keys with the value id
    ``num_values`` ("unknown"). The label is the value stored with the
    queried key.

    Returns:
        ``((keys, values), labels)``: int32 ``(num, pairs + 1)`` twice and
        int32 ``(num,)`` in ``0 .. num_values - 1``.
    """
    for name, value, low in (("num", num, 1), ("pairs", pairs, 1),
                             ("num_keys", num_keys, 1), ("num_values", num_values, 2)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
    if pairs > num_keys:
        raise ValueError(f"`pairs` must be at most num_keys={num_keys} (the stored keys are "
                         f"distinct). Received: pairs={pairs}")
    rng = np.random.default_rng(seed)
    keys = np.argsort(rng.random((num, num_keys)), axis=1)[:, :pairs]
    values = rng.integers(0, num_values, size=(num, pairs))
    asked = rng.integers(0, pairs, size=num)
    rows = np.arange(num)
    k = np.concatenate([keys, keys[rows, asked][:, None]], axis=1).astype("int32")
    v = np.concatenate([values, np.full((num, 1), num_values)], axis=1).astype("int32")
    return (k, v), values[rows, asked].astype("int32")


@dataclasses.dataclass(frozen=True)
class RecallConfig:
    """The recall task and the models trained on it (the notebook's
    parameters).

    Attributes:
        pairs: stored key-value pairs (the sequence has ``pairs + 1``
            positions).
        num_keys: key ids.
        num_values: value ids (the classes; chance is ``1 / num_values``).
        layers: attention + MLP blocks.
        dim: model width.
        num_heads: heads of every attention layer.
        batch_size: sequences per step.
        steps: training steps (fresh sequences every step).
        test_sequences: held-out sequences the accuracy and the weights are
            measured on.
        learning_rate: peak rate of the cosine decay.
    """

    pairs: int = 12
    num_keys: int = 16
    num_values: int = 8
    layers: int = 2
    dim: int = 32
    num_heads: int = 4
    batch_size: int = 32
    steps: int = 150
    test_sequences: int = 256
    learning_rate: float = 5e-3

    def __post_init__(self):
        for name in ("pairs", "num_keys", "num_values", "layers", "dim", "num_heads",
                     "batch_size", "steps", "test_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
        if self.pairs > self.num_keys:
            raise ValueError(f"`pairs` must be at most num_keys={self.num_keys}. "
                             f"Received: pairs={self.pairs}")
        if self.dim % self.num_heads:
            raise ValueError(f"`dim` must be a multiple of num_heads={self.num_heads}. "
                             f"Received: dim={self.dim}")

    @property
    def length(self) -> int:
        """Positions per sequence: the pairs and the query."""
        return self.pairs + 1

    @property
    def chance(self) -> float:
        """Chance accuracy: ``1 / num_values``."""
        return 1.0 / self.num_values

    def test_set(self):
        """``((keys, values), labels)`` of the held-out sequences (seed 12 345)."""
        return make_recall(self.test_sequences, self.pairs, self.num_keys, self.num_values,
                           seed=12_345)

    def train_set(self, seed):
        """The ``steps * batch_size`` training sequences of ``seed``."""
        return make_recall(self.steps * self.batch_size, self.pairs, self.num_keys,
                           self.num_values, seed=seed)


# ------------------------------------------------------------ planted layers
@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class AlphaStuckAtOne(EntmaxAttention):
    """Planted bug: a learned-α layer whose α is stuck at 1. It builds the
    per-head α logits but normalises with the softmax (α = 1) and reports
    α = 1 for every head; the logits get no gradient and never move."""

    def _alpha_tensor(self):
        return ops.ones((self.num_heads,), "float32")

    def normalize(self, scores, mask):
        return entmax_ops.entmax(scores, 1.0, mask=mask, axis=-1)


@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class FrozenScoresEntmax(EntmaxAttention):
    """Planted bug: the attention weights carry no gradient (the hand-made
    gradient of α-entmax lost: ``stop_gradient`` on the normaliser's
    output), so the query and key projections, and a learned α, never learn
    where to look."""

    def normalize(self, scores, mask):
        return ops.stop_gradient(super().normalize(scores, mask))


@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class MaskIgnoringEntmax(EntmaxAttention):
    """Planted bug: the normaliser ignores the call's mask (causal and
    padding): masked keys get weight, and the outputs read them."""

    def normalize(self, scores, mask):
        return super().normalize(scores, None)


#: Each planted variant and the arms it replaces (the mask probe's layers
#: for ``"mask_ignored"``).
VARIANT_ARMS = {
    "alpha_stuck_at_1": ("learned",),
    "entmax_scores_frozen": ("entmax15", "learned"),
    "softmax_scores_frozen": ("softmax",),
    "softmax_control_sparse": ("softmax",),
    "entmax15_as_softmax": ("entmax15",),
    "mask_ignored": ARMS,
}


def arm_attention(arm, num_heads, key_dim, variant=None, **kwargs):
    """The attention layer of one arm: ``EntmaxAttention`` with α = 1
    (``"softmax"``), 1.5 (``"entmax15"``) or learned per head from 1.5
    (``"learned"``); a ``variant`` of :data:`VARIANT_ARMS` replaces the arms
    it names (the others are built as without it)."""
    if arm not in ARMS:
        raise ValueError(f"`arm` must be one of {ARMS}. Received: arm={arm!r}")
    if variant is not None and variant not in VARIANT_ARMS:
        raise ValueError(f"`variant` must be None or one of {sorted(VARIANT_ARMS)}. "
                         f"Received: variant={variant!r}")
    cls, alpha = EntmaxAttention, _ARM_ALPHA[arm]
    if variant is not None and arm in VARIANT_ARMS[variant]:
        if variant == "alpha_stuck_at_1":
            cls = AlphaStuckAtOne
        elif variant in ("entmax_scores_frozen", "softmax_scores_frozen"):
            cls = FrozenScoresEntmax
        elif variant == "softmax_control_sparse":
            alpha = 1.5
        elif variant == "entmax15_as_softmax":
            alpha = 1.0
        elif variant == "mask_ignored":
            cls = MaskIgnoringEntmax
    return cls(num_heads=num_heads, key_dim=key_dim, alpha=alpha, **kwargs)


# --------------------------------------------------------------- models
def build_recall_model(attention_factory, config: RecallConfig):
    """Pre-norm Transformer blocks over ``key + value`` embeddings (no
    position embedding: the task needs none), bidirectional, read at the last (query)
    position: logits over the ``num_values`` values.

    ``attention_factory(name)`` returns a fresh attention layer named
    ``name`` for each block: block ``i``'s layer is ``attention_i`` and its
    input ``attention_norm_i``."""
    n, dim = config.length, config.dim
    keys = keras.Input((n,), dtype="int32", name="keys")
    values = keras.Input((n,), dtype="int32", name="values")
    x = (keras.layers.Embedding(config.num_keys, dim, name="key_embedding")(keys)
         + keras.layers.Embedding(config.num_values + 1, dim, name="value_embedding")(values))
    for i in range(config.layers):
        h = keras.layers.LayerNormalization(name=f"attention_norm_{i}")(x)
        # The weights are an output of the layer's node (unused by the
        # logits): predict_with_weights reads them.
        out, _ = attention_factory(f"attention_{i}")(h, h, return_attention_scores=True)
        x = x + out
        h = keras.layers.LayerNormalization(name=f"mlp_norm_{i}")(x)
        h = keras.layers.Dense(4 * dim, activation="gelu", name=f"mlp_in_{i}")(h)
        x = x + keras.layers.Dense(dim, name=f"mlp_out_{i}")(h)
    x = keras.layers.LayerNormalization(name="final_norm")(x[:, -1])
    logits = keras.layers.Dense(config.num_values, name="logits")(x)
    return keras.Model([keys, values], logits, name="recall")


def attention_layers(model):
    """The attention layers of a :func:`build_recall_model` model, bottom first."""
    out, i = [], 0
    while True:
        try:
            out.append(model.get_layer(f"attention_{i}"))
        except ValueError:
            return out
        i += 1


def predict_with_weights(model, inputs, batch_size=128):
    """The logits and the attention weights of every layer on ``inputs``
    (``[keys, values]``), from one compiled probe model over the model's
    own graph (each attention layer of :func:`build_recall_model` returns
    its weights beside its output).

    Returns:
        ``(logits, weights)``: float ``(N, num_values)`` and a list (bottom
        first) of float32 ``(N, H, n, n)`` arrays, exact zeros included.
    """
    layers = attention_layers(model)
    outputs = [model.output]
    for layer in layers:
        outputs.append(layer.output[1])
    probe = keras.Model(model.input, outputs, name=f"{model.name}_weights")
    predicted = probe.predict(inputs, batch_size=batch_size, verbose=0)
    return (np.asarray(predicted[0]),
            [np.asarray(w, "float32") for w in predicted[1:]])


def attention_weights(model, inputs, batch_size=128):
    """The attention weights of every layer on ``inputs``: the second
    value of :func:`predict_with_weights`."""
    return predict_with_weights(model, inputs, batch_size)[1]


def zero_shares(weights):
    """The share of attention weights that are exactly 0, per layer and
    head: float ``(layers, H)`` from :func:`attention_weights` (every
    query-key pair is visible in the bidirectional recall model)."""
    return np.stack([np.mean(w == 0.0, axis=(0, 2, 3)) for w in weights])


def layer_alphas(model):
    """The α of every head of every attention layer, float ``(layers, H)``
    (``EntmaxAttention.alphas()``: the fixed α repeated, or the learned
    one as it is used)."""
    return np.stack([np.asarray(ops.convert_to_numpy(layer.alphas()), "float64")
                     for layer in attention_layers(model)])


def compile_model(model, steps, learning_rate):
    """Adam with a cosine decay over ``steps`` (to 10 %), gradients clipped
    to norm 1, cross-entropy on logits."""
    schedule = keras.optimizers.schedules.CosineDecay(learning_rate, decay_steps=steps,
                                                      alpha=0.1)
    model.compile(optimizer=keras.optimizers.Adam(schedule, global_clipnorm=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train_arm(arm, seed, config: RecallConfig, variant=None, test_set=None, reuse=None):
    """Trains one arm with ``seed`` (initial weights drawn after
    ``keras.utils.set_random_seed(seed)``, the training sequences of
    ``seed``, one epoch of ``config.steps`` batches) and measures it on the
    test set.

    ``reuse``: a model this function returned for the same arm, config and
    variant (another seed): its weights are replaced by a fresh model's of
    ``seed`` and its optimizer's variables zeroed, so the run is the fresh
    model's while the compiled functions are kept.

    Returns:
        ``(measures, model)``: ``measures`` a dict with ``accuracy``
        (fraction), ``zeros`` (:func:`zero_shares`, ``(layers, H)``),
        ``alpha_start`` and ``alpha_end`` (:func:`layer_alphas` before and
        after training), ``seconds`` (training wall time).
    """
    (x_keys, x_values), y_test = test_set if test_set is not None else config.test_set()
    (k_train, v_train), y_train = config.train_set(seed)
    keras.utils.set_random_seed(seed)
    key_dim = config.dim // config.num_heads
    model = build_recall_model(
        lambda name: arm_attention(arm, config.num_heads, key_dim, variant, name=name),
        config)
    if reuse is None:
        compile_model(model, config.steps, config.learning_rate)
    else:
        reuse.set_weights(model.get_weights())
        for variable in reuse.optimizer.variables:
            variable.assign(np.zeros(variable.shape,
                                     keras.backend.standardize_dtype(variable.dtype)))
        model = reuse
    alpha_start = layer_alphas(model)
    started = time.perf_counter()
    model.fit([k_train, v_train], y_train, batch_size=config.batch_size, epochs=1,
              shuffle=False, verbose=0)
    seconds = time.perf_counter() - started
    logits, weights = predict_with_weights(model, [x_keys, x_values], batch_size=256)
    return {
        "accuracy": float(np.mean(np.argmax(logits, -1) == y_test)),
        "zeros": zero_shares(weights),
        "alpha_start": alpha_start,
        "alpha_end": layer_alphas(model),
        "seconds": seconds,
    }, model


def run_arms(config: RecallConfig, seeds, arms=ARMS, variant=None, verbose=True):
    """Every arm over ``seeds`` seeds (:func:`train_arm`; an arm's model is
    reused, reinitialised, for its next seed).

    Returns:
        ``{arm: {"accuracy": [per seed], "zeros": [(layers, H) per seed],
        "alpha_start": [...], "alpha_end": [...], "seconds": [...]}}``.
    """
    test_set = config.test_set()
    out = {arm: {"accuracy": [], "zeros": [], "alpha_start": [], "alpha_end": [],
                 "seconds": []} for arm in arms}
    models = {}
    for seed in range(seeds):
        for arm in arms:
            measures, models[arm] = train_arm(arm, seed, config, variant, test_set,
                                              reuse=models.get(arm))
            for name, value in measures.items():
                out[arm][name].append(value)
            if verbose:
                alpha = measures["alpha_end"]
                print(f"seed {seed} {arm:>8}: accuracy {measures['accuracy']:.3f}, "
                      f"exact zeros {float(np.mean(measures['zeros'])):.2f}, "
                      f"α {alpha.min():.3f} .. {alpha.max():.3f}", flush=True)
    return out


# ---------------------------------------------------------------- probes
def mask_probe(arm, variant=None, *, length=12, dim=16, num_heads=2, padded=3, seed=0):
    """Whether a fresh layer of ``arm`` honours its masks.

    The layer (``num_heads`` heads of ``dim / num_heads``) is called on a
    random ``(1, length, dim)`` sequence twice: causally, and
    bidirectionally with the last ``padded`` keys masked by a
    ``value_mask``. Then masked inputs are replaced by other random vectors
    and the outputs that must not see them compared: for the causal call,
    the last position and then the second half of the sequence (the
    outputs before them); for the padding call, the padded positions (the
    outputs of the other positions).

    Returns:
        A dict: ``masked_weight`` (the largest weight on a masked key),
        ``row_error`` (the largest ``|sum of a row's weights - 1|`` over the
        visible queries), ``output_change`` (the largest change of an
        unmasked query's output when masked inputs change, relative to the
        largest output).
    """
    keras.utils.set_random_seed(seed)
    layer = arm_attention(arm, num_heads, dim // num_heads, variant)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, length, dim)).astype("float32")
    visible_keys = length - padded
    value_mask = np.ones((1, length), bool)
    value_mask[:, visible_keys:] = False
    causal = np.tril(np.ones((length, length), bool))

    out_c, w_c = layer(x, x, use_causal_mask=True, return_attention_scores=True)
    out_p, w_p = layer(x, x, value_mask=value_mask, return_attention_scores=True)
    w_c, w_p = ops.convert_to_numpy(w_c), ops.convert_to_numpy(w_p)
    out_c, out_p = ops.convert_to_numpy(out_c)[0], ops.convert_to_numpy(out_p)[0]
    masked_weight = max(float(np.max(np.where(causal, 0.0, w_c[0]))),
                        float(np.max(w_p[0][..., visible_keys:])))
    row_error = max(float(np.max(np.abs(w_c.sum(-1) - 1.0))),
                    float(np.max(np.abs(w_p.sum(-1) - 1.0))))
    scale = max(float(np.max(np.abs(out_c))), float(np.max(np.abs(out_p))), 1e-30)
    change = 0.0
    for split in sorted({length - 1, length // 2}):
        # Later positions replaced: the outputs before them must not move.
        y = x.copy()
        y[:, split:] = rng.normal(size=y[:, split:].shape)
        moved = ops.convert_to_numpy(layer(y, y, use_causal_mask=True))[0]
        change = max(change, float(np.max(np.abs(moved[:split] - out_c[:split]))))
    y = x.copy()
    y[:, visible_keys:] = rng.normal(size=y[:, visible_keys:].shape)
    moved = ops.convert_to_numpy(layer(y, y, value_mask=value_mask))[0]
    change = max(change, float(np.max(np.abs(moved[:visible_keys] - out_p[:visible_keys]))))
    return {"masked_weight": masked_weight, "row_error": row_error,
            "output_change": change / scale}


# ---------------------------------------------------------------- claims
def _stack(values):
    return np.stack([np.asarray(v, "float64") for v in values])


def _fmt_heads(matrix, digits=2):
    """``"L0 [1.52 1.47], L1 [...]"``: a (layers, H) array by layer."""
    return ", ".join(f"L{i} [" + " ".join(f"{v:.{digits}f}" for v in row) + "]"
                     for i, row in enumerate(np.asarray(matrix)))


def _each_at_least(name, statement, per_seed, threshold):
    """A claim that holds when every seed's value is at least ``threshold``."""
    per_seed = [float(v) for v in per_seed]
    ok = bool(per_seed) and min(per_seed) >= threshold
    return cl.Claim(name, statement, PAPER["alpha"],
                    f"per seed {', '.join(f'{v:.3f}' for v in per_seed)} "
                    f"(needs >= {threshold} in each)",
                    cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
                    f"smallest {min(per_seed, default=float('nan')):.4f}, needs >= {threshold}")


def entmax_claims(results: Mapping, margins: Mapping) -> list:
    """The claims of the entmax notebook.

    Args:
        results:
            ``"arms"``: :func:`run_arms` (the arms ``"softmax"``,
            ``"entmax15"`` and ``"learned"``; per seed ``accuracy`` as a
            fraction, ``zeros``, ``alpha_start`` and ``alpha_end`` as
            ``(layers, H)``);
            ``"chance"``: ``1 / num_values``;
            ``"mask"``: ``{arm: mask_probe(arm)}`` for every arm.
        margins: ``min_softmax_accuracy`` (the task check: softmax solves
            the task), ``accuracy_margin`` (an entmax arm's accuracy may be
            behind softmax's by less than this, as a fraction),
            ``min_zero_share`` (the mean share of exact zeros an entmax arm
            reaches), ``max_softmax_zero_share`` (softmax's largest share of
            exact zeros, from float32 underflow only), ``min_alpha_move``
            (the largest change of a learned α in every seed),
            ``min_alpha_spread`` (the largest minus the smallest learned α
            over the heads and layers, in every seed), ``mask_tolerance``
            (masked weight, row sum error and relative output change),
            ``near_softmax`` and ``near_sparsemax`` (α bounds of the
            reported head census).
    """
    out = []
    arms = results["arms"]

    mask = results["mask"]
    tol = margins["mask_tolerance"]
    worst = {arm: max(m["masked_weight"], m["row_error"], m["output_change"])
             for arm, m in mask.items()}
    ok = all(v <= tol for v in worst.values())
    out.append(cl.Claim(
        "mask_respected", "every arm's weights are exactly 0 on masked keys (causal and "
        "padding masks), rows sum to 1, and outputs do not move when masked inputs change",
        "masked entries get probability 0 (the α-entmax threshold is taken over the "
        "visible scores)",
        "; ".join(f"{arm}: masked weight {m['masked_weight']:.1e}, row error "
                  f"{m['row_error']:.1e}, output change {m['output_change']:.1e}"
                  for arm, m in mask.items()),
        cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
        f"tolerance {tol}; worst {max(worst.values()):.3g}"))

    acc = {arm: arms[arm]["accuracy"] for arm in arms}
    out.append(cl.at_least(
        "softmax_solves", "the recall task is solvable: the softmax arm reaches "
        f"{margins['min_softmax_accuracy']} accuracy (chance {results['chance']:.3f})",
        acc["softmax"], margins["min_softmax_accuracy"], paper="(task check)"))
    for arm, label in (("entmax15", "1.5-entmax"), ("learned", "learned α")):
        out.append(cl.no_worse_than(
            f"parity_{arm}", f"{label} is as accurate as softmax (not behind by "
            f"{margins['accuracy_margin']} or more)", acc[arm], acc["softmax"],
            margins["accuracy_margin"], paper=PAPER["translation"],
            labels=(label, "softmax")))
    out.append(cl.compare_means(
        "learned_beats_entmax15", "learned α is more accurate than 1.5-entmax (by "
        f"{margins['accuracy_margin']})", acc["learned"], acc["entmax15"],
        margins["accuracy_margin"], asserted=False, paper=PAPER["translation"],
        labels=("learned α", "1.5-entmax")))

    zeros = {arm: _stack(arms[arm]["zeros"]) for arm in arms}  # (seeds, layers, H)
    softmax_max = float(np.max(zeros["softmax"]))
    out.append(cl.Claim(
        "softmax_dense", "softmax weights are never exactly 0: the largest share of exact "
        f"zeros of any softmax head is at most {margins['max_softmax_zero_share']} "
        "(float32 underflow only)", PAPER["zeros"],
        f"largest share {softmax_max:.4f} ({zeros['softmax'].shape[0]} seeds)",
        cl.REPRODUCED if softmax_max <= margins["max_softmax_zero_share"]
        else cl.NOT_REPRODUCED, True,
        f"largest {softmax_max:.5f}, needs <= {margins['max_softmax_zero_share']}"))
    for arm, label in (("entmax15", "1.5-entmax"), ("learned", "learned-α")):
        per_seed = zeros[arm].mean(axis=(1, 2))
        out.append(cl.at_least(
            f"zeros_{arm}", f"{label} weights have exact zeros: their mean share over heads "
            f"and layers is at least {margins['min_zero_share']}", per_seed,
            margins["min_zero_share"], paper=PAPER["zeros"]))

    start = _stack(arms["learned"]["alpha_start"])
    end = _stack(arms["learned"]["alpha_end"])
    move = np.max(np.abs(end - start), axis=(1, 2))
    spread = np.max(end, axis=(1, 2)) - np.min(end, axis=(1, 2))
    out.append(_each_at_least(
        "alpha_moves", "the learned α moves away from its start: the largest change of a "
        f"head's α is at least {margins['min_alpha_move']} in every seed", move,
        margins["min_alpha_move"]))
    out.append(_each_at_least(
        "alpha_spread", "heads learn different α: the largest minus the smallest α over the "
        f"heads and layers is at least {margins['min_alpha_spread']} in every seed", spread,
        margins["min_alpha_spread"]))

    low, high = margins["near_softmax"], margins["near_sparsemax"]
    n_low, n_high = int(np.sum(end < low)), int(np.sum(end > high))
    out.append(cl.report_only(
        "alpha_census", f"some learned heads end near softmax (α < {low}) and some sparse "
        f"(α > {high})",
        f"{n_low} heads below {low}, {n_high} above {high}, of {end.size} "
        f"(heads x layers x seeds); seed 0: {_fmt_heads(end[0])}",
        cl.REPRODUCED if n_low and n_high else cl.NOT_REPRODUCED, paper=PAPER["alpha"],
        detail="reported: at this scale α moves little from its start"))
    head_spread = float(np.mean(np.max(zeros["learned"], axis=(1, 2))
                                - np.min(zeros["learned"], axis=(1, 2))))
    out.append(cl.report_only(
        "zeros_differ_by_head", "the learned-α heads differ in sparsity (largest minus "
        "smallest share of exact zeros over heads and layers, mean over seeds)",
        f"{head_spread:.3f}; seed 0: {_fmt_heads(zeros['learned'][0])}",
        cl.REPRODUCED if head_spread > 0 else cl.NOT_REPRODUCED,
        paper="heads specialise", detail="reported: no margin is stated for it"))
    return out


# -------------------------------------------------------- planted bugs
#: The small size the planted variants train at (:data:`PLANTED`).
PLANTED_CONFIG = RecallConfig(pairs=8, num_keys=16, num_values=8, layers=1, dim=32,
                              num_heads=4, batch_size=32, steps=200, test_sequences=128,
                              learning_rate=1e-2)
PLANTED_SEEDS = 2
PLANTED_MARGINS = dict(
    min_softmax_accuracy=0.8, accuracy_margin=0.25, min_zero_share=0.2,
    max_softmax_zero_share=0.01, min_alpha_move=0.01, min_alpha_spread=0.01,
    mask_tolerance=1e-5, near_softmax=1.25, near_sparsemax=1.75)

#: The last model trained for each (arm, layer kind), reused (reinitialised)
#: for the next seed as :func:`run_arms` does.
_PLANTED_MODELS = {}


def _built_as(arm, variant):
    """The variant that really changes ``arm`` (None when ``variant``
    leaves it as the real one), so that arms built the same share a cache
    entry."""
    return variant if variant is not None and arm in VARIANT_ARMS[variant] else None


@functools.lru_cache(maxsize=None)
def _planted_arm(arm, variant, seed):
    if variant == "softmax_control_sparse":
        # The "softmax" control built as 1.5-entmax is the entmax15 arm.
        return _planted_arm("entmax15", None, seed)
    if variant == "entmax15_as_softmax":
        # The 1.5-entmax arm built with alpha = 1 is the softmax arm.
        return _planted_arm("softmax", None, seed)
    measures, model = train_arm(arm, seed, PLANTED_CONFIG, variant,
                                reuse=_PLANTED_MODELS.get((arm, variant)))
    _PLANTED_MODELS[(arm, variant)] = model
    return measures


@functools.lru_cache(maxsize=None)
def _planted_mask(arm, variant):
    return mask_probe(arm, variant)


def _planted_run(variant=None):
    """The notebook's claims at the planted size, with the real layers
    (``variant=None``) or with the arms :data:`VARIANT_ARMS` names built by
    the planted ``variant`` (the mask probe's layers for ``"mask_ignored"``,
    the trained arms for the others); everything else is the real run's."""
    if variant is not None and variant not in VARIANT_ARMS:
        raise ValueError(f"`variant` must be None or one of {sorted(VARIANT_ARMS)}. "
                         f"Received: variant={variant!r}")
    trained = None if variant == "mask_ignored" else variant
    arms = {}
    for arm in ARMS:
        runs = [_planted_arm(arm, _built_as(arm, trained), seed)
                for seed in range(PLANTED_SEEDS)]
        arms[arm] = {name: [run[name] for run in runs] for name in runs[0]}
    probed = variant if variant == "mask_ignored" else None
    results = {
        "arms": arms,
        "chance": PLANTED_CONFIG.chance,
        "mask": {arm: _planted_mask(arm, _built_as(arm, probed)) for arm in ARMS},
    }
    return entmax_claims(results, PLANTED_MARGINS)


PLANTED = planted.PlantedSet("entmax", run=_planted_run, variants=(
    planted.PlantedVariant(
        "alpha_stuck_at_1", "a learned-α layer whose α is stuck at 1 (AlphaStuckAtOne: "
        "softmax weights, α logits that never move)",
        ("alpha_moves", "alpha_spread", "zeros_learned")),
    planted.PlantedVariant(
        "entmax_scores_frozen", "the entmax arms' weights carry no gradient "
        "(FrozenScoresEntmax: stop_gradient on the normaliser, queries and keys never "
        "learn where to look)", ("parity_entmax15", "parity_learned")),
    planted.PlantedVariant(
        "softmax_scores_frozen", "the softmax arm's weights carry no gradient "
        "(FrozenScoresEntmax with α = 1)", ("softmax_solves",)),
    planted.PlantedVariant(
        "softmax_control_sparse", "the softmax control built as 1.5-entmax (a control "
        "that is not softmax)", ("softmax_dense",)),
    planted.PlantedVariant(
        "entmax15_as_softmax", "the 1.5-entmax arm built with alpha = 1 (a sparse arm "
        "that normalises with softmax)", ("zeros_entmax15",)),
    planted.PlantedVariant(
        "mask_ignored", "every arm's normaliser ignores the call's mask "
        "(MaskIgnoringEntmax)", ("mask_respected",)),
))
