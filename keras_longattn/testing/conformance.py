"""The conformance suite every attention layer of keras_longattn runs.

Subclass :class:`AttentionLayerConformance` in a pytest module (the subclass
name must start with ``Test``), set :attr:`layer_cls`, :attr:`init_kwargs`
and :attr:`implementation`, and pytest collects every check below. Write one
subclass per implementation of the layer (``implementation = "blocked"``,
``"blocked_fused"``, ...): each is checked against the layer's
``"reference"`` path and must be the path that runs. The contract flags
(``supports_causal``, ``supports_bidirectional``, ``supports_scores``,
``supports_attention_mask``, ``is_exact``, ``reference_rtol``) default to
what the layer class declares; set them on the subclass only to narrow a
test. The suite runs on whatever ``KERAS_BACKEND`` is active; the project
runs it once per backend.

Example::

    from keras_longattn.layers import LocalAttention
    from keras_longattn.testing import AttentionLayerConformance

    class TestLocalAttentionBlocked(AttentionLayerConformance):
        layer_cls = LocalAttention
        init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 6}
        implementation = "blocked"

    class TestLocalAttentionBlockedFused(TestLocalAttentionBlocked):
        implementation = "blocked_fused"
"""

import os

import keras
import numpy as np
import pytest

from keras_longattn.testing import gradients
from keras_longattn.testing.numerics import rel_error
from keras_longattn.testing.properties import AttentionLayerProperties
from keras_longattn.testing.profiles import slow_profile


def _np(x):
    return keras.ops.convert_to_numpy(x)


