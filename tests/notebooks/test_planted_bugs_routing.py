"""Unit tests of the Routing Transformer notebook's check functions.

The reach and co-clustering measures run on tiny real layers (whether the
layer's own attention lets a query see its stored key; which cluster it
puts them in); the claim checks run on synthetic per-seed numbers shaped
like the notebook's outputs. The planted variants that train real broken
layers through the notebook's code are ``rt.PLANTED``
(``tests/notebooks/test_planted_real.py``).
"""

import functools

import numpy as np
import pytest

import keras

from keras_longattn.layers import RoutingAttention
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import routing_transformer as rt

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _failed(claims):
    return {c.name for c in claims if c.failed}



# ------------------------------------------------------------------ routing

ROUTING_MARGINS = dict(min_full_accuracy=0.8, max_local_excess=0.1, margin_random=0.3,
                       margin_local=0.3, margin_reach=0.3, min_local_speedup=1.1)
CHANCE = 1 / 8


def _recall_probe(seed=0):
    x, _, w = rt.make_unique_recall(4, 96, 4, 4, 48, np.random.default_rng(seed))
    embedding = np.random.default_rng(seed).normal(size=(16, 16)).astype("float32")
    return x, w, embedding[x]


@functools.lru_cache(maxsize=None)
def _shares(layer_cls, seed=0):
    """(co-clustered share, reach share, the reach read from the layer's own
    attention weights) of a tiny routing layer on recall sequences whose
    token vectors depend on the token only."""
    keras.utils.set_random_seed(seed)
    x, w, hidden = _recall_probe(seed)
    layer = layer_cls(num_heads=2, key_dim=8, local_heads=0, num_clusters=2, window=8,
                      shared_qk=True)
    routing = layer.compute_clusters(hidden, use_causal_mask=True)
    clusters = keras.ops.convert_to_numpy(routing["query_clusters"])
    co = rt.co_clustered_share(x, clusters, w, 4, 4)
    reach = rt.reach_share(x, clusters, w, int(routing["window"]))
    _, weights = layer(hidden, hidden, use_causal_mask=True, return_attention_scores=True)
    weights = keras.ops.convert_to_numpy(weights)
    seen = []
    for b in range(x.shape[0]):
        for q in np.flatnonzero(w[b] > 0):
            stored = np.flatnonzero(x[b, :q] == x[b, q])[0]
            seen.append(np.mean(weights[b, :, q, stored] > 0))
    return co, reach, float(np.mean(seen))


def _routing_results(routing_acc, reach_routing, routing_step=1.5):
    return {
        "chance": CHANCE,
        "accuracy": {"local": [0.12, 0.14], "random": [0.22, 0.27],
                     "routing": routing_acc, "full": [1.0, 0.99]},
        "reach": {"routing": reach_routing, "random": [0.25, 0.26]},
        "co_clustered": {"routing": [1.0, 1.0], "random": [0.25, 0.26]},
        "step_seconds": {"local": [0.10, 0.11, 0.10, 0.12],
                         "routing": [routing_step * v for v in (0.10, 0.11, 0.10, 0.12)]},
    }


def test_reach_share_is_what_the_layer_attends_to():
    # The share computed from the clusters is the share of queries whose
    # stored key gets attention weight in the layer's own computation.
    co, reach, seen = _shares(RoutingAttention)
    assert co == 1.0  # the same token vector, the same cluster
    assert reach == pytest.approx(seen)
    assert 0.0 < reach < 1.0  # chunks of 8 members: far keys are out of reach


def test_co_clustered_cannot_tell_one_cluster_from_learned_ones():
    # The hollow measure: one cluster for every token gives 1.0; the reach
    # of the same assignment is 0 (the filler fills the key's chunks).
    x, w, _ = _recall_probe()
    one_cluster = np.zeros((x.shape[0], 2, x.shape[1]), dtype="int32")
    assert rt.co_clustered_share(x, one_cluster, w, 4, 4) == 1.0
    assert rt.reach_share(x, one_cluster, w, 8) == 0.0


def test_routing_real_layer_passes():
    results = _routing_results([0.97, 0.99], [0.92, 0.95])
    claims = rt.routing_claims(results, ROUTING_MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)
    co = {c.name: c for c in claims}["co_clustered"]
    assert not co.asserted and "reported, not asserted" in co.detail


def test_routing_planted_random_clusters_fails():
    # Bug: the layer's clusters are random (RandomRoutingAttention): its
    # queries rarely reach their stored key, and the model scores like
    # the random control.
    co, reach, _ = _shares(rt.RandomRoutingAttention)
    assert co < 0.8
    results = _routing_results([0.23, 0.26], [reach, reach + 0.02])
    claims = rt.routing_claims(results, ROUTING_MARGINS)
    assert {"beats_random", "beats_local", "reach"} <= _failed(claims)
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims(claims)


def test_routing_frozen_arm_is_reported():
    results = _routing_results([0.97, 0.99], [0.92, 0.95])
    results["accuracy"]["frozen"] = [0.6, 0.7]
    results["reach"]["frozen"] = [0.4, 0.45]
    claims = {c.name: c for c in rt.routing_claims(results, ROUTING_MARGINS)}
    assert claims["beats_frozen"].verdict == cl.REPRODUCED
    assert not claims["beats_frozen"].asserted
    assert claims["reach_frozen"].verdict == cl.REPRODUCED
    margins = dict(ROUTING_MARGINS, assert_frozen=True)
    results["accuracy"]["frozen"] = [0.95, 0.97]
    claims = {c.name: c for c in rt.routing_claims(results, margins)}
    assert claims["beats_frozen"].failed


def test_recall_setup_refuses_a_reachable_store():
    with pytest.raises(ValueError, match="min_distance"):
        rt.RecallSetup(min_distance=100)  # < 4 local windows of 32
    with pytest.raises(ValueError, match="min_distance"):
        rt.RecallSetup(window=16, routing_window=64, min_distance=128)


def test_routing_planted_leaky_task_or_dense_control_fails():
    # Bug: the local control reaches the answer (a task whose stored key is
    # inside the window, or the control swapped for dense attention).
    results = _routing_results([0.97, 0.99], [0.92, 0.95])
    results["accuracy"]["local"] = [0.95, 0.97]
    claims = rt.routing_claims(results, ROUTING_MARGINS)
    assert {"local_blind", "beats_local"} <= _failed(claims)


def test_routing_planted_routing_swapped_for_dense_fails_on_time():
    # Bug: the routing layer swapped for a cheap local one (no routing cost)
    # or a timing that measures the same model twice.
    results = _routing_results([0.97, 0.99], [0.92, 0.95], routing_step=1.0)
    assert "local_faster" in _failed(rt.routing_claims(results, ROUTING_MARGINS))
