"""Taking a keras-hub model long (the Longformer recipe): the guide's
experiment, its measures and its claims.

A small keras-hub ``RobertaBackbone`` is trained on tokenized Wikipedia
text at a short length on a task whose answer can stand anywhere in the
input and is told apart from decoys by its position. It is
then made long with :func:`keras_longattn.hub.longify` (attention swapped
for ``LocalAttention`` or ``LongformerAttention``, the learned position
table extended by copying, as Beltagy et al. 2020 made RoBERTa long) and
fine-tuned at the long length. A tiny ``GPT2Backbone`` is converted the same
way and generates past its trained length with keras-hub's sampler.

* :data:`PAPER`: what the Longformer paper says of the recipe (§5, as the
  seed slides quote it).
* :func:`wiki_token_ids`, :func:`text_windows`, :func:`make_far_key_task`
  (the data) from the Wikipedia sample through
  :func:`keras_longattn.hub.tokenizers.wikipedia_tokenizer`.
* :class:`Config`, :func:`build_roberta`, :func:`train_short_model`: the
  short model (the task at the short length).
* :func:`long_attention`, :func:`convert`, :func:`longify_dropping_positions`
  (the planted bug: a conversion whose new position rows are re-initialised):
  the conversions.
* :func:`run_copy_init` (accuracy on long inputs right after conversion,
  copied against dropped positions), :func:`run_task` (truncated vs Local vs
  Longformer over seeds), :func:`output_difference` (converted against
  original where the window covers the input), :func:`compiled_costs` (XLA
  memory and FLOPs of the forward and backward pass on JAX, wall time
  reported) and :func:`train_gpt2` / :func:`run_generation` (greedy
  generation from the converted decoder): the measures.
* :func:`longify_claims`: the claims from the results; :data:`PLANTED`: the
  broken conversions trained through the same functions at a small size.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping

import keras
import numpy as np

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import planted

__all__ = [
    "ARMS",
    "Config",
    "PAPER",
    "PLANTED",
    "ShortModel",
    "build_roberta",
    "compiled_backbone_cost",
    "compiled_costs",
    "convert",
    "longify_claims",
    "longify_dropping_positions",
    "longify_halved_window",
    "long_attention",
    "key_ids",
    "make_far_key_task",
    "output_difference",
    "covering_differences",
    "finetune_arm",
    "long_test_set",
    "short_test_set",
    "truncated_accuracy",
    "run_copy_init",
    "run_generation",
    "run_task",
    "text_windows",
    "train_gpt2",
    "train_short_model",
    "wiki_token_ids",
]

#: What the Longformer paper (Beltagy, Peters, Cohan 2020, §5, as quoted by
#: the seed slides ``002``) says of the recipe: continue pre-training from
#: RoBERTa with sliding-window attention of window 512 on all layers (the
#: computation of RoBERTa), inputs up to 4,096 tokens, the new position
#: embeddings initialised by copying RoBERTa's 512; and the downstream
#: results of RoBERTa-base and Longformer-base (WikiHop, TriviaQA,
#: HotpotQA, OntoNotes, IMDB, Hyperpartisan).
PAPER = {
    "window": 512,
    "roberta_length": 512,
    "long_length": 4096,
    "downstream": {
        "roberta_base": {"WikiHop": 72.4, "TriviaQA": 74.3, "HotpotQA": 63.5,
                         "OntoNotes": 78.4, "IMDB": 95.3, "Hyperpartisan": 87.4},
        "longformer_base": {"WikiHop": 75.0, "TriviaQA": 75.2, "HotpotQA": 64.4,
                            "OntoNotes": 78.6, "IMDB": 95.7, "Hyperpartisan": 94.8},
    },
}

#: The three ways of reading a long input with the short model.
ARMS = ("truncated", "local", "longformer")

#: RoBERTa's special ids in :func:`keras_longattn.hub.tokenizers.wikipedia_tokenizer`.
START_ID, PAD_ID, END_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4


# ------------------------------------------------------------------ data
@functools.lru_cache(maxsize=None)
def _tokenizer(model, vocabulary_size):
    from keras_longattn.hub.tokenizers import wikipedia_tokenizer

    return wikipedia_tokenizer(model, vocabulary_size=vocabulary_size)


@functools.lru_cache(maxsize=None)
def wiki_token_ids(split, vocabulary_size, model="roberta"):
    """The articles of one split of the Wikipedia sample (``"train"``,
    ``"valid"`` or ``"test"`` of :func:`keras_longattn.datasets.wiki_article_splits`),
    tokenized by :func:`keras_longattn.hub.tokenizers.wikipedia_tokenizer`
    (``model``, ``vocabulary_size``: trained on the training articles) and
    concatenated, each article followed by the end token (RoBERTa) or
    ``<|endoftext|>`` (GPT-2). A read-only int32 array, cached."""
    from keras_longattn.datasets import load_wiki_articles, wiki_article_splits

    splits = wiki_article_splits()
    if split not in splits:
        raise ValueError(f"`split` must be one of {sorted(splits)}. Received: split={split!r}")
    tokenizer = _tokenizer(model, vocabulary_size)
    articles = load_wiki_articles()
    texts = [articles[i][1].decode("utf-8") for i in splits[split]]
    end = tokenizer.end_token_id
    pieces = []
    for ids in tokenizer(texts):
        pieces.append(np.asarray(ids, "int32"))
        pieces.append(np.asarray([end], "int32"))
    out = np.concatenate(pieces)
    out.flags.writeable = False
    return out


def text_windows(ids, count, length, rng):
    """``count`` windows of ``length`` consecutive tokens of ``ids`` at
    positions drawn by ``rng`` (a ``numpy.random.Generator``): int32
    ``(count, length)``."""
    ids = np.asarray(ids)
    if length > ids.shape[0]:
        raise ValueError(f"`length` ({length}) is longer than the text ({ids.shape[0]} tokens)")
    starts = rng.integers(0, ids.shape[0] - length + 1, size=count)
    return ids[starts[:, None] + np.arange(length)[None, :]].astype("int32")


def key_ids(vocabulary_size, num_keys):
    """The token ids of the task's keys: the last ``num_keys`` ids of the
    vocabulary (the least frequent merges; removed from the filler text)."""
    return np.arange(vocabulary_size - num_keys, vocabulary_size, dtype="int32")


def make_far_key_task(ids, count, length, min_position, max_position, *, num_keys,
                      vocabulary_size, seed, grid=8, num_decoys=2):
    """A classification task on real text whose answer stands anywhere and
    is told apart from decoys by its position.

    Each example is ``<s>`` followed by ``length - 1`` tokens of Wikipedia
    text (a random window of ``ids``) in which the ``num_keys`` key ids
    (:func:`key_ids`) are replaced by ``<unk>``. The answer key is written
    at a position on the grid (a multiple of ``grid``) drawn uniformly from
    those in ``min_position .. max_position``; ``num_decoys`` other keys,
    drawn at random, at positions off the grid anywhere in the input. The
    label is which key stands on the grid: a model must read positions (a
    bag of tokens sees the answer and the decoys alike) and must reach the
    answer from ``<s>``; a model fed the first ``m`` tokens sees no answer
    when ``min_position >= m`` (chance: ``1 / num_keys``).

    Returns:
        ``(tokens, labels, positions)``: int32 ``(count, length)``,
        ``(count,)`` in ``0 .. num_keys - 1``, ``(count,)`` (the answer's).
    """
    for name, value in (("count", count), ("length", length), ("num_keys", num_keys),
                        ("grid", grid)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    if not 1 <= min_position <= max_position < length:
        raise ValueError("Need 1 <= min_position <= max_position < length. Received: "
                         f"min_position={min_position!r}, max_position={max_position!r}, "
                         f"length={length!r}")
    slots = np.arange(-(-min_position // grid) * grid, max_position + 1, grid)
    if slots.size == 0:
        raise ValueError(f"No multiple of `grid` ({grid}) in {min_position} .. {max_position}")
    rng = np.random.default_rng(seed)
    keys = key_ids(vocabulary_size, num_keys)
    tokens = np.empty((count, length), "int32")
    tokens[:, 0] = START_ID
    tokens[:, 1:] = text_windows(ids, count, length - 1, rng)
    body = tokens[:, 1:]
    body[np.isin(body, keys)] = UNK_ID
    rows = np.arange(count)
    off_grid = np.nonzero(np.arange(length) % grid)[0]
    for _ in range(int(num_decoys)):
        tokens[rows, rng.choice(off_grid, size=count)] = keys[rng.integers(0, num_keys, count)]
    labels = rng.integers(0, num_keys, size=count).astype("int32")
    positions = rng.choice(slots, size=count).astype("int32")
    tokens[rows, positions] = keys[labels]
    return tokens, labels, positions


def _features(tokens):
    tokens = np.asarray(tokens, "int32")
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


# ---------------------------------------------------------------- models
@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the experiment (the notebook's parameters).

    ``short_length``: the length the model is trained at; ``long_length``:
    the converted length; ``window``: the window of the converted Local and
    Longformer layers; ``grid``, ``num_decoys``: the task's
    (:func:`make_far_key_task`); ``task_steps``: training steps at the
    short length; ``finetune_steps``: fine-tuning steps at the
    long length; ``test_examples``: held-out examples."""

    short_length: int = 256
    long_length: int = 512
    vocabulary_size: int = 1024
    num_layers: int = 2
    num_heads: int = 4
    hidden_dim: int = 64
    intermediate_dim: int = 128
    window: int = 64
    num_keys: int = 4
    batch_size: int = 16
    task_steps: int = 100
    finetune_steps: int = 40
    test_examples: int = 128
    learning_rate: float = 3e-3
    grid: int = 8
    num_decoys: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", int) and (isinstance(value, bool) or not isinstance(
                    value, (int, np.integer)) or value < 1):
                raise ValueError(f"`{field.name}` must be a positive integer. "
                                 f"Received: {field.name}={value!r}")
        if self.long_length <= self.short_length:
            raise ValueError("`long_length` must be longer than `short_length`. Received: "
                             f"long_length={self.long_length}, short_length={self.short_length}")

    @property
    def chance(self) -> float:
        """Accuracy (%) of a guess on the task."""
        return 100.0 / self.num_keys


