import pytest

from keras_longattn.models import interleaved_pattern
from keras_longattn.models import sandwich_pattern
from keras_longattn.models import validate_layer_pattern


def test_sandwich_pattern_definition():
    assert sandwich_pattern(4, 0) == interleaved_pattern(4) == "sfsfsfsf"
    assert sandwich_pattern(4, 1) == "s" + "sf" * 3 + "f"
    assert sandwich_pattern(4, 4) == "ssssffff"
    for n in range(1, 6):
        for k in range(n + 1):
            p = sandwich_pattern(n, k)
            assert p.count("s") == p.count("f") == n
            assert p == "s" * k + "sf" * (n - k) + "f" * k


@pytest.mark.parametrize(
    "args, name",
    [((3, 4), "k"), ((3, -1), "k"), ((0, 0), "num_layers"), ((2.5, 1), "num_layers")],
)
def test_sandwich_pattern_refuses_bad_arguments(args, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        sandwich_pattern(*args)


@pytest.mark.parametrize("pattern", ["ff", "", "sfx", "SF", None, ["s", "f"]])
def test_validate_layer_pattern_refuses(pattern):
    with pytest.raises(ValueError, match="layer_pattern") as info:
        validate_layer_pattern(pattern)
    assert repr(pattern) in str(info.value)


def test_validate_layer_pattern_accepts():
    for pattern in ("s", "sf", "ssff", "sffs", sandwich_pattern(6, 2)):
        assert validate_layer_pattern(pattern) == pattern
