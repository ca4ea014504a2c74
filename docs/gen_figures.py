"""Generates the docs' figures and generated pages.

``mkdocs build`` and ``mkdocs serve`` call this module through the hook
``docs/hooks/generate.py`` (``hooks:`` in ``mkdocs.yml``): nothing needs to
run before them. The hook writes into ``build/docs-generated/`` (cached by a
hash of the inputs) and adds the files to the site at the paths below, as if
they were in ``docs/``; nothing is written into ``docs/``. To look at the
generated files without building the site::

    python docs/gen_figures.py                      # everything, into build/docs-preview/
    python docs/gen_figures.py patterns --out DIR   # some of: patterns, benchmarks, notebooks

The files, by their path in the site's sources (none is committed):

* ``assets/patterns/<layer>.png``: the attention pattern of every layer
  of ``keras_longattn.layers``, causal and bidirectional, drawn from the
  layer's own ``attention_pattern(n, n, causal).dense_mask(n, n)``;
* ``benchmarks.md`` and ``assets/benchmarks/*.png``: the benchmark
  page, from ``docs/benchmarks/results.json`` (committed results, in the
  format of ``build/benchmarks/latest.json``), else from
  ``build/benchmarks/latest.json`` (a local run, labelled as such), else a
  page that says there are no results;
* ``notebooks/<slug>.ipynb`` and ``reproductions.md``: the notebooks of
  ``notebooks/`` for mkdocs-jupyter, each from its committed full-size run
  (``docs/results/``) when there is one, else from the CI-size run of
  ``build/notebooks/`` (``keras-longattn reproduce --all``), else unexecuted
  with a note; and the reproductions index with each notebook's results.
  A committed run whose sources changed since it ran (or that records no
  provenance) gets a "Stale" note on its page and in the index, from
  :func:`stale_checks` (``keras_longattn/reproductions/provenance.py``, the
  check of ``keras-longattn reproduce --stale``).

Adding a mechanism: its layer gets a figure automatically (constructor
options for the figure go in :data:`FIGURE_OPTIONS`); write
``docs/guides/<layer>.md`` and add it to the ``nav`` of ``mkdocs.yml``.
"""

from __future__ import annotations

import argparse
import copy
import html
import json
import logging
import math
import os
import re
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Where the command line writes by default (the hook: build/docs-generated/).
PREVIEW_DIR = ROOT / "build" / "docs-preview"

# Paths of the generated files in the site's sources (relative to docs/).
PATTERNS_URI = "assets/patterns"
BENCHMARK_ASSETS_URI = "assets/benchmarks"
BENCHMARK_PAGE_URI = "benchmarks.md"
BENCHMARK_PLOT_NAME = "benchmark.png"
NOTEBOOKS_URI = "notebooks"
REPRODUCTIONS_URI = "reproductions.md"

BENCHMARK_SOURCES = (
    (DOCS / "benchmarks" / "results.json", "committed"),
    (ROOT / "build" / "benchmarks" / "latest.json", "local"),
)
#: Committed memory-per-token runs of LocalAttention on torch (n = 16K .. 1M,
#: forward and backward of the attention alone), drawn on the benchmark page
#: when present: benchmark JSON, one run or several merged.
MEMORY_CURVE_SOURCE = DOCS / "benchmarks" / "memory_per_token.json"
#: The summary of the last device check (``scripts/device_check.sh``,
#: ``python -m keras_longattn.benchmarks.device_report --write``).
GPU_SOURCE = DOCS / "benchmarks" / "gpu_results.json"
MEMORY_PLOT_NAME = "memory_per_token.png"
NOTEBOOKS_SRC = ROOT / "notebooks"
NOTEBOOKS_BUILD = ROOT / "build" / "notebooks"
#: Committed full-size runs (``keras-longattn reproduce <slug> --full
#: --output-dir docs/results``): shown in the docs in place of the CI-size
#: run of the build when present.
NOTEBOOKS_FULL = DOCS / "results"
GUIDES = DOCS / "guides"

#: Sequence length of the pattern figures.
PATTERN_LENGTH = 32
#: Constructor options of a layer for its figure (besides num_heads, key_dim).
FIGURE_OPTIONS = {
    "LocalAttention": {"window": 8},
    "SparseAttention": {"block_length": 8},
    "RoutingAttention": {"num_clusters": 4, "seed": 0},
    "AdaMRAAttention": {"compression_rates": (0.5, 0.125)},
    "LinformerAttention": {"k": 8, "max_length": 32},
    "SynthesizerAttention": {"kind": "random+vanilla", "max_length": 32},
    "LongformerAttention": {"window": 6, "dilation": [1, 2], "global_tokens": 2},
    "BigBirdAttention": {"block_size": 2, "window_blocks": 3, "global_blocks": 1,
                         "random_blocks": 2, "seed": 0},
    "NystromAttention": {"num_landmarks": 8},
    "LSHAttention": {"bucket_size": 4, "num_hashes": 2, "hash_seed": 0},
    "AdaptiveSpanAttention": {"max_span": 16, "ramp": 4},
}
#: Layers whose figure shows each head's pattern (``layer.head_patterns``),
#: causal and bidirectional: heads that differ (Longformer's dilations).
PER_HEAD_FIGURES = {"LongformerAttention"}
#: Approximations of softmax attention whose figure compares their explicit
#: weights with softmax attention's on one input, same projections: each
#: maps to the panels (a label and constructor overrides of the layer).
APPROXIMATION_FIGURES = {
    "LinearAttention": (("elu+1 features", {"feature_map": "elu+1"}),
                        ("relu features", {"feature_map": "relu"})),
    "PerformerAttention": (("m = 16 features", {"num_features": 16, "seed": 0}),
                           ("m = 256 features", {"num_features": 256, "seed": 0}),
                           ("m = 4096 features", {"num_features": 4096, "seed": 0})),
}
#: Figure and guide names that ``snake_case`` does not give (acronyms).
SLUGS = {"AdaMRAAttention": "adamra_attention", "BigBirdAttention": "bigbird_attention",
         "NystromAttention": "nystrom_attention", "LSHAttention": "lsh_attention"}

GENERATED_NOTE = (
    "<!-- Generated by docs/gen_figures.py: edit that script, not this file. -->\n"
)

#: Each file written (debug) and what is missing (info). Under mkdocs this is
#: a child of mkdocs' logger (``mkdocs build -v`` shows the debug lines); the
#: command line prints everything.
log = logging.getLogger("mkdocs.hooks.gen_figures")


def snake_case(name: str) -> str:
    """``LocalAttention`` -> ``local_attention``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------
# Attention patterns
# ---------------------------------------------------------------------------


def attention_layers() -> dict[str, type]:
    """Every attention layer class exported by ``keras_longattn.layers``."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras_longattn.layers as layers

    found = {}
    for name in dir(layers):
        obj = getattr(layers, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, layers.BaseAttention)
            and obj is not layers.BaseAttention
        ):
            found[name] = obj
    return dict(sorted(found.items()))


def is_content_dependent(cls) -> bool:
    """Whether the layer's keys depend on the data (e.g. routing): such a
    layer overrides ``_attention_reference`` (see ``BaseAttention``), and its
    ``attention_pattern`` is not what it computes."""
    from keras_longattn.layers import BaseAttention

    return any("_attention_reference" in vars(k) for k in cls.__mro__
               if k is not BaseAttention and issubclass(k, BaseAttention))


