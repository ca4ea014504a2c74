"""Cross-backend fixtures: stored weights, inputs and outputs of each layer.

Run once per backend, from the repository root::

    KERAS_BACKEND=jax python -m keras_longattn.testing.fixtures
    KERAS_BACKEND=tensorflow python -m keras_longattn.testing.fixtures
    KERAS_BACKEND=torch python -m keras_longattn.testing.fixtures

On :data:`EXPECTED_BACKEND` (JAX) the run writes ``tests/fixtures/<case>.npz``
for every case of :data:`CASES`: the layer's config, weights (drawn with
NumPy, so they do not depend on a backend's initialisers), inputs, masks and
the expected output (the layer's default path, checked against its
``"reference"`` path before it is stored). On every backend it writes
``tests/fixtures/<case>.<backend>.keras``, a small functional model around
the layer with the stored weights, and prints how far this backend's output
is from the stored one. ``--case NAME`` limits the run to some cases;
``--expected`` also rewrites the ``.npz`` files on another backend.

The property suite (:class:`keras_longattn.testing.properties.
AttentionLayerProperties`, ``fixture_cases``) checks on each backend that
the stored weights and inputs give the stored outputs and that every
backend's ``.keras`` file loads and reproduces them.

To add a layer, add its cases to :data:`CASES` and run the three commands.
"""

import argparse
import json
import os
import sys

import numpy as np

#: Where the fixtures live (the repository's tests/fixtures).
FIXTURE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "tests",
    "fixtures",
)
#: The backend whose outputs are stored as the expected ones.
EXPECTED_BACKEND = "jax"
BACKENDS = ("jax", "tensorflow", "torch")

_FEATURES = 16

#: name -> case. ``inputs``: "random", "repeated" (runs of identical tokens)
#: or "identical" (every token the same: similarity ties). Layers whose
#: block length or routing window follows the call's length (default
#: ``block_length``, routing) are stored without padding, so that their
#: expected outputs do not depend on how padding sets those lengths.
CASES = {
    "full_causal_padded": dict(
        layer="FullAttention",
        kwargs={"num_heads": 2, "key_dim": 8},
        batch=2, T=13, S=13, causal=True, padding=True, inputs="random",
    ),
    "local_cross": dict(
        layer="LocalAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "window": 5},
        batch=2, T=11, S=17, causal=False, padding=True, inputs="random",
    ),
    "sparse_strided_causal": dict(
        layer="SparseAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "pattern": "strided", "block_length": 4},
        batch=2, T=21, S=21, causal=True, padding=True, inputs="random",
    ),
    "sparse_fixed_default": dict(
        layer="SparseAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "pattern": "fixed"},
        batch=2, T=26, S=26, causal=False, padding=False, inputs="random",
    ),
    "routing_balanced_repeated": dict(
        layer="RoutingAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "num_clusters": 3, "local_heads": 1},
        batch=2, T=20, S=20, causal=False, padding=False, inputs="repeated",
    ),
    "routing_token_causal": dict(
        layer="RoutingAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "num_clusters": 3},
        batch=2, T=20, S=20, causal=True, padding=False, inputs="repeated",
    ),
    "routing_ties": dict(
        layer="RoutingAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "num_clusters": 3},
        batch=1, T=8, S=8, causal=False, padding=False, inputs="identical",
    ),
    "routing_shared_qk": dict(
        layer="RoutingAttention",
        kwargs={"num_heads": 2, "key_dim": 8, "num_clusters": 3, "shared_qk": True},
        batch=2, T=15, S=15, causal=False, padding=False, inputs="repeated",
    ),
}


def case_path(name):
    return os.path.join(FIXTURE_DIR, f"{name}.npz")


def keras_path(name, backend):
    return os.path.join(FIXTURE_DIR, f"{name}.{backend}.keras")