class AttentionLayerConformance(AttentionLayerProperties):
    """Shared checks of the attention-layer contract.

    It includes the property-based checks of
    :class:`keras_longattn.testing.properties.AttentionLayerProperties`
    (random lengths, padding, dtypes, batch composition, variable lengths,
    non-finite padding, cross-backend fixtures): in a conformance subclass
    they run with ``--run-slow``; the CI subset runs from the property
    classes of ``tests/layers/test_properties.py``, where each layer also
    gets one (set ``ci_properties = None`` on a conformance subclass to run
    them all by default).

    Flags (class attributes) a subclass sets:

    * ``layer_cls``, ``init_kwargs``: the layer under test (``num_heads`` and
      ``key_dim`` included).
    * ``implementation``: the path under test (``"auto"`` by default).
    * ``features``: feature size of the inputs. ``batch_size``.
    * ``supports_causal``, ``supports_bidirectional``: which call modes the
      reference checks cover (default: the layer's declaration).
    * ``supports_scores``: ``return_attention_scores=True`` (default: the
      layer's); ``is_exact``: exact attention under a pattern (default: the
      layer's).
    * ``supports_padding``: key/query padding masks.
    * ``supports_attention_mask``: whether the default (efficient) path
      accepts a dense ``attention_mask`` (otherwise it must refuse it).
    * ``supports_mixed_precision``, ``supports_jit``.
    * ``reference_lengths``: sequence lengths of the reference checks; include
      one that is not a multiple of the layer's block/window and one >= 2048.
    * ``long_length_causal_only``: run the lengths >= 1024 causally only.
    * ``reference_rtol``: relative error allowed against the reference
      (fp32). Defaults to the layer's ``reference_tolerance``.
    * ``compare_with_mha``: also compare with ``keras.layers.MultiHeadAttention``
      on copied weights (FullAttention).
    * ``deterministic``: the layer's output is a pure function of weights
      and inputs (content-dependent layers with state may set False).
    """

    layer_cls = None
    init_kwargs = {}
    implementation = "auto"
    features = 16
    batch_size = 2
    #: None: the layer class's declaration.
    supports_causal = None
    supports_bidirectional = None
    supports_scores = None
    supports_attention_mask = None
    is_exact = None
    reference_rtol = None
    supports_padding = True
    supports_mixed_precision = True
    supports_jit = True
    reference_lengths = (16, 37, 2048)
    long_length_causal_only = True
    #: A secondary implementation of a layer whose primary one runs the
    #: whole suite: its checks of the shared machinery (mixed precision, a
    #: fit step, .keras files, gradients) run with --run-slow only, while
    #: its equality with the reference, padding, causality by perturbation
    #: and dispatch run always.
    secondary = False
    #: Property tests run by default (the rest with --run-slow): none here,
    #: the CI subset runs from tests/layers/test_properties.py.
    ci_properties = ()
    #: The contract properties every layer keeps run from
    #: tests/layers/test_properties.py (one class per layer), not again for
    #: each implementation's conformance class.
    always_in_ci = ()
    compare_with_mha = False
    deterministic = True
    short_length = 37

    _LAYER_FLAGS = {
        "supports_causal": "supports_causal",
        "supports_bidirectional": "supports_bidirectional",
        "supports_scores": "supports_scores",
        "supports_attention_mask": "supports_attention_mask",
        "is_exact": "is_exact",
        "reference_rtol": "reference_tolerance",
    }

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if value is None and name in AttentionLayerConformance._LAYER_FLAGS:
            layer_cls = object.__getattribute__(self, "layer_cls")
            return getattr(layer_cls, AttentionLayerConformance._LAYER_FLAGS[name])
        return value

    # ----------------------------------------------------------- utilities
    def make_layer(self, **overrides):
        kwargs = dict(self.init_kwargs)
        if self.implementation != "auto":
            kwargs.setdefault("implementation", self.implementation)
        kwargs.update(overrides)
        return self.layer_cls(**kwargs)

    def make_inputs(self, length=None, batch_size=None, seed=0):
        length = length or self.short_length
        batch_size = batch_size or self.batch_size
        rng = np.random.default_rng(seed)
        return rng.standard_normal((batch_size, length, self.features)).astype(
            "float32"
        )

    def reference_output(self, layer, query, value, **call_kwargs):
        """The dense reference of ``layer``'s own pattern on the same weights.

        Content-dependent layers override this (e.g. fix the clusters the
        layer chose and turn them into a dense mask).
        """
        config = layer.get_config()
        config["implementation"] = "reference"
        ref = type(layer).from_config(config)
        ref(query, value)
        ref.set_weights(layer.get_weights())
        out = ref(query, value, **call_kwargs)
        assert ref.last_implementation == "reference"
        return _np(out)

    def padding_masks(self, length, seed=1):
        """A key mask with right padding in example 0 and left padding in
        example 1 (so the first causal rows of example 1 see no key)."""
        mask = np.ones((self.batch_size, length), dtype=bool)
        cut = max(1, length // 3)
        mask[0, length - cut :] = False
        if self.batch_size > 1:
            mask[1, :cut] = False
        return mask

    # ---------------------------------------------------------- shape/config
    def test_output_shape(self):
        layer = self.make_layer()
        x = self.make_inputs()
        for causal in self.modes():
            out = layer(x, x, use_causal_mask=causal)
            assert tuple(out.shape) == x.shape
        T = x.shape[1]
        if self.supports_scores:
            out, scores = layer(x, x, return_attention_scores=True,
                                use_causal_mask=self.modes()[0])
            assert tuple(scores.shape) == (x.shape[0], layer.num_heads, T, T)
            assert np.all(np.isfinite(_np(scores)))
        else:
            with pytest.raises(ValueError, match="return_attention_scores"):
                layer(x, x, return_attention_scores=True)
        # Symbolic (functional) call.
        inp = keras.Input((T, self.features))
        sym = self.make_layer()(inp, inp, use_causal_mask=self.modes()[0])
        assert tuple(sym.shape) == (None, T, self.features)

    def test_output_shape_argument(self):
        layer = self.make_layer(output_shape=5)
        x = self.make_inputs()
        assert tuple(layer(x, x).shape) == x.shape[:2] + (5,)

    def test_config_round_trip(self):
        layer = self.make_layer()
        x = self.make_inputs()
        causal = self.modes()[0]
        y = _np(layer(x, x, use_causal_mask=causal))
        config = layer.get_config()
        clone = type(layer).from_config(config)
        assert clone.get_config() == config
        clone(x, x)
        clone.set_weights(layer.get_weights())
        np.testing.assert_allclose(
            _np(clone(x, x, use_causal_mask=causal)), y, rtol=1e-6, atol=1e-6
        )

    def test_keras_file_round_trip(self, tmp_path):
        x = self.make_inputs()
        causal = self.modes()[0]
        inp = keras.Input(x.shape[1:])
        out = self.make_layer()(inp, inp, use_causal_mask=causal)
        model = keras.Model(inp, out)
        expected = _np(model(x))
        path = os.path.join(str(tmp_path), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(_np(loaded(x)), expected, rtol=1e-6, atol=1e-6)

    # -------------------------------------------------------- reference
    def _reference_cases(self):
        cases = []
        for n in self.reference_lengths:
            for causal in self.modes():
                if n >= 1024 and self.long_length_causal_only and len(self.modes()) > 1 and not causal:
                    continue
                cases.append((n, causal))
        return cases

    def test_equals_reference(self):
        for n, causal in self._reference_cases():
            batch = 1 if n >= 1024 else self.batch_size
            x = self.make_inputs(n, batch_size=batch, seed=n)
            layer = self.make_layer()
            out = _np(layer(x, x, use_causal_mask=causal))
            if self.implementation != "auto":
                # "name:variant" where the path reports what ran beside its own code.
                assert layer.last_implementation.split(":")[0] == self.implementation
            else:
                assert layer.last_implementation != "reference" or not layer.implementations
            ref = self.reference_output(layer, x, x, use_causal_mask=causal)
            err = rel_error(out, ref)
            assert err <= self.reference_rtol, (
                f"n={n} causal={causal}: relative error {err:.3g} > "
                f"{self.reference_rtol}"
            )

    def test_equals_reference_with_padding(self):
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        n = self.short_length
        x = self.make_inputs(n)
        mask = self.padding_masks(n)
        for causal in self.modes():
            layer = self.make_layer()
            out = _np(layer(x, x, value_mask=mask, query_mask=mask,
                            use_causal_mask=causal))
            ref = self.reference_output(layer, x, x, value_mask=mask,
                                        query_mask=mask, use_causal_mask=causal)
            # Compare the real (unpadded) queries.
            err = rel_error(out[mask], ref[mask])
            assert err <= self.reference_rtol, f"causal={causal}: {err:.3g}"
            assert np.all(np.isfinite(out))

    # -------------------------------------------------------- causality
    def test_causality_by_perturbation(self):
        if not self.supports_causal:
            pytest.skip("layer has no causal mode")
        n = self.short_length
        x = self.make_inputs(n)
        layer = self.make_layer()
        y = _np(layer(x, x, use_causal_mask=True))
        for t in (0, n // 2, n - 2):
            x2 = x.copy()
            x2[:, t + 1 :] = np.random.default_rng(t).standard_normal(
                x2[:, t + 1 :].shape
            ) * 10
            y2 = _np(layer(x2, x2, use_causal_mask=True))
            np.testing.assert_allclose(y2[:, : t + 1], y[:, : t + 1], rtol=1e-6, atol=1e-6)
            assert not np.allclose(y2[:, t + 1 :], y[:, t + 1 :])

    def test_causality_by_gradient(self):
        if not self.supports_causal:
            pytest.skip("layer has no causal mode")
        n = self.short_length
        x = self.make_inputs(n, batch_size=1)
        layer = self.make_layer()
        layer(x, x)
        for t in (0, n // 2):
            def f(inp, t=t):
                out = layer(inp, inp, use_causal_mask=True)
                return out[:, t]

            g = gradients.input_gradient(f, x)
            assert np.all(g[:, t + 1 :] == 0.0), f"gradient leaks from after t={t}"
            assert np.any(g[:, : t + 1] != 0.0)

    # ---------------------------------------------------------- padding
    def test_padded_keys_do_not_matter(self):
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        n = self.short_length
        x = self.make_inputs(n)
        mask = self.padding_masks(n)
        layer = self.make_layer()
        for causal in self.modes():
            y = _np(layer(x, x, value_mask=mask, query_mask=mask, use_causal_mask=causal))
            x2 = np.where(mask[..., None], x, 100.0 * np.ones_like(x)).astype("float32")
            y2 = _np(layer(x2, x2, value_mask=mask, query_mask=mask, use_causal_mask=causal))
            np.testing.assert_allclose(y2[mask], y[mask], rtol=1e-5, atol=1e-5)
            assert np.all(np.isfinite(y2)), "padded queries must give finite output"

    def test_all_padding_row_is_finite(self):
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        n = self.short_length
        x = self.make_inputs(n)
        mask = np.ones((self.batch_size, n), dtype=bool)
        mask[0] = False
        layer = self.make_layer()
        for causal in self.modes():
            y = _np(layer(x, x, value_mask=mask, use_causal_mask=causal))
            assert np.all(np.isfinite(y))

            def f(inp, causal=causal):
                return layer(inp, inp, value_mask=mask, use_causal_mask=causal)

            g = gradients.input_gradient(f, x)
            assert np.all(np.isfinite(g)), "gradient through an all-padding row"

    def test_keras_implicit_mask(self):
        if not self.supports_padding:
            pytest.skip("layer does not support padding")
        n = self.short_length
        tokens = np.random.default_rng(0).integers(1, 20, size=(self.batch_size, n))
        tokens[0, n - n // 3 :] = 0
        emb = keras.layers.Embedding(20, self.features, mask_zero=True)
        layer = self.make_layer()
        e = emb(tokens)
        causal = self.modes()[0]
        implicit = _np(layer(e, e, use_causal_mask=causal))
        explicit = _np(layer(e, e, query_mask=tokens != 0, value_mask=tokens != 0,
                             use_causal_mask=causal))
        valid = tokens != 0
        np.testing.assert_allclose(implicit[valid], explicit[valid], rtol=1e-6, atol=1e-6)

    # -------------------------------------------------- precision and fit
    @pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
    def test_mixed_precision(self, policy):
        if not self.supports_mixed_precision:
            pytest.skip("layer does not support mixed precision")
        n = self.short_length
        x = self.make_inputs(n)
        layer = self.make_layer(dtype=policy)
        mask = self.padding_masks(n) if self.supports_padding else None
        for causal in self.modes():
            kwargs = {"use_causal_mask": causal}
            if mask is not None:
                kwargs["value_mask"] = mask
            y = layer(x, x, **kwargs)
            assert keras.backend.standardize_dtype(y.dtype) == policy.split("_")[1]
            assert np.all(np.isfinite(_np(keras.ops.cast(y, "float32"))))

    def test_fit_step(self):
        jit = self.supports_jit and keras.backend.backend() != "torch"
        n = self.short_length
        x = self.make_inputs(n, batch_size=4)
        y = np.roll(x, 1, axis=1)
        inp = keras.Input(x.shape[1:])
        h = self.make_layer()(inp, inp, use_causal_mask=self.modes()[0])
        model = keras.Model(inp, keras.layers.Dense(self.features)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=jit)
        before = [w.copy() for w in model.get_weights()]
        history = model.fit(x, y, epochs=2, batch_size=2, verbose=0)
        losses = history.history["loss"]
        assert all(np.isfinite(losses))
        after = model.get_weights()
        assert any(not np.allclose(a, b) for a, b in zip(before, after))

    # ---------------------------------------------------- MHA equivalence
    def test_matches_multi_head_attention(self):
        if not self.compare_with_mha:
            pytest.skip("only for layers equivalent to MultiHeadAttention")
        kwargs = {k: v for k, v in self.init_kwargs.items() if k in ("num_heads", "key_dim", "value_dim")}
        mha = keras.layers.MultiHeadAttention(**kwargs)
        n = self.short_length
        x = self.make_inputs(n)
        mha(x, x)
        layer = self.layer_cls.from_multi_head_attention(mha, **self.init_kwargs)
        mask = self.padding_masks(n)
        for causal in (True, False):
            np.testing.assert_allclose(
                _np(layer(x, x, use_causal_mask=causal)),
                _np(mha(x, x, use_causal_mask=causal)),
                rtol=1e-5, atol=1e-5,
            )
            ours = _np(layer(x, x, value_mask=mask, query_mask=mask, use_causal_mask=causal))
            theirs = _np(mha(x, x, value_mask=mask, query_mask=mask, use_causal_mask=causal))
            # Compare real queries that see at least one key (MHA gives a
            # uniform row where nothing is visible; the contract gives 0).
            visible = mask.copy()
            if causal:
                visible &= np.cumsum(mask, axis=1) > 0
            np.testing.assert_allclose(ours[visible], theirs[visible], rtol=1e-5, atol=1e-5)
        # The weights of a trained MultiHeadAttention load as they are.
        clone = self.make_layer()
        clone(x, x)
        clone.set_weights(mha.get_weights())
        np.testing.assert_allclose(_np(clone(x, x)), _np(mha(x, x)), rtol=1e-5, atol=1e-5)

    def test_weights_line_up_with_multi_head_attention(self):
        layer = self.make_layer()
        x = self.make_inputs()
        layer(x, x)
        kwargs = {k: v for k, v in self.init_kwargs.items() if k in ("num_heads", "key_dim", "value_dim")}
        mha = keras.layers.MultiHeadAttention(**kwargs)
        mha(x, x)
        ours = [w.path.split("/", 1)[1] for w in layer.weights if w.path.split("/")[1] in ("query", "key", "value", "attention_output")]
        theirs = [w.path.split("/", 1)[1] for w in mha.weights]
        assert ours[: len(theirs)] == theirs
        shapes = [tuple(w.shape) for w in layer.weights[: len(theirs)]]
        assert shapes == [tuple(w.shape) for w in mha.weights]

    # --------------------------------------------------------- bad input
    def test_bad_inputs(self):
        layer = self.make_layer()
        x = self.make_inputs()
        layer(x, x)
        with pytest.raises(ValueError, match="query.shape"):
            layer(x[0], x)
        with pytest.raises(ValueError, match="batch size"):
            layer(x, x[:1])
        with pytest.raises(ValueError, match="features"):
            layer(x, x[..., :-1])
        with pytest.raises(ValueError, match=r"value_mask.shape"):
            layer(x, x, value_mask=np.ones((x.shape[0], x.shape[1] + 1), bool))
        with pytest.raises(ValueError, match=r"query_mask.dtype"):
            layer(x, x, query_mask=np.ones(x.shape[:2], "float32"))
        dense = np.ones((x.shape[0], x.shape[1], x.shape[1]), bool)
        if self.supports_attention_mask:
            out = layer(x, x, attention_mask=dense)
            assert tuple(out.shape) == x.shape
        else:
            with pytest.raises(ValueError, match="value_mask"):
                layer(x, x, attention_mask=dense)
            ref = self.make_layer(implementation="reference")
            assert tuple(ref(x, x, attention_mask=dense).shape) == x.shape

    def test_bad_constructor_arguments(self):
        for name, value in (("num_heads", 0), ("key_dim", -1), ("dropout", 1.5),
                            ("implementation", "nope")):
            with pytest.raises(ValueError, match=f"{name}={value!r}".replace("(", r"\(")):
                self.make_layer(**{name: value})

    def test_implementation_is_inspectable(self):
        layer = self.make_layer()
        x = self.make_inputs()
        causal = self.modes()[0]
        layer(x, x, use_causal_mask=causal)
        expected = layer.select_implementation(use_causal_mask=causal)
        assert layer.last_implementation.split(":")[0] == expected
        if layer.implementations:
            assert expected in layer.implementations
        if self.supports_scores:
            layer(x, x, return_attention_scores=True, use_causal_mask=causal)
            assert layer.last_implementation == "reference"

    @pytest.fixture(autouse=True)
    def _secondary_subset(self, request):
        shared = ("test_mixed_precision", "test_fit_step", "test_keras_file_round_trip",
                  "test_causality_by_gradient", "test_all_padding_row_is_finite",
                  "test_keras_implicit_mask", "test_config_round_trip")
        name = getattr(request.node, "originalname", None) or request.node.name
        if self.secondary and name in shared and not slow_profile():
            pytest.skip("secondary implementation: shared checks run with --run-slow")

    def test_last_implementation_is_the_path_that_ran(self, monkeypatch):
        """Every call runs exactly one path, and ``last_implementation``
        names it: inference, attention dropout in training (a path without
        dropout must refuse, never fall back inside) and scores."""
        from keras_longattn.layers.dispatch import Implementation

        ran = []
        original_run = Implementation.run

        def spy_run(impl, layer, *args, **kwargs):
            ran.append(impl.name)
            return original_run(impl, layer, *args, **kwargs)

        monkeypatch.setattr(Implementation, "run", spy_run)
        x = self.make_inputs()
        calls = [(self.make_layer(), {"use_causal_mask": c}) for c in self.modes()]
        first_mode_only = self.modes()[:1]
        try:
            dropout_layer = self.make_layer(dropout=0.3, seed=1)
        except ValueError:  # e.g. recomputation excludes dropout
            dropout_layer = None
        if dropout_layer is not None:
            table = dropout_layer._implementation_table
            if self.implementation in table and not table[self.implementation].dropout:
                dropout_layer(x, x)
                with pytest.raises(ValueError, match="attention dropout"):
                    dropout_layer(x, x, training=True, use_causal_mask=self.modes()[0])
            else:
                calls += [(dropout_layer, {"use_causal_mask": c, "training": True})
                          for c in first_mode_only]
        if self.supports_scores:
            calls.append((self.make_layer(), {"return_attention_scores": True}))
        for layer, kwargs in calls:
            layer(x, x)  # build
            original_reference = layer._attention_reference

            def spy_reference(*args, original=original_reference, **kw):
                ran.append("reference")
                return original(*args, **kw)

            layer._attention_reference = spy_reference
            del ran[:]
            try:
                layer(x, x, **kwargs)
            finally:
                del layer._attention_reference
            assert ran == [layer.last_implementation.split(":")[0]], (kwargs, ran)
            if self.implementation != "auto" and not kwargs.get("return_attention_scores"):
                assert ran == [self.implementation], (kwargs, ran)
            if kwargs.get("training") and ran[0] != "reference":
                assert layer._implementation_table[ran[0]].dropout, (
                    f"{ran[0]} ran a training call with dropout but has no dropout"
                )

    def test_equals_full_attention_in_its_limit(self):
        """The layer's declared limit case equals FullAttention on the same
        weights (every approximate layer must declare one)."""
        from keras_longattn.layers import FullAttention

        n = self.short_length
        layer = self.make_layer()
        limit = layer.full_attention_limit(n)
        if limit is None:
            assert self.is_exact, "an approximate layer must declare its limit case"
            pytest.skip("no full-attention limit declared")
        overrides, tolerance = limit
        config = layer.get_config()
        config.update(overrides)
        limited = type(layer).from_config(config)
        x = self.make_inputs(n)
        shared = ("num_heads", "key_dim", "value_dim", "use_bias", "output_shape",
                  "rotary_max_wavelength")
        full = FullAttention(**{k: v for k, v in config.items() if k in shared})
        full(x, x)
        limited(x, x)
        limited.set_weights(full.get_weights())
        for causal in self.modes():
            ours = _np(limited(x, x, use_causal_mask=causal))
            theirs = _np(full(x, x, use_causal_mask=causal))
            err = rel_error(ours, theirs)
            assert err <= tolerance, f"causal={causal}: {err:.3g} > {tolerance}"

    def test_exact_layer_has_a_pattern(self):
        layer = self.make_layer()
        if not self.is_exact:
            pytest.skip("approximate layer: no pattern")
        from keras_longattn.ops import AttentionPattern

        for causal in self.modes():
            pattern = layer.attention_pattern(8, 8, causal)
            assert isinstance(pattern, AttentionPattern)