def build_roberta(config: Config, max_sequence_length=None, seed=0):
    """A keras-hub ``RobertaBackbone`` of ``config``'s sizes, no dropout,
    built from its config (no preset) with seed ``seed``."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    return keras_hub.models.RobertaBackbone(
        vocabulary_size=config.vocabulary_size, num_layers=config.num_layers,
        num_heads=config.num_heads, hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim, dropout=0.0,
        max_sequence_length=max_sequence_length or config.short_length)


def _classifier(backbone, head):
    return keras.Model(backbone.input, head(backbone.output[:, 0, :]))


def _dense_copy(head, input_dim):
    copy = keras.layers.Dense(head.units, name=head.name)
    copy.build((None, input_dim))
    copy.set_weights(head.get_weights())
    return copy


def _compile(model, learning_rate):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _reset_optimizer(model):
    """Sets the optimizer's state (moments, iteration count) back to zero:
    the next fit starts like a fresh optimizer, with the compiled step kept.
    The learning rate, also one of ``optimizer.variables``, is kept."""
    learning_rate = model.optimizer.learning_rate
    for variable in model.optimizer.variables:
        if variable is learning_rate or variable.path.endswith("/learning_rate"):
            continue
        variable.assign(np.zeros(variable.shape, variable.dtype))


def _fit(model, x, y, batch_size, sample_weight=None):
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=1,
                        shuffle=False, verbose=0)
    return [float(v) for v in history.history["loss"]]


def _accuracy(model, tokens, labels, batch_size=32):
    correct = 0
    for i in range(0, tokens.shape[0], batch_size):
        logits = np.asarray(model.predict_on_batch(_features(tokens[i:i + batch_size])))
        correct += int(np.sum(np.argmax(logits, axis=-1) == labels[i:i + batch_size]))
    return 100.0 * correct / tokens.shape[0]


@dataclasses.dataclass
class ShortModel:
    """The model trained at the short length: ``backbone`` (keras-hub's
    ``RobertaBackbone``) and ``head`` (a ``Dense`` layer on ``<s>``),
    ``accuracy``: held-out task accuracy (%) at the short length,
    ``losses``: the training loss per epoch, ``seconds``."""

    config: Config
    backbone: object
    head: object
    accuracy: float
    losses: list
    seconds: float
    _model: object = dataclasses.field(default=None, repr=False, compare=False)

    def classifier(self):
        """The short classifier (token ids -> logits over the keys), built
        once and reused (its compiled prediction step with it)."""
        if self._model is None:
            self._model = _classifier(self.backbone, self.head)
        return self._model


def _task_set(config, count, length, min_position, max_position, seed, split="train"):
    return make_far_key_task(
        wiki_token_ids(split, config.vocabulary_size), count, length, min_position,
        max_position, num_keys=config.num_keys, vocabulary_size=config.vocabulary_size,
        seed=seed, grid=config.grid, num_decoys=config.num_decoys)


def short_test_set(config: Config, seed=999):
    """Held-out (test articles) examples of length ``short_length``, answer
    anywhere on the grid."""
    n = config.short_length
    return _task_set(config, config.test_examples, n, 1, n - 1, seed, split="test")


def long_test_set(config: Config, seed=12345):
    """The LONG split: held-out (test articles) examples of length
    ``long_length`` whose answer stands at or beyond ``short_length``."""
    return _task_set(config, config.test_examples, config.long_length, config.short_length,
                     config.long_length - 1, seed, split="test")


def train_short_model(config: Config, seed=0) -> ShortModel:
    """Trains a :func:`build_roberta` backbone (``short_length`` positions)
    with a linear head on ``<s>`` on :func:`make_far_key_task` at
    ``short_length`` (answer anywhere on the grid, training articles,
    ``task_steps`` batches of fresh examples)."""
    started = time.perf_counter()
    n, b = config.short_length, config.batch_size
    backbone = build_roberta(config, seed=seed)
    head = keras.layers.Dense(config.num_keys, name="task_head")
    classifier = _classifier(backbone, head)
    _compile(classifier, config.learning_rate)
    tokens, labels, _ = _task_set(config, config.task_steps * b, n, 1, n - 1, seed + 1)
    losses = _fit(classifier, _features(tokens), labels, b)
    test_tokens, test_labels, _ = short_test_set(config)
    accuracy = _accuracy(classifier, test_tokens, test_labels)
    return ShortModel(config, backbone, head, accuracy, losses,
                      time.perf_counter() - started, _model=classifier)


# ----------------------------------------------------------- conversions
def long_attention(arm, window, variant=None):
    """The attention config of a converted arm: ``"local"``:
    ``LocalAttention(window)``; ``"longformer"``: ``LongformerAttention(window)``
    with ``<s>`` (position 0) global. Planted: ``"no_global"`` (Longformer
    with no global position) and ``"dense_swap"`` (``FullAttention`` in
    Longformer's place)."""
    if arm == "local":
        return {"class_name": "LocalAttention", "config": {"window": int(window)}}
    if arm != "longformer":
        raise ValueError(f"`arm` must be 'local' or 'longformer'. Received: arm={arm!r}")
    if variant == "dense_swap":
        return {"class_name": "FullAttention", "config": {}}
    global_tokens = 0 if variant == "no_global" else 1
    return {"class_name": "LongformerAttention",
            "config": {"window": int(window), "global_tokens": global_tokens}}


def longify_dropping_positions(backbone, attention, max_sequence_length, seed=0):
    """A conversion that drops the copied positions (the planted bug): the
    backbone of :func:`keras_longattn.hub.longify`, whose position rows
    beyond the trained length are re-initialised with RoBERTa's initializer
    (what a conversion that only makes the table longer gives)."""
    from keras_longattn import hub

    long_backbone = hub.longify(backbone, attention, max_sequence_length=max_sequence_length)
    _reinitialise_positions(long_backbone, int(backbone.max_sequence_length), seed)
    return long_backbone


def _reinitialise_positions(backbone, start, seed):
    """Draws rows ``start ..`` of ``backbone``'s position table afresh with
    RoBERTa's initializer (seed ``seed``)."""
    from keras_hub.src.models.roberta.roberta_backbone import roberta_kernel_initializer

    table = backbone.embeddings.position_embedding.position_embeddings
    values = keras.ops.convert_to_numpy(table).copy()
    keras.utils.set_random_seed(seed)
    values[start:] = keras.ops.convert_to_numpy(
        roberta_kernel_initializer()((values.shape[0] - start, values.shape[1])))
    table.assign(values)


def longify_halved_window(backbone, attention, max_sequence_length=None):
    """A conversion that builds the attention with half the requested window
    (a one-sided / two-sided window mix-up; planted): otherwise
    :func:`keras_longattn.hub.longify`."""
    from keras_longattn import hub

    spec = {"class_name": attention["class_name"], "config": dict(attention.get("config", {}))}
    if "window" in spec["config"]:
        spec["config"]["window"] = max(1, int(spec["config"]["window"]) // 2)
    return hub.longify(backbone, spec, max_sequence_length=max_sequence_length)


def convert(backbone, attention, max_sequence_length, variant=None):
    """:func:`keras_longattn.hub.longify`, or the planted conversion
    ``variant`` (``"dropped_positions"``: :func:`longify_dropping_positions`;
    ``"halved_window"``: :func:`longify_halved_window`)."""
    from keras_longattn import hub

    if variant == "dropped_positions":
        return longify_dropping_positions(backbone, attention, max_sequence_length)
    if variant == "halved_window":
        return longify_halved_window(backbone, attention, max_sequence_length)
    return hub.longify(backbone, attention, max_sequence_length=max_sequence_length)


# --------------------------------------------------------------- measures
def run_copy_init(short: ShortModel, seeds, variant=None, arms=("copied", "dropped", "short")):
    """Accuracy (%) on the LONG split right after conversion (Longformer,
    ``<s>`` global, no training), where every answer stands at a position
    whose embedding the conversion made:

    * ``"copied"``: :func:`keras_longattn.hub.longify` (positions copied;
      the planted ``variant`` ``"dropped_positions"`` builds this arm with
      :func:`longify_dropping_positions`);
    * ``"dropped"``: the control, :func:`longify_dropping_positions`
      (re-initialised with each seed);
    * ``"short"``: the short model at its own length (held-out examples of
      ``short_length``), the skill to keep.

    Each seed draws its own held-out examples (the same for every arm).

    Returns:
        ``{arm: [accuracy per seed]}`` for each of ``arms``.
    """
    config = short.config
    attention = long_attention("longformer", config.window)
    head = _dense_copy(short.head, config.hidden_dim)
    out = {arm: [] for arm in arms}
    models = {}
    if "copied" in arms:
        models["copied"] = _classifier(convert(
            short.backbone, attention, config.long_length,
            "dropped_positions" if variant == "dropped_positions" else None), head)
    if "dropped" in arms:
        dropped_backbone = _hub_longify(short.backbone, attention, config.long_length)
        models["dropped"] = _classifier(dropped_backbone, head)
    for seed in seeds:
        tokens, labels, _ = long_test_set(config, seed=20000 + seed)
        if "dropped" in arms:
            _reinitialise_positions(dropped_backbone, config.short_length, seed)
        for arm, model in models.items():
            out[arm].append(_accuracy(model, tokens, labels))
        if "short" in arms:
            short_tokens, short_labels, _ = short_test_set(config, seed=30000 + seed)
            out["short"].append(_accuracy(short.classifier(), short_tokens, short_labels))
    return out


def _hub_longify(backbone, attention, max_sequence_length):
    """:func:`keras_longattn.hub.longify` (imported when called)."""
    from keras_longattn import hub

    return hub.longify(backbone, attention, max_sequence_length=max_sequence_length)


def truncated_accuracy(short: ShortModel, test_set, variant=None):
    """The short classifier on the first ``short_length`` tokens of the LONG
    test set (accuracy, %). Planted ``"tail_truncation"``: the last
    ``short_length`` tokens instead, with ``<s>`` in front."""
    config = short.config
    tokens, labels, _ = test_set
    if variant == "tail_truncation":
        cut = np.concatenate([tokens[:, :1], tokens[:, -(config.short_length - 1):]], axis=1)
    else:
        cut = tokens[:, :config.short_length]
    return _accuracy(short.classifier(), cut, labels)


def finetune_arm(short: ShortModel, arm, seed, test_set, variant=None, reuse=None):
    """Converts the short classifier's backbone to ``arm`` (``"local"`` or
    ``"longformer"``) at ``long_length``, measures its accuracy on the LONG
    test set right away (zero-shot), fine-tunes it ``finetune_steps``
    batches at ``long_length`` (key anywhere in ``1 .. long_length - 1``,
    training articles, data drawn by ``seed``) and measures it again.
    ``reuse``: a model of the same arm from an earlier seed, whose weights
    and optimizer are reset to the fresh conversion (the compiled step is
    kept).

    Returns:
        ``(zero_shot_accuracy, accuracy, model)``.
    """
    config = short.config
    backbone = convert(short.backbone, long_attention(arm, config.window, variant),
                       config.long_length)
    fresh = _classifier(backbone, _dense_copy(short.head, config.hidden_dim))
    if reuse is None:
        model = fresh
        _compile(model, config.learning_rate)
    else:
        model = reuse
        model.set_weights(fresh.get_weights())
        _reset_optimizer(model)
    tokens, labels, _ = test_set
    zero_shot = _accuracy(model, tokens, labels)
    n = config.long_length
    train_tokens, train_labels, _ = _task_set(
        config, config.finetune_steps * config.batch_size, n, 1, n - 1, 5000 + seed)
    _fit(model, _features(train_tokens), train_labels, config.batch_size)
    return zero_shot, _accuracy(model, tokens, labels), model


def run_task(short: ShortModel, seeds, variant=None, verbose=True, arms=ARMS):
    """Truncated, Local and Longformer on the LONG test set over ``seeds``.

    Returns:
        ``(accuracy, zero_shot)``: ``{arm: [accuracy % per seed]}`` for
        each of ``arms`` (default :data:`ARMS`; the truncated model is not trained: the same value for
        every seed) and ``{"local", "longformer"}`` -> zero-shot accuracy
        per seed.
    """
    test_set = long_test_set(short.config)
    accuracy = {arm: [] for arm in arms}
    zero_shot = {arm: [] for arm in arms if arm != "truncated"}
    if "truncated" in arms:
        truncated = truncated_accuracy(short, test_set,
                                       variant if variant == "tail_truncation" else None)
        accuracy["truncated"] = [truncated] * len(seeds)
    for arm in (a for a in arms if a != "truncated"):
        model = None
        for seed in seeds:
            started = time.perf_counter()
            zero, acc, model = finetune_arm(
                short, arm, seed, test_set,
                variant if (arm == "longformer" and variant == "no_global") else None,
                reuse=model)
            zero_shot[arm].append(zero)
            accuracy[arm].append(acc)
            if verbose:
                print(f"{arm:>10} seed {seed}: zero-shot {zero:5.1f}%, fine-tuned {acc:5.1f}% "
                      f"({time.perf_counter() - started:.1f} s)")
    return accuracy, zero_shot


def output_difference(original, converted, length, seed=0):
    """Largest absolute difference between the outputs of ``original`` and
    ``converted`` (backbones, or ``original``'s outputs already computed by
    :func:`_probe_outputs`) on random token ids of ``length`` drawn with
    ``seed``, relative to the largest absolute output of ``original``."""
    tokens, reference = (original if isinstance(original, tuple)
                         else _probe_outputs(original, length, seed))
    out = np.asarray(converted.predict_on_batch(_features(tokens)))
    return float(np.max(np.abs(reference - out)) / max(float(np.max(np.abs(reference))), 1e-30))


def _probe_outputs(backbone, length, seed=0):
    """``(tokens, outputs)``: two rows of random token ids of ``length`` and
    ``backbone``'s outputs on them."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, backbone.vocabulary_size, size=(2, length)).astype("int32")
    return tokens, np.asarray(backbone.predict_on_batch(_features(tokens)))


def covering_differences(short: ShortModel, gpt2_backbone=None, variant=None):
    """:func:`output_difference` at ``short_length`` of the trained RoBERTa
    backbone against its conversions whose window covers the input
    (Local and Longformer of window ``2 * short_length``: ``window // 2``
    keys on each side) and, with ``gpt2_backbone``, of GPT-2 against
    causal Local attention of window ``short_length``; all at
    ``long_length``. ``variant``: the planted conversion (``"halved_window"``)."""
    config = short.config
    n = config.short_length
    out = {}
    reference = _probe_outputs(short.backbone, n)
    for arm in ("local", "longformer"):
        attention = long_attention(arm, 2 * n)
        out[f"roberta_{arm}"] = output_difference(
            reference, convert(short.backbone, attention, config.long_length, variant), n)
    if gpt2_backbone is not None:
        attention = {"class_name": "LocalAttention", "config": {"window": n}}
        out["gpt2_local"] = output_difference(
            gpt2_backbone, convert(gpt2_backbone, attention, config.long_length, variant), n)
    return out


def compiled_backbone_cost(backbone, length, batch=1, repeats=0):
    """The compiled cost of one forward + backward pass of ``backbone`` on
    ``(batch, length)`` token ids (the gradient of the sum of squared
    outputs with respect to every trainable weight), from XLA's analysis of
    the compiled program on JAX (deterministic); with ``repeats`` > 0 the
    compiled program is also run that many times on zeros (wall clock,
    median, reported only).

    Returns:
        ``{"status", "temp_mib", "gflops", "median_ms"}`` (``status`` is
        ``"error: ..."`` when the program does not compile).

    Raises:
        ValueError: on a backend other than JAX.
    """
    if keras.backend.backend() != "jax":
        raise ValueError("`compiled_backbone_cost` reads the compiled program of JAX; the "
                         f"Keras backend is {keras.backend.backend()!r}")
    import jax

    trainable = [v.value for v in backbone.trainable_variables]
    non_trainable = [v.value for v in backbone.non_trainable_variables]

    def loss(weights, token_ids):
        inputs = {"token_ids": token_ids, "padding_mask": jax.numpy.ones_like(token_ids)}
        out, _ = backbone.stateless_call(weights, non_trainable, inputs)
        return jax.numpy.sum(jax.numpy.square(out))

    x = jax.ShapeDtypeStruct((batch, int(length)), "int32")
    try:
        compiled = jax.jit(jax.grad(loss)).lower(trainable, x).compile()
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
    except Exception as error:  # a failed compilation is recorded, not raised
        return {"status": f"error: {type(error).__name__}: {error}"[:200],
                "temp_mib": None, "gflops": None, "median_ms": None}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    median_ms = None
    if repeats:
        tokens = jax.numpy.zeros((batch, int(length)), "int32")
        jax.block_until_ready(compiled(trainable, tokens))
        times = []
        for _ in range(int(repeats)):
            started = time.perf_counter()
            jax.block_until_ready(compiled(trainable, tokens))
            times.append(time.perf_counter() - started)
        median_ms = round(1000 * float(np.median(times)), 3)
    return {"status": "ok", "temp_mib": round(memory.temp_size_in_bytes / 2**20, 3),
            "gflops": None if flops is None else round(float(flops) / 1e9, 4),
            "median_ms": median_ms}


COST_ARMS = ("full", "local", "longformer")


def compiled_costs(config: Config, lengths, repeats=0, variant=None, arms=COST_ARMS):
    """:func:`compiled_backbone_cost` at each of ``lengths`` of keras-hub's
    ``RobertaBackbone`` of ``config``'s sizes at that length (``"full"``:
    its own dense attention) and of its conversions (``"local"``,
    ``"longformer"``: window ``config.window``, ``<s>`` global). Planted
    ``"dense_swap"``: ``FullAttention`` in Longformer's place.

    Returns:
        ``{arm: {length: row}}``.
    """
    out = {arm: {} for arm in arms}
    base = build_roberta(config, seed=0)
    for n in lengths:
        for arm in arms:
            if arm == "full":
                backbone = build_roberta(config, max_sequence_length=int(n), seed=0)
            else:
                backbone = convert(base, long_attention(arm, config.window, variant), int(n))
            out[arm][int(n)] = compiled_backbone_cost(backbone, int(n), repeats=repeats)
    return out


# ------------------------------------------------------------- generation
def train_gpt2(config: Config, steps, seed=0):
    """A keras-hub ``GPT2Backbone`` of ``config``'s sizes (vocabulary: the
    ``"gpt2"`` tokenizer's), no dropout, trained ``steps`` batches as a
    causal LM on windows of ``short_length`` of the training articles, in
    keras-hub's ``GPT2CausalLM`` (no preprocessor). Returns
    ``(causal_lm, losses)``."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    n = config.short_length
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=config.vocabulary_size, num_layers=config.num_layers,
        num_heads=config.num_heads, hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim, dropout=0.0, max_sequence_length=n)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               sampler="greedy")
    ids = wiki_token_ids("train", config.vocabulary_size, model="gpt2")
    losses = []
    if steps:
        windows = text_windows(ids, steps * config.batch_size, n + 1,
                               np.random.default_rng(seed))
        losses = _fit(lm, _features(windows[:, :-1]), windows[:, 1:], config.batch_size)
    return lm, losses