# ------------------------------------------------------------------- making
def _inputs(spec, rng):
    B, T, S = spec["batch"], spec["T"], spec["S"]
    kind = spec["inputs"]
    q = rng.standard_normal((B, T, _FEATURES)).astype("float32")
    kv = q.copy() if T == S else rng.standard_normal((B, S, _FEATURES)).astype("float32")
    if kind == "identical":
        q[:] = q[:, :1]
        kv = q.copy()
    elif kind == "repeated":
        # Runs of identical tokens (ties in every similarity).
        for x in (q, kv):
            x[:, 3:7] = x[:, 2:3]
            x[:, 10:13] = x[:, 9:10]
    mask = np.ones((B, S), bool)
    if spec["padding"] and B > 1:
        mask[1, S - S // 4 :] = False
    return q, kv, mask


def _layer_class(name):
    from keras_longattn import layers

    return getattr(layers, name)


def _random_weights(layer, rng):
    weights = []
    for v in layer.weights:
        shape = tuple(v.shape)
        if v.path.endswith("centroids"):
            w = rng.standard_normal(shape)
            w /= np.linalg.norm(w, axis=-1, keepdims=True)
        else:
            w = 0.4 * rng.standard_normal(shape)
        weights.append(w.astype("float32"))
    return weights


def _call_kwargs(case):
    kwargs = {"use_causal_mask": bool(case["causal"])}
    if case["padding"]:
        kwargs["value_mask"] = case["mask"]
        if case["q"].shape[1] == case["kv"].shape[1]:
            kwargs["query_mask"] = case["mask"]
    return kwargs


def make_case(name, seed=None):
    """Builds case ``name`` on the active backend: a dict of numpy arrays
    and the layer config, with the output of this backend."""
    import keras

    spec = CASES[name]
    rng = np.random.default_rng(seed if seed is not None else sum(map(ord, name)))
    q, kv, mask = _inputs(spec, rng)
    layer = _layer_class(spec["layer"])(**spec["kwargs"])
    layer(q, kv)
    weights = _random_weights(layer, rng)
    case = {
        "layer": spec["layer"],
        "config": layer.get_config(),
        "weights": weights,
        "q": q,
        "kv": kv,
        "mask": mask,
        "causal": bool(spec["causal"]),
        "padding": bool(spec["padding"]),
    }
    out = run_case(case)
    config = dict(case["config"], implementation="reference")
    ref = _layer_class(spec["layer"]).from_config(config)
    ref(q, kv)
    ref.set_weights(weights)
    expected_ref = keras.ops.convert_to_numpy(ref(q, kv, **_call_kwargs(case)))
    err = output_error(out, dict(case, expected=expected_ref))
    if err > 1e-5:
        raise AssertionError(f"{name}: default path differs from reference ({err:.3g})")
    case["expected"] = out
    return case


def save_case(case, path):
    arrays = {f"weight_{i}": w for i, w in enumerate(case["weights"])}
    arrays.update(
        q=case["q"], kv=case["kv"], mask=case["mask"], expected=case["expected"],
        causal=np.array(case["causal"]), padding=np.array(case["padding"]),
        layer=np.array(case["layer"]), config=np.array(json.dumps(case["config"])),
    )
    np.savez_compressed(path, **arrays)


def load_case(name):
    with np.load(case_path(name)) as data:
        n = sum(1 for k in data.files if k.startswith("weight_"))
        return {
            "layer": str(data["layer"]),
            "config": json.loads(str(data["config"])),
            "weights": [data[f"weight_{i}"] for i in range(n)],
            "q": data["q"],
            "kv": data["kv"],
            "mask": data["mask"],
            "expected": data["expected"],
            "causal": bool(data["causal"]),
            "padding": bool(data["padding"]),
        }


# ------------------------------------------------------------------ running
def real_rows(case):
    """``(B, T)``: the real queries of a case (outputs of padded queries
    are not part of the contract)."""
    q, kv = case["q"], case["kv"]
    if case["padding"] and q.shape[1] == kv.shape[1]:
        return np.asarray(case["mask"], bool)
    return np.ones(q.shape[:2], bool)


def output_error(out, case):
    """Relative error of ``out`` against the stored output, real queries."""
    real = real_rows(case)
    expected = case["expected"][real].astype("float64")
    diff = np.abs(np.asarray(out, "float64")[real] - expected).max()
    return float(diff / max(np.abs(expected).max(), 1e-30))


def run_case(case, call=None):
    """The case's layer, rebuilt from its config with its weights, on its
    inputs (active backend), as numpy. ``call(layer, q, kv, **kwargs)``
    replaces the plain eager call (e.g. the property suite's jitted call)."""
    import keras

    layer = _layer_class(case["layer"]).from_config(dict(case["config"]))
    layer.build(case["q"].shape, case["kv"].shape)
    layer.set_weights(case["weights"])
    if call is not None:
        return np.asarray(call(layer, case["q"], case["kv"], **_call_kwargs(case)))
    return keras.ops.convert_to_numpy(layer(case["q"], case["kv"], **_call_kwargs(case)))


def build_model(case):
    """A functional model around the case's layer with its weights."""
    import keras

    q_in = keras.Input(case["q"].shape[1:], name="query")
    kv_in = keras.Input(case["kv"].shape[1:], name="value")
    inputs = [q_in, kv_in]
    kwargs = {"use_causal_mask": case["causal"]}
    if case["padding"]:
        m_in = keras.Input(case["mask"].shape[1:], dtype="bool", name="mask")
        inputs.append(m_in)
        kwargs["value_mask"] = m_in
        if case["q"].shape[1] == case["kv"].shape[1]:
            kwargs["query_mask"] = m_in
    layer = _layer_class(case["layer"]).from_config(dict(case["config"]))
    out = layer(q_in, kv_in, **kwargs)
    model = keras.Model(inputs, out)
    layer.set_weights(case["weights"])
    return model


def run_model(model, case):
    import keras

    feed = [case["q"], case["kv"]]
    if case["padding"]:
        feed.append(case["mask"])
    return keras.ops.convert_to_numpy(model(feed))


def main(argv=None):
    import keras

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument(
        "--expected", action="store_true",
        help="write the .npz files (expected outputs) on this backend too",
    )
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    os.makedirs(FIXTURE_DIR, exist_ok=True)
    status = 0
    for name in args.case or sorted(CASES):
        if backend == EXPECTED_BACKEND or args.expected or not os.path.exists(case_path(name)):
            if backend != EXPECTED_BACKEND and not args.expected:
                print(f"{name}: no {case_path(name)}; run on {EXPECTED_BACKEND} first")
                status = 1
                continue
            save_case(make_case(name), case_path(name))
        case = load_case(name)
        out = run_case(case)
        err = output_error(out, case)
        model = build_model(case)
        path = keras_path(name, backend)
        model.save(path)
        loaded = keras.saving.load_model(path)
        err_file = output_error(run_model(loaded, case), case)
        flag = "" if max(err, err_file) <= 1e-4 else "   <-- differs from the stored output"
        print(
            f"{name}: {backend} output vs stored: {err:.2e}; .keras round trip: "
            f"{err_file:.2e} ({os.path.getsize(path)} bytes){flag}"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
