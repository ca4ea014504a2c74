"""enwik8, the Wikipedia sample, LM windows and LMWindowDataset."""

import bz2
import importlib.metadata
import os
import zipfile

import keras
import numpy as np
import pytest

from keras_longattn.datasets import DatasetNotFoundError
from keras_longattn.datasets import ENWIK8_ENV_VAR
from keras_longattn.datasets import LMWindowDataset
from keras_longattn.datasets import lm_windows
from keras_longattn.datasets import load_enwik8
from keras_longattn.datasets import load_wiki_articles
from keras_longattn.datasets import load_wiki_sample
from keras_longattn.datasets import wiki_sample_path
from keras_longattn.datasets import text as text_module
from keras_longattn.testing.data import WIKI_PATH
from keras_longattn.testing.data import requires_wiki

SIZES = dict(train_size=200, valid_size=30, test_size=20)


@pytest.fixture
def fake_enwik8(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 260, dtype=np.uint8)
    path = tmp_path / "enwik8"
    path.write_bytes(data.tobytes())
    return path, data


def test_enwik8_split(fake_enwik8):
    path, data = fake_enwik8
    train, valid, test = load_enwik8(path, **SIZES)
    assert train.dtype == valid.dtype == test.dtype == np.uint8
    assert (len(train), len(valid), len(test)) == (200, 30, 20)
    np.testing.assert_array_equal(np.concatenate([train, valid, test]),
                                  data[:250])
    for name, part in zip(("train", "valid", "test"), (train, valid, test)):
        np.testing.assert_array_equal(
            load_enwik8(str(path), split=name, **SIZES), part)


def test_enwik8_default_sizes_are_the_standard_split(fake_enwik8):
    path, _ = fake_enwik8
    with pytest.raises(ValueError, match="100000000") as info:
        load_enwik8(path)
    assert "train_size=90000000" in str(info.value)
    assert "valid_size=5000000" in str(info.value)
    assert "test_size=5000000" in str(info.value)


def test_enwik8_env_var_directory_and_zip(fake_enwik8, tmp_path, monkeypatch):
    path, data = fake_enwik8
    monkeypatch.setenv(ENWIK8_ENV_VAR, str(path))
    np.testing.assert_array_equal(load_enwik8(split="test", **SIZES),
                                  data[230:250])
    np.testing.assert_array_equal(
        load_enwik8(tmp_path, split="valid", **SIZES), data[200:230])
    archive = tmp_path / "zipped" / "enwik8.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("enwik8", data.tobytes())
    for where in (archive, archive.parent):
        np.testing.assert_array_equal(
            load_enwik8(where, split="valid", **SIZES), data[200:230])


def test_enwik8_missing_file(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "enwik8"
    with pytest.raises(DatasetNotFoundError) as info:
        load_enwik8(missing)
    message = str(info.value)
    assert "http://mattmahoney.net/dc/enwik8.zip" in message
    assert ENWIK8_ENV_VAR in message and str(missing) in message
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, ValueError)
    monkeypatch.delenv(ENWIK8_ENV_VAR, raising=False)
    with pytest.raises(FileNotFoundError, match="enwik8.zip"):
        load_enwik8()
    with pytest.raises(FileNotFoundError, match="neither"):
        load_enwik8(tmp_path)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(split="tarin"), "split"),
        (dict(train_size=0), "train_size"),
        (dict(valid_size=-1), "valid_size"),
        (dict(test_size=2.5), "test_size"),
    ],
)
def test_enwik8_bad_arguments(fake_enwik8, kwargs, name):
    path, _ = fake_enwik8
    kwargs = dict(SIZES, **kwargs)
    with pytest.raises(ValueError, match=name) as info:
        load_enwik8(path, **kwargs)
    assert "Received" in str(info.value)
    if name == "split":
        for word in ("tarin", "train", "valid", "test"):
            assert word in str(info.value)


@requires_wiki
def test_wiki_sample_split():
    with open(WIKI_PATH, "rb") as f:
        raw = bz2.decompress(f.read())
    train, valid, test = load_wiki_sample()
    assert train.dtype == np.uint8
    total = len(raw)
    assert len(valid) == len(test) == round(total * 0.05)
    assert len(train) == total - 2 * round(total * 0.05)
    assert np.concatenate([train, valid, test]).tobytes() == raw
    assert train[:10].tobytes() == b"<mediawiki"
    np.testing.assert_array_equal(load_wiki_sample("valid"), valid)
    small_valid = load_wiki_sample("valid", valid_fraction=0.01,
                                   test_fraction=0.02)
    assert len(small_valid) == round(total * 0.01)


@requires_wiki
def test_wiki_articles():
    articles = load_wiki_articles()
    assert len(articles) > 50
    for title, body in articles:
        assert isinstance(title, str) and isinstance(body, bytes)
        assert not body.lstrip().upper().startswith(b"#REDIRECT")
        assert b"</text>" not in body and b"&lt;" not in body[:2000]


