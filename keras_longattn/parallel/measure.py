"""What a distributed program costs each device (JAX): temporary memory
from the memory analysis of XLA's compiled program, and the bytes its
collectives move, counted in the traced program (a loop's body times its
trip count, which the compiled HLO does not state).

Used by the tests of :mod:`keras_longattn.parallel` and by
``python -m keras_longattn.parallel.measure`` (the scaling table of the
distributed-training guide). Compiling needs no device memory, so the
figures can be taken for sequence lengths that would not run on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["compiled_cost", "jaxpr_collective_bytes", "markdown_table", "scaling_rows",
           "summarize", "main"]

#: Collective primitives of a jaxpr (inside ``shard_map``: per device).
JAXPR_COLLECTIVES = ("ppermute", "psum", "pmax", "pmin", "all_gather", "all_to_all",
                     "psum_scatter", "reduce_scatter")


def _aval_bytes(aval):
    import numpy as np

    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def jaxpr_collective_bytes(jaxpr):
    """Bytes the collectives of a (closed) jaxpr move per device: the
    results of each collective primitive inside ``shard_map``, a ``scan``
    body's counted ``length`` times, a ``cond``'s largest branch once."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in JAXPR_COLLECTIVES:
            total += sum(_aval_bytes(v.aval) for v in eqn.outvars)
            continue
        if name == "while":
            raise ValueError("a while loop's trip count is unknown: cannot count its collectives")
        if name == "cond":
            total += max(jaxpr_collective_bytes(b) for b in eqn.params["branches"])
            continue
        times = int(eqn.params["length"]) if name == "scan" else 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                total += times * jaxpr_collective_bytes(sub)
    return total


def compiled_cost(fn, *args):
    """Compiles ``jax.jit(fn)`` for ``args`` (arrays or
    ``jax.ShapeDtypeStruct`` with shardings) and returns one device's
    ``temp_bytes``, ``argument_bytes``, ``output_bytes`` (XLA's memory
    analysis) and the bytes its collectives move (``collective_bytes``,
    :func:`jaxpr_collective_bytes` of the traced program: loops in the
    compiled HLO hide their trip counts)."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    analysis = compiled.memory_analysis()
    return {
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "collective_bytes": jaxpr_collective_bytes(jax.make_jaxpr(fn)(*args)),
    }


#: Global tokens of the "longformer" kind (the first positions).
LONGFORMER_GLOBAL_TOKENS = 16
KINDS = ("local", "longformer", "full")


def _training_step(kind, mesh, axis, window, causal):
    """Forward + backward of one attention call with the sequence sharded."""
    import jax
    import jax.numpy as jnp

    from keras_longattn.parallel.context import (halo_local_attention,
                                                 halo_longformer_attention, ring_attention)

    def loss(q, k, v):
        if kind == "longformer":
            out = halo_longformer_attention(q, k, v, mesh=mesh, sequence_axis=axis,
                                            window=window, causal=causal,
                                            global_tokens=LONGFORMER_GLOBAL_TOKENS)
        elif kind == "local":
            out = halo_local_attention(q, k, v, mesh=mesh, sequence_axis=axis,
                                       look_back=window - 1 if causal else window // 2,
                                       look_ahead=0 if causal else window // 2)
        else:
            out = ring_attention(q, k, v, mesh=mesh, sequence_axis=axis, causal=causal)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))


def scaling_rows(kinds=KINDS, length=65536, devices=(1, 2, 4, 8), batch=1,
                 heads=4, head_dim=64, window=512, causal=True, dtype="float32"):
    """Per-device cost of a forward + backward pass of context-parallel
    attention (:func:`compiled_cost`) for each kind and device count, from
    the compiled programs."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    available = jax.devices()
    rows = []
    for kind in kinds:
        for count in devices:
            if count > len(available):
                raise ValueError(
                    f"`devices` asks for {count} devices; JAX has {len(available)}. "
                    "On the CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                    "before JAX starts.")
            mesh = Mesh(np.array(available[:count]), ("sequence",))
            sharding = NamedSharding(mesh, PartitionSpec(None, "sequence", None, None))
            spec = jax.ShapeDtypeStruct((batch, length, heads, head_dim), dtype,
                                        sharding=sharding)
            cost = compiled_cost(_training_step(kind, mesh, "sequence", window, causal),
                                 spec, spec, spec)
            rows.append({"kind": kind, "devices": count, "length": length, **cost})
    return rows


def summarize(rows):
    """Per kind: each device count's temporary memory as a share of one
    device's (``memory_share``), next to ``1 / devices``, and the collective
    traffic per device in MiB."""
    summary = {}
    for kind in [k for k in KINDS if any(row["kind"] == k for row in rows)]:
        mine = {row["devices"]: row for row in rows if row["kind"] == kind}
        one = mine.get(1)
        summary[kind] = {
            str(count): {
                "temp_mib": round(row["temp_bytes"] / 2**20, 1),
                "collective_mib": round(row["collective_bytes"] / 2**20, 3),
                "memory_share": (round(row["temp_bytes"] / one["temp_bytes"], 4)
                                 if one else None),
                "ideal_share": round(1 / count, 4),
            }
            for count, row in sorted(mine.items())
        }
    return summary


def markdown_table(rows):
    """The rows as a Markdown table (kind, devices, temporary memory per
    device, its share of one device's, collective traffic per device)."""
    summary = summarize(rows)
    names = {"local": "Local (halo exchange)", "full": "Full (ring)",
             "longformer": f"Longformer (halo, {LONGFORMER_GLOBAL_TOKENS} global tokens)"}
    lines = ["| attention | devices | temporary memory per device (MiB) | share of 1 device "
             "| 1 / devices | collectives per device (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, counts in summary.items():
        for count, cell in counts.items():
            share = "-" if cell["memory_share"] is None else f"{cell['memory_share']:.3f}"
            lines.append(f"| {names.get(kind, kind)} | {count} | {cell['temp_mib']:,.1f} | {share} "
                         f"| {cell['ideal_share']:.3f} | {cell['collective_mib']:,.2f} |")
    return "\n".join(lines)


def _platform():
    import jax

    return {"jax": jax.__version__, "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_longattn.parallel.measure",
        description="Per-device temporary memory and collective traffic of "
                    "context-parallel attention (forward + backward), from "
                    "XLA's compiled programs.")
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    devices = tuple(int(d) for d in args.devices.split(","))
    rows = scaling_rows(kinds=tuple(args.kinds.split(",")), length=args.length,
                        devices=devices, heads=args.heads, head_dim=args.head_dim,
                        window=args.window)
    for row in rows:
        print(f"{row['kind']:10s} devices={row['devices']}"
              f"  temp={row['temp_bytes'] / 2**20:10.1f} MiB"
              f"  collectives={row['collective_bytes'] / 2**20:10.2f} MiB")
    if args.output:
        from keras_longattn.provenance import collect

        command = ("KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m "
                   f"keras_longattn.parallel.measure --length {args.length} --devices "
                   f"{args.devices} --window {args.window} --heads {args.heads} --head-dim "
                   f"{args.head_dim} --kinds {args.kinds} --output {args.output}")
        record = {"rows": rows, "summary": summarize(rows), "table": markdown_table(rows),
                  "parameters": vars(args), "platform": _platform(), "command": command,
                  "provenance": collect()}
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