def _generate(lm, prompt, max_length):
    tokens = np.zeros((1, max_length), "int32")
    mask = np.zeros((1, max_length), bool)
    tokens[0, :len(prompt)] = prompt
    mask[0, :len(prompt)] = True
    out = lm.generate({"token_ids": tokens, "padding_mask": mask}, stop_token_ids=None)
    return np.asarray(keras.ops.convert_to_numpy(out["token_ids"]))[0]


def run_generation(lm, config: Config, prompt_length, generate_length, variant=None):
    """Greedy generation (keras-hub's ``"greedy"`` sampler, compiled by
    keras-hub) from the trained ``lm`` and from its conversion to causal
    ``LocalAttention`` of window ``short_length`` at ``generate_length``
    positions (:class:`keras_longattn.hub.LongGPT2CausalLM`, our caches),
    from the first ``prompt_length`` tokens of the test articles. The
    original generates up to ``short_length`` (its table); the converted
    model up to ``generate_length``. ``variant``: the planted conversion
    (``"halved_window"``).

    Returns:
        ``{"original": ids (short_length,), "converted": ids
        (generate_length,), "equal": whether the converted model's tokens
        equal the original's on the first short_length positions,
        "first_difference": the first position where they differ or None,
        "text": the converted model's text, "seconds"}``.
    """
    from keras_longattn import hub

    started = time.perf_counter()
    n = config.short_length
    prompt = np.asarray(wiki_token_ids("test", config.vocabulary_size, model="gpt2")
                        [:prompt_length])
    original = _generate(lm, prompt, n)
    backbone = convert(lm.backbone, {"class_name": "LocalAttention", "config": {"window": n}},
                       int(generate_length), variant)
    long_lm = hub.LongGPT2CausalLM(backbone=backbone, preprocessor=None)
    long_lm.compile(sampler="greedy")
    converted = _generate(long_lm, prompt, int(generate_length))
    differ = np.nonzero(converted[:n] != original)[0]
    tokenizer = _tokenizer("gpt2", config.vocabulary_size)
    return {"original": original, "converted": converted,
            "equal": bool(differ.size == 0),
            "first_difference": int(differ[0]) if differ.size else None,
            "text": tokenizer.detokenize(converted.tolist()),
            "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------- claims
def _bool_claim(name, statement, paper, ok, ours, asserted=True, detail=""):
    return cl.Claim(name, statement, paper, ours,
                    cl.REPRODUCED if ok else cl.NOT_REPRODUCED, asserted, detail)


def longify_claims(results: Mapping, margins: Mapping) -> list:
    """The claims of the longify notebook.

    Args:
        results:
            ``"differences"``: :func:`covering_differences` (relative output
            differences where the window covers the input);
            ``"generation"``: ``{"equal": bool, "first_difference": int or
            None}`` (:func:`run_generation`), or None when not run;
            ``"copy_init"``: :func:`run_copy_init` (accuracy %);
            ``"accuracy"``: ``{"truncated", "local", "longformer"}`` ->
            accuracy (%) per seed on the LONG test set (:func:`run_task`);
            ``"zero_shot"``: ``{"local", "longformer"}`` -> accuracy per
            seed before fine-tuning; ``"chance"`` (%);
            ``"compiled"``: :func:`compiled_costs`, or None where not
            measured (a backend other than JAX).
        margins: ``max_output_difference`` (relative), ``copy_margin``
            (points: copied positions above dropped ones, zero-shot),
            ``accuracy_margin`` (points: Longformer above Local),
            ``min_long_accuracy`` (Longformer's accuracy, at least),
            ``max_blind_excess`` (points above chance allowed to the
            truncated model; the Local model's is reported),
            ``min_memory_ratio``, ``min_flops_ratio`` (full over Longformer
            at the longest compiled length), ``min_speedup`` (reported).
    """
    out = []
    diffs = results["differences"]
    worst = max(diffs.values())
    tol = margins["max_output_difference"]
    out.append(_bool_claim(
        "outputs_match", "where the window covers the input, the converted backbone's "
        "outputs equal the original's, before any training",
        "§5: the converted model starts from RoBERTa's weights",
        worst <= tol, ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
        + f" (needs <= {tol:g})"))
    gen = results.get("generation")
    if gen is None:
        out.append(cl.report_only("generation_match", "the converted GPT-2 generates the "
                                  "original's greedy tokens while the sequence fits both",
                                  "not run", cl.NOT_TESTABLE))
    else:
        ours = ("equal on every position both generate" if gen["equal"]
                else f"differ from position {gen['first_difference']}")
        out.append(_bool_claim(
            "generation_match", "the converted GPT-2 (keras-hub's greedy sampler, our "
            "cache) generates the original's tokens while the sequence fits both, and "
            "goes on past the trained length", "—", gen["equal"], ours, asserted=False,
            detail="reported: a GPT-2 this small repeats tokens greedily, so a broken "
            "window need not change its tokens (outputs_match tests the conversion)"))
    ci = results["copy_init"]
    out.append(cl.compare_means(
        "copy_init", "right after conversion, before any fine-tuning, the Longformer "
        "conversion with the copied position table keeps the short model's skill on the "
        "LONG split: it beats the same conversion with the new rows re-initialised by "
        "copy_margin points", ci["copied"], ci["dropped"], margins["copy_margin"],
        paper="§5: new positions initialised by copying RoBERTa's 512",
        digits=1, labels=("copied", "dropped")))
    out.append(cl.no_worse_than(
        "copy_init_keeps_skill", "the copied conversion's accuracy on the LONG split, "
        "zero-shot, is within copy_margin points of the short model's at its own length",
        ci["copied"], ci["short"], margins["copy_margin"], asserted=False, digits=1,
        labels=("copied", "short")))
    acc, chance = results["accuracy"], results["chance"]
    out.append(cl.at_most(
        "truncated_blind", "the short model fed the first short_length tokens stays at "
        "chance on the LONG split (every key beyond them)", acc["truncated"],
        chance + margins["max_blind_excess"], paper="—", digits=1))
    out.append(cl.at_least(
        "longformer_solves", "Longformer (<s> global) fine-tuned at the long length reads "
        "the key beyond the trained length", acc["longformer"],
        margins["min_long_accuracy"], paper="WikiHop, Hyperpartisan: Longformer-base above "
        "RoBERTa-base (which truncates)", digits=1))
    out.append(cl.compare_means(
        "longformer_beats_local", "Longformer (<s> global) beats Local attention whose "
        "reach from <s> ends before the key, by accuracy_margin points",
        acc["longformer"], acc["local"], margins["accuracy_margin"], digits=1,
        labels=("longformer", "local")))
    local = cl.seed_stats(acc["local"])
    out.append(cl.report_only(
        "local_blind", "Local attention (window far below the key's distance) stays near "
        "chance", f"{cl.format_stats(local, 1)} (chance {chance:.0f})",
        cl.REPRODUCED if local.mean <= chance + margins["max_blind_excess"]
        else cl.NOT_REPRODUCED,
        detail="reported: no planted variant targets it (a leak would show in "
        "longformer_beats_local)"))
    zero = results.get("zero_shot") or {}
    if zero:
        out.append(cl.report_only(
            "zero_shot", "accuracy on the LONG split right after conversion, before "
            "fine-tuning", "; ".join(f"{arm} {cl.format_stats(cl.seed_stats(v), 1)}"
                                     for arm, v in zero.items()), cl.NOT_TESTABLE,
            detail="reported, no claim of the paper"))
    out.extend(_cost_claims(results.get("compiled"), margins))
    return out


def _cost_claims(compiled, margins):
    names = (("memory_ratio", "temp_mib", "min_memory_ratio", "less temporary memory"),
             ("flops_ratio", "gflops", "min_flops_ratio", "fewer FLOPs"))
    if compiled is None:
        return [cl.report_only(name, f"on JAX: Longformer's compiled forward + backward "
                               f"needs {key} times {unit} than keras-hub's full "
                               "attention at the longest length", "not measured (not JAX)",
                               cl.NOT_TESTABLE) for name, _, key, unit in names] + [
            cl.report_only("speedup", "wall-clock speed-up of Longformer over full "
                           "attention", "not measured (not JAX)", cl.NOT_TESTABLE)]
    full, lf = compiled["full"], compiled["longformer"]
    both = [n for n in sorted(full) if full[n]["status"] == "ok" and lf[n]["status"] == "ok"]
    out = []
    for name, field, key, unit in names:
        statement = (f"on JAX, from the compiled forward + backward program: Longformer "
                     f"needs {key} times {unit} than keras-hub's full attention at the "
                     "longest length")
        if not both:
            out.append(_bool_claim(name, statement, "—", False, "no length compiled"))
            continue
        n = both[-1]
        ratio = full[n][field] / lf[n][field]
        out.append(_bool_claim(name, statement, "—", ratio >= margins[key],
                               f"{ratio:.1f}x at n = {n} (needs >= {margins[key]})"))
    timed = [n for n in both if full[n].get("median_ms") and lf[n].get("median_ms")]
    if timed:
        n = timed[-1]
        ratio = full[n]["median_ms"] / lf[n]["median_ms"]
        verdict = (cl.REPRODUCED if ratio >= margins["min_speedup"] else
                   cl.DIRECTION_ONLY if ratio > 1 else cl.NOT_REPRODUCED)
        out.append(cl.report_only(
            "speedup", "wall-clock speed-up of Longformer over full attention (forward + "
            "backward, reported)", f"{ratio:.2f}x at n = {n} (full {full[n]['median_ms']:.1f}"
            f" ms, Longformer {lf[n]['median_ms']:.1f} ms)", verdict))
    else:
        out.append(cl.report_only("speedup", "wall-clock speed-up of Longformer over full "
                                  "attention", "not timed", cl.NOT_TESTABLE))
    return out


# ------------------------------------------------------------- planted set
#: The small size the planted variants train at (:data:`PLANTED`).
PLANTED_CONFIG = Config(short_length=32, long_length=96, vocabulary_size=512, num_layers=2,
                        num_heads=2, hidden_dim=32, intermediate_dim=64, window=8,
                        num_keys=4, batch_size=16, task_steps=120,
                        finetune_steps=20, test_examples=64, learning_rate=3e-3)
PLANTED_SEEDS = (0, 1)
PLANTED_COST_LENGTHS = (512,)
PLANTED_MARGINS = dict(max_output_difference=1e-4, copy_margin=25.0, accuracy_margin=20.0,
                       min_long_accuracy=60.0, max_blind_excess=15.0, min_memory_ratio=2.0,
                       min_flops_ratio=1.5, min_speedup=1.5)

#: The measurement each variant is planted in; the others are the real
#: run's (cached).
VARIANT_MEASURES = {
    "dropped_positions": "copy_init",
    "no_global": "task",
    "tail_truncation": "task",
    "dense_swap": "compiled",
    "halved_window": "equality",
}


@functools.lru_cache(maxsize=None)
def _planted_short():
    return train_short_model(PLANTED_CONFIG, seed=0)


@functools.lru_cache(maxsize=None)
def _planted_gpt2():
    """An untrained GPT-2 of the planted size (the equality check needs no
    training)."""
    import keras_hub

    config = PLANTED_CONFIG
    keras.utils.set_random_seed(0)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=config.vocabulary_size, num_layers=config.num_layers,
        num_heads=config.num_heads, hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim, dropout=0.0,
        max_sequence_length=config.short_length)


