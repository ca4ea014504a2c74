"""MPNet reproduction: masked (MLM), permuted (PLM) and masked-and-permuted
(MPNet) pre-training of one small byte-level encoder on the Wikipedia
sample, probes of two-stream attention, a small downstream task, and the
notebook's claims.

* :data:`PAPER`: what the paper reports (GLUE dev average of BERT, XLNet,
  RoBERTa and MPNet: the paper's GLUE dev table, single models).
* Tokens are **bytes** (ids 0 to 255) plus one mask token (id 256):
  :data:`VOCAB_SIZE`, :data:`MASK_TOKEN`. :func:`pretraining_batch` and
  :func:`held_out_set` cut windows of the Wikipedia sample
  (:func:`keras_longattn.datasets.load_wiki_sample`) and permute them with
  :func:`keras_longattn.models.permute_for_prediction`; the three
  objectives read the same inputs and predict the same tokens.
* :class:`PretrainConfig`, :func:`train_objective` and
  :func:`run_pretraining`: the pre-training of every objective over seeds
  (``fit``), measured on the same held-out positions
  (:func:`prediction_scores`).
* :func:`query_leak_probe`: whether the query stream at a predicted
  position depends on that position's content (it must not), and whether
  the content reaches the later predictions (it must).
  :func:`position_probe`: whether the first prediction depends on the
  *positions* of the later predicted tokens (MPNet's position
  compensation: yes; PLM: no).
* :func:`make_corruption_task`, :class:`EncoderClassifier` and
  :func:`run_downstream`: the downstream task (is a byte window corrupted?)
  fine-tuned from each pre-trained encoder and from scratch.
* :func:`mpnet_claims`: the notebook's claims from its results.
* :data:`PLANTED`: real broken variants (a query stream that sees its own
  content, MPNet whose appended mask tokens carry no position, a model
  whose weights ``fit`` never moves) trained through the functions above
  at a small size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import keras
import numpy as np
from keras import ops

from keras_longattn.models import permute_for_prediction
from keras_longattn.models.mpnet import OBJECTIVES
from keras_longattn.models.mpnet import PretrainingModel
from keras_longattn.models.mpnet import TwoStreamBlock
from keras_longattn.models.two_stream import two_stream_masks
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import planted

__all__ = [
    "MASK_TOKEN",
    "OBJECTIVES",
    "PAPER",
    "PLANTED",
    "VARIANTS",
    "VOCAB_SIZE",
    "EncoderClassifier",
    "FrozenPretrainingModel",
    "OwnContentQueryBlock",
    "OwnContentQueryModel",
    "PositionlessMaskModel",
    "PretrainConfig",
    "build_model",
    "compile_model",
    "held_out_set",
    "make_corruption_task",
    "mpnet_claims",
    "position_probe",
    "prediction_scores",
    "pretraining_batch",
    "query_leak_probe",
    "run_downstream",
    "run_pretraining",
    "train_objective",
]

#: The paper's numbers (Song, Tan, Qin, Lu, Liu 2020): the GLUE dev set
#: average of single models of BERT-base size (the paper's GLUE dev table).
PAPER = {"glue_dev_average": {"bert": 83.1, "xlnet": 84.5, "roberta": 86.4, "mpnet": 87.7}}

#: Bytes 0 to 255 and the mask token.
VOCAB_SIZE = 257
#: The id of the mask token (not a byte).
MASK_TOKEN = 256
#: The paper's baseline each objective stands for.
BASELINE_OF = {"mlm": "bert", "plm": "xlnet", "mpnet": "mpnet"}

LN2 = math.log(2.0)


# ------------------------------------------------------------------ data
def _wiki_split(split):
    from keras_longattn.datasets import load_wiki_sample

    return np.asarray(load_wiki_sample(split), "int32")


def pretraining_batch(data, length, batch_size, predict_ratio, seed):
    """One permuted batch of ``batch_size`` random windows of ``length``
    bytes of ``data`` (start positions and permutations drawn from
    ``seed``).

    Returns:
        ``(inputs, targets)``: ``{"tokens", "positions"}`` int32 ``(B, n)``
        in permuted order, and the ``b`` predicted bytes ``(B, b)`` (the
        last ``b`` permuted tokens).
    """
    data = np.asarray(data)
    if data.ndim != 1 or data.size <= length:
        raise ValueError(f"`data` must be a 1D array longer than length={length}. "
                         f"Received: shape={data.shape}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, data.size - length, size=batch_size)
    windows = data[starts[:, None] + np.arange(length)[None]].astype("int32")
    permuted = permute_for_prediction(windows, predict_ratio, seed=int(rng.integers(2**31)))
    b = permuted["num_predicted"]
    inputs = {"tokens": permuted["tokens"].astype("int32"),
              "positions": permuted["positions"].astype("int32")}
    return inputs, inputs["tokens"][:, -b:].copy()


def held_out_set(data, length, num_windows, predict_ratio, seed=10_000):
    """The held-out positions every objective is measured on: the first
    ``num_windows`` consecutive windows of ``length`` bytes of ``data``
    (the validation split), each permuted once with ``seed``: the same
    tokens, the same positions, the same predicted tokens for MLM, PLM and
    MPNet.

    Returns:
        ``(inputs, targets)`` as :func:`pretraining_batch`.
    """
    data = np.asarray(data)
    if num_windows * length > data.size:
        raise ValueError(f"`num_windows` * length must fit in the data ({data.size} bytes). "
                         f"Received: num_windows={num_windows}, length={length}")
    windows = data[: num_windows * length].reshape(num_windows, length).astype("int32")
    permuted = permute_for_prediction(windows, predict_ratio, seed=seed)
    b = permuted["num_predicted"]
    inputs = {"tokens": permuted["tokens"].astype("int32"),
              "positions": permuted["positions"].astype("int32")}
    return inputs, inputs["tokens"][:, -b:].copy()


class _PretrainingSequence(keras.utils.PyDataset):
    """``steps`` fresh batches of :func:`pretraining_batch` (batch ``i``
    from seed ``seed * 100_003 + i``)."""

    def __init__(self, data, length, batch_size, predict_ratio, steps, seed):
        super().__init__()
        self.data, self.length, self.batch_size = data, length, batch_size
        self.predict_ratio, self.steps, self.seed = predict_ratio, steps, seed

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        return pretraining_batch(self.data, self.length, self.batch_size, self.predict_ratio,
                                 self.seed * 100_003 + int(index))


# ---------------------------------------------------------------- models
@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class OwnContentQueryBlock(TwoStreamBlock):
    """Planted bug: a two-stream block whose query mask is built without
    the diagonal exclusion: the query row of predicted token ``t`` also
    sees the content of token ``t`` (the token it must predict)."""

    def _masks(self, L, b):
        n = L - b if self.kind == "mpnet" else L
        content, query = two_stream_masks(n, b, self.kind)
        query = query.copy()
        query[np.arange(b), n - b + np.arange(b)] = True
        return ops.convert_to_tensor(content), ops.convert_to_tensor(query)


def _replace_blocks(model, block_class):
    """Rebuilds ``model.encoder_layers`` (before the model is built) as
    ``block_class`` blocks with the same arguments, untracking the old
    ones."""
    old = list(model.encoder_layers)
    kind = old[0].kind
    model.encoder_layers = [
        block_class(attention=model.attention_spec, num_heads=model.num_heads, kind=kind,
                    dropout=model.dropout, name=f"block_{i}")
        for i in range(model.num_layers)]
    layers = getattr(model, "_layers", None)
    if layers is not None:
        for block in old:
            if any(item is block for item in layers):
                layers.remove(block)


@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class OwnContentQueryModel(PretrainingModel):
    """Planted bug: a pre-training model (PLM or MPNet) built of
    :class:`OwnContentQueryBlock`: its query stream sees the content of the
    token it predicts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.objective == "mlm":
            raise ValueError("OwnContentQueryModel needs a two-stream objective ('plm' or "
                             f"'mpnet'). Received: objective={self.objective!r}")
        _replace_blocks(self, OwnContentQueryBlock)


