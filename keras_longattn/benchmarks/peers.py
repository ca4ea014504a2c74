"""Peer comparison: public PyTorch implementations of the same mechanisms,
measured by the benchmark in the same run and table as the project's layers.

Two peers, both by lucidrains, the fastest public PyTorch implementations
of local and routing attention the project knows of:

* ``peer-local-attention``: ``local_attention.LocalAttention`` (package
  ``local-attention`` 1.11), ``window_size`` = the benchmark's ``--window``
  (256 by default), causal or not as the run, ``autopad=True``, no rotary
  embedding (no ``dim``): each query sees its own and the previous window
  block (and the next one when bidirectional);
* ``peer-routing-transformer``: ``routing_transformer.KmeansAttention``
  (package ``routing-transformer`` 1.6), ``num_clusters = round(sqrt(n))``
  as the ``routing`` short name (128 at n = 16384), window ``n / k``, causal
  or not as the run. Its causal mode is not strictly causal (the clusters
  are the top-w tokens of each centroid, as the authors' code), and it
  trains its centroids in training calls, as the project's layer does.

``keras-longattn bench --peers`` adds both to ``--layers`` (``--peers
routing-transformer`` one of them); from Python, ``run_benchmark(layers=
["full", "routing"] + peer_specs())``. A peer is a Keras layer,
:class:`PeerAttention`, with MultiHeadAttention's projections around the
peer module, so that ``--scope layer`` and ``--scope attention`` (the
attention alone, projected heads in and out) both compare like with like
(:mod:`keras_longattn.benchmarks.peer_layer`; this module imports no
backend).

Nothing is installed here and the peers are not dependencies of the
project. A peer runs on the torch backend only; a configuration whose peer
package is not importable, or that asks for another backend, is reported as
``skipped`` with the reason (``pip install`` line included), without a
worker. To install them (the versions measured in the docs)::

    pip install --no-deps "local-attention==1.11.*" "routing-transformer==1.6.*" \\
        einops hyper-connections mixture-of-experts "product-key-memory==0.1.10"

(``--no-deps`` keeps the installed torch; ``product-key-memory`` newer than
0.1 needs yet another package that ``routing-transformer`` never uses.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Mapping

__all__ = ["PEERS", "Peer", "peer_names", "peer_specs", "skip_reason",
           "unavailable_reason"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer implementation.

    Attributes:
        name: the peer's name (``PeerAttention(peer=...)``); its rows are
            labelled ``"peer-" + name``.
        module: the module imported to run it.
        requirement: what to ``pip install`` (the version measured).
        config: its :class:`PeerAttention` config in the benchmark (values
            may be ``"${...}"`` placeholders).
        description: one line for ``--list-layers``.
    """

    name: str
    module: str
    requirement: str
    config: Mapping[str, Any]
    description: str


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer(
            "local-attention",
            "local_attention",
            "local-attention==1.11.*",
            {"window": "${window}"},
            "peer: lucidrains local-attention 1.11 LocalAttention, window_size "
            "--window, autopad (torch only; installed separately)",
        ),
        Peer(
            "routing-transformer",
            "routing_transformer",
            "routing-transformer==1.6.*",
            {"num_clusters": "${max(1, round(sqrt(seq_len)))}"},
            "peer: lucidrains routing-transformer 1.6 KmeansAttention, "
            "round(sqrt(n)) clusters, window n/k (torch only; installed separately)",
        ),
    )
}

#: Prefix of the peers' row labels.
PREFIX = "peer-"


def peer_names() -> list[str]:
    """The row labels of every peer (``peer-<name>``)."""
    return [PREFIX + name for name in PEERS]


def unavailable_reason(name: str, backend: str | None = None) -> str | None:
    """Why peer ``name`` cannot run on ``backend`` here (None: it can).
    Looks the module up without importing it."""
    peer = PEERS[name]
    if backend is not None and backend != "torch":
        return f"peer {name} runs on the torch backend only (asked: {backend})"
    try:
        found = importlib.util.find_spec(peer.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (
            f"peer {name} is not importable (module {peer.module!r}); the benchmark "
            f"installs nothing: pip install --no-deps '{peer.requirement}' and its "
            "pure-Python dependencies (see keras_longattn.benchmarks.peers)"
        )
    return None


def _peer_of_spec(spec: Mapping[str, Any] | None) -> str | None:
    if not isinstance(spec, Mapping):
        return None
    class_name = str(spec.get("class_name", ""))
    if not class_name.endswith("peer_layer:PeerAttention"):
        return None
    return (spec.get("config") or {}).get("peer")


def skip_reason(job: Mapping[str, Any]) -> str | None:
    """For a benchmark job (``layer_spec``, ``backend``): the reason to
    record it as skipped when it is a peer that cannot run, else None."""
    name = _peer_of_spec(job.get("layer_spec"))
    if name not in PEERS:
        return None
    return unavailable_reason(name, job.get("backend"))


def peer_specs(names: str | list[str] | None = "all") -> list[dict[str, Any]]:
    """The layer configs of the peers (``"all"``, or names with or without
    the ``peer-`` prefix, comma-separated or a list), labelled
    ``peer-<name>`` by their config's ``"name"``: what ``--peers`` adds to
    ``--layers``. Not in the registry of short names, so that every-layer
    runs (``keras-longattn lra --layers all``) never include them.

    Raises:
        ValueError: an unknown peer, naming it and the known ones.
    """
    if names is None or names == "all":
        chosen = list(PEERS)
    else:
        items = names.split(",") if isinstance(names, str) else list(names)
        chosen = []
        for item in (str(i).strip() for i in items):
            name = item[len(PREFIX):] if item.startswith(PREFIX) else item
            if name not in PEERS:
                raise ValueError(
                    f"unknown peer {item!r}; the peers are {', '.join(PEERS)}. "
                    f"Received: peers={names!r}"
                )
            if name not in chosen:
                chosen.append(name)
    return [
        {
            "class_name": f"{__package__}.peer_layer:PeerAttention",
            "config": {"name": PREFIX + name, "peer": name, **PEERS[name].config},
        }
        for name in chosen
    ]
