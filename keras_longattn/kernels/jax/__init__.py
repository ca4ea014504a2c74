"""JAX entries of the backend table (see :mod:`keras_longattn.kernels`)."""

import jax
from keras import ops

from keras_longattn.kernels import BackendOps


class JaxOps(BackendOps):
    name = "jax"
    context_parallel = True

    def block_sparse_refusal(self):
        return None

    def block_sparse_attention(self, query, key, value, rows, cols, block_q, block_k, *,
                               predicate=None, q_pos=None, k_pos=None, k_valid=None,
                               scale=None):
        # The Pallas kernel (kernels/jax/pallas_attention.py), imported on
        # first use.
        from keras_longattn.kernels.jax import pallas_attention

        layout = pallas_attention.Layout(rows, cols, int(block_q), int(block_k))
        return pallas_attention.block_sparse_attention(
            query, key, value, layout, predicate=predicate, q_pos=q_pos, k_pos=k_pos,
            k_valid=k_valid, scale=scale)

    @property
    def auto_preference(self):
        """The Pallas kernel first on a GPU/TPU kind where a device run has
        proven it (:mod:`keras_longattn.kernels.proven`); never on the CPU,
        where Pallas only interprets (slowly: tests only)."""
        from keras_longattn.kernels import proven

        device = proven.active_device_kind("jax")
        if "pallas" in proven.trusted_kinds("jax", device):
            return ("pallas", "explicit", "fused")
        return ("explicit", "fused")

    def refuse_at_run_time(self, bad, value, message):
        """A host callback on the bad branch of a ``lax.cond``: Python runs
        only when ``bad`` is True, and its ValueError stops the program
        (``JaxRuntimeError`` carrying the message)."""

        def fail(v):
            raise ValueError(message.format(value=v.item()))

        jax.lax.cond(bad, lambda v: jax.debug.callback(fail, v), lambda v: None, value)
        return value, True

    def dot_product_attention(self, q, k, v, mask=None, is_causal=False, scale=None):
        dtype = q.dtype
        if dtype == "float16" and jax.default_backend() == "cpu":
            # XLA's CPU dot product has no float16 x float16 -> float32 form
            # (which the fused attention asks for inside jit): compute in
            # float32 and return float16.
            q, k, v = (ops.cast(t, "float32") for t in (q, k, v))
            return ops.cast(
                self.dot_product_attention(q, k, v, mask, is_causal, scale), dtype
            )
        # JAX's kernel needs the value head size equal to the query's: the
        # smaller side is zero-padded (zero query/key columns add nothing to
        # the scores; the zero value columns are cut from the output).
        d, dv = q.shape[-1], v.shape[-1]
        if d == dv:
            return ops.dot_product_attention(
                q, k, v, mask=mask, is_causal=is_causal, scale=scale
            )
        if scale is None:
            scale = 1.0 / float(d) ** 0.5
        width = max(d, dv)

        def widen(x):
            if x.shape[-1] == width:
                return x
            pad = [[0, 0]] * (len(x.shape) - 1) + [[0, width - x.shape[-1]]]
            return ops.pad(x, pad)

        out = ops.dot_product_attention(
            widen(q), widen(k), widen(v), mask=mask, is_causal=is_causal, scale=scale
        )
        return out[..., :dv]

    def compile(self, fn, static_argnames=()):
        jitted = jax.jit(fn, static_argnames=tuple(static_argnames))

        def run(*args, **kwargs):
            # Stateful randomness (attention dropout) is not traced.
            if kwargs.get("dropout_fn") is not None:
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        return run


OPS = JaxOps()
