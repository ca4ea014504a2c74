"""Longformer reproduction: the paper's numbers, a far-signal task that only
a global token can solve, probes of the layer's pattern and of the class
token's reach, the window schedules of the ablation, and the notebook's
claims.

* :data:`PAPER`: what the paper reports (character-level LM, the window and
  dilation ablation, the WikiHop ablation without global attention).
* :func:`make_far_signal_task`: sequences of filler tokens holding one
  signal token, whose identity is the label, at a position beyond a chosen
  distance from the start (so beyond the local reach of a class token
  prepended at position 0).
* :func:`expected_head_masks`: the keys each head of a non-causal
  Longformer layer should read (window, dilation, global rows and columns),
  written out in NumPy independently of the layer's code, to compare with
  :func:`keras_longattn.reproductions.sparse_transformer.measured_head_masks`.
* :func:`class_token_dependence`: which input tokens a classifier's class
  token output depends on, measured by replacing one token at a time.
* :func:`window_schedule` and :func:`ablation_attention`: the per-layer
  windows (increasing, decreasing, constant with the same mean) and the
  dilated variant of the ablation.
* :func:`longformer_claims`: the notebook's claims from its results.
* :class:`LocalOnlyLongformer`: a planted bug for the tests (global
  positions treated as ordinary ones).
"""

from __future__ import annotations

from typing import Mapping

import keras
import numpy as np

from keras_longattn.layers import LongformerAttention
from keras_longattn.reproductions import claims as cl

__all__ = [
    "PAPER",
    "LocalOnlyLongformer",
    "ablation_attention",
    "class_token_dependence",
    "class_token_reach",
    "expected_head_masks",
    "longformer_claims",
    "make_far_signal_task",
    "memory_growth",
    "window_schedule",
]

#: The paper's numbers (Beltagy, Peters, Cohan 2020). ``char_lm``: test
#: bits per character of the small models (Table 2) and of the large model
#: on enwik8 (Table 3). ``ablation``: dev bits per character on text8 after
#: 150K steps of the first training phase (Table 4), window sizes across
#: layers (the constant one is the average of the others) and dilation on
#: two heads against none. ``wikihop``: dev accuracy of Longformer-base and
#: of the same model without global attention (and without the separate
#: global projections), from the ablation table of the QA section.
PAPER = {
    "char_lm": {"text8_small": 1.10, "enwik8_small": 1.00, "enwik8_large": 0.99},
    "ablation": {
        "windows": {"decreasing": 1.24, "constant": 1.23, "increasing": 1.21},
        "dilation": {"none": 1.21, "two_heads": 1.20},
    },
    "wikihop": {"longformer": 73.8, "no_global": 65.5},
}