@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class PositionlessMaskModel(PretrainingModel):
    """Planted bug: MPNet whose appended mask tokens carry no position (the
    mask token's embedding alone): the content stream has the ``n + b``
    tokens and the masks of MPNet, but the predicted tokens' positions are
    not compensated."""

    def call(self, inputs, training=None):
        if self.objective != "mpnet":
            return super().call(inputs, training=training)
        tokens = ops.cast(inputs["tokens"], "int32")
        positions = ops.cast(inputs["positions"], "int32")
        b = self.num_predicted
        pos = self.position_embedding(positions)
        mask_vector = self.token_embedding(ops.full((1, 1), self.mask_token_id, "int32"))
        content = self.token_embedding(tokens) + pos
        query = mask_vector + pos[:, -b:]
        masks = ops.broadcast_to(mask_vector, (ops.shape(tokens)[0], b, self.dim))
        content = ops.concatenate([content, masks], axis=1)
        for block in self.encoder_layers:
            content, query = block(content, query, training=training)
        return self.head(self.final_norm(query))


@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class FrozenPretrainingModel(PretrainingModel):
    """Planted bug: a pre-training model whose weights are all frozen
    (``trainable=False``): ``fit`` runs, nothing learns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trainable = False


#: The planted variants and the pre-training model class of each (the
#: objectives they break: ``"leak"`` the two-stream ones, ``"positionless"``
#: MPNet, ``"frozen"`` every objective).
VARIANTS = {
    "own_content_query": OwnContentQueryModel,
    "no_position_compensation": PositionlessMaskModel,
    "frozen_weights": FrozenPretrainingModel,
}


def build_model(objective, config, variant=None):
    """The pre-training model of ``objective`` (``"mlm"``, ``"plm"``,
    ``"mpnet"``) at ``config``'s size, or the planted ``variant``'s model
    with the same arguments (:data:`VARIANTS`; a variant that does not break
    ``objective`` builds the real model). Built (called once on zeros)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"`objective` must be one of {OBJECTIVES}. "
                         f"Received: objective={objective!r}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"`variant` must be None or one of {sorted(VARIANTS)}. "
                         f"Received: variant={variant!r}")
    cls = PretrainingModel
    if variant == "own_content_query" and objective != "mlm":
        cls = OwnContentQueryModel
    elif variant == "no_position_compensation" and objective == "mpnet":
        cls = PositionlessMaskModel
    elif variant == "frozen_weights":
        cls = FrozenPretrainingModel
    model = cls(VOCAB_SIZE, config.length, dim=config.dim, num_layers=config.layers,
                num_heads=config.num_heads, objective=objective,
                predict_ratio=config.predict_ratio, mask_token_id=MASK_TOKEN,
                name=f"{objective}_pretraining")
    zeros = np.zeros((1, config.length), "int32")
    model({"tokens": zeros, "positions": zeros})
    return model