def pattern_masks(layer, n: int = PATTERN_LENGTH):
    """``{"causal": mask, "bidirectional": mask}``: boolean numpy ``(n, n)``
    arrays from the layer's own ``attention_pattern(...).dense_mask(n, n)``."""
    import numpy as np
    from keras import ops

    masks = {}
    for label, causal in (("causal", True), ("bidirectional", False)):
        pattern = layer.attention_pattern(n, n, causal)
        masks[label] = np.asarray(ops.convert_to_numpy(pattern.dense_mask(n, n)), dtype=bool)
    return masks


def head_pattern_masks(layer, n: int = PATTERN_LENGTH):
    """``{"head 0, causal": mask, ...}``: each head's
    ``layer.head_patterns(n, n, causal)[h].dense_mask(n, n)``, causal and
    bidirectional."""
    import numpy as np
    from keras import ops

    masks = {}
    for label, causal in (("causal", True), ("bidirectional", False)):
        for h, pattern in enumerate(layer.head_patterns(n, n, causal)):
            mask = ops.convert_to_numpy(pattern.dense_mask(n, n))
            masks[f"head {h}, {label}"] = np.asarray(mask, dtype=bool)
    return masks


def content_masks(layer, n: int = PATTERN_LENGTH, head: int = -1, seed: int = 0):
    """The keys that one head of a content-dependent layer attends to on one
    seeded random input: the nonzero weights of ``return_attention_scores``
    (the layer's reference path, under the clusters it forms), causal and
    bidirectional, for head ``head`` (default: the last, a routing head)."""
    import numpy as np
    from keras import ops

    dim = layer.num_heads * layer.key_dim
    x = np.random.default_rng(seed).standard_normal((1, n, dim)).astype("float32")
    masks = {}
    for label, causal in (("causal", True), ("bidirectional", False)):
        _, scores = layer(x, x, use_causal_mask=causal, return_attention_scores=True)
        scores = np.asarray(ops.convert_to_numpy(scores))[0, head]
        masks[label] = scores > 0
    return masks


def support_masks(layer, n: int = PATTERN_LENGTH, seed: int = 0):
    """``{"head 0": mask, ...}``: ``layer.attention_support`` on one seeded
    random input (bidirectional), one panel per head."""
    import numpy as np
    from keras import ops

    dim = layer.num_heads * layer.key_dim
    x = np.random.default_rng(seed).standard_normal((1, n, dim)).astype("float32")
    layer(x, x)
    support = np.asarray(ops.convert_to_numpy(layer.attention_support(x, x)))[0]
    return {f"head {h}": support[h] for h in range(support.shape[0])}


