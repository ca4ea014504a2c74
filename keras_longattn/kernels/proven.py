"""Which accelerator paths a device run has proven, per device kind.

``implementation="auto"`` tries an accelerator kind of path (``"pallas"``
on JAX, ``"flex"`` on torch) only on a device kind listed here for that
kind; elsewhere it keeps the portable paths, and the accelerator path runs
only when named (``implementation="pallas"``). An entry is added from a
run of ``scripts/device_check.sh`` on that device in which every layer's
path equalled the reference path, values and gradients, in float32 and
bfloat16 (the ``correct`` stage), and is dated with the commit it ran on.

``KERAS_LONGATTN_TRUSTED_PATHS`` (a comma-separated list of kinds, e.g.
``pallas,flex``) lets ``"auto"`` try those kinds on any accelerator, for
devices nobody has checked yet.
"""

import os

#: ``{(backend, device kind): {path kind: evidence}}``. The device kind is
#: the device's own name (JAX's ``device_kind``, torch's
#: ``torch.cuda.get_device_name()``).
PROVEN = {
    ("jax", "NVIDIA H200"): {
        "pallas": {
            "date": "2026-11-26",
            "device": "NVIDIA H200 (jax 0.11.2, jaxlib 0.11.2, triton 3.6.0)",
            "check": "scripts/device_check.py correct: the 11 cases of layer_cases() "
                     "(Local, Sparse strided/fixed, BigBird, Longformer with dilation and "
                     "global tokens, Routing), float32 and bfloat16, outputs and input "
                     "gradients against the reference path",
            "commits": ("6dc464fb4d7b37ea40c3b12dd10a9a22260f08c3",
                        "9f81bbd396fcead69860e32df56c9ebeb1718c6d"),
            "results": "docs/benchmarks/gpu_results.json",
        },
    },
    # torch "flex" on the H200: 10 of the 11 cases passed; Longformer's was
    # cut off by the check's time limit, so "auto" does not try it yet.
}

#: Environment variable listing kinds ``"auto"`` may try on any accelerator.
TRUST_VARIABLE = "KERAS_LONGATTN_TRUSTED_PATHS"


def active_device_kind(backend):
    """The name of the accelerator the backend computes on, or None on a
    CPU."""
    if backend == "jax":
        import jax

        if jax.default_backend() == "cpu":
            return None
        return jax.devices()[0].device_kind
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return None


def trusted_kinds(backend, device_kind):
    """The path kinds ``"auto"`` may try on ``device_kind`` (a set; empty
    on a CPU, ``device_kind`` None)."""
    if device_kind is None:
        return frozenset()
    kinds = set(PROVEN.get((backend, device_kind), {}))
    extra = os.environ.get(TRUST_VARIABLE, "")
    kinds.update(k.strip() for k in extra.split(",") if k.strip())
    return frozenset(kinds)


def evidence(backend, device_kind, kind):
    """The record that proved ``kind`` on ``device_kind`` (None: none)."""
    return PROVEN.get((backend, device_kind), {}).get(kind)
