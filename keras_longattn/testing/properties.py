"""Property-based checks (Hypothesis) that every attention layer runs.

:class:`AttentionLayerProperties` is a mixin with the same class-attribute
flags as :class:`keras_longattn.testing.AttentionLayerConformance` (and a few
of its own, listed below), so a test class can inherit both. Subclass it in a
pytest module (the class name must start with ``Test``)::

    from keras_longattn.layers import LocalAttention
    from keras_longattn.testing.properties import AttentionLayerProperties

    class TestLocalAttentionProperties(AttentionLayerProperties):
        layer_cls = LocalAttention
        init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 5}

What is checked (every test name starts with ``test_prop_``):

* random query/key lengths (``min_length..max_length``, ``T != S`` when the
  layer supports cross-attention), random left/right/middle/all padding per
  example: the efficient path equals the layer's ``"reference"``
  implementation on the same weights on real queries, and every output is
  finite;
* ``value_dim != key_dim`` and ``output_shape`` (int and tuple);
* dtype policies (``float16``, ``bfloat16``, ``mixed_float16``,
  ``mixed_bfloat16``): finite, the policy's dtype, close to float32 on the
  same weights within :attr:`precision_rtol`;
* large-magnitude inputs give finite outputs;
* a functional model with ``Input((None, features))`` predicts and fits at
  two sequence lengths, with and without ``jit_compile``;
* batch composition: an example's real outputs do not change when other
  examples (other lengths) share its batch or when padding is appended;
* NaN or inf in padded key/value positions never reaches a real output or a
  weight gradient;
* padding is inert on every path: for the ``"reference"`` path and each
  efficient path that accepts the call, random values and NaN at padded
  positions (marked by ``value_mask`` alone, by ``value_mask`` and
  ``query_mask``, by ``key_mask``, or by a dense ``attention_mask``) leave
  the real outputs as they are with zeros there;
* decoding with a cache (layers that have one; the mixin
  :class:`keras_longattn.testing.decoding.DecodingProperties`): bad cache
  arguments refused, empty calls, the cache's dtype kept, unwritten slots
  inert, a traced index outside the cache refused when the program runs;
* an empty batch and an empty sequence give an empty output of the right
  shape and dtype;
* causal layers are prefix-consistent: the outputs for a prefix equal the
  first outputs of the longer sequence (what generation relies on);
* ``keras.utils.set_random_seed`` makes construction reproducible: two
  layers made after the same seed (the layer's own seed arguments left at
  None) give the same outputs;
* invalid constructor arguments are refused at construction with a
  ``ValueError`` naming the argument and the value;
* stored fixtures (``tests/fixtures``, written by
  ``python -m keras_longattn.testing.fixtures``): the same weights and inputs
  give the stored outputs on every backend, and ``.keras`` files saved on
  each backend load and reproduce them.

Hypothesis profiles (:mod:`keras_longattn.testing.profiles`): ``"ci"``
(derandomised, no deadline, few examples, no shrinking) is the default;
``"slow"`` (random, 10x the examples, shrinking) is loaded by the root
``conftest.py`` under ``--run-slow``. Each test's number
of examples is :attr:`property_examples` scaled by the active profile; the
batch-composition test also runs two explicit examples first (10 real
tokens padded to 30 next to an example of 16, in each mode).

Cost: JAX compiles per shape, so on JAX the calls run under ``jax.jit``
(:func:`call_layer`: one compilation per shape instead of one per primitive;
the conformance suite covers eager calls). Under "ci", eager ``fit`` on JAX
and ``jit_compile=True`` on torch (``torch.compile``, minutes to warm up on
CPU) are left to ``--run-slow``, and a class can name the tests it runs in
CI (:attr:`ci_properties`), so that secondary configurations of a layer share
the budget.

Known failures: :attr:`known_failures` maps a test id (``"test_prop_x"`` or a
parametrized ``"test_prop_x[case]"``) to a reason; the root ``conftest.py``
calls :func:`apply_known_failures`, which marks those tests
``xfail(strict=True)``.
"""

import os

import keras
import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_longattn.testing.calls import PADDINGS
from keras_longattn.testing.calls import call_layer
from keras_longattn.testing.calls import masked_sum
from keras_longattn.testing.calls import padding_row
from keras_longattn.testing.decoding import DecodingProperties
from keras_longattn.testing.gradients import weight_gradients
from keras_longattn.testing.profiles import example_budget
from keras_longattn.testing.profiles import slow_profile
from keras_longattn.testing.numerics import rel_error