def draw_nystrom(name: str, options: dict, path: Path, n: int = PATTERN_LENGTH,
                 seed: int = 0) -> Path:
    """NystromAttention's figure: one head's exact softmax matrix, the
    layer's ``F A^+ B`` on the same weights and input (its
    ``return_attention_scores``), and their difference."""
    import numpy as np
    from keras import ops

    import keras_longattn.layers as layers

    plt = _pyplot()
    layer = layers.NystromAttention(num_heads=2, key_dim=4, **options)
    full = layers.FullAttention(num_heads=2, key_dim=4)
    x = np.random.default_rng(seed).standard_normal((1, n, 8)).astype("float32")
    full(x, x)
    layer(x, x)
    layer.set_weights(full.get_weights())
    exact = np.asarray(ops.convert_to_numpy(full(x, x, return_attention_scores=True)[1]))[0, 0]
    approx = np.asarray(ops.convert_to_numpy(layer(x, x, return_attention_scores=True)[1]))[0, 0]
    panels = {"exact softmax (FullAttention)": exact,
              f"F A+ B, {options.get('num_landmarks')} landmarks": approx,
              "difference": approx - exact}
    fig, axes = plt.subplots(1, 3, figsize=(12.6, 4.6), squeeze=False)
    top = float(np.abs(exact).max())
    for ax, (label, matrix) in zip(axes[0], panels.items()):
        scale = top if label != "difference" else float(np.abs(matrix).max())
        image = ax.imshow(matrix, cmap="RdBu_r", vmin=-scale, vmax=scale,
                          interpolation="nearest")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    fig.suptitle(f"{name}({args}), n = {n}: head 0 on one random input", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def approximation_weights(cls, panels, n: int = PATTERN_LENGTH, seed: int = 0):
    """``{"softmax (FullAttention)": w, label: w, ...}``: head 0's
    bidirectional ``(n, n)`` weights of FullAttention and of ``cls`` under
    each panel's overrides (its explicit weights,
    ``return_attention_scores``), all with FullAttention's projections, on
    one seeded random input of unit variance."""
    import numpy as np
    from keras import ops

    import keras

    from keras_longattn.layers import FullAttention

    keras.utils.set_random_seed(seed)  # the projections: one figure per seed
    x = np.random.default_rng(seed).standard_normal((1, n, 8)).astype("float32")
    full = FullAttention(num_heads=2, key_dim=4, seed=seed)
    _, scores = full(x, x, return_attention_scores=True)
    weights = {"softmax (FullAttention)": np.asarray(ops.convert_to_numpy(scores))[0, 0]}
    for label, overrides in panels:
        layer = cls(num_heads=2, key_dim=4, **overrides)
        layer(x, x)
        layer.set_weights(full.get_weights())
        _, scores = layer(x, x, return_attention_scores=True)
        weights[label] = np.asarray(ops.convert_to_numpy(scores))[0, 0]
    return weights


def draw_weights(name: str, weights: dict, path: Path) -> Path:
    """Draws attention weight matrices side by side into ``path`` (PNG),
    one colour scale, each titled with its largest difference from the
    first (softmax) panel."""
    import numpy as np

    plt = _pyplot()
    first = next(iter(weights.values()))
    top = max(float(w.max()) for w in weights.values())
    fig, axes = plt.subplots(1, len(weights), figsize=(4.2 * len(weights), 4.6),
                             squeeze=False)
    for i, (ax, (label, w)) in enumerate(zip(axes[0], weights.items())):
        image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=top, interpolation="nearest")
        title = label if i == 0 else (
            f"{label}\nmax |w - softmax| = {float(np.abs(w - first).max()):.3f}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key position j")
        if i == 0:
            ax.set_ylabel("query position i")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
    n = first.shape[0]
    fig.suptitle(f"{name}: head 0's weights on one random input (n = {n}), "
                 "same projections as FullAttention", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


#: The panels of EntmaxAttention's figure: a title and the fixed ``alpha``.
ENTMAX_FIGURE_ALPHAS = (("softmax (alpha = 1)", 1.0), ("1.5-entmax (alpha = 1.5)", 1.5),
                        ("sparsemax (alpha = 2)", 2.0))
#: The span fractions ``v_h`` (span ``z_h = max_span * v_h``) of the heads of
#: AdaptiveSpanAttention's figure, one head each.
SPAN_FIGURE_FRACTIONS = (0.0, 0.25, 0.5, 1.0)
#: The colour of the entries that are exactly 0 in EntmaxAttention's figure.
EXACT_ZERO_COLOUR = "#e4572e"


def entmax_weights(n: int = PATTERN_LENGTH, seed: int = 0, alphas=ENTMAX_FIGURE_ALPHAS,
                   causal: bool = False):
    """``{title: w, ...}``: head 0's ``(n, n)`` weights of
    ``EntmaxAttention`` at each fixed α of ``alphas`` (its
    ``return_attention_scores``), every panel with the same projections
    (Glorot-uniform kernels and zero biases drawn from a NumPy generator of
    ``seed``, so the figure depends on nothing else), on one seeded random
    input of unit variance."""
    import numpy as np
    from keras import ops

    from keras_longattn.layers import EntmaxAttention

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n, 8)).astype("float32")
    weights, projections = {}, None
    for title, alpha in alphas:
        layer = EntmaxAttention(num_heads=2, key_dim=4, alpha=alpha)
        layer(x, x)
        if projections is None:
            projections = []
            for variable, w in zip(layer.weights, layer.get_weights()):
                if w.ndim == 3:  # kernels: (dim, heads, size); the output's (heads, size, dim)
                    output = "attention_output" in variable.path
                    fan_in = w.shape[0] * w.shape[1] if output else w.shape[0]
                    limit = np.sqrt(6.0 / (fan_in + w.size // fan_in))
                    w = rng.uniform(-limit, limit, w.shape)
                else:
                    w = np.zeros_like(w)
                projections.append(w.astype("float32"))
        layer.set_weights(projections)
        _, scores = layer(x, x, use_causal_mask=causal, return_attention_scores=True)
        weights[title] = np.asarray(ops.convert_to_numpy(scores))[0, 0]
    return weights


def draw_entmax(name: str, options: dict, path: Path, n: int = PATTERN_LENGTH,
                seed: int = 0) -> Path:
    """EntmaxAttention's figure: head 0's bidirectional weights under
    softmax, 1.5-entmax and sparsemax (:func:`entmax_weights`), one colour
    scale, exact zeros in a colour of their own; each panel is titled with
    its share of exact zeros. ``options`` is unused (the panels are
    :data:`ENTMAX_FIGURE_ALPHAS`); it is the signature of
    :data:`CUSTOM_FIGURES`."""
    import numpy as np

    plt = _pyplot()
    weights = entmax_weights(n, seed)
    top = max(float(w.max()) for w in weights.values())
    cmap = plt.get_cmap("viridis").with_extremes(bad=EXACT_ZERO_COLOUR)
    fig, axes = plt.subplots(1, len(weights), figsize=(4.2 * len(weights), 4.8),
                             squeeze=False)
    for i, (ax, (title, w)) in enumerate(zip(axes[0], weights.items())):
        zeros = w == 0.0
        image = ax.imshow(np.ma.masked_where(zeros, w), cmap=cmap, vmin=0.0, vmax=top,
                          interpolation="nearest")
        ax.set_title(f"{title}\n{100 * zeros.mean():.0f}% exact zeros "
                     f"({int(zeros.sum())} of {zeros.size})", fontsize=10)
        ax.set_xlabel("key position j")
        if i == 0:
            ax.set_ylabel("query position i")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="weight (red: exactly 0)")
    fig.suptitle(f"{name}: head 0's weights on one random input (n = {n}), "
                 "same projections in every panel", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def span_masks(options: dict, n: int = PATTERN_LENGTH, fractions=SPAN_FIGURE_FRACTIONS):
    """The causal soft masks of an ``AdaptiveSpanAttention(**options)`` with
    one head per entry of ``fractions``, its span fractions set to them
    through the layer's weights: ``(layer, {title: (n, n) mask})`` with the
    layer's own ``span_mask(i - j)`` on ``j <= i`` and 0 above the
    diagonal."""
    import numpy as np
    from keras import ops

    from keras_longattn.layers import AdaptiveSpanAttention

    heads = len(fractions)
    layer = AdaptiveSpanAttention(num_heads=heads, key_dim=2, **options)
    x = np.zeros((1, n, 2 * heads), "float32")
    layer(x, x, use_causal_mask=True)
    weights = layer.get_weights()
    weights[-1] = np.asarray(fractions, "float32")  # the span fractions, last
    layer.set_weights(weights)
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    masks = np.asarray(ops.convert_to_numpy(layer.span_mask(i - j))) * (j <= i)
    spans = ops.convert_to_numpy(layer.current_spans())
    return layer, {f"head {h}: span z = {float(spans[h]):g}": masks[h] for h in range(heads)}


def draw_adaptive_span(name: str, options: dict, path: Path, n: int = PATTERN_LENGTH) -> Path:
    """AdaptiveSpanAttention's figure: each head's causal soft mask
    ``m_z(i - j)`` (:func:`span_masks`) in greys, white 0 to black 1, each
    panel titled with its span and the keys it weighs per query."""
    plt = _pyplot()
    layer, masks = span_masks(options, n)
    fig, axes = plt.subplots(1, len(masks), figsize=(3.9 * len(masks), 4.5), squeeze=False)
    for i, (ax, (title, mask)) in enumerate(zip(axes[0], masks.items())):
        image = ax.imshow(mask, cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest")
        keys = int((mask[-1] > 0).sum())
        ax.set_title(f"{title}\nlast query weighs {keys} keys", fontsize=10)
        ax.set_xlabel("key position j")
        if i == 0:
            ax.set_ylabel("query position i")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="soft mask m_z(i - j)")
    args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    fig.suptitle(f"{name}({args}), causal, n = {n}: the soft mask of each head; "
                 f"band computed: current_reach() = {layer.current_reach()}", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


#: Layers whose figure is drawn by a function of their own.
CUSTOM_FIGURES = {"NystromAttention": draw_nystrom, "EntmaxAttention": draw_entmax,
                  "AdaptiveSpanAttention": draw_adaptive_span}


def draw_pattern(name: str, options: dict, masks: dict, path: Path,
                 caption: str = "query i attends key j where blue") -> Path:
    """Draws the masks side by side into ``path`` (PNG)."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#f4f4f4", "#3f51b5"])
    fig, axes = plt.subplots(1, len(masks), figsize=(4.2 * len(masks), 4.6), squeeze=False)
    for ax, (label, mask) in zip(axes[0], masks.items()):
        n = mask.shape[0]
        ax.imshow(mask, cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"{label}: {mask.sum()} of {mask.size} pairs ({100 * mask.mean():.0f}%)",
                     fontsize=10)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        ticks = list(range(0, n, 8)) + [n - 1]
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.set_xticks([x - 0.5 for x in range(1, n)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, n)], minor=True)
        ax.grid(which="minor", color="white", linewidth=0.4)
        ax.tick_params(which="minor", length=0)
    args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    fig.suptitle(f"{name}({args}), n = {n}: {caption}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def generate_patterns(out_dir: Path, n: int = PATTERN_LENGTH,
                      guides: Path = GUIDES) -> list[Path]:
    """One figure per layer into ``out_dir``; a layer with a guide page
    (``guides/<layer>.md``) must produce one."""
    written = []
    for name, cls in attention_layers().items():
        slug = SLUGS.get(name, snake_case(name))
        required = (guides / f"{slug}.md").exists()
        options = dict(FIGURE_OPTIONS.get(name, {}))
        content = is_content_dependent(cls)
        caption = "query i attends key j where blue"
        if content:
            # Content-dependent layers override _attention_reference: their
            # attention_pattern is not what runs. Their figure shows what
            # one head attends to on one seeded random input.
            caption = "one head on one random input, blue = attended"
        if name in CUSTOM_FIGURES:
            path = CUSTOM_FIGURES[name](name, options, out_dir / f"{slug}.png", n)
            written.append(path)
            log.debug("%s", _relative(path))
            continue
        try:
            if name in APPROXIMATION_FIGURES:
                weights = approximation_weights(cls, APPROXIMATION_FIGURES[name], n)
                path = draw_weights(name, weights, out_dir / f"{slug}.png")
                written.append(path)
                log.debug("%s", _relative(path))
                continue
            layer = cls(num_heads=2, key_dim=4, **options)
            if name in PER_HEAD_FIGURES:
                # An exact pattern per head (its reference is overridden
                # for other reasons, e.g. Longformer's global projections).
                caption = "head h: query i attends key j where blue"
                masks = head_pattern_masks(layer, n)
            elif hasattr(layer, "attention_support"):
                # No scores and no causal mode (AdaMRA, Linformer): the keys each head
                # draws on, per head.
                caption = "head h of query i draws on key j where blue"
                masks = support_masks(layer, n)
            else:
                masks = content_masks(layer, n) if content else pattern_masks(layer, n)
        except Exception as error:  # noqa: BLE001 - reported, fatal when required
            message = f"{name}: no pattern figure ({type(error).__name__}: {error})"
            if required:
                raise RuntimeError(
                    message + f"; docs/guides/{slug}.md needs it: set its constructor "
                    "options in FIGURE_OPTIONS of docs/gen_figures.py"
                ) from error
            log.info("skipped %s", message)
            continue
        path = draw_pattern(name, options, masks, out_dir / f"{slug}.png", caption)
        written.append(path)
        log.debug("%s", _relative(path))
    return written


# ---------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------

MIB = float(1 << 20)
DASH = "\u2014"


def find_benchmark(sources=BENCHMARK_SOURCES):
    """``(document, path, kind)`` of the first benchmark JSON that exists,
    or ``(None, None, None)``."""
    for path, kind in sources:
        if path.is_file():
            with open(path, encoding="utf-8") as stream:
                return json.load(stream), path, kind
    return None, None, None


def _num(value, digits=3):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return DASH
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.{digits - 1}f}"


def _ratio(row, field, suffix=""):
    value = row.get(field)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return _num(value) + suffix
    note = row.get("ratio_note") or ""
    return f"{DASH} ({note})" if note and row.get("status") == "ok" else DASH


def _peak_mib(row):
    value = row.get("peak_memory_bytes")
    if isinstance(value, (int, float)) and row.get("status") == "ok":
        return value / MIB
    return None


def benchmark_table(rows, baseline) -> str:
    """The results of one backend as a markdown table, one row per configuration."""
    header = ["layer", "path", "n", "causal", "mode", "median ms"]
    if baseline:
        header.append("speed-up")
    header.append("peak MiB")
    if baseline:
        header.append("memory ratio")
    header.append("status")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if h in ("layer", "path", "mode", "status") else "---:"
                            for h in header) + "|"]
    order = sorted(rows, key=lambda r: (str(r.get("scope", "layer")), str(r.get("mode")),
                                        not r.get("causal", True), r.get("seq_len") or 0,
                                        str(r.get("layer"))))
    for row in order:
        ok = row.get("status") == "ok"
        n = row.get("seq_len")
        label = f"`{row.get('layer')}`"
        if row.get("scope", "layer") != "layer":
            label += f" ({row.get('scope')} only)"
        causal = row.get("causal", True)
        path = f"`{row['implementation']}`" if row.get("implementation") else DASH
        cells = [label, path, f"{n:,}" if isinstance(n, int) else str(n),
                 "yes" if causal else "no",
                 str(row.get("mode")), _num(row.get("median_ms")) if ok else DASH]
        if baseline:
            cells.append(_ratio(row, "time_ratio", "x"))
        cells.append(_num(_peak_mib(row)))
        if baseline:
            cells.append(_ratio(row, "memory_ratio"))
        cells.append(str(row.get("status")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def benchmark_tables(rows, baseline) -> str:
    """One table per backend, under a heading each."""
    parts = []
    for backend in sorted({str(r.get("backend")) for r in rows}):
        chosen = [r for r in rows if str(r.get("backend")) == backend]
        parts.append(f"### {backend}\n\n" + benchmark_table(chosen, baseline) + "\n")
    return "\n".join(parts)


def benchmark_plot(rows, path: Path) -> Path | None:
    """Median time and peak memory against n, one panel row per mode (causal,
    whole-layer runs only: the other runs are in the tables)."""
    ok = [r for r in rows if r.get("status") == "ok" and isinstance(r.get("seq_len"), int)
          and r.get("causal", True) and r.get("scope", "layer") == "layer"]
    if not ok:
        return None
    plt = _pyplot()
    modes = sorted({r["mode"] for r in ok})
    layers = sorted({r["layer"] for r in ok})
    backends = sorted({r["backend"] for r in ok})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D"]
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.6 * len(modes)), squeeze=False)
    for row_axes, mode in zip(axes, modes):
        for li, layer in enumerate(layers):
            for bi, backend in enumerate(backends):
                points = sorted(
                    (r for r in ok if r["mode"] == mode and r["layer"] == layer
                     and r["backend"] == backend),
                    key=lambda r: r["seq_len"])
                if not points:
                    continue
                n = [r["seq_len"] for r in points]
                style = dict(color=colors[li % len(colors)], linestyle=styles[bi % len(styles)],
                             marker=markers[bi % len(markers)], label=f"{layer} ({backend})")
                row_axes[0].plot(n, [r.get("median_ms") for r in points], **style)
                row_axes[1].plot(n, [_peak_mib(r) for r in points], **style)
        for ax, what in zip(row_axes, ("median time (ms)", "peak memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length n")
            ax.set_ylabel(what)
            ax.set_title(f"{what.split(' (')[0]}, {mode}")
            ax.grid(alpha=0.3, which="both")
        row_axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _config_cells(config) -> str:
    keys = ("layers", "lengths", "backends", "modes", "batch", "num_heads", "head_dim",
            "window", "causal", "scope", "repeats", "warmup", "options", "tf_jit", "baseline",
            "settle_allocator")
    return ", ".join(f"`{k}={config[k]!r}`" for k in keys if k in config)


def _when(run) -> str:
    text = f"started {run.get('started') or '?'}"
    if run.get("finished"):
        text += f", finished {run['finished']}"
    return text


def _is_absolute(path: str) -> bool:
    """Whether ``path`` is absolute on POSIX or Windows (``/tmp/x``,
    ``C:\\x``, ``\\\\host\\x``)."""
    return path.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:[\\/]", path) is not None


def _setting_lines(document, rows) -> list[str]:
    """The run(s), configuration(s), machine and memory method as bullets.

    A document is one ``keras-longattn bench`` run (``config`` at the top)
    or several merged (a ``runs`` list, each with ``file``, ``config``,
    ``started``, ``finished``)."""
    machine = document.get("machine") or {}
    versions = machine.get("versions") or {}
    runs = document.get("runs") or []
    interrupted = " (interrupted)" if document.get("interrupted") else ""
    lines = []
    if runs:
        lines.append(f"- **Runs:** {len(rows)} configurations from {len(runs)} runs"
                     f"{interrupted}:")
        for run in runs:
            # a file named by an absolute path is one of the measuring
            # machine's, not of the checkout: not shown
            shown = run.get("file") and not _is_absolute(str(run["file"]))
            name = f"`{run['file']}`, " if shown else ""
            config = _config_cells(run.get("config") or {})
            lines.append(f"    - {name}{_when(run)}" + (f": {config}" if config else ""))
    else:
        lines.append(f"- **Run:** {_when(document)}; {len(rows)} configurations{interrupted}.")
        if document.get("config"):
            lines.append("- **Configuration:** " + _config_cells(document["config"]))
    if machine:
        parts = [str(machine.get("platform", "?"))]
        if machine.get("usable_cpus") is not None:
            parts.append(f"{machine['usable_cpus']} usable CPU cores")
        if machine.get("memory_total_gib") is not None:
            parts.append(f"{machine['memory_total_gib']} GiB memory")
        lines.append("- **Machine:** " + ", ".join(parts))
        if versions:
            lines.append("- **Versions:** " + ", ".join(
                f"{k} {v}" for k, v in versions.items() if v))
    if document.get("memory_method"):
        lines.append(f"- **Memory:** {document['memory_method']}.")
    return lines


def benchmark_page(document, source: Path | None, kind: str | None,
                   assets: Path | None = None) -> str:
    """The markdown of the benchmark page, whose plot goes into ``assets``
    (``assets/benchmarks/`` of the site, next to the page's folder)."""
    intro = (
        "# Benchmarks\n\n"
        + GENERATED_NOTE
        + "\nSpeed and peak memory of each attention layer against `FullAttention` "
        "at the same backend, sequence length and mode, measured by `keras-longattn bench` "
        "(one subprocess per configuration). A speed-up above 1 means faster than the "
        "baseline; a memory ratio below 1 means less memory. `fwd` is the forward pass, "
        "`fwdbwd` forward plus backward. The path is the layer's `last_implementation` after "
        "the timed calls: for a layer built without `implementation=`, what `auto` chose.\n\n"
        "The committed results are re-made by `bash scripts/bench_docs.sh` (its runs, "
        "merged with their provenance; `keras-longattn reproduce --stale` says when they "
        "no longer describe the sources). One run of your own: `bash scripts/main.sh` or "
        "`keras-longattn bench --help`, which write `build/benchmarks/latest.json`. The layer names are short names of layer configs "
        "(`keras-longattn bench --list-layers`); any other attention layer is measured from "
        "its Keras layer config, e.g. `keras-longattn bench --layers "
        "'{\"class_name\": \"LocalAttention\", \"config\": {\"window\": 128}}'`, "
        "and each result row records the config it was built from (`layer_spec`).\n"
    )
    if document is None:
        return intro + (
            "\n## No results yet\n\n"
            "**No benchmark results are available, so this page shows no numbers.** "
            "Neither `docs/benchmarks/results.json` (committed results) nor "
            "`build/benchmarks/latest.json` (a local run) exists in this build.\n"
        )
    rows = list(document.get("results") or [])
    baseline = next((r.get("baseline") for r in rows if r.get("baseline")), None)
    where = _relative(source)
    if kind == "local":
        origin = (
            "\n!!! warning \"Local, uncommitted run\"\n"
            f"    These numbers come from `{where}`, the latest local run of this checkout, "
            "not from committed results (`docs/benchmarks/results.json` does not exist). "
            "They depend on that run's settings and machine.\n"
        )
    else:
        origin = f"\nSource: `{where}`.\n"
    parts = [intro, origin, "\n## Setting\n\n" + "\n".join(_setting_lines(document, rows)) + "\n"]
    if not rows:
        parts.append("\nThe file holds no result rows.\n")
        return "".join(parts)
    plot = benchmark_plot(rows, assets / BENCHMARK_PLOT_NAME) if assets is not None else None
    if plot is not None:
        rel = os.path.relpath(f"{BENCHMARK_ASSETS_URI}/{plot.name}",
                              os.path.dirname(BENCHMARK_PAGE_URI) or ".").replace(os.sep, "/")
        parts.append(f"\n## Time and memory against sequence length\n\n"
                     f"![Median time and peak memory against sequence length]({rel})\n")
    results = "\n## Results\n\n"
    if baseline:
        results += (
            f"Speed-up: median time of `{baseline}` / median time of the layer. Memory "
            f"ratio: peak memory of the layer / peak memory of `{baseline}`. {DASH}: no "
            f"ratio, because `{baseline}` was not run at that backend, length and mode, "
            "or did not complete there.\n\n")
    parts.append(results + benchmark_tables(rows, baseline))
    parts.append(efficiency_section(rows))
    parts.append(memory_curve_section(memory_curve_document(), assets))
    parts.append(gpu_section(gpu_document()))
    notes = [r for r in rows if r.get("status") != "ok"]
    if notes:
        parts.append("\n## Configurations that did not complete\n\n" + "\n".join(
            f"- `{r.get('layer')}` n={r.get('seq_len')} {r.get('mode')} {r.get('backend')}: "
            f"{r.get('status')}: {' '.join(str(r.get('message') or '(no message)').split())}"
            for r in notes) + "\n")
    return "".join(parts)


EFFICIENCY_NOTE = (
    "Useful FLOPs count the two products of attention over the (query, key) pairs "
    "the mechanism allows, nothing else (one multiply-add = 2 FLOPs): `2 P (d + dv)` "
    "forward and `6 P (d + dv)` forward and backward, with `P` the allowed pairs summed "
    "over heads and batch (with `scope=layer` the four projections are added). Masked "
    "pairs a path computes anyway, softmax and the recomputation of scores in a backward "
    "pass do not count. The peak is the fastest of five float32 4096 x 4096 matrix "
    "products timed in the same worker, on the same backend and threads, right after "
    "the layer's calls (`--efficiency`). Definitions per layer: "
    "`keras_longattn.benchmarks.efficiency`. *malloc*: `settled` where the worker first "
    "raised glibc's mmap and trim thresholds to their maximum, as in a process that has "
    "freed a large tensor (the default since 2026-11-25; "
    "`keras_longattn.benchmarks.worker.settle_allocator`), `as started` with "
    "`--no-settle-allocator`, where a fast call may fault in memory the previous call gave "
    "back; *faults*: the median of the minor page faults per timed call (4 KiB pages; "
    f"{DASH} for rows measured before they were recorded)."
)


def efficiency_section(rows) -> str:
    """The useful-FLOP throughput of the rows that have it, as markdown (empty
    when no row has one)."""
    chosen = [r for r in rows if r.get("status") == "ok"
              and isinstance(r.get("useful_gflops_per_s"), (int, float))]
    if not chosen:
        return ""
    lines = ["| layer | backend | n | causal | scope | mode | useful GFLOP | GFLOP/s "
             "| matmul peak GFLOP/s | of peak | malloc | faults |",
             "|---|---|---:|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in sorted(chosen, key=lambda r: (str(r.get("backend")), str(r.get("scope")),
                                           not r.get("causal", True), str(r.get("mode")),
                                           r.get("seq_len") or 0, str(r.get("layer")))):
        fraction = r.get("peak_fraction")
        lines.append(
            f"| `{r.get('layer')}` | {r.get('backend')} | {r.get('seq_len'):,} | "
            f"{'yes' if r.get('causal', True) else 'no'} | {r.get('scope', 'layer')} | "
            f"{r.get('mode')} | {_num(r.get('useful_gflop'))} | "
            f"{_num(r.get('useful_gflops_per_s'))} | {_num(r.get('matmul_peak_gflops'))} | "
            + (DASH if not isinstance(fraction, (int, float)) else f"{100 * fraction:.0f}%")
            + f" | {_malloc_state(r)} | {_median_faults(r)} |")
    return ("\n## Useful-FLOP throughput\n\n" + EFFICIENCY_NOTE + "\n\n"
            + "\n".join(lines) + "\n")


def _malloc_state(row) -> str:
    if "allocator_settled" not in row:
        return DASH
    return "settled" if row["allocator_settled"] else "as started"


def _median_faults(row) -> str:
    faults = row.get("page_faults")
    if not faults:
        return DASH
    ordered = sorted(faults)
    return f"{ordered[len(ordered) // 2]:,}"


def memory_curve_document(path: Path = MEMORY_CURVE_SOURCE):
    """The committed memory-per-token runs, or None."""
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def memory_curve_section(document, assets: Path | None) -> str:
    """Peak memory per token against n (figure and table) of the committed
    memory runs, as markdown; empty without them."""
    if document is None:
        return ""
    rows = [r for r in document.get("results") or []
            if r.get("status") == "ok" and isinstance(r.get("peak_memory_bytes"), (int, float))
            and isinstance(r.get("seq_len"), int)]
    if not rows:
        return ""
    layers = sorted({str(r.get("layer")) for r in rows})
    lines = ["| layer | path | n | peak MiB | bytes per token | median s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (str(r.get("layer")), r["seq_len"])):
        per_token = r["peak_memory_bytes"] / r["seq_len"]
        path = f"`{r['implementation']}`" if r.get("implementation") else "not recorded"
        lines.append(f"| `{r.get('layer')}` | {path} | {r['seq_len']:,} | "
                     f"{_num(r['peak_memory_bytes'] / MIB)} | {per_token:,.0f} | "
                     f"{_num((r.get('median_ms') or float('nan')) / 1e3)} |")
    figure = ""
    if assets is not None:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for layer in layers:
            points = sorted((r for r in rows if str(r.get("layer")) == layer),
                            key=lambda r: r["seq_len"])
            ax.plot([r["seq_len"] for r in points],
                    [r["peak_memory_bytes"] / r["seq_len"] / 1024 for r in points],
                    marker="o", label=layer)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("peak memory per token (KiB)")
        ax.set_ylim(bottom=0)
        ax.set_title("forward + backward, attention alone, torch (CPU)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = assets / MEMORY_PLOT_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        rel = os.path.relpath(f"{BENCHMARK_ASSETS_URI}/{MEMORY_PLOT_NAME}",
                              os.path.dirname(BENCHMARK_PAGE_URI) or ".").replace(os.sep, "/")
        figure = f"![Peak memory per token against sequence length]({rel})\n\n"
    settings = _setting_lines(document, rows)
    return (
        "\n## Memory per token up to one million tokens\n\n"
        "Peak memory (increase of the worker's peak RSS over the inputs and weights) "
        "divided by the sequence length, for `LocalAttention` (window 256, causal) "
        "forward and backward of the attention alone (`--scope attention`), B = 1, "
        "H = 4, d = 64, on torch. Source: "
        f"`{_relative(MEMORY_CURVE_SOURCE)}`."
        + (f" {document['note']}" if document.get("note") else "") + "\n\n" + figure + "\n".join(lines) + "\n\n"
        + "\n".join(settings) + "\n")


GPU_METHODS = {
    "full_cudnn": "full attention, cuDNN (`jax.nn.dot_product_attention`)",
    "full_sdpa": "full attention, SDPA flash (`torch.nn.functional.scaled_dot_product_attention`)",
    "local_cudnn_window": "peer: cuDNN sliding window (`local_window_size`)",
    "local_flex_direct": "peer: FlexAttention used directly, sliding-window `BlockMask`",
    "local_pallas": "ours: `LocalAttention`, `\"pallas\"`",
    "local_flex": "ours: `LocalAttention`, `\"flex\"`",
    "sparse_strided_pallas": "ours: `SparseAttention` strided, `\"pallas\"`",
    "sparse_strided_flex": "ours: `SparseAttention` strided, `\"flex\"`",
    "longformer_pallas": "ours: `LongformerAttention`, `\"pallas\"`",
    "longformer_flex": "ours: `LongformerAttention`, `\"flex\"`",
    "bigbird_pallas": "ours: `BigBirdAttention`, `\"pallas\"`",
    "bigbird_flex": "ours: `BigBirdAttention`, `\"flex\"`",
}


def gpu_document(path: Path = GPU_SOURCE):
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def gpu_section(document) -> str:
    """The GPU table of the benchmark page from the device check's summary
    (empty when there is none; a dry run's summary is not published)."""
    if not document or document.get("dry"):
        return ""
    commit = (document.get("commit") or "")[:10]
    from keras_longattn.reproductions import provenance

    stale = (provenance.check_results(GPU_SOURCE, compute=False) if GPU_SOURCE.is_file()
             else None)
    runs = document.get("runs") or [{"run": 1, "commit": document.get("commit")}]
    lines = [
        "\n## GPU: the device check\n",
        *([f"!!! warning \"Stale\"\n    {stale.note()}\n"] if stale and stale.stale else []),
        f"Device: **{document.get('device')}**, {document.get('date')}; "
        + "; ".join(f"run {r['run']} at commit `{(r.get('commit') or '')[:10]}`" for r in runs)
        + ". B = 1, H = 16, d = 128, bfloat16, forward + backward of the attention alone "
        "(projected heads in, heads out), median of 5 timed calls after a warm-up (2 at "
        "1,048,576 tokens). Local: a causal window of 512 keys. Speed-up: time of full "
        "attention on the same backend and length in the same run / time of the row. Useful "
        "TFLOP/s count `3.5 x 4 P d` FLOPs for the `P` allowed (query, key) pairs per head "
        "(the backward as 2.5 forward passes); *of peak* divides by the faster of the two "
        "bf16 8192^3 matrix products the run timed (one per backend). Every ratio and "
        "criterion is computed within one run. Source: "
        f"`{_relative(GPU_SOURCE)}`, written by `scripts/device_check.sh` and "
        "`python -m keras_longattn.benchmarks.device_report` from the runs' JSON lines in "
        "`docs/benchmarks/device_runs/`.\n",
        "| criterion | verdict | numbers |", "|---|---|---|",
    ]
    for c in document.get("criteria", []):
        verdict = {True: "met", False: "**not met**", None: "not measured"}[c.get("passed")]
        if c.get("unchecked") and c.get("passed") is None:
            verdict = (f"{c.get('passed_cases')} of {c.get('cases')} cases passed, none failed; "
                       f"not checked: {', '.join(c['unchecked'])}")
        numbers = ", ".join(
            f"{k} {v if isinstance(v, int) else _num(v)}" for k, v in c.items()
            if k not in ("criterion", "passed", "cases", "passed_cases")
            and isinstance(v, (int, float)))
        lines.append(f"| {c['criterion']} | {verdict} | {numbers or DASH} |")
    lines += ["", "Matrix-product peaks timed: " + "; ".join(
        f"run {r['run']}: " + ", ".join(f"{b} {_num(v)} TFLOP/s"
                                       for b, v in sorted((r.get('peak_tflops') or {}).items()))
        for r in runs) + ".", "",
        "| run | backend | row | n | ms | speed-up vs full | useful TFLOP/s | of peak |",
        "|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(GPU_METHODS)}
    timings = sorted(document.get("timings", []), key=lambda t: (
        t.get("run", 1), t["backend"], t["n"], order.get(t["method"], len(order))))
    for t in timings:
        share = t.get("fraction_of_peak")
        lines.append(
            f"| {t.get('run', 1)} | {t['backend']} | "
            f"{GPU_METHODS.get(t['method'], t['method'])} | {t['n']:,} | "
            f"{_num(t['ms'])} | {_num(t.get('speedup_vs_full'))} | "
            f"{_num(t.get('useful_tflops'))} | "
            f"{DASH if share is None else f'{100 * share:.0f}%'} |")
    layers = document.get("keras_layers") or []
    for row in layers:
        lines += ["", f"Whole layers (projections included), run {row.get('run')}, n = "
                  f"{row.get('n'):,}, JAX, forward + backward: Keras "
                  "`MultiHeadAttention(sliding_window=512)` (a dense band) "
                  f"{_num(row.get('keras_mha_sliding_window_ms'))} ms, `LocalAttention` "
                  f"(`{row.get('longattn_local_layer_path')}`) "
                  f"{_num(row.get('longattn_local_layer_ms'))} ms."]
    failed = [f for f in document.get("timing_failures") or [] if f.get("status") != "skipped"]
    if failed:
        lines += ["", "Rows that failed:", ""] + [
            f"- run {f.get('run', 1)}, {f['backend']} `{f['method']}` n={f['n']}: "
            f"{' '.join(str(f.get('error') or '').split())[:300]}" for f in failed]
    skipped = [f for f in document.get("timing_failures") or [] if f.get("status") == "skipped"]
    if skipped:
        lines += ["", "Not measured (the stage's time limit came first): " + ", ".join(
            f"run {f.get('run', 1)} {f['backend']} `{f['method']}` n={f['n']:,}"
            for f in skipped) + "."]
    checks = document.get("correctness") or []
    if checks:
        lines += ["", "Correctness on the device (each path against `\"reference\"` on the "
                  "same weights, B = 2 with padding, n = 1024, heads of 64; relative max error "
                  "of outputs / input gradients against the reference in float32 at full "
                  "precision; a path passes where its error is at most twice the reference "
                  "path's own in that dtype, or below 1e-4 / 1e-2):", "",
                  "| run | backend | case | float32 out / grad | bfloat16 out / grad | verdict |",
                  "|---|---|---|---|---|---|"]
        for c in sorted(checks, key=lambda c: (c["backend"], c["case"])):
            cells = []
            for dtype in ("float32", "bfloat16"):
                d = c.get(dtype) or {}
                cells.append(f"{_num(d.get('error_out'))} / {_num(d.get('error_grad'))}")
            verdict = c["status"] if c["status"] != "error" else \
                f"error: {' '.join(str(c.get('error')).split())[:120]}"
            lines.append(f"| {c.get('run', 1)} | {c['backend']} | {c['case']} | {cells[0]} | "
                         f"{cells[1]} | {verdict} |")
    return "\n".join(lines) + "\n"


def generate_benchmarks(page: Path, assets: Path, sources=BENCHMARK_SOURCES) -> Path:
    """Writes the benchmark page ``page`` and its plot into ``assets``."""
    document, source, kind = find_benchmark(sources)
    for name in (BENCHMARK_PLOT_NAME, MEMORY_PLOT_NAME):
        stale = assets / name
        if stale.exists():
            stale.unlink()
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(benchmark_page(document, source, kind, assets), encoding="utf-8")
    if source is None:
        log.info("benchmarks.md: no benchmark results, the page says so")
    log.debug("%s (%s)", _relative(page), "from " + _relative(source) if source else "no results")
    return page


# ---------------------------------------------------------------------------
# Notebooks
# ---------------------------------------------------------------------------

#: stderr lines of the backends' start-up logs, dropped from the docs copies.
NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)|I0000 |W0000 |"
    r"To enable the following instructions|.*cpu_feature_guard|.*oneDNN custom operations|"
    r"\s*$)"
)


#: The machine-specific start of an absolute path in a notebook's outputs
#: (a traceback's ``/work/runs/keras_longattn/...``, a virtual
#: environment's ``.../site-packages/keras/...``), after an ANSI colour code
#: or a character that cannot end a path. :func:`_relative_paths` cuts it,
#: keeping the path from the checkout's top folder (or from
#: ``site-packages/``) on.
MACHINE_PREFIX = re.compile(
    r"((?:\x1b\[[0-9;]*m)|(?<![\w.~/-]))"
    r"/(?:[^\s/\"'<>:]+/)+?"
    r"((?:site|dist)-packages/|(?=(?:keras_longattn|notebooks|docs|tests|scripts|build)/))")


def _relative_paths(value):
    """``value`` (a string, or the lists and dicts of a notebook output)
    with :data:`MACHINE_PREFIX` cut from every string in it."""
    if isinstance(value, str):
        return MACHINE_PREFIX.sub(lambda m: m.group(1) + m.group(2), value)
    if isinstance(value, list):
        return [_relative_paths(item) for item in value]
    if isinstance(value, dict):
        return {key: _relative_paths(item) for key, item in value.items()}
    return value


def _clean_outputs(notebook: dict) -> dict:
    """Drops stderr outputs made only of backend start-up log lines, and
    cuts the machine's folders from the absolute paths in the outputs (a
    page names files relative to the checkout)."""
    notebook = copy.deepcopy(notebook)
    for cell in notebook.get("cells", []):
        outputs = cell.get("outputs")
        if not outputs:
            continue
        outputs = [_relative_paths(output) for output in outputs]
        kept = []
        for output in outputs:
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                text = output.get("text", "")
                text = "".join(text) if isinstance(text, list) else text
                if all(NOISE.match(line) for line in text.splitlines()):
                    continue
            kept.append(output)
        cell["outputs"] = kept
    return notebook


def _title(notebook: dict, slug: str) -> str:
    meta = notebook.get("metadata", {}).get("keras_longattn", {})
    if meta.get("title"):
        return meta["title"]
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            for line in source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return slug


def _flatten(metrics: dict, prefix: str = "") -> list:
    rows = []
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _flatten(value, f"{name}.")
        elif isinstance(value, (list, tuple)):
            continue  # curves and tables live in the notebook
        else:
            rows.append((name, value))
    return rows


def _results_table(results: dict) -> str:
    rows = _flatten(results.get("metrics") or {})
    rows += [("backend", results.get("backend")), ("wall time (s)", results.get("wall_time_s"))]
    lines = ["| metric | value |", "|---|---:|"]
    for name, value in rows:
        if isinstance(value, float):
            value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
        elif isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        lines.append(f"| `{name}` | {value} |")
    return "\n".join(lines)


def stale_checks(full: Path = NOTEBOOKS_FULL, root: Path = ROOT) -> dict:
    """``{slug: Staleness}`` of the committed results ``full/*.json`` against
    the sources under ``root`` (the check of ``keras-longattn reproduce
    --stale``)."""
    # Standard library only (keras_longattn's package imports load no
    # backend).
    from keras_longattn.reproductions import provenance

    # Cached fingerprints only: the build stage runs `keras-longattn
    # reproduce --stale` first, which computes those a changed library
    # file needs; without them a page says its behaviour was not checked.
    return {check.name: check for check in provenance.check_directory(full, root, compute=False)}


def stale_cell(note: str) -> dict:
    """A markdown cell that shows ``note`` as a warning admonition (an HTML
    block with the admonition classes: notebook cells do not get mkdocs'
    ``!!!`` syntax)."""
    return {
        "cell_type": "markdown", "metadata": {}, "id": "stale-run",
        "source": ('<div class="admonition warning stale-run">\n'
                   '<p class="admonition-title">Stale</p>\n'
                   f"<p>{html.escape(note)} Re-run it with <code>keras-longattn reproduce "
                   "--stale --run</code>.</p>\n</div>"),
    }


def _size_of(results: dict, meta: dict) -> str:
    full = meta.get("full_parameters")
    params = results.get("parameters") or {}
    if full and all(params.get(k) == v for k, v in full.items()):
        return "full size"
    return "CI size"


def generate_notebooks(out: Path, page: Path, src: Path = NOTEBOOKS_SRC,
                       build: Path = NOTEBOOKS_BUILD, full: Path = NOTEBOOKS_FULL,
                       root: Path = ROOT) -> list[Path]:
    """Copies the notebooks, executed where possible, into ``out`` and writes
    the index ``page``.

    A notebook's page is its committed full-size run (``docs/results/``)
    when there is one, else the CI-size run of this build; the index gives
    the results of both. A committed run that :func:`stale_checks` finds
    stale against the sources under ``root`` gets a "Stale" admonition on
    its page and in the index."""
    stale = {slug: check for slug, check in stale_checks(full, root).items() if check.stale}
    out.mkdir(parents=True, exist_ok=True)
    slugs = sorted(p.stem for p in src.glob("*.ipynb") if not p.name.startswith(("_", ".")))
    for stale in out.glob("*.ipynb"):
        if stale.stem not in slugs:
            stale.unlink()
    sections = []
    written = []
    for slug in slugs:
        executed = build / f"{slug}.ipynb"
        results_file = build / f"{slug}.json"
        full_nb, full_json = full / f"{slug}.ipynb", full / f"{slug}.json"
        full_results = None
        if full_json.is_file():
            full_results = json.loads(full_json.read_text(encoding="utf-8"))
        shown = "this build's run"
        if full_nb.is_file():
            notebook = _clean_outputs(json.loads(full_nb.read_text(encoding="utf-8")))
            when = (full_results or {}).get("finished") or "committed"
            note = {
                "cell_type": "markdown", "metadata": {}, "id": "full-size-run",
                # Plain markdown: notebook cells do not get mkdocs admonitions.
                "source": ("> **Full-size run.** "
                           f"The outputs below are the committed full-size run "
                           f"(`docs/results/{slug}.ipynb`, backend "
                           f"`{(full_results or {}).get('backend', '?')}`, "
                           f"{(full_results or {}).get('wall_time_s', '?')} s). Every test run "
                           "executes the same notebook at its CI size; see "
                           "[Reproductions](../reproductions.md)."),
            }
            notebook["cells"].insert(1, note)
            if slug in stale:
                notebook["cells"].insert(2, stale_cell(stale[slug].note()))
            ran = executed.is_file()
            shown = "the committed full-size run"
        elif executed.is_file():
            notebook = _clean_outputs(json.loads(executed.read_text(encoding="utf-8")))
            ran = True
        else:
            notebook = json.loads((src / f"{slug}.ipynb").read_text(encoding="utf-8"))
            note = {
                "cell_type": "markdown", "metadata": {}, "id": "not-executed",
                "source": ("> **Not executed in this build.** "
                           f"This copy has no outputs: run `keras-longattn reproduce {slug}` "
                           "before building the docs to see them."),
            }
            notebook["cells"].insert(1, note)
            ran = False
        target = out / f"{slug}.ipynb"
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n",
                          encoding="utf-8")
        written.append(target)
        log.debug("%s (%s; %s in this build)", _relative(target), shown,
                  "executed" if ran else "NOT executed")
        if not ran and not full_nb.is_file():
            log.info("notebooks/%s.ipynb: shown unexecuted (no %s)", slug, _relative(executed))

        source_nb = json.loads((src / f"{slug}.ipynb").read_text(encoding="utf-8"))
        meta = source_nb.get("metadata", {}).get("keras_longattn", {})
        lines = [f"## {_title(source_nb, slug)}", ""]
        if meta.get("summary"):
            lines += [meta["summary"], ""]
        lines += [f"[Open the notebook](notebooks/{slug}.ipynb) · source: "
                  f"`notebooks/{slug}.ipynb`", ""]
        if meta.get("claims"):
            lines += ["Claims checked by its `assert` cells:", ""]
            lines += [f"- {claim}" for claim in meta["claims"]] + [""]
        if slug in stale:
            lines += ['!!! warning "Stale"', "",
                      f"    {stale[slug].note()} Re-run it with "
                      "`keras-longattn reproduce --stale --run`.", ""]
        if full_results is not None:
            lines += [f"Committed results ({_size_of(full_results, meta)}, backend "
                      f"`{full_results.get('backend')}`, `docs/results/{slug}.json`):", "",
                      _results_table(full_results), ""]
        results = None
        if ran and results_file.is_file():
            results = json.loads(results_file.read_text(encoding="utf-8"))
        if results is not None:
            lines += [f"Results of this build ({_size_of(results, meta)}, backend "
                      f"`{results.get('backend')}`):", "", _results_table(results), ""]
        else:
            lines += ["*Not executed in this build: no results.*", ""]
        lines += ["Reproduce:", "", "```bash",
                  f"keras-longattn reproduce {slug}           # CI size, ~{meta.get('ci_minutes', '?')} min on 2 CPU cores",
                  f"keras-longattn reproduce {slug} --full    # full size, ~{meta.get('full_minutes', '?')} min on 2 CPU cores",
                  f"keras-longattn reproduce {slug} --backend torch",
                  "```", ""]
        sections.append("\n".join(lines))

    text = (
        "# Reproductions\n\n" + GENERATED_NOTE + "\n"
        "Each reproduction is a notebook in `notebooks/` that runs at two sizes: a **CI size** "
        "(its parameters' defaults, a few minutes at most on a 2-core CPU, executed on every "
        "test run) and a **full size** declared in its metadata (`--full`). `keras-longattn "
        "reproduce` executes it with papermill into `build/notebooks/<slug>.ipynb`, its "
        "`assert` cells check the claims at the scale it ran at, and its results go to "
        "`build/notebooks/<slug>.json`. A notebook's page shows its committed **full-size** run "
        "(`docs/results/<slug>.ipynb`, made with `keras-longattn reproduce <slug> --full "
        "--output-dir docs/results`) when there is one, else the CI-size run of this build "
        f"({datetime.now().strftime('%Y-%m-%d')}).\n\n"
        + ("\n".join(sections) if sections else "No notebooks yet.\n")
    )
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    log.debug("%s", _relative(page))
    return written


# ---------------------------------------------------------------------------

def _patterns(out: Path) -> None:
    generate_patterns(out / PATTERNS_URI)


def _benchmarks(out: Path) -> None:
    generate_benchmarks(out / BENCHMARK_PAGE_URI, out / BENCHMARK_ASSETS_URI)


def _notebooks(out: Path) -> None:
    generate_notebooks(out / NOTEBOOKS_URI, out / REPRODUCTIONS_URI)


#: The steps: each writes its files under a folder laid out like docs/.
STEPS = {
    "patterns": _patterns,
    "benchmarks": _benchmarks,
    "notebooks": _notebooks,
}


def generate(out: Path, steps=None) -> list[str]:
    """Runs ``steps`` (default: all of :data:`STEPS`), writing under ``out``
    in the layout of ``docs/``; returns the paths written, relative to
    ``out`` (their paths in the site's sources)."""
    out = Path(out)
    for name in steps or list(STEPS):
        STEPS[name](out)
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="*", metavar="STEP",
                        help=f"what to generate, among {', '.join(STEPS)} (default: everything)")
    parser.add_argument("--out", type=Path, default=PREVIEW_DIR,
                        help="folder to write into, laid out like docs/ (default: %(default)s)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.steps if name not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; choose among {', '.join(STEPS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[gen_figures] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    generate(args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