# ------------------------------------------------------------------ task
def make_far_signal_task(num_examples, length, num_classes=4, num_fillers=16,
                         min_position=0, seed=0):
    """A classification task whose answer lies beyond ``min_position``.

    Every sequence holds ``length`` filler tokens drawn uniformly from
    ``num_fillers`` ids, except one position, drawn uniformly from
    ``min_position .. length - 1``, which holds a signal token; the label is
    which of the ``num_classes`` signal tokens it is. A model that reads the
    sequence from a class token at position 0 needs to see positions at
    least ``min_position`` away from it; fillers carry no information.

    Token ids: 0 is padding (unused), ``1 .. num_classes`` the signals,
    ``num_classes + 1 .. num_classes + num_fillers`` the fillers.

    Returns:
        ``(tokens, labels, positions)``: int32 ``(N, length)``, int32
        ``(N,)`` in ``0 .. num_classes - 1``, int32 ``(N,)`` (where the
        signal stands).
    """
    for name, value, low in (("num_examples", num_examples, 1), ("length", length, 1),
                             ("num_classes", num_classes, 2),
                             ("num_fillers", num_fillers, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
    if not 0 <= min_position < length:
        raise ValueError("`min_position` must be in [0, length). Received: "
                         f"min_position={min_position!r}, length={length}")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(num_classes + 1, num_classes + 1 + num_fillers,
                          size=(num_examples, length)).astype("int32")
    labels = rng.integers(0, num_classes, size=num_examples).astype("int32")
    positions = rng.integers(min_position, length, size=num_examples).astype("int32")
    tokens[np.arange(num_examples), positions] = labels + 1
    return tokens, labels, positions


def class_token_reach(num_layers, window, dilation=1):
    """How many input tokens (after the class token at position 0) the
    class token of a non-causal local model reaches through
    ``num_layers`` layers of window ``window`` (``w / 2`` keys each side,
    times the largest dilation): tokens ``0 .. reach - 1``."""
    return int(num_layers) * (int(window) // 2) * int(max(np.atleast_1d(dilation)))


# --------------------------------------------------------------- probes
def expected_head_masks(length, window, dilations, global_positions=(), causal=False):
    """The keys each head of Longformer attention reads, ``(H, n, n)`` bool.

    Written from the paper's definition, not from the library: query ``i``
    reads key ``j = i + r_h * t`` for ``-w/2 <= t <= w/2`` (causal:
    ``-w <= t <= 0``), every query reads the global keys and a global query
    reads every key; causal mode keeps ``j <= i`` only. The diagonal is
    always True (an output depends on its own input through its query).
    """
    n = int(length)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    masks = []
    for r in dilations:
        offset = j - i
        reach_back, reach_ahead = (window, 0) if causal else (window // 2, window // 2)
        mask = (offset % r == 0) & (offset >= -reach_back * r) & (offset <= reach_ahead * r)
        for g in global_positions:
            mask[g, :] = True
            mask[:, g] = True
        if causal:
            mask &= j <= i
        mask |= np.eye(n, dtype=bool)
        masks.append(mask)
    return np.stack(masks)


def class_token_dependence(model, tokens, num_fillers_from, *, pooling="pooling",
                           tolerance=1e-6):
    """Which input tokens the class token's final vector depends on.

    ``model`` is a classifier built by
    :func:`keras_longattn.models.build_sequence_classifier` with
    ``pooling="cls"`` (its layer ``pooling`` outputs the class token's
    vector). One sequence ``tokens`` ``(n,)`` and ``n`` copies of it, copy
    ``j`` with token ``j`` replaced by another id (``num_fillers_from`` or
    the next id), are run through the model up to that layer; position ``j``
    counts as read when the class token's vector moves by more than
    ``tolerance`` times the largest move.

    Returns:
        ``(read, change)``: bool ``(n,)`` and float ``(n,)``.
    """
    tokens = np.asarray(tokens, "int32")
    n = tokens.shape[0]
    batch = np.repeat(tokens[None], n + 1, axis=0)
    for j in range(n):
        other = num_fillers_from if tokens[j] != num_fillers_from else num_fillers_from + 1
        batch[j + 1, j] = other
    probe = keras.Model(model.input, model.get_layer(pooling).output)
    out = np.asarray(probe.predict_on_batch(batch)).astype("float64")
    change = np.max(np.abs(out[1:] - out[:1]), axis=-1)
    scale = max(float(np.max(change)), 1e-30)
    return change > tolerance * scale, change


# ------------------------------------------------------------- ablation
def window_schedule(kind, num_layers, low, high):
    """Per-layer windows, bottom first: ``"increasing"`` (geometric from
    ``low`` to ``high``), ``"decreasing"`` (the same, reversed) or
    ``"constant"`` (their mean, rounded to an even number)."""
    if num_layers < 1:
        raise ValueError(f"`num_layers` must be >= 1. Received: num_layers={num_layers!r}")
    if num_layers == 1:
        grow = [float(high)]
    else:
        grow = [low * (high / low) ** (k / (num_layers - 1)) for k in range(num_layers)]
    grow = [max(2, 2 * int(round(w / 2))) for w in grow]
    if kind == "increasing":
        return grow
    if kind == "decreasing":
        return grow[::-1]
    if kind == "constant":
        return [max(2, 2 * int(round(np.mean(grow) / 2)))] * num_layers
    raise ValueError("`kind` must be 'increasing', 'decreasing' or 'constant'. "
                     f"Received: kind={kind!r}")


def ablation_attention(arm, num_layers, num_heads, low, high, dilation=2,
                       dilated_heads=2):
    """The attention configs of one ablation arm, bottom first.

    Arms: ``"increasing"``, ``"decreasing"``, ``"constant"`` (the windows of
    :func:`window_schedule`, no dilation) and ``"dilated"`` (increasing
    windows, and in the upper half of the layers the last
    ``dilated_heads`` heads dilated by ``dilation``, as the paper dilates
    two heads of the upper layers)."""
    kind = "increasing" if arm == "dilated" else arm
    windows = window_schedule(kind, num_layers, low, high)
    configs = []
    for layer, w in enumerate(windows):
        config = {"window": int(w)}
        if arm == "dilated" and layer >= num_layers // 2:
            heads = [1] * num_heads
            for h in range(max(0, num_heads - dilated_heads), num_heads):
                heads[h] = int(dilation)
            config["dilation"] = heads
        configs.append({"class_name": "LongformerAttention", "config": config})
    return configs


# --------------------------------------------------------------- scaling
def memory_growth(scaling, factor=4):
    """The largest ``n`` with ``n`` and ``factor * n`` both measured (status
    ok, a peak) in ``scaling`` (``{n: {"peak_mib", "status"}}``), and the
    ratio of the peaks: ``(n, ratio)``, or ``(None, None)``."""
    best = (None, None)
    for n in sorted(scaling):
        m = factor * n
        a, b = scaling.get(n), scaling.get(m)
        if a and b and a.get("peak_mib") and b.get("peak_mib"):
            best = (n, b["peak_mib"] / a["peak_mib"])
    return best


# ---------------------------------------------------------------- claims
def _bool_claim(name, statement, paper, ok, ours, asserted=True, detail=""):
    return cl.Claim(name, statement, paper, ours,
                    cl.REPRODUCED if ok else cl.NOT_REPRODUCED, asserted, detail)


def longformer_claims(results: Mapping, margins: Mapping) -> list:
    """The claims of the Longformer notebook.

    Args:
        results:
            ``"pattern"``: ``{"measured": (H, n, n) bool, "expected":
            (H, n, n) bool}`` (a tiny layer's heads, measured on its call
            path, and :func:`expected_head_masks`);
            ``"reach"``: ``{"min_position": p, "local": bool (n,),
            "global": bool (n,)}``: which tokens the class token of the
            model without and with global attention reads;
            ``"accuracy"``: ``{"global", "local", "full"}`` -> test accuracy
            (%) per seed on the far-signal task; ``"chance"`` (%);
            ``"ablation"``: ``{"increasing", "decreasing", "constant",
            "dilated"}`` -> validation bits per byte per seed, or None when
            skipped;
            ``"scaling"``: ``{"full": {n: row}, "longformer": {n: row}}``,
            rows ``{"status", "median_ms", "peak_mib"}``.
        margins: ``accuracy_margin`` (points: global beats local),
            ``min_full_accuracy`` (the task check: full attention solves
            it), ``max_blind_excess`` (points above chance the local model
            may reach), ``bpb_margin`` (bits per byte, ablation; reported
            only), ``max_linear_growth`` (Longformer's peak at 4n over its
            peak at n), ``min_full_growth`` (the same for full attention)
            and ``assert_full_growth`` (whether that one is asserted),
            ``min_bench_speedup`` and ``min_bench_memory_ratio`` (full over
            Longformer at the longest n both ran) and
            ``assert_bench_speed`` and ``assert_bench_memory`` (whether
            they are asserted: not where full attention runs a fused,
            linear-memory kernel, as on PyTorch).
    """
    out = []
    pat = results["pattern"]
    measured = np.asarray(pat["measured"], bool)
    expected = np.asarray(pat["expected"], bool)
    same = measured.shape == expected.shape and bool(np.array_equal(measured, expected))
    wrong = int(np.sum(measured != expected)) if measured.shape == expected.shape else -1
    out.append(_bool_claim(
        "pattern", "the keys each head reads, measured on the layer's call path, are "
        "its (dilated) window plus the global rows and columns",
        "Figure 2 (sliding, dilated and global attention)", same,
        f"{'equal' if same else f'{wrong} query-key pairs differ'} "
        f"({measured.shape[0]} heads, n = {measured.shape[-1]})"))

    reach = results["reach"]
    p = int(reach["min_position"])
    local_read = np.asarray(reach["local"], bool)
    global_read = np.asarray(reach["global"], bool)
    beyond = int(np.sum(local_read[p:]))
    out.append(_bool_claim(
        "reach_local", "without global attention the class token reads no token at or "
        f"beyond position {p} (where the signal stands): the task is out of the window's reach",
        "(the control's precondition)", beyond == 0,
        f"reads {int(np.sum(local_read))} of {local_read.size} tokens, "
        f"{beyond} at or beyond {p}"))
    out.append(_bool_claim(
        "reach_global", "with global attention on it the class token reads every token",
        "global tokens attend to every position", bool(np.all(global_read)),
        f"reads {int(np.sum(global_read))} of {global_read.size} tokens"))

    acc, chance = results["accuracy"], float(results["chance"])
    out.append(cl.at_least(
        "task_full_solves", "the far-signal task is solvable: full attention solves it "
        f"(accuracy >= {margins['min_full_accuracy']}%)", acc["full"],
        margins["min_full_accuracy"], paper="(task check)"))
    out.append(cl.at_most(
        "task_local_blind", "the model without global attention stays at chance "
        f"({chance:.0f}% + {margins['max_blind_excess']} points)", acc["local"],
        chance + margins["max_blind_excess"], paper="(control check)"))
    out.append(cl.compare_means(
        "global_beats_local", "global attention on the class token beats the same layer "
        f"without it by {margins['accuracy_margin']} accuracy points",
        acc["global"], acc["local"], margins["accuracy_margin"],
        paper=f"WikiHop {PAPER['wikihop']['longformer']} vs "
              f"{PAPER['wikihop']['no_global']} without global attention",
        labels=("global", "no global"), digits=1))
    out.append(cl.no_worse_than(
        "global_vs_full", "global attention is as good as full attention on the task "
        f"(not behind by {margins['accuracy_margin']} points)",
        acc["global"], acc["full"], margins["accuracy_margin"], asserted=False,
        paper="(Longformer-base above RoBERTa-base on WikiHop, 75.0 vs 72.4)",
        labels=("global", "full"), digits=1))

    abl = results.get("ablation")
    if abl:
        m = margins["bpb_margin"]
        w = PAPER["ablation"]["windows"]
        d = PAPER["ablation"]["dilation"]
        for name, better, worse, paper in (
            ("increasing_vs_decreasing", "increasing", "decreasing",
             f"{w['increasing']} vs {w['decreasing']}"),
            ("increasing_vs_constant", "increasing", "constant",
             f"{w['increasing']} vs {w['constant']}"),
            ("dilated_vs_none", "dilated", "increasing",
             f"{d['two_heads']} vs {d['none']}"),
        ):
            if better not in abl or worse not in abl:
                continue
            statement = (f"byte LM: {better} windows beat {worse} ones" if name != "dilated_vs_none"
                         else "byte LM: dilation on two heads of the upper layers helps")
            out.append(cl.compare_means(
                f"ablation_{name}", statement, abl[better], abl[worse], m,
                higher_is_better=False, asserted=False,
                paper=f"{paper} bpc (text8 dev, Table 4)", labels=(better, worse)))

    scaling = results["scaling"]
    full, lf = scaling.get("full", {}), scaling.get("longformer", {})
    n, growth = memory_growth(lf)
    out.append(cl.Claim(
        "memory_linear", f"Longformer's peak memory grows linearly: at 4n at most "
        f"{margins['max_linear_growth']}x its peak at n",
        "linear in n (memory figure)",
        f"{growth:.2f}x from n = {n} to {4 * n}" if n else "no n and 4n measured",
        cl.REPRODUCED if n and growth <= margins["max_linear_growth"] else cl.NOT_REPRODUCED,
        True))
    fn, fgrowth = memory_growth(full)
    oom = [k for k, row in full.items() if row and row.get("status") not in (None, "ok")]
    if fn:
        ok = fgrowth >= margins["min_full_growth"]
        ours = f"{fgrowth:.2f}x from n = {fn} to {4 * fn}"
    else:
        ok = bool(oom)
        ours = f"not measured at 4n ({', '.join(f'n = {k}' for k in sorted(oom)) or 'none'} failed)"
    if oom and fn:
        ours += "; " + ", ".join(f"n = {k}: {full[k]['status']}" for k in sorted(oom))
    out.append(cl.Claim(
        "memory_full_quadratic", "full attention's peak memory grows quadratically: at 4n "
        f"at least {margins['min_full_growth']}x its peak at n",
        "quadratic in n, out of memory at long n (memory figure)", ours,
        cl.REPRODUCED if ok else cl.NOT_REPRODUCED,
        bool(margins.get("assert_full_growth", True))))

    both = [k for k in sorted(full) if full.get(k) and lf.get(k)
            and full[k].get("median_ms") and lf[k].get("median_ms")
            and full[k].get("peak_mib") and lf[k].get("peak_mib")]
    if not both:
        for name in ("bench_speed", "bench_memory"):
            out.append(cl.Claim(name, "longest n: Longformer against full attention",
                                "O(n w) vs O(n^2)", "no length where both ran",
                                cl.NOT_REPRODUCED, True))
        return out
    k = both[-1]
    speed = full[k]["median_ms"] / lf[k]["median_ms"]
    memory = full[k]["peak_mib"] / lf[k]["peak_mib"]
    for name, value, needed, what, key, unit, asserted in (
        ("bench_speed", speed, margins["min_bench_speedup"], "faster", "median_ms", "ms",
         bool(margins.get("assert_bench_speed", True))),
        ("bench_memory", memory, margins["min_bench_memory_ratio"], "smaller in peak memory",
         "peak_mib", "MiB", bool(margins.get("assert_bench_memory", True))),
    ):
        out.append(cl.Claim(
            name, f"at the longest n both ran, Longformer is at least {needed}x {what} "
            "than full attention", "O(n w) vs O(n^2)",
            f"n = {k}: {value:.2f}x (full {full[k][key]} {unit}, Longformer {lf[k][key]} {unit})",
            cl.REPRODUCED if value >= needed else (
                cl.DIRECTION_ONLY if value > 1 else cl.NOT_REPRODUCED),
            asserted, f"ratio {value:.3f}, needs >= {needed}"))
    return out


# --------------------------------------------------------- planted bug
@keras.saving.register_keras_serializable(package="keras_longattn.reproductions")
class LocalOnlyLongformer(LongformerAttention):
    """Planted bug: the global positions (``global_tokens`` and a call's
    ``global_mask``) are ignored, i.e. treated as ordinary positions of the
    sliding window."""

    def call(self, query, value, key=None, query_mask=None, value_mask=None,
             key_mask=None, attention_mask=None, return_attention_scores=False,
             training=None, use_causal_mask=False, global_mask=None):
        return super().call(
            query, value, key=key, query_mask=query_mask, value_mask=value_mask,
            key_mask=key_mask, attention_mask=attention_mask,
            return_attention_scores=return_attention_scores, training=training,
            use_causal_mask=use_causal_mask,
        )

    def _dispatch(self, q, k, v, context):
        saved = self.global_tokens
        self.global_tokens = 0
        try:
            return super()._dispatch(q, k, v, context)
        finally:
            self.global_tokens = saved