@functools.lru_cache(maxsize=None)
def _planted_measure(measure, arm, variant):
    """One arm of one measurement at the planted size (cached: each arm is
    measured once per process with the real conversions and once with the
    variant planted in it)."""
    config = PLANTED_CONFIG
    short = _planted_short()
    if measure == "copy_init":
        return run_copy_init(short, PLANTED_SEEDS, variant, arms=(arm,))[arm]
    if measure == "task":
        accuracy, zero_shot = run_task(short, PLANTED_SEEDS, variant, verbose=False,
                                       arms=(arm,))
        return accuracy[arm], zero_shot.get(arm)
    if measure == "compiled":
        return compiled_costs(config, PLANTED_COST_LENGTHS, variant=variant,
                              arms=(arm,))[arm]
    if measure == "equality":
        return covering_differences(short, _planted_gpt2(), variant)
    raise ValueError(f"unknown measure {measure!r}")


#: The arm each variant is planted in (``None``: every arm of its measure).
VARIANT_ARMS = {
    "dropped_positions": "copied",
    "no_global": "longformer",
    "tail_truncation": "truncated",
    "dense_swap": "longformer",
    "halved_window": None,
}


def _planted_run(variant=None):
    """The notebook's claims at the planted size, with the real conversions
    (``variant=None``) or with the planted ``variant`` in the arm of the
    measurement :data:`VARIANT_MEASURES` and :data:`VARIANT_ARMS` name;
    everything else is the real run's."""
    if variant is not None and variant not in VARIANT_MEASURES:
        raise ValueError(f"`variant` must be None or one of {sorted(VARIANT_MEASURES)}. "
                         f"Received: variant={variant!r}")

    def measure(name, arm=None):
        planted_here = (VARIANT_MEASURES.get(variant) == name
                        and VARIANT_ARMS.get(variant) in (None, arm))
        return _planted_measure(name, arm, variant if planted_here else None)

    accuracy, zero_shot = {}, {}
    for arm in ARMS:
        accuracy[arm], zero = measure("task", arm)
        if zero is not None:
            zero_shot[arm] = zero
    compiled = None
    if keras.backend.backend() == "jax":
        compiled = {arm: measure("compiled", arm) for arm in ("full", "longformer")}
    results = {"differences": measure("equality"), "generation": None,
               "copy_init": {arm: measure("copy_init", arm)
                             for arm in ("copied", "dropped", "short")},
               "accuracy": accuracy, "zero_shot": zero_shot,
               "chance": PLANTED_CONFIG.chance, "compiled": compiled}
    return longify_claims(results, PLANTED_MARGINS)


PLANTED = planted.PlantedSet("longify", run=_planted_run, variants=(
    planted.PlantedVariant(
        "dropped_positions", "a conversion that drops the copied positions "
        "(longify_dropping_positions: the rows beyond the trained length re-initialised)",
        ("copy_init",)),
    planted.PlantedVariant(
        "no_global", "the Longformer conversion with no global position (<s> an ordinary "
        "windowed token)", ("longformer_solves", "longformer_beats_local")),
    planted.PlantedVariant(
        "tail_truncation", "a truncation that keeps the last short_length tokens (with <s>) "
        "instead of the first", ("truncated_blind",)),
    planted.PlantedVariant(
        "dense_swap", "FullAttention in Longformer's place in the converted backbone "
        "(quadratic memory)", ("memory_ratio", "flops_ratio")),
    planted.PlantedVariant(
        "halved_window", "a conversion that builds the attention with half the requested "
        "window (longify_halved_window)", ("outputs_match",)),
))
