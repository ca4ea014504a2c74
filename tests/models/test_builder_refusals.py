"""The builders refuse, when the model is built, an attention that could
never run in it: a layer without a causal mode in a causal model, a layer
whose ``max_length`` is below the length it would see. The checks read the
capabilities the layer classes declare (``supports_causal``,
``supports_bidirectional``, ``max_length``), so they cover layers outside
the library too."""

import keras
import pytest

from keras_longattn.layers import BaseAttention
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LinformerAttention
from keras_longattn.models import AttentionSublayer
from keras_longattn.models import TransformerBlock
from keras_longattn.models import build_causal_language_model
from keras_longattn.models import build_image_density_model
from keras_longattn.models import build_matching_model
from keras_longattn.models import build_sequence_classifier
from keras_longattn.models import build_sublayers
from keras_longattn.models._attention_config import library_layers

N, DIM, HEADS, VOCAB = 16, 16, 2, 30
SMALL = dict(dim=DIM, num_heads=HEADS)

#: The library's attention classes without a causal mode.
NON_CAUSAL = sorted(
    name for name, cls in library_layers().items()
    if issubclass(cls, BaseAttention) and cls.supports_causal is False
)


@keras.saving.register_keras_serializable(package="keras_longattn_refusal_tests")
class NoCausalAttention(FullAttention):
    """A layer from outside the library that declares no causal mode."""

    supports_causal = False


@keras.saving.register_keras_serializable(package="keras_longattn_refusal_tests")
class CausalOnlyAttention(FullAttention):
    """A layer from outside the library that only runs causally."""

    supports_bidirectional = False


@keras.saving.register_keras_serializable(package="keras_longattn_refusal_tests")
class BoundedAttention(FullAttention):
    """A layer from outside the library whose weights take at most
    ``max_length`` positions."""

    def __init__(self, num_heads, key_dim, max_length=N, **kwargs):
        super().__init__(num_heads, key_dim, **kwargs)
        self.max_length = max_length

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length}


def causal_builders():
    return [
        lambda attention, n=N: build_causal_language_model(
            VOCAB, n, attention=attention, **SMALL),
        lambda attention, n=N: build_image_density_model(
            4, n, attention=attention, **SMALL),
    ]


CAUSAL_IDS = ["language_model", "image_density_model"]


def test_the_library_declares_its_non_causal_layers():
    assert {"LinformerAttention", "NystromAttention", "AdaMRAAttention"} <= set(
        NON_CAUSAL)


@pytest.mark.parametrize("build", causal_builders(), ids=CAUSAL_IDS)
@pytest.mark.parametrize("class_name", NON_CAUSAL)
def test_causal_builders_refuse_attention_without_causal_mode(build, class_name):
    with pytest.raises(ValueError, match=(
            rf"`attention` must have a causal mode.*{class_name}.supports_causal "
            rf"is False.*Received: attention='{class_name}'")):
        build(class_name)


@pytest.mark.parametrize("build", causal_builders(), ids=CAUSAL_IDS)
def test_causal_builders_refuse_an_outside_layer_without_causal_mode(build):
    layer = NoCausalAttention(num_heads=HEADS, key_dim=8)
    with pytest.raises(ValueError, match=(
            r"`attention` must have a causal mode.*NoCausalAttention.*"
            r"Received: attention=<NoCausalAttention")):
        build(layer)
    # A config dict and one entry of a per-layer list are named as passed.
    config = keras.saving.serialize_keras_object(layer)
    with pytest.raises(ValueError, match=r"`attention\[1\]` must have a causal mode"):
        build(["FullAttention", config])


def test_bidirectional_builders_refuse_a_causal_only_layer():
    with pytest.raises(ValueError, match=(
            r"`attention` must support bidirectional calls.*CausalOnlyAttention"
            r".*Received: attention=<CausalOnlyAttention")):
        build_sequence_classifier(
            VOCAB, N, 2, attention=CausalOnlyAttention(HEADS, 8), **SMALL)


@pytest.mark.parametrize("class_name", ["LinformerAttention", "SynthesizerAttention"])
@pytest.mark.parametrize("builder", [build_sequence_classifier, build_matching_model])
def test_bidirectional_builders_refuse_max_length_below_the_sequence(
        class_name, builder):
    config = {"class_name": class_name, "config": {"max_length": N - 1}}
    if class_name == "LinformerAttention":
        config["config"]["k"] = 4
    with pytest.raises(ValueError, match=(
            rf"`attention` takes at most max_length={N - 1} positions "
            rf"\({class_name}.*its sequences have {N} positions.*"
            rf"Received: attention=.*'max_length': {N - 1}.*sequence_length={N}")):
        builder(VOCAB, N, 2, attention=config, **SMALL)


@pytest.mark.parametrize("class_name", ["LinformerAttention", "SynthesizerAttention"])
def test_class_token_adds_a_position(class_name):
    config = {"class_name": class_name, "config": {"max_length": N}}
    if class_name == "LinformerAttention":
        config["config"]["k"] = 4
    # max_length == sequence_length fits mean pooling ...
    build_sequence_classifier(VOCAB, N, 2, attention=config, **SMALL)
    # ... but not the class token (n + 1 positions).
    for builder in (build_sequence_classifier, build_matching_model):
        with pytest.raises(ValueError, match=(
                rf"`attention` takes at most max_length={N} positions.*"
                rf"its sequences have {N + 1} positions.*sequence_length={N}, "
                r"pooling='cls'")):
            builder(VOCAB, N, 2, attention=config, pooling="cls", **SMALL)


def test_causal_builder_refuses_max_length_below_the_sequence():
    config = {"class_name": "SynthesizerAttention", "config": {"max_length": N}}
    build_causal_language_model(VOCAB, N, attention=config, **SMALL)
    with pytest.raises(ValueError, match=(
            rf"`attention` takes at most max_length={N} positions.*"
            rf"sequence_length={N + 1}")):
        build_causal_language_model(VOCAB, N + 1, attention=config, **SMALL)
    with pytest.raises(ValueError, match=rf"max_length={N}.*BoundedAttention"):
        build_image_density_model(4, N + 1, attention=BoundedAttention(HEADS, 8),
                                  **SMALL)


def test_build_sublayers_refuses_the_same():
    with pytest.raises(ValueError, match=r"`attention` must have a causal mode"
                                         r".*causal=True"):
        build_sublayers("sf", "NystromAttention", dim=DIM, causal=True)
    with pytest.raises(ValueError, match=rf"max_length={N}.*sequence_length={N + 1}"):
        build_sublayers("sf", BoundedAttention(HEADS, 8), dim=DIM,
                        sequence_length=N + 1)
    # Without a known length the length check cannot apply.
    build_sublayers("sf", BoundedAttention(HEADS, 8), dim=DIM)


def test_sublayer_and_block_refuse_a_causal_mode_the_layer_lacks():
    layer = LinformerAttention(num_heads=HEADS, key_dim=8, k=4, max_length=N)
    with pytest.raises(ValueError, match=(
            r"`attention` must have a causal mode.*LinformerAttention.*"
            r"Received: attention=<LinformerAttention .*causal=True")):
        AttentionSublayer(layer, causal=True)
    # The refused instance is not taken: it still serves a sublayer.
    assert AttentionSublayer(layer).attention is layer
    with pytest.raises(ValueError, match=r"`attention` must have a causal mode"):
        TransformerBlock({"class_name": "AdaMRAAttention",
                          "config": {"num_heads": HEADS, "key_dim": 8}},
                         causal=True)
