"""JAX entries of the backend table (see :mod:`keras_longattn.kernels`)."""

import jax
import jax.numpy as jnp
from keras import ops

from keras_longattn.kernels import BackendOps


#: Programs :meth:`JaxOps.probe` compiled (their jaxpr text and argument
#: shapes).
_PROBED = set()


def _spec(x):
    """The shape, dtype and weak type of ``x`` (an array or a tracer)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


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

    def window_attention_refusal(self, dtype, query_length, key_length, key_dim, value_dim,
                                 look_back, look_ahead, causal, key_padding):
        # cuDNN's sliding window (kernels/jax/cudnn_window.py).
        from keras_longattn.kernels.jax import cudnn_window

        return cudnn_window.refusal(dtype, query_length, key_length, key_dim, value_dim,
                                    look_back, look_ahead, causal, key_padding)

    def window_attention(self, query, key, value, look_back, look_ahead, causal, scale):
        from keras_longattn.kernels.jax import cudnn_window

        return cudnn_window.window_attention(query, key, value, look_back, look_ahead,
                                             causal, scale)

    @property
    def auto_preference(self):
        """cuDNN's window, then the Pallas kernel, first on a GPU/TPU of a
        vendor for which a device run proved them on their current sources
        (:mod:`keras_longattn.kernels.proven`); never on the CPU, where
        Pallas only interprets (slowly: tests only) and there is no
        cuDNN."""
        from keras_longattn.kernels import proven

        trusted = proven.trusted_kinds("jax", proven.active_vendor("jax"))
        first = tuple(kind for kind in ("cudnn", "pallas") if kind in trusted)
        return first + ("explicit", "fused")

    def probe(self, fn, args):
        """Under ``jax.jit`` (``args`` tracers) a path is only traced while
        its layer runs; Pallas' Triton lowering and XLA's compilation of a
        cuDNN call come later, with the whole program, where no layer can
        fall back. So ``fn(*args)`` is traced to a program of its own
        (the values it closes over, the caller's tracers included, become
        arguments) and compiled now for the same shapes, forward and
        backward; what compiling raises is raised here. Each program is
        compiled once per process. Eager calls (concrete ``args``) compile
        as they run, and are not probed."""
        tracer = getattr(jax.core, "Tracer", None)
        eval_jaxpr = getattr(jax.core, "eval_jaxpr", None)
        if tracer is None or eval_jaxpr is None:  # pragma: no cover (no probe there)
            return None
        if not any(isinstance(x, tracer) for x in jax.tree_util.tree_leaves(args)):
            return None
        closed = jax.make_jaxpr(fn)(*args)
        jaxpr, consts = closed.jaxpr, list(closed.consts)
        flat = jax.tree_util.tree_leaves(args)
        specs = ([_spec(c) for c in consts], [_spec(a) for a in flat])
        key = (str(jaxpr), repr(specs))
        if key in _PROBED:
            return None
        outputs = jaxpr.outvars
        differentiable = (all(jnp.issubdtype(s.dtype, jnp.inexact) for s in specs[1])
                          and all(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in outputs))

        def program(consts, args):
            if not differentiable:
                return eval_jaxpr(jaxpr, consts, *args)
            outs, pullback = jax.vjp(lambda *a: eval_jaxpr(jaxpr, consts, *a), *args)
            return outs, pullback([jnp.ones_like(o) for o in outs])

        jax.jit(program).lower(*specs).compile()
        if len(_PROBED) >= 256:
            _PROBED.clear()
        _PROBED.add(key)
        return None

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
