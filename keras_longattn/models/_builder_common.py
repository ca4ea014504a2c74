"""What the model builders share: argument checks and the Transformer body."""

import keras

from keras_longattn.models._validation import check_choice
from keras_longattn.models._validation import check_int
from keras_longattn.models._validation import check_rate
from keras_longattn.models.layer_pattern import validate_layer_pattern
from keras_longattn.models.position_embedding import PositionEmbedding
from keras_longattn.models.sublayer_stack import build_sublayers

POSITIONS = ("learned", "rotary", None)
DEFAULT_NUM_LAYERS = 2


def resolve_pattern(layer_pattern, num_layers):
    """The layer pattern of a builder call (validated)."""
    if layer_pattern is None:
        if num_layers is None:
            num_layers = DEFAULT_NUM_LAYERS
        num_layers = check_int("num_layers", num_layers)
        return "sf" * num_layers
    pattern = validate_layer_pattern(layer_pattern)
    if num_layers is not None:
        num_layers = check_int("num_layers", num_layers)
        if num_layers != pattern.count("s"):
            raise ValueError(
                "When both are given, `num_layers` must equal the number of "
                f"'s' in `layer_pattern` ({pattern.count('s')}). Received: "
                f"num_layers={num_layers}, layer_pattern={layer_pattern!r}"
            )
    return pattern


def check_body_args(
    *, sequence_length, dim, num_heads, feedforward_dim, dropout, positions
):
    """Checks the arguments every builder shares; returns sequence_length."""
    check_choice("positions", positions, POSITIONS)
    if sequence_length is None and positions == "learned":
        raise ValueError(
            "`sequence_length` must be an integer with positions='learned' "
            "(the position table has one row per position); use "
            "positions='rotary' or None for inputs of any length. "
            "Received: sequence_length=None"
        )
    sequence_length = check_int(
        "sequence_length", sequence_length, allow_none=positions != "learned"
    )
    check_int("dim", dim)
    check_int("num_heads", num_heads)
    check_int("feedforward_dim", feedforward_dim, allow_none=True)
    check_rate("dropout", dropout)
    return sequence_length


def check_vocab_size(name, value):
    value = check_int(name, value, min_value=2)
    return value


def transformer_body(
    x,
    *,
    attention_length,
    pattern,
    attention,
    dim,
    num_heads,
    feedforward_dim,
    dropout,
    normalize_first,
    causal,
    positions,
    rotary_max_wavelength,
    context=None,
):
    """Positions, embedding dropout, the sublayers and the final norm,
    applied to ``(B, n, dim)`` embeddings (masks propagate).

    Attention layers that could never run here (no causal mode in a causal
    model, a ``max_length`` below ``attention_length``) are refused with a
    ``ValueError`` whose message repeats ``context``: the builder arguments
    that fixed ``causal`` and ``attention_length``."""
    sublayers = build_sublayers(
        pattern,
        attention,
        dim=dim,
        num_heads=num_heads,
        feedforward_dim=feedforward_dim,
        dropout=dropout,
        normalize_first=normalize_first,
        causal=causal,
        rotary_max_wavelength=(
            rotary_max_wavelength if positions == "rotary" else None
        ),
        sequence_length=attention_length,
        context=context,
    )
    if positions == "learned":
        x = PositionEmbedding(attention_length, name="position_embedding")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
    for sublayer in sublayers:
        x = sublayer(x)
    if normalize_first:
        x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    return x