def compile_model(model, steps, learning_rate):
    """Adam with a cosine decay over ``steps`` (to 10 %), gradients clipped
    to norm 1, cross-entropy on logits."""
    schedule = keras.optimizers.schedules.CosineDecay(learning_rate, decay_steps=max(1, steps),
                                                      alpha=0.1)
    model.compile(optimizer=keras.optimizers.Adam(schedule, global_clipnorm=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


# ----------------------------------------------------------- pretraining
@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """The pre-training of the notebook (its ``pretrain_*`` parameters).

    Attributes:
        length: bytes per window (``n``).
        predict_ratio: share of the window predicted (``b = round(n * ratio)``).
        dim: model width.
        layers: two-stream blocks.
        num_heads: attention heads.
        batch_size: windows per step.
        steps: training steps (fresh windows every step).
        learning_rate: peak rate of the cosine decay.
        valid_windows: held-out windows (the start of the validation split).
    """

    length: int = 32
    predict_ratio: float = 0.15
    dim: int = 32
    layers: int = 2
    num_heads: int = 2
    batch_size: int = 32
    steps: int = 60
    learning_rate: float = 3e-3
    valid_windows: int = 256

    def __post_init__(self):
        for name in ("length", "dim", "layers", "num_heads", "batch_size", "steps",
                     "valid_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
        if not 0.0 < float(self.predict_ratio) <= 1.0:
            raise ValueError("`predict_ratio` must be in (0, 1]. "
                             f"Received: predict_ratio={self.predict_ratio!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"`dim` must be a multiple of `num_heads`. Received: "
                             f"dim={self.dim}, num_heads={self.num_heads}")

    @property
    def num_predicted(self) -> int:
        """``b``: the predicted tokens of a window."""
        from keras_longattn.models.two_stream import permutation_split

        return permutation_split(self.length, self.predict_ratio)

    def held_out(self):
        """:func:`held_out_set` of the validation split at this size."""
        return held_out_set(_wiki_split("valid"), self.length, self.valid_windows,
                            self.predict_ratio)


def prediction_scores(model, inputs, targets):
    """Held-out prediction of the ``b`` predicted tokens.

    Returns:
        ``{"bits": mean bits per predicted byte, "accuracy": % of the
        predicted bytes right (argmax), "first_accuracy": % right at the
        first predicted token only}``. The first prediction has the same
        context (the non-predicted bytes) in every objective.
    """
    logits = np.asarray(model.predict(inputs, batch_size=64, verbose=0), "float64")
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, targets[..., None].astype("int64"), -1)[..., 0]
    right = np.argmax(logits, -1) == targets
    return {"bits": float(-picked.mean() / LN2), "accuracy": 100.0 * float(right.mean()),
            "first_accuracy": 100.0 * float(right[:, 0].mean())}


def _reinitialise(reuse, fresh):
    """Gives ``reuse`` the weights of ``fresh`` and zeroes its optimizer's
    variables: the fresh model's run, with the compiled functions kept."""
    reuse.set_weights(fresh.get_weights())
    for variable in reuse.optimizer.variables:
        variable.assign(np.zeros(variable.shape,
                                 keras.backend.standardize_dtype(variable.dtype)))
    return reuse


def train_objective(objective, seed, config: PretrainConfig, variant=None, held_out=None,
                    reuse=None, train_data=None):
    """Pre-trains ``objective`` with ``seed`` (initial weights after
    ``keras.utils.set_random_seed(seed)``, the windows and permutations of
    ``seed``) for ``config.steps`` steps with ``fit``, and scores it on the
    held-out positions before and after.

    ``reuse``: a model this function returned for the same objective,
    config and variant: reinitialised with the fresh model's weights (its
    compiled programs kept).

    Returns:
        ``(scores, initial, model)``: :func:`prediction_scores` after and
        before training, and the trained model.
    """
    inputs, targets = held_out if held_out is not None else config.held_out()
    data = train_data if train_data is not None else _wiki_split("train")
    keras.utils.set_random_seed(seed)
    model = build_model(objective, config, variant)
    if reuse is None:
        compile_model(model, config.steps, config.learning_rate)
    else:
        model = _reinitialise(reuse, model)
    initial = prediction_scores(model, inputs, targets)
    model.fit(_PretrainingSequence(data, config.length, config.batch_size,
                                   config.predict_ratio, config.steps, seed),
              epochs=1, shuffle=False, verbose=0)
    return prediction_scores(model, inputs, targets), initial, model


def run_pretraining(config: PretrainConfig, seeds, objectives=OBJECTIVES, variant=None,
                    probe_examples=64, verbose=True):
    """Every objective over ``seeds`` seeds (:func:`train_objective`, the
    model of an objective reused, reinitialised, for its next seed), and
    the probes of each seed-0 model on the first ``probe_examples``
    held-out windows (:func:`query_leak_probe` for the two-stream
    objectives, :func:`position_probe` for all).

    Returns:
        A dict: ``"scores"`` and ``"initial"`` (``{objective: {metric:
        [per seed]}}`` after and before training), ``"leak"``
        (``{objective: probe}``), ``"position"`` (``{objective: relative
        change}``) and ``"weights"`` (``{objective: [trained weights per
        seed]}``, for :func:`run_downstream`).
    """
    held_out = config.held_out()
    data = _wiki_split("train")
    probe_inputs = {k: v[:probe_examples] for k, v in held_out[0].items()}
    out = {"scores": {o: {} for o in objectives}, "initial": {o: {} for o in objectives},
           "leak": {}, "position": {}, "weights": {o: [] for o in objectives}}
    models = {}
    for seed in range(seeds):
        for objective in objectives:
            after, before, model = train_objective(
                objective, seed, config, variant, held_out, reuse=models.get(objective),
                train_data=data)
            models[objective] = model
            for key, value in after.items():
                out["scores"][objective].setdefault(key, []).append(value)
            for key, value in before.items():
                out["initial"][objective].setdefault(key, []).append(value)
            out["weights"][objective].append(model.get_weights())
            if seed == 0:
                if objective != "mlm":
                    out["leak"][objective] = query_leak_probe(model, probe_inputs)
                out["position"][objective] = position_probe(model, probe_inputs)
            if verbose:
                print(f"seed {seed} {objective:>5}: held-out {after['bits']:.3f} bits/byte "
                      f"(untrained {before['bits']:.3f}), accuracy {after['accuracy']:.1f}%, "
                      f"first prediction {after['first_accuracy']:.1f}%", flush=True)
    return out


# ---------------------------------------------------------------- probes
def query_leak_probe(model, inputs):
    """Does the query stream at predicted position ``t`` depend on the
    content of token ``t``?

    For every predicted ``t``, the byte of token ``t`` (permuted column
    ``n - b + t``) is replaced by another byte in every example; the change
    of the logits of prediction ``t`` (the query stream's output there) is
    recorded, and the change of the logits of the later predictions
    ``t' > t``, which read token ``t`` through the content stream. Changes
    are relative to the largest logit magnitude.

    Returns:
        ``{"own": float (b,), "later": float (b - 1,)}``: the largest
        relative change of prediction ``t`` and of the predictions after
        ``t`` (``t < b - 1``).
    """
    tokens = np.asarray(inputs["tokens"], "int32")
    positions = np.asarray(inputs["positions"], "int32")
    n = tokens.shape[1]
    b = int(model.num_predicted)
    base = np.asarray(model.predict_on_batch({"tokens": tokens, "positions": positions}),
                      "float64")
    scale = max(float(np.max(np.abs(base))), 1e-30)
    own, later = np.zeros(b), np.zeros(max(b - 1, 0))
    for t in range(b):
        changed = tokens.copy()
        column = n - b + t
        changed[:, column] = (changed[:, column] + 1 + np.arange(len(tokens)) % 7) % 256
        out = np.asarray(model.predict_on_batch({"tokens": changed, "positions": positions}),
                         "float64")
        delta = np.abs(out - base) / scale
        own[t] = float(delta[:, t].max())
        if t < b - 1:
            later[t] = float(delta[:, t + 1:].max())
    return {"own": own, "later": later}


def position_probe(model, inputs):
    """Does the first prediction depend on the positions of the later
    predicted tokens?

    The positions of predicted tokens ``1 .. b - 1`` are moved (each to
    another position of the window) while every content and every other
    position stays; the largest change of the first prediction's logits,
    relative to the largest logit magnitude, is returned. MPNet's first
    prediction sees the positions of every predicted token (the appended
    mask tokens); PLM's sees only its own.
    """
    tokens = np.asarray(inputs["tokens"], "int32")
    positions = np.asarray(inputs["positions"], "int32")
    n = tokens.shape[1]
    b = int(model.num_predicted)
    if b < 2:
        raise ValueError(f"the position probe needs at least 2 predicted tokens; the model "
                         f"predicts b={b}")
    base = np.asarray(model.predict_on_batch({"tokens": tokens, "positions": positions}),
                      "float64")
    scale = max(float(np.max(np.abs(base))), 1e-30)
    moved = positions.copy()
    moved[:, n - b + 1:] = (moved[:, n - b + 1:] + 1 + np.arange(b - 1)[None]) % n
    out = np.asarray(model.predict_on_batch({"tokens": tokens, "positions": moved}), "float64")
    return float(np.max(np.abs(out[:, 0] - base[:, 0])) / scale)


# ------------------------------------------------------------- downstream
def make_corruption_task(data, num_examples, length, corrupted=3, seed=0):
    """Is a byte window corrupted? Windows of ``length`` bytes of ``data``;
    half of them (label 1) get ``corrupted`` positions overwritten by bytes
    drawn from other positions of the same window (the window's byte
    counts are nearly kept, so a model must judge the bytes in context).

    Returns:
        ``(tokens int32 (N, n), labels int32 (N,))``.
    """
    data = np.asarray(data)
    if not 1 <= corrupted <= length:
        raise ValueError(f"`corrupted` must be in [1, length={length}]. "
                         f"Received: corrupted={corrupted}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, data.size - length, size=num_examples)
    tokens = data[starts[:, None] + np.arange(length)[None]].astype("int32")
    labels = (np.arange(num_examples) % 2).astype("int32")
    rng.shuffle(labels)
    for i in np.nonzero(labels)[0]:
        where = rng.choice(length, size=corrupted, replace=False)
        source = rng.integers(0, length, size=corrupted)
        replacement = tokens[i, source]
        same = replacement == tokens[i, where]
        replacement[same] = (replacement[same] + 1) % 256
        tokens[i, where] = replacement
    return tokens, labels


class EncoderClassifier(keras.Model):
    """A classifier on the encoder of a pre-training model (its embeddings,
    blocks and final norm, shared, run as a plain bidirectional encoder as
    :meth:`PretrainingModel.encode` does), mean-pooled, and a new dense head.
    It holds the pre-training model's layers, so it is not serialised on
    its own (fine-tuning only)."""

    def __init__(self, pretrained, num_classes=2, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = pretrained.token_embedding
        self.position_embedding = pretrained.position_embedding
        self.encoder_layers = list(pretrained.encoder_layers)
        self.final_norm = pretrained.final_norm
        self.num_classes = int(num_classes)
        self.classifier = keras.layers.Dense(self.num_classes, name="classifier")

    def call(self, tokens, training=None):
        tokens = ops.cast(tokens, "int32")
        positions = ops.arange(tokens.shape[1], dtype="int32")[None]
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.encoder_layers:
            x, _ = block(x, training=training)
        return self.classifier(ops.mean(self.final_norm(x), axis=1))


def run_downstream(pretrained, config: PretrainConfig, seeds, *, steps, batch_size,
                   learning_rate, test_examples, corrupted=3, verbose=True):
    """Fine-tunes each pre-trained encoder (and one from scratch, the
    control) on :func:`make_corruption_task` (training windows from the
    training split, test windows from the test split).

    Args:
        pretrained: ``{arm: [weights per seed]}`` of pre-training models of
            ``config`` (:func:`run_pretraining`'s weights) for the
            objectives; the ``"scratch"`` arm is added (an untrained model).

    Returns:
        ``{arm: [test accuracy % per seed]}``.
    """
    train = _wiki_split("train")
    x_test, y_test = make_corruption_task(_wiki_split("test"), test_examples, config.length,
                                          corrupted, seed=20_000)
    arms = list(pretrained) + ["scratch"]
    accuracy = {arm: [] for arm in arms}
    compiled = None
    for seed in range(seeds):
        x, y = make_corruption_task(train, steps * batch_size, config.length, corrupted,
                                    seed=seed)
        for arm in arms:
            keras.utils.set_random_seed(1000 + seed)
            base = build_model("mlm" if arm == "scratch" else arm, config)
            if arm != "scratch":
                base.set_weights(pretrained[arm][seed])
            model = EncoderClassifier(base, 2, name="classifier")
            model(x[:1])
            if compiled is None:
                compiled = compile_model(model, steps, learning_rate)
            else:
                # The same architecture for every arm: one compiled model,
                # given this arm's weights and a zeroed optimizer.
                compiled = _reinitialise(compiled, model)
            compiled.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
            logits = compiled.predict(x_test, batch_size=256, verbose=0)
            accuracy[arm].append(100.0 * float(np.mean(np.argmax(logits, -1) == y_test)))
            if verbose:
                print(f"seed {seed} {arm:>7}: corruption detection {accuracy[arm][-1]:.1f}%",
                      flush=True)
    return accuracy


# ---------------------------------------------------------------- claims
def mpnet_claims(results: Mapping, margins: Mapping) -> list:
    """The claims of the MPNet notebook.

    Args:
        results:
            ``"leak"``: ``{objective: query_leak_probe dict}`` for ``"plm"``
            and ``"mpnet"`` (``"own"``, ``"later"`` relative changes);
            ``"position"``: ``{objective: position_probe value}`` for
            ``"plm"`` and ``"mpnet"`` (``"mlm"`` optional, reported);
            ``"scores"``: ``{objective: {"bits", "accuracy",
            "first_accuracy": [per seed]}}`` after pre-training;
            ``"initial"``: the same before training (``"bits"`` at least);
            ``"downstream"``: ``{arm: [accuracy % per seed]}`` with the
            objectives and ``"scratch"``, or None when skipped.
        margins: ``leak_tolerance`` (a relative change at or below it is no
            dependence), ``min_dependence`` (a relative change at or above
            it is one), ``min_bits_drop`` (bits per byte every objective's
            held-out loss must fall in pre-training), ``accuracy_margin``
            (points, held-out comparisons, reported),
            ``downstream_margin`` (points, reported) and
            ``downstream_chance`` (%, default 50: when no arm's mean is at
            least chance + ``downstream_margin``, the task was not learned
            and the downstream comparisons are not testable).
    """
    out = []
    tol, dep = float(margins["leak_tolerance"]), float(margins["min_dependence"])
    leak = results["leak"]
    parts, ok = [], True
    for objective in ("plm", "mpnet"):
        own = np.asarray(leak[objective]["own"], float)
        later = np.asarray(leak[objective]["later"], float)
        worst = float(own.max())
        weakest = float(later.min()) if later.size else 0.0
        ok = ok and worst <= tol and later.size > 0 and weakest >= dep
        parts.append(f"{objective}: own {worst:.1e}, later {weakest:.1e}")
    out.append(cl.Claim(
        "query_no_leak", "the query stream never sees the token it predicts: changing the "
        f"content of predicted token t moves prediction t by at most {tol:g} (relative), "
        f"and moves every later prediction by at least {dep:g} (the content stream carries it)",
        "two-stream self-attention and its masks (Figure 2)",
        "; ".join(parts) + " (largest own change, smallest later change)",
        cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
        f"own <= {tol}, later >= {dep}"))

    pos = results["position"]
    mp, pl = float(pos["mpnet"]), float(pos["plm"])
    ok = mp >= dep and pl <= tol
    extra = f", mlm {float(pos['mlm']):.1e}" if "mlm" in pos else ""
    out.append(cl.Claim(
        "position_compensation", "position compensation: moving the positions of the later "
        f"predicted tokens moves MPNet's first prediction (by at least {dep:g}, relative) "
        f"and leaves PLM's unchanged (at most {tol:g})",
        "MPNet sees the positions of the full sentence, PLM does not (Figure 2; Introduction)",
        f"mpnet {mp:.1e}, plm {pl:.1e}{extra}", cl.REPRODUCED if ok else cl.NOT_REPRODUCED,
        True, f"mpnet >= {dep}, plm <= {tol}"))

    scores, initial = results["scores"], results["initial"]
    drops = {o: [a - b for a, b in zip(initial[o]["bits"], scores[o]["bits"])]
             for o in scores}
    worst = min(drops, key=lambda o: cl.seed_stats(drops[o]).mean)
    ok = all(cl.seed_stats(d).mean >= margins["min_bits_drop"] for d in drops.values())
    out.append(cl.Claim(
        "trainable", "every objective trains with fit: its held-out loss falls by at least "
        f"{margins['min_bits_drop']} bits per predicted byte",
        "(the objectives as Keras models)",
        "; ".join(f"{o} {cl.format_stats(cl.seed_stats(scores[o]['bits']))} bits "
                  f"(from {cl.seed_stats(initial[o]['bits']).mean:.3f})" for o in scores),
        cl.REPRODUCED if ok else cl.NOT_REPRODUCED, True,
        f"smallest mean drop {cl.seed_stats(drops[worst]).mean:.3f} ({worst})"))

    m = margins["accuracy_margin"]
    if "mpnet" in scores and "plm" in scores:
        out.append(cl.compare_means(
            "held_out_mpnet_vs_plm", "held-out prediction: MPNet beats PLM on the same "
            "predicted bytes (the same factorisation; MPNet also sees the later positions)",
            scores["mpnet"]["accuracy"], scores["plm"]["accuracy"], m, asserted=False,
            paper="MPNet above PLM (the paper's ablation: removing position compensation "
                  "costs GLUE points)", labels=("mpnet", "plm"), digits=1))
    if "mpnet" in scores and "mlm" in scores:
        out.append(cl.compare_means(
            "first_mpnet_vs_mlm", "held-out prediction of the first predicted byte (the same "
            "context in the three objectives): MPNet against MLM",
            scores["mpnet"]["first_accuracy"], scores["mlm"]["first_accuracy"], m,
            asserted=False, paper="(no pre-training number in the paper)",
            labels=("mpnet", "mlm"), digits=1))
    if "plm" in scores and "mlm" in scores:
        out.append(cl.compare_means(
            "first_mlm_vs_plm", "held-out prediction of the first predicted byte: MLM, which "
            "sees every position, against PLM, which sees only its own",
            scores["mlm"]["first_accuracy"], scores["plm"]["first_accuracy"], m,
            asserted=False, paper="(PLM lacks the full sentence's positions: the paper's position discrepancy)",
            labels=("mlm", "plm"), digits=1))

    down = results.get("downstream")
    if down:
        dm = margins["downstream_margin"]
        glue = PAPER["glue_dev_average"]
        chance = float(margins.get("downstream_chance", 50.0))
        best = max(cl.seed_stats(v).mean for v in down.values())
        learned = best >= chance + dm
        for name, better, worse in (("downstream_mpnet_vs_mlm", "mpnet", "mlm"),
                                    ("downstream_mpnet_vs_plm", "mpnet", "plm"),
                                    ("downstream_pretrained_vs_scratch", "mpnet", "scratch")):
            if better not in down or worse not in down:
                continue
            paper = (f"GLUE dev average {glue[BASELINE_OF[better]]} vs "
                     f"{glue[BASELINE_OF[worse]]} (GLUE dev table)" if worse != "scratch"
                     else "(control: pre-training helps)")
            claim = cl.compare_means(
                name, f"downstream (corruption detection, fine-tuned): {better} beats {worse}",
                down[better], down[worse], dm, asserted=False, paper=paper,
                labels=(better, worse), digits=1)
            if not learned:
                # No arm is above chance by the margin: the task was not
                # learned, so it cannot order the encoders.
                claim = dataclasses.replace(
                    claim, verdict=cl.NOT_TESTABLE,
                    detail=claim.detail + f"; no arm reaches chance ({chance:g}%) + {dm}")
            out.append(claim)
    return out


# -------------------------------------------------------- planted bugs
#: The small size the planted variants train at (:data:`PLANTED`).
PLANTED_CONFIG = PretrainConfig(length=24, predict_ratio=0.2, dim=32, layers=1, num_heads=2,
                                batch_size=32, steps=20, learning_rate=3e-3, valid_windows=32)
#: The objectives the planted run trains (MLM has no query stream and no
#: position compensation: the notebook trains it, the planted set does not).
PLANTED_OBJECTIVES = ("plm", "mpnet")
PLANTED_MARGINS = dict(leak_tolerance=1e-5, min_dependence=1e-3, min_bits_drop=1.0,
                       accuracy_margin=2.0, downstream_margin=2.0)
#: The objectives each variant breaks (the others are the real run's).
VARIANT_OBJECTIVES = {
    "own_content_query": ("mpnet",),
    "no_position_compensation": ("mpnet",),
    "frozen_weights": ("mpnet",),
}


@functools.lru_cache(maxsize=None)
def _planted_arm(objective, variant):
    """One objective at the planted size: held-out scores after and before,
    and the probes of the trained model."""
    config = PLANTED_CONFIG
    held = _planted_held_out()
    after, before, model = train_objective(objective, 0, config, variant, held)
    # The probes on the held-out windows themselves: the same batch shape
    # as the held-out predictions, so no new compilation.
    leak = query_leak_probe(model, held[0]) if objective != "mlm" else None
    position = position_probe(model, held[0])
    return after, before, leak, position


@functools.lru_cache(maxsize=None)
def _planted_held_out():
    return PLANTED_CONFIG.held_out()


def _planted_run(variant=None):
    """The notebook's claims at the planted size (one seed, PLM and MPNet,
    no downstream task), with the real models (``variant=None``) or with the objectives of
    :data:`VARIANT_OBJECTIVES` built as the planted ``variant``."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"`variant` must be None or one of {sorted(VARIANTS)}. "
                         f"Received: variant={variant!r}")
    broken = VARIANT_OBJECTIVES.get(variant, ())
    scores, initial, leak, position = {}, {}, {}, {}
    for objective in PLANTED_OBJECTIVES:
        after, before, lk, pos = _planted_arm(objective,
                                              variant if objective in broken else None)
        scores[objective] = {k: [v] for k, v in after.items()}
        initial[objective] = {k: [v] for k, v in before.items()}
        if lk is not None:
            leak[objective] = lk
        position[objective] = pos
    results = {"leak": leak, "position": position, "scores": scores, "initial": initial,
               "downstream": None}
    return mpnet_claims(results, PLANTED_MARGINS)


PLANTED = planted.PlantedSet("mpnet", run=_planted_run, variants=(
    planted.PlantedVariant(
        "own_content_query", "MPNet whose query mask is built without the diagonal "
        "exclusion (OwnContentQueryBlock: the query stream sees the token it predicts)",
        ("query_no_leak",)),
    planted.PlantedVariant(
        "no_position_compensation", "MPNet whose appended mask tokens carry no position "
        "(PositionlessMaskModel: the mask tokens are there, the predicted positions are not)",
        ("position_compensation",)),
    planted.PlantedVariant(
        "frozen_weights", "MPNet pre-training model whose weights are frozen "
        "(FrozenPretrainingModel: fit runs, nothing learns)",
        ("trainable",)),
))