class AttentionLayerProperties(DecodingProperties):
    """Hypothesis properties of the attention-layer contract.

    Flags shared with :class:`AttentionLayerConformance` (same meaning):
    ``layer_cls``, ``init_kwargs``, ``features``, ``batch_size``,
    ``supports_causal``, ``supports_bidirectional``, ``supports_padding``,
    ``supports_mixed_precision``, ``supports_jit``, ``reference_rtol``,
    ``deterministic``.

    Flags of this mixin:

    * ``exact``: the efficient path computes the reference exactly (up to
      float rounding, :attr:`reference_rtol`). An approximate layer sets
      False and gives ``approximation_rtol`` (or None: only shapes and
      finiteness are checked against the reference).
    * ``supports_cross_attention``: calls with ``T != S``.
    * ``supports_dynamic_length``: works in a functional model whose inputs
      have an unknown sequence length.
    * ``min_length``, ``max_length``: sequence lengths drawn (the layer's
      smallest legal padded length, e.g. balanced routing needs
      ``num_clusters``).
    * ``precision_rtol``: relative error allowed against float32 for each
      low-precision compute dtype (None: finiteness and dtype only).
    * ``large_input_scales``: input magnitudes of the large-activation check.
    * ``invariance_rtol``: relative error allowed when the batch around an
      example changes (different shapes round differently).
    * ``dynamic_lengths``: the two lengths of the dynamic-length model.
    * ``property_examples``: examples per Hypothesis test under "ci".
    * ``fixture_cases``: names of the stored cross-backend fixtures of this
      layer (see :mod:`keras_longattn.testing.fixtures`).
    * ``fixture_rtol``: relative error allowed against a stored output.
    * ``known_failures``: test id -> reason, marked ``xfail(strict=True)``.
    * ``ci_properties``: the tests run in CI (None: all); the others need
      ``--run-slow``.
    * ``jit_on_jax``: on JAX, run the calls under ``jax.jit`` (one
      compilation per shape; eager JAX compiles every primitive per shape).
      The conformance suite covers the eager calls.
    * ``couples_queries``: the layer mixes queries with each other (e.g.
      Nyström's landmarks are means of queries), so a position padded only
      through ``value_mask`` is a real query that may move real outputs:
      the padding-inert check then always passes ``query_mask`` too.
    * ``seed_arguments``: constructor arguments that seed the layer's own
      random structure; the seed check sets them to None.
    * ``precision_length``: sequence length of the mixed-precision check
      (None: :attr:`fixed_length`).
    * ``seed_length``: sequence length of the seeding check (None:
      :attr:`fixed_length`).
    * ``invalid_arguments``: constructor argument -> values that must be
      refused at construction (added to :attr:`BASE_INVALID_ARGUMENTS`).
    """

    layer_cls = None
    init_kwargs = {}
    features = 16
    batch_size = 2
    supports_causal = True
    supports_bidirectional = True
    supports_padding = True
    supports_mixed_precision = True
    supports_jit = True
    reference_rtol = 1e-5
    deterministic = True

    exact = True
    approximation_rtol = None
    supports_cross_attention = True
    supports_dynamic_length = True
    min_length = 1
    max_length = 300
    precision_rtol = {"float16": 2e-2, "bfloat16": 1e-1}
    large_input_scales = (1e3, 1e5, 1e7)
    invariance_rtol = 1e-5
    dynamic_lengths = (13, 21)
    property_examples = {
        "reference": 2,
        "invariance": 1,
        "nonfinite": 1,
        "large": 2,
    }
    #: Length of the checks that do not draw lengths (one shape: JAX
    #: compiles it once per layer configuration).
    fixed_length = 19
    fixture_cases = ()
    fixture_rtol = 1e-4
    known_failures = {}
    #: Run the property calls under ``jax.jit`` on JAX (see :func:`call_layer`).
    jit_on_jax = True
    #: Names of the tests run under the "ci" profile (None: all); the others
    #: run under --run-slow. Lets secondary configurations of a layer share
    #: the CI budget.
    ci_properties = None
    #: Tests every configuration runs in CI, whatever :attr:`ci_properties`
    #: says (the contract every layer must keep).
    always_in_ci = (
        "test_prop_padding_inert_every_path",
        "test_prop_empty_inputs",
        "test_prop_prefix_consistency",
        "test_prop_seed_reproducible",
        "test_prop_invalid_arguments",
        "test_prop_dtype_policy",
        # keras_longattn.testing.decoding (layers with a cache only).
        "test_prop_decode_cache_arguments",
        "test_prop_decode_unwritten_slots_inert",
        "test_prop_decode_traced_index_refused",
    )
    couples_queries = False
    seed_arguments = ("seed",)
    precision_length = None
    #: Sequence length of the seeding check (None: :attr:`fixed_length`):
    #: long enough that the random structure matters.
    seed_length = None
    invalid_arguments = {}
    #: Arguments every layer refuses at construction (BaseAttention's).
    BASE_INVALID_ARGUMENTS = {
        "num_heads": (0, -1, 1.5, "2", True, None),
        "key_dim": (0, 2.5, "8"),
        "value_dim": (0, -3, 4.5),
        "dropout": (1.0, -0.1, float("nan"), "0.1"),
        "output_shape": (0, (0,), (), "a", 2.7),
        "implementation": ("nope",),
        "seed": (-1, 1.5, "a"),
        "rotary_max_wavelength": (1, 0.5, float("inf"), "x"),
    }

    @pytest.fixture(autouse=True)
    def _property_subset(self, request):
        subset = self.ci_properties
        if subset is None or slow_profile():
            return
        name = getattr(request.node, "originalname", None) or request.node.name
        if name in self.always_in_ci:
            return
        if name.startswith("test_prop_") and name not in subset:
            pytest.skip("not in this configuration's CI subset: --run-slow")

    # ----------------------------------------------------------- utilities
    def make_layer(self, **overrides):
        kwargs = dict(self.init_kwargs)
        kwargs.update(overrides)
        return self.layer_cls(**kwargs)

    def modes(self):
        result = []
        if self.supports_causal:
            result.append(True)
        if self.supports_bidirectional:
            result.append(False)
        return result

    def reference_output(self, layer, query, value, **call_kwargs):
        """The dense reference of ``layer``'s own pattern on the same weights
        (as the conformance suite: a clone with
        ``implementation="reference"``)."""
        ref = self._path_layer(layer, "reference", tuple(query.shape), tuple(value.shape))
        out = call_layer(ref, query, value, jit=self.jit_on_jax, **call_kwargs)
        assert ref.last_implementation == "reference"
        return out

    def call(self, layer, query, value, **kwargs):
        """The layer's output as numpy (on JAX under ``jax.jit`` when
        :attr:`jit_on_jax`)."""
        return call_layer(layer, query, value, jit=self.jit_on_jax, **kwargs)

    def _record(self, test):
        """Appends "<class> <test> <backend>" to the file named by
        ``KERAS_LONGATTN_PROPERTY_LOG`` (one line per example tried)."""
        path = os.environ.get("KERAS_LONGATTN_PROPERTY_LOG")
        if path:
            with open(path, "a") as f:
                f.write(f"{type(self).__name__} {test} {keras.backend.backend()}\n")

    def _examples(self, name):
        return example_budget(self.property_examples.get(name, 3))

    def _random(self, rng, *shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype("float32")

    @staticmethod
    def _draw_mask(data, B, n, label):
        rows = []
        for b in range(B):
            kind = data.draw(st.sampled_from(PADDINGS), label=f"{label}[{b}]")
            cut = data.draw(st.integers(1, n), label=f"{label}_cut[{b}]")
            rows.append(padding_row(kind, n, cut))
        return np.stack(rows)

    @staticmethod
    def _draw_kind(data, n, b):
        kind = data.draw(st.sampled_from(PADDINGS), label=f"kind[{b}]")
        return kind, n, data.draw(st.integers(1, n), label=f"cut[{b}]")

    def _draw_call(self, data, self_attention=False):
        """Lengths, mode and padding of one call."""
        lo, hi = self.min_length, self.max_length
        T = data.draw(st.integers(lo, hi), label="T")
        cross = (
            self.supports_cross_attention
            and not self_attention
            and data.draw(st.booleans(), label="cross")
        )
        S = data.draw(st.integers(lo, hi), label="S") if cross else T
        causal = data.draw(st.sampled_from(self.modes()), label="causal")
        return T, S, causal

    # ---------------------------------------------- efficient == reference
    def test_prop_matches_reference(self):
        """Random lengths and padding: the efficient path equals the
        reference on real queries, and every output is finite."""
        B = self.batch_size
        layer = self.make_layer()

        @settings(max_examples=self._examples("reference"))
        @given(st.data())
        def check(data):
            self._record("matches_reference")
            T, S, causal = self._draw_call(data)
            seed = data.draw(st.integers(0, 2**16), label="seed")
            rng = np.random.default_rng(seed)
            q = self._random(rng, B, T, self.features)
            same_kv = S == T and data.draw(st.booleans(), label="self_attention")
            kv = q if same_kv else self._random(rng, B, S, self.features)
            kwargs = {"use_causal_mask": causal}
            qmask = np.ones((B, T), bool)
            if self.supports_padding:
                kmask = self._draw_mask(data, B, S, "key_padding")
                kwargs["value_mask"] = kmask
                if same_kv:
                    qmask = kmask  # self-attention: one padding
                else:
                    qmask = self._draw_mask(data, B, T, "query_padding")
                kwargs["query_mask"] = qmask
            out = self.call(layer, q, kv, **kwargs)
            assert out.shape == (B, T, self.features)
            assert np.all(np.isfinite(out)), "non-finite output"
            if layer.implementations:
                assert layer.last_implementation != "reference"
            ref = self.reference_output(layer, q, kv, **kwargs)
            if not qmask.any():
                return
            err = rel_error(out[qmask], ref[qmask])
            if self.exact:
                tol = self.reference_rtol
            elif self.approximation_rtol is not None:
                tol = self.approximation_rtol
            else:
                return
            assert err <= tol, (
                f"T={T} S={S} causal={causal}: relative error {err:.3g} > {tol}"
            )

        check()

    # ----------------------------------------------- value_dim / output_shape
    @pytest.mark.parametrize(
        "case", ["value_dim", "output_shape_int", "value_dim_output_shape_tuple"]
    )
    def test_prop_projection_shapes(self, case):
        """value_dim != key_dim and output_shape (int, tuple) give the right
        shape, finite values, and equal the reference."""
        overrides = {}
        key_dim = self.init_kwargs.get("key_dim", 8)
        if "value_dim" in case:
            overrides["value_dim"] = key_dim + 3
        if case == "output_shape_int":
            overrides["output_shape"] = 7
        elif "tuple" in case:
            overrides["output_shape"] = (3, 2)
        out_tail = {7: (7,), (3, 2): (3, 2)}.get(overrides.get("output_shape"), (self.features,))
        n = self.fixed_length
        rng = np.random.default_rng(3)
        x = self._random(rng, self.batch_size, n, self.features)
        causal = self.modes()[0]
        layer = self.make_layer(**overrides)
        out = self.call(layer, x, x, use_causal_mask=causal)
        assert out.shape == (self.batch_size, n) + out_tail
        assert np.all(np.isfinite(out))
        ref = self.reference_output(layer, x, x, use_causal_mask=causal)
        if self.exact:
            assert rel_error(out, ref) <= self.reference_rtol

    # ------------------------------------------------------- precision
    @pytest.mark.parametrize(
        "policy",
        [
            "mixed_float16",
            "mixed_bfloat16",
            pytest.param("float16", marks=pytest.mark.slow),
            pytest.param("bfloat16", marks=pytest.mark.slow),
        ],
    )
    def test_prop_dtype_policy(self, policy):
        """Low-precision policies: finite, the compute dtype, close to
        float32 on the same weights (real queries)."""
        if not self.supports_mixed_precision:
            pytest.skip("layer does not support low precision")
        n = self.precision_length or self.fixed_length
        B = self.batch_size
        rng = np.random.default_rng(5)
        x = self._random(rng, B, n, self.features)
        mask = np.ones((B, n), bool)
        if self.supports_padding:
            mask[0, n - 5 :] = False
        compute = policy.split("_")[-1]
        # XLA's CPU dot_general has no float16 x float16 -> float32 (JAX
        # under jit; MultiHeadAttention fails the same way in predict):
        # float16 runs eagerly on JAX.
        jit = self.jit_on_jax and compute != "float16"
        # Seeded weights: the result must not depend on which tests ran
        # before (discrete layers, e.g. routing, can move a token to another
        # cluster under float16 for some weights; the stated tolerance is for
        # these).
        keras.utils.set_random_seed(5)
        for causal in self.modes()[:1]:
            kwargs = {"use_causal_mask": causal}
            if self.supports_padding:
                kwargs.update(query_mask=mask, value_mask=mask)
            full = self.make_layer()
            expected = call_layer(full, x, x, jit=jit, **kwargs)
            low = self.make_layer(dtype=policy)
            low.build(x.shape, x.shape)
            low.set_weights(full.get_weights())
            y = call_layer(low, x, x, jit=jit, **kwargs)
            assert keras.backend.standardize_dtype(y.dtype) == compute
            y = y.astype("float32")
            assert np.all(np.isfinite(y)), f"{policy}: non-finite output"
            tol = (self.precision_rtol or {}).get(compute)
            if tol is not None:
                err = rel_error(y[mask], expected[mask])
                assert err <= tol, f"{policy} causal={causal}: {err:.3g} > {tol}"

    # ------------------------------------------------- large activations
    def test_prop_large_inputs_finite(self):
        """Inputs of large magnitude (fp32 and mixed_bfloat16) give finite
        outputs, padded queries included."""
        B, n = self.batch_size, self.fixed_length
        policies = ["float32"]
        if self.supports_mixed_precision:
            policies.append("mixed_bfloat16")  # float16 overflows at 65504
        layers = {}

        @settings(max_examples=self._examples("large"))
        @given(
            scale=st.sampled_from(self.large_input_scales),
            policy=st.sampled_from(policies),
            causal=st.sampled_from(self.modes()),
            seed=st.integers(0, 2**16),
        )
        def check(scale, policy, causal, seed):
            self._record("large_inputs")
            rng = np.random.default_rng(seed)
            x = self._random(rng, B, n, self.features, scale=scale)
            kwargs = {"use_causal_mask": causal}
            if self.supports_padding:
                mask = np.ones((B, n), bool)
                mask[0, :4] = False
                kwargs.update(query_mask=mask, value_mask=mask)
            if policy not in layers:
                layers[policy] = self.make_layer(dtype=policy)
            y = self.call(layers[policy], x, x, **kwargs).astype("float32")
            assert np.all(np.isfinite(y)), f"scale={scale} {policy}: non-finite"

        check()

    # ----------------------------------------------------- dynamic length
    @pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
    def test_prop_dynamic_length(self, jit):
        """A functional model with Input((None, features)) (and a padding
        mask input) predicts and fits at two sequence lengths; predictions
        equal a direct call of the layer on real queries."""
        if not self.supports_dynamic_length:
            pytest.skip("layer needs static sequence lengths")
        if jit and not self.supports_jit:
            pytest.skip("layer does not support jit_compile")
        if not jit and keras.backend.backend() == "jax" and not slow_profile():
            pytest.skip(
                "eager fit on JAX compiles every primitive per shape (up to "
                "minutes per layer): --run-slow"
            )
        if jit and keras.backend.backend() == "torch" and not slow_profile():
            pytest.skip(
                "jit_compile on torch (torch.compile) costs minutes to warm up "
                "on CPU: --run-slow"
            )
        F = self.features
        causal = self.modes()[0]
        x_in = keras.Input((None, F))
        inputs = [x_in]
        kwargs = {"use_causal_mask": causal}
        if self.supports_padding:
            m_in = keras.Input((None,), dtype="bool")
            inputs.append(m_in)
            kwargs.update(query_mask=m_in, value_mask=m_in)
        layer = self.make_layer()
        model = keras.Model(inputs, layer(x_in, x_in, **kwargs))
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", jit_compile=jit)
        rng = np.random.default_rng(7)
        for n in self.dynamic_lengths:
            x = self._random(rng, 4, n, F)
            mask = np.ones((4, n), bool)
            mask[1, n - n // 3 :] = False
            feed = [x, mask] if self.supports_padding else [x]
            pred = model.predict(feed, batch_size=2, verbose=0)
            assert pred.shape == (4, n, F)
            call = {"use_causal_mask": causal}
            if self.supports_padding:
                call.update(query_mask=mask, value_mask=mask)
            direct = self.call(layer, x, x, **call)
            np.testing.assert_allclose(pred[mask], direct[mask], rtol=1e-4, atol=1e-5)
            history = model.fit(feed, np.roll(x, 1, axis=1), batch_size=2, epochs=1, verbose=0)
            assert np.all(np.isfinite(history.history["loss"]))

    # ------------------------------------------------ batch composition
    def test_prop_batch_composition(self):
        """An example's real outputs are the same alone (unpadded) and in a
        batch with other examples of other lengths, padded on the right to
        a longer length."""
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        layer = self.make_layer()
        lo, hi = self.min_length, self.max_length
        lengths = st.integers(lo, max(lo, hi // 2))

        # The explicit examples (run first, every profile): 10 real tokens
        # padded to 30 next to an example of 16, in each mode.
        @settings(max_examples=self._examples("invariance"))
        @given(
            n=lengths,
            extra=st.integers(1, max(1, hi - hi // 2)),
            others=st.lists(st.integers(lo, hi), min_size=1, max_size=2),
            causal=st.sampled_from(self.modes()),
            seed=st.integers(0, 2**16),
        )
        @example(n=10, extra=20, others=[16], causal=False, seed=0)
        @example(n=10, extra=20, others=[16], causal=True, seed=0)
        def check(n, extra, others, causal, seed):
            self._record("batch_composition")
            if causal not in self.modes():
                causal = self.modes()[0]
            n = max(n, lo)
            others = [min(m, n + extra) for m in others]
            rng = np.random.default_rng(seed)
            N = n + extra
            x = self._random(rng, len(others) + 1, N, self.features)
            mask = np.zeros((len(others) + 1, N), bool)
            mask[0, :n] = True
            for b, m in enumerate(others, start=1):
                mask[b, :m] = True
            alone = self.call(layer, x[:1, :n], x[:1, :n], use_causal_mask=causal)
            batch = self.call(
                layer, x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal
            )
            err = rel_error(batch[0, :n], alone[0])
            assert err <= self.invariance_rtol, (
                f"length {n} padded to {N} with others {others}, causal={causal}: "
                f"relative error {err:.3g}"
            )

        check()

    # ------------------------------------------------- non-finite padding
    @pytest.mark.parametrize("poison", ["nan", "inf"])
    def test_prop_nonfinite_padding(self, poison):
        """NaN/inf in padded key/value positions never reaches a real output
        or a weight gradient; real outputs equal those with zeros there."""
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        B = self.batch_size
        bad = {"nan": np.nan, "inf": np.inf}[poison]
        layer = self.make_layer()

        @settings(max_examples=self._examples("nonfinite"))
        @given(st.data())
        def check(data):
            self._record("nonfinite_padding")
            cross = self.supports_cross_attention
            lo = max(self.min_length, 4)
            # Short sequences (the gradient is the costly part), at least one
            # padded and one real key in the first example.
            S = data.draw(st.integers(lo, 64), label="S")
            T = data.draw(st.integers(lo, 64), label="T") if cross else S
            causal = data.draw(st.sampled_from(self.modes()), label="causal")
            seed = data.draw(st.integers(0, 2**16), label="seed")
            rng = np.random.default_rng(seed)
            kind = data.draw(st.sampled_from(("right", "left", "middle")), label="kind")
            cut = data.draw(st.integers(1, S - 1), label="cut")
            kmask = np.stack(
                [padding_row(kind, S, cut)]
                + [padding_row(*self._draw_kind(data, S, b)) for b in range(1, B)]
            )
            kv = self._random(rng, B, S, self.features)
            q = self._random(rng, B, T, self.features) if cross else kv
            qmask = np.ones((B, T), bool) if cross else kmask
            sign = np.where(rng.random(kv.shape) < 0.5, -1.0, 1.0).astype("float32")
            poisoned_kv = np.where(kmask[..., None], kv, bad * sign).astype("float32")
            clean_kv = np.where(kmask[..., None], kv, 0.0).astype("float32")
            if cross:
                pq, cq = q, q
            else:
                pq, cq = poisoned_kv, clean_kv
            kwargs = {"use_causal_mask": causal, "value_mask": kmask, "query_mask": qmask}
            clean = self.call(layer, cq, clean_kv, **kwargs)
            out = self.call(layer, pq, poisoned_kv, **kwargs)
            if not qmask.any():
                return
            assert np.all(np.isfinite(out[qmask])), "padding reached a real output"
            np.testing.assert_allclose(out[qmask], clean[qmask], rtol=1e-5, atol=1e-6)
            grads = weight_gradients(
                layer, lambda: masked_sum(layer(pq, poisoned_kv, **kwargs), qmask)
            )
            names = [v.path for v in layer.trainable_variables]
            for name, g in zip(names, grads):
                assert g is None or np.all(np.isfinite(g)), (
                    f"padding reached the gradient of {name}"
                )

        check()

    # ------------------------------------------- padding inert, every path
    def _path_layer(self, layer, name, query_shape, value_shape=None):
        """A clone of ``layer`` with ``implementation=name`` and its
        weights."""
        config = layer.get_config()
        config["implementation"] = name
        clone = type(layer).from_config(config)
        clone.build(query_shape, value_shape or query_shape)
        clone.set_weights(layer.get_weights())
        return clone

    def _padding_cases(self, B, n, rng):
        """(label, call kwargs, real-query rows) of each way of marking
        the same padding (self-attention)."""
        kmask = np.ones((B, n), bool)
        kmask[0, n - 5 :] = False  # right
        if B > 1:
            kmask[1, :3] = False  # left
            kmask[1, n // 2] = False  # middle
        cases = []
        if not self.couples_queries:
            cases.append(("value_mask", {"value_mask": kmask}, kmask))
        cases.append(("value_and_query_mask",
                      {"value_mask": kmask, "query_mask": kmask}, kmask))
        key_only = {"key_mask": kmask}
        if self.couples_queries:
            key_only["query_mask"] = kmask
        cases.append(("key_mask", key_only, kmask))
        # Dense mask: the padding, and a fifth of the real pairs hidden too.
        dense = kmask[:, None, :] & kmask[:, :, None]
        dense &= rng.random(dense.shape) >= 0.2
        dense |= np.eye(n, dtype=bool)[None] & kmask[:, :, None]
        cases.append(("attention_mask", {"attention_mask": dense}, kmask))
        return cases

    def test_prop_padding_inert_every_path(self):
        """On the reference path and every efficient path that accepts the
        call: random values and NaN at padded positions (marked by
        ``value_mask``, ``value_mask`` + ``query_mask``, ``key_mask`` or a
        dense ``attention_mask``) leave real outputs as with zeros there."""
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        self._record("padding_inert_every_path")
        B, n, F = self.batch_size, max(self.fixed_length, self.min_length + 6), self.features
        rng = np.random.default_rng(11)
        keras.utils.set_random_seed(11)
        base = self.make_layer()
        x = self._random(rng, B, n, F)
        base.build(x.shape, x.shape)
        paths = ("reference",) + tuple(base.implementations)
        ran = []
        for i, name in enumerate(paths):
            layer = self._path_layer(base, name, x.shape)
            causal = self.modes()[i % len(self.modes())]
            for label, kwargs, real in self._padding_cases(B, n, rng):
                kwargs = dict(kwargs, use_causal_mask=causal)
                clean_x = np.where(real[..., None], x, 0.0).astype("float32")
                try:
                    clean = self.call(layer, clean_x, clean_x, **kwargs)
                except ValueError as error:
                    message = str(error)
                    if "cannot run this call" in message or "dense `attention_mask`" in message:
                        continue  # refused before running: not this path's call
                    raise
                ran.append((name, label))
                for poison in ("random", "nan"):
                    self._record("padding_inert_every_path")
                    fill = (
                        self._random(rng, B, n, F, scale=10.0)
                        if poison == "random"
                        else np.full((B, n, F), np.nan, "float32")
                    )
                    bad_x = np.where(real[..., None], x, fill).astype("float32")
                    out = self.call(layer, bad_x, bad_x, **kwargs)
                    where = f"path={name} mask={label} poison={poison} causal={causal}"
                    assert np.all(np.isfinite(out[real])), f"{where}: non-finite real output"
                    err = rel_error(out[real], clean[real])
                    assert err <= self.invariance_rtol, (
                        f"{where}: padded positions moved real outputs (relative "
                        f"error {err:.3g})"
                    )
        assert any(name == "reference" for name, _ in ran)
        if base.implementations:
            assert any(name != "reference" for name, _ in ran), "no efficient path ran"

    # ------------------------------------------------------- empty inputs
    def test_prop_empty_inputs(self):
        """An empty batch and an empty sequence give an empty output of the
        right shape and dtype, as ``keras.layers.MultiHeadAttention``."""
        F = self.features
        for B, T in ((0, self.fixed_length), (self.batch_size, 0)):
            for causal in self.modes():
                self._record("empty_inputs")
                x = np.zeros((B, T, F), "float32")
                kwargs = {"use_causal_mask": causal}
                if self.supports_padding:
                    mask = np.ones((B, T), bool)
                    kwargs.update(query_mask=mask, value_mask=mask)
                layer = self.make_layer()
                out = self.call(layer, x, x, **kwargs)
                assert out.shape == (B, T, F), (
                    f"batch {B}, length {T}, causal={causal}: shape {out.shape}"
                )
                H, d = layer.num_heads, layer.key_dim
                heads = np.zeros((B, T, H, d), "float32")
                values = np.zeros((B, T, H, layer.value_dim), "float32")
                attended = layer.attend(heads, heads, values, use_causal_mask=causal)
                assert tuple(attended.shape) == (B, T, H, layer.value_dim)

    # -------------------------------------------------- prefix consistency
    def test_prop_prefix_consistency(self):
        """Causal calls: the outputs for a prefix equal the first outputs of
        the longer sequence (every prefix length of a few), so a model
        generates with the function it was trained as."""
        if not self.supports_causal:
            pytest.skip("layer has no causal mode")
        self._record("prefix_consistency")
        F = self.features
        n = max(33, 2 * self.min_length)
        rng = np.random.default_rng(13)
        x = self._random(rng, self.batch_size, n, F)
        layer = self.make_layer()
        whole = self.call(layer, x, x, use_causal_mask=True)
        for t in sorted({max(self.min_length, n // 3), n - 1}):
            if t < self.min_length:
                continue
            self._record("prefix_consistency")
            part = self.call(layer, x[:, :t], x[:, :t], use_causal_mask=True)
            err = rel_error(part, whole[:, :t])
            assert err <= self.invariance_rtol, (
                f"prefix of {t} of {n}: relative error {err:.3g} against the "
                "first outputs of the whole sequence"
            )

    # ---------------------------------------------------------- seeding
    def test_prop_seed_reproducible(self):
        """Two layers made after ``keras.utils.set_random_seed(s)`` (the
        layer's own seed arguments None) compute the same outputs: weights
        and any random structure (hashes, random blocks, features) follow
        Keras's seed."""
        self._record("seed_reproducible")
        F, n = self.features, self.seed_length or self.fixed_length
        x = self._random(np.random.default_rng(17), self.batch_size, n, F)
        causal = self.modes()[0]
        overrides = {name: None for name in self.seed_arguments}
        outputs = []
        for _ in range(2):
            keras.utils.set_random_seed(1234)
            layer = self.make_layer(**overrides)
            outputs.append(self.call(layer, x, x, use_causal_mask=causal))
        # Equal up to float rounding (two layers of the same weights may lay
        # out their work differently); another random structure or other
        # weights differ by O(1).
        err = rel_error(outputs[1], outputs[0])
        assert err <= self.invariance_rtol, (
            f"the same keras.utils.set_random_seed gave different outputs "
            f"(relative error {err:.3g})"
        )

    # -------------------------------------------------------- arguments
    def test_prop_invalid_arguments(self):
        """Each invalid constructor argument is refused at construction
        with a ValueError naming the argument and showing the value."""
        cases = dict(self.BASE_INVALID_ARGUMENTS)
        for name, values in self.invalid_arguments.items():
            cases[name] = tuple(cases.get(name, ())) + tuple(values)
        problems = []
        for name, values in cases.items():
            for value in values:
                self._record("invalid_arguments")
                try:
                    self.make_layer(**{name: value})
                except ValueError as error:
                    message = str(error)
                    if name not in message or repr(value) not in message:
                        problems.append(
                            f"{name}={value!r}: the message does not name it: {message[:200]}"
                        )
                except Exception as error:  # refused, but not as a ValueError
                    problems.append(f"{name}={value!r}: {type(error).__name__}: {error}")
                else:
                    problems.append(f"{name}={value!r}: accepted")
        assert not problems, "\n".join(problems)

    # ---------------------------------------------- cross-backend fixtures
    def _fixture(self, name):
        from keras_longattn.testing import fixtures

        path = fixtures.case_path(name)
        if not os.path.exists(path):
            if not os.path.isdir(fixtures.FIXTURE_DIR):
                pytest.skip("no tests/fixtures directory (installed package)")
            pytest.fail(
                f"missing fixture {path}: run `python -m "
                "keras_longattn.testing.fixtures` once per backend"
            )
        return fixtures.load_case(name)

    def test_prop_fixture_outputs(self):
        """Stored weights and inputs give the stored outputs on this backend
        (the same on JAX, TensorFlow and PyTorch)."""
        if not self.fixture_cases:
            pytest.skip("no stored fixtures for this layer")
        from keras_longattn.testing import fixtures

        for name in self.fixture_cases:
            case = self._fixture(name)
            err = fixtures.output_error(fixtures.run_case(case, call=self.call), case)
            assert err <= self.fixture_rtol, (
                f"fixture {name}: relative error {err:.3g} on {keras.backend.backend()}"
            )

    @pytest.mark.parametrize("saved_on", ["jax", "tensorflow", "torch"])
    def test_prop_keras_file_from_backend(self, saved_on):
        """A .keras file saved on ``saved_on`` loads on this backend and
        reproduces the stored outputs."""
        if not self.fixture_cases:
            pytest.skip("no stored fixtures for this layer")
        from keras_longattn.testing import fixtures

        for name in self.fixture_cases:
            case = self._fixture(name)
            path = fixtures.keras_path(name, saved_on)
            if not os.path.exists(path):
                pytest.fail(
                    f"missing {path}: run `KERAS_BACKEND={saved_on} python -m "
                    "keras_longattn.testing.fixtures`"
                )
            model = keras.saving.load_model(path)
            err = fixtures.output_error(fixtures.run_model(model, case), case)
            assert err <= self.fixture_rtol, (
                f"{name} saved on {saved_on}: relative error {err:.3g} on {keras.backend.backend()}"
            )