@requires_wiki
def test_wiki_sample_found_without_package_metadata(monkeypatch):
    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    assert os.path.samefile(wiki_sample_path(), WIKI_PATH)


def test_wiki_sample_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(text_module, "WIKI_SAMPLE_RELPATH",
                        "gensim/test/test_data/no-such-file.bz2")
    with pytest.raises(DatasetNotFoundError, match="pip install gensim"):
        load_wiki_sample()
    with pytest.raises(FileNotFoundError, match="path"):
        load_wiki_sample(path=tmp_path / "missing.bz2")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(split="tarin"), "split"),
        (dict(valid_fraction=1.5), "valid_fraction"),
        (dict(valid_fraction=0.5, test_fraction=0.5), "test_fraction"),
    ],
)
def test_wiki_sample_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        load_wiki_sample(**kwargs)


DATA = np.arange(1000, dtype=np.int64) % 251


def test_lm_windows_contiguous():
    x, y = lm_windows(DATA, 100, mode="contiguous")
    assert x.shape == y.shape == (9, 100) and x.dtype == DATA.dtype
    np.testing.assert_array_equal(x.ravel(), DATA[:900])
    np.testing.assert_array_equal(y.ravel(), DATA[1:901])
    x, _ = lm_windows(DATA, 10, num_windows=3, mode="contiguous",
                      dtype="int32")
    assert x.dtype == np.int32 and x.shape == (3, 10)


def test_lm_windows_random():
    x, y = lm_windows(DATA, 50, num_windows=40, seed=0)
    assert x.shape == y.shape == (40, 50)
    starts = x[:, 0]
    for row, target, start in zip(x, y, starts):
        i = int(np.flatnonzero(DATA == start)[0])  # DATA is 0..250 repeated
        np.testing.assert_array_equal(row, DATA[i : i + 50])
        np.testing.assert_array_equal(target, DATA[i + 1 : i + 51])
    again, _ = lm_windows(DATA, 50, num_windows=40, seed=0)
    other, _ = lm_windows(DATA, 50, num_windows=40, seed=1)
    np.testing.assert_array_equal(x, again)
    assert not np.array_equal(x, other)
    # The last possible window is reachable and never overruns.
    x, y = lm_windows(np.arange(6), 5, num_windows=20, seed=0)
    np.testing.assert_array_equal(y, np.tile(np.arange(1, 6), (20, 1)))


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((DATA, 1000), {}, "sequence_length"),
        ((DATA, 0), {}, "sequence_length"),
        ((DATA, 10), dict(mode="sliding"), "mode"),
        ((DATA, 100), dict(num_windows=10, mode="contiguous"), "num_windows"),
        ((DATA.reshape(10, 100), 10), {}, "data"),
    ],
)
def test_lm_windows_bad_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name) as info:
        lm_windows(*args, **kwargs)
    assert "Received" in str(info.value)


def test_lm_window_dataset():
    dataset = LMWindowDataset(DATA, 32, batch_size=4, num_batches=5, seed=0)
    assert isinstance(dataset, keras.utils.PyDataset)
    assert len(dataset) == 5 and dataset.num_batches == 5
    batches = list(dataset)
    assert len(batches) == 5
    for x, y in batches:
        assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(dataset[3][0], batches[3][0])
    np.testing.assert_array_equal(dataset[-1][0], batches[4][0])
    same = LMWindowDataset(DATA, 32, batch_size=4, num_batches=5, seed=0)
    other = LMWindowDataset(DATA, 32, batch_size=4, num_batches=5, seed=1)
    np.testing.assert_array_equal(same[2][0], batches[2][0])
    assert not np.array_equal(other[2][0], batches[2][0])
    dataset.on_epoch_end()
    assert not np.array_equal(dataset[2][0], batches[2][0])
    with pytest.raises(IndexError):
        dataset[5]
    assert len(LMWindowDataset(DATA, 10, batch_size=9)) == 999 // 90


def test_lm_window_dataset_bad_arguments():
    with pytest.raises(ValueError, match="sequence_length"):
        LMWindowDataset(DATA, 1000)
    with pytest.raises(ValueError, match="batch_size"):
        LMWindowDataset(DATA, 10, batch_size=0)
    with pytest.raises(ValueError, match="num_batches"):
        LMWindowDataset(DATA, 10, num_batches=0)


def test_lm_window_dataset_trains_a_model():
    data = np.frombuffer(b"abcdefgh" * 64, dtype=np.uint8)
    dataset = LMWindowDataset(data, 16, batch_size=8, num_batches=2, seed=0)
    model = keras.Sequential([
        keras.Input((16,), dtype="int32"),
        keras.layers.Embedding(256, 8),
        keras.layers.Dense(256),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(dataset, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert np.isfinite(history.history["loss"]).all()
    # Keras calls on_epoch_end() after each epoch (and may call it once more).
    assert dataset.epoch >= 2
