"""Byte-level text: enwik8, the Wikipedia sample shipped with gensim, and
language-model windows over byte arrays.

Nothing here downloads anything. enwik8 is read from a local file; the
Wikipedia sample is read from gensim's installed test data, which is found
without importing gensim.
"""

import bz2
import functools
import importlib.metadata
import os
import re
import site
import sys
import zipfile
from xml.sax.saxutils import unescape

import keras
import numpy as np

from keras_longattn.datasets import _validation as v

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_ENV_VAR = "KERAS_LONGATTN_ENWIK8"
WIKI_SAMPLE_RELPATH = (
    "gensim/test/test_data/"
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)


class DatasetNotFoundError(FileNotFoundError, ValueError):
    """Raised when a local data file that a loader needs is missing.

    It is both a `FileNotFoundError` and a `ValueError`, so either can be
    caught.
    """


# --------------------------------------------------------------------------
# enwik8
# --------------------------------------------------------------------------


def _enwik8_help():
    return (
        f"Download {ENWIK8_URL} (about 36 MB), unzip it to get the 100 MB "
        "file `enwik8`, then pass its path as `path=...` or set the "
        f"environment variable {ENWIK8_ENV_VAR} to it. A path to "
        "`enwik8.zip` itself, or to a directory holding `enwik8` or "
        "`enwik8.zip`, is also accepted. Nothing is downloaded automatically."
    )


def _resolve_enwik8_path(path):
    if path is None:
        path = os.environ.get(ENWIK8_ENV_VAR) or None
        if path is None:
            raise DatasetNotFoundError(
                "No enwik8 file given: `path` is None and the environment "
                f"variable {ENWIK8_ENV_VAR} is not set. " + _enwik8_help()
            )
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in ("enwik8", "enwik8.zip"):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return candidate
        raise DatasetNotFoundError(
            f"The directory given as `path` holds neither `enwik8` nor "
            f"`enwik8.zip`. Received: path={path!r}. " + _enwik8_help()
        )
    if not os.path.isfile(path):
        raise DatasetNotFoundError(
            f"The enwik8 file does not exist. Received: path={path!r}. "
            + _enwik8_help()
        )
    return path


def _is_zip(path):
    return path.lower().endswith(".zip")


def _read_bytes(path, offset, count):
    """Reads `count` bytes at `offset` from a plain file or enwik8.zip."""
    if _is_zip(path):
        with zipfile.ZipFile(path) as archive:
            name = _zip_member(archive, path).filename
            with archive.open(name) as member:
                while offset > 0:  # skip in pieces to bound memory
                    skipped = len(member.read(min(offset, 1 << 24)))
                    if not skipped:
                        break
                    offset -= skipped
                data = member.read(count)
        return np.frombuffer(data, dtype=np.uint8).copy()
    return np.fromfile(path, dtype=np.uint8, count=count, offset=offset)


def _zip_member(archive, path):
    infos = [i for i in archive.infolist() if not i.is_dir()]
    named = [i for i in infos if i.filename == "enwik8"]
    if not (named or infos):
        raise ValueError(f"The zip file is empty. Received: path={path!r}")
    return (named or infos)[0]


def _file_size(path):
    if _is_zip(path):
        with zipfile.ZipFile(path) as archive:
            return _zip_member(archive, path).file_size
    return os.path.getsize(path)


def load_enwik8(
    path=None,
    split=None,
    train_size=90_000_000,
    valid_size=5_000_000,
    test_size=5_000_000,
):
    """Loads the enwik8 byte-level language modelling benchmark.

    enwik8 is the first 100M bytes of an English Wikipedia XML dump. The
    standard split takes the first 90M bytes for training, the next 5M for
    validation and the next 5M for testing. The file is never downloaded:
    get it from http://mattmahoney.net/dc/enwik8.zip, unzip it and pass the
    path, or set the environment variable `KERAS_LONGATTN_ENWIK8`.

    Args:
        path: path to the unzipped `enwik8` file, to `enwik8.zip`, or to a
            directory holding either. Defaults to `None`, which reads the
            environment variable `KERAS_LONGATTN_ENWIK8`.
        split: one of `"train"`, `"valid"`, `"test"`, or `None` for all
            three. Defaults to `None`.
        train_size: number of bytes in the training split, taken from the
            start of the file. Defaults to `90_000_000`.
        valid_size: number of bytes in the validation split, following the
            training split. Defaults to `5_000_000`.
        test_size: number of bytes in the test split, following the
            validation split. Defaults to `5_000_000`.

    Returns:
        A 1D `uint8` numpy array of bytes when `split` is given, else a
        tuple `(train, valid, test)` of such arrays.

    Raises:
        DatasetNotFoundError: (a `FileNotFoundError` and a `ValueError`) if
            the file is missing; the message says where to get it.
        ValueError: if `split` is unknown, a size is not a positive integer
            or the file is shorter than
            `train_size + valid_size + test_size`.

    Example:

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> fake = os.path.join(folder, "enwik8")
    >>> with open(fake, "wb") as f:
    ...     _ = f.write(bytes(range(100)) * 2)
    >>> train, valid, test = load_enwik8(
    ...     fake, train_size=180, valid_size=10, test_size=10)
    >>> train.shape, valid.shape, test.dtype
    ((180,), (10,), dtype('uint8'))
    >>> load_enwik8(fake, "test", 180, 10, 10)[:3]
    array([90, 91, 92], dtype=uint8)
    """
    split = v.check_split(split)
    train_size = v.check_int("train_size", train_size, min_value=1)
    valid_size = v.check_int("valid_size", valid_size, min_value=1)
    test_size = v.check_int("test_size", test_size, min_value=1)
    path = _resolve_enwik8_path(path)
    total = train_size + valid_size + test_size
    size = _file_size(path)
    if size < total:
        raise ValueError(
            f"The enwik8 file at {path!r} holds {size} bytes, fewer than "
            f"train_size + valid_size + test_size = {total}. Received: "
            f"train_size={train_size}, valid_size={valid_size}, "
            f"test_size={test_size}. The real enwik8 file holds "
            "100,000,000 bytes."
        )
    bounds = {
        "train": (0, train_size),
        "valid": (train_size, valid_size),
        "test": (train_size + valid_size, test_size),
    }
    if split is not None:
        offset, count = bounds[split]
        return _read_bytes(path, offset, count)
    data = _read_bytes(path, 0, total)
    # Views of one array: the three splits do not overlap.
    return tuple(
        data[offset : offset + count]
        for offset, count in (bounds[s] for s in v.SPLITS)
    )


# --------------------------------------------------------------------------
# Wikipedia sample from gensim's test data
# --------------------------------------------------------------------------


def _candidate_dirs():
    dirs = []
    getsitepackages = getattr(site, "getsitepackages", None)
    if getsitepackages is not None:
        dirs.extend(getsitepackages())
    getuser = getattr(site, "getusersitepackages", None)
    if getuser is not None:
        dirs.append(getuser())
    dirs.extend(p for p in sys.path if p)
    return dirs


def wiki_sample_path():
    """Finds the Wikipedia sample shipped in gensim's test data.

    The file is `WIKI_SAMPLE_RELPATH`, i.e. `gensim/test/test_data/`
    `enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`,
    a bz2-compressed English Wikipedia XML dump of 206 pages (6,089,746
    bytes once decompressed). It is found with
    `importlib.metadata.distribution("gensim").locate_file(...)` and then by
    searching the site-packages directories; gensim itself is never
    imported.

    Returns:
        The path to the file, as a string.

    Raises:
        DatasetNotFoundError: (a `FileNotFoundError` and a `ValueError`) if
            gensim's test data is not installed.

    Example:

    >>> wiki_sample_path().endswith("-shortened.bz2")
    True
    """
    try:
        dist = importlib.metadata.distribution("gensim")
        candidate = os.fspath(dist.locate_file(WIKI_SAMPLE_RELPATH))
        if os.path.isfile(candidate):
            return candidate
    except importlib.metadata.PackageNotFoundError:
        pass
    for directory in _candidate_dirs():
        candidate = os.path.join(directory, WIKI_SAMPLE_RELPATH)
        if os.path.isfile(candidate):
            return candidate
    raise DatasetNotFoundError(
        "The Wikipedia sample shipped in gensim's test data was not found "
        f"(looked for {WIKI_SAMPLE_RELPATH!r} in gensim's distribution and in "
        "the site-packages directories). Install it with `pip install gensim` "
        "or `pip install 'keras-longattn[notebooks]'`. Nothing is downloaded "
        "automatically."
    )


@functools.lru_cache(maxsize=2)
def _wiki_sample_bytes(path):
    with open(path, "rb") as f:
        return bz2.decompress(f.read())


def _wiki_sample_raw(path=None):
    if path is None:
        path = wiki_sample_path()
    else:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DatasetNotFoundError(
                f"The Wikipedia sample file does not exist. Received: "
                f"path={path!r}"
            )
    return _wiki_sample_bytes(os.path.abspath(path))


def load_wiki_sample(
    split=None, valid_fraction=0.05, test_fraction=0.05, path=None
):
    """Loads the Wikipedia sample of gensim's test data as a byte array.

    The bz2 file is decompressed (it becomes 6,089,746 bytes of raw XML,
    the same format as enwik8) and split by bytes, in order: the first
    `1 - valid_fraction - test_fraction` of the bytes for training, the next
    `valid_fraction` for validation and the last `test_fraction` for
    testing. The split sizes are `round(total * valid_fraction)` and
    `round(total * test_fraction)` bytes, the training split takes the rest.
    With the defaults (90/5/5) that is 5,480,772 / 304,487 / 304,487 bytes.

    The file is found without importing gensim, see `wiki_sample_path()`.

    Args:
        split: one of `"train"`, `"valid"`, `"test"`, or `None` for all
            three. Defaults to `None`.
        valid_fraction: fraction of the bytes in the validation split.
            Defaults to `0.05`.
        test_fraction: fraction of the bytes in the test split.
            Defaults to `0.05`.
        path: path to the `.bz2` file. Defaults to `None`, which uses
            `wiki_sample_path()`.

    Returns:
        A 1D `uint8` numpy array of bytes when `split` is given, else a
        tuple `(train, valid, test)` of such arrays.

    Raises:
        DatasetNotFoundError: if gensim's test data is not installed.
        ValueError: if `split` is unknown or the fractions are not in
            `[0, 1)` or leave no training data.

    Example:

    >>> train, valid, test = load_wiki_sample()
    >>> len(train), len(valid), len(test)
    (5480772, 304487, 304487)
    """
    split = v.check_split(split)
    valid_fraction = v.check_fraction("valid_fraction", valid_fraction)
    test_fraction = v.check_fraction("test_fraction", test_fraction)
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(
            "`valid_fraction + test_fraction` must be < 1 to leave training "
            f"data. Received: valid_fraction={valid_fraction}, "
            f"test_fraction={test_fraction}"
        )
    raw = _wiki_sample_raw(path)
    total = len(raw)
    n_valid = int(round(total * valid_fraction))
    n_test = int(round(total * test_fraction))
    n_train = total - n_valid - n_test
    bounds = {
        "train": (0, n_train),
        "valid": (n_train, n_train + n_valid),
        "test": (n_train + n_valid, total),
    }

    def piece(name):
        start, stop = bounds[name]
        return np.frombuffer(raw[start:stop], dtype=np.uint8).copy()

    if split is not None:
        return piece(split)
    return tuple(piece(s) for s in v.SPLITS)


_PAGE_RE = re.compile(rb"<page>(.*?)</page>", re.S)
_TITLE_RE = re.compile(rb"<title>(.*?)</title>", re.S)
_TEXT_RE = re.compile(rb"<text[^>]*>(.*?)</text>", re.S)


@functools.lru_cache(maxsize=2)
def _articles(path):
    raw = _wiki_sample_bytes(path)
    articles = []
    for page in _PAGE_RE.finditer(raw):
        body = page.group(1)
        title = _TITLE_RE.search(body)
        text = _TEXT_RE.search(body)
        if text is None:
            continue
        content = unescape(
            text.group(1).decode("utf-8"), {"&quot;": '"', "&apos;": "'"}
        )
        if content.lstrip()[:9].upper() == "#REDIRECT":
            continue
        title = title.group(1).decode("utf-8") if title else ""
        articles.append((unescape(title), content.encode("utf-8")))
    return tuple(articles)


def load_wiki_articles(path=None):
    """Loads the articles of the Wikipedia sample of gensim's test data.

    Each `<page>` ... `</page>` of the XML dump is an article; its text is
    the content of the `<text ...>` element, XML entities decoded
    (`&lt;` becomes `<` and so on), encoded back to UTF-8. Redirect pages
    (text starting with `#REDIRECT`) are left out, which leaves 106
    articles.

    Args:
        path: path to the `.bz2` file. Defaults to `None`, which uses
            `wiki_sample_path()`.

    Returns:
        A list of `(title, text)` tuples in the order of the dump, `title`
        a `str` and `text` `bytes`.

    Raises:
        DatasetNotFoundError: if gensim's test data is not installed.

    Example:

    >>> articles = load_wiki_articles()
    >>> len(articles), articles[0][0]
    (106, 'Anarchism')
    """
    if path is None:
        path = wiki_sample_path()
    _wiki_sample_raw(path)  # checks that the file exists
    return list(_articles(os.path.abspath(os.fspath(path))))


# --------------------------------------------------------------------------
# Language-model windows
# --------------------------------------------------------------------------


def _check_windows_args(data, sequence_length):
    data = v.as_byte_array("data", data)
    sequence_length = v.check_int("sequence_length", sequence_length, 1)
    if len(data) < sequence_length + 1:
        raise ValueError(
            "`sequence_length` must be at most len(data) - 1 = "
            f"{len(data) - 1} (a window needs sequence_length + 1 bytes). "
            f"Received: sequence_length={sequence_length}"
        )
    return data, sequence_length


def _gather(data, starts, sequence_length, dtype):
    # A strided view of all windows; indexing it copies only the rows used.
    windows = np.lib.stride_tricks.sliding_window_view(
        data, sequence_length + 1
    )[starts]
    dtype = data.dtype if dtype is None else dtype
    return windows[:, :-1].astype(dtype), windows[:, 1:].astype(dtype)


def lm_windows(
    data,
    sequence_length,
    num_windows=None,
    mode="random",
    seed=None,
    dtype=None,
):
    """Cuts a byte array into `(inputs, targets)` windows for LM training.

    Each window covers `sequence_length + 1` consecutive bytes; `inputs` are
    its first `sequence_length` bytes and `targets` its last
    `sequence_length` bytes, so that `targets[:, t]` is the byte that
    follows `inputs[:, t]`.

    Args:
        data: 1D integer array (or `bytes`), e.g. from `load_enwik8()`.
        sequence_length: length `n` of each window.
        num_windows: number of windows. Defaults to `None`, which means
            `(len(data) - 1) // sequence_length`, i.e. all non-overlapping
            windows.
        mode: `"random"` for windows at uniformly random start positions
            (they may overlap), or `"contiguous"` for consecutive
            non-overlapping windows starting at byte 0 (the first
            `num_windows` of them). Defaults to `"random"`.
        seed: seed of the random start positions; ignored when `mode` is
            `"contiguous"`. Defaults to `None` (not reproducible).
        dtype: numpy dtype of the outputs. Defaults to `None`, which keeps
            the dtype of `data` (`uint8` for the loaders).

    Returns:
        A tuple `(inputs, targets)` of arrays of shape
        `(num_windows, sequence_length)`.

    Raises:
        ValueError: if `sequence_length` is not smaller than `len(data)`,
            `mode` is unknown, or `num_windows` is too large for
            `"contiguous"` windows.

    Example:

    >>> data = np.arange(10, dtype="uint8")
    >>> x, y = lm_windows(data, 4, mode="contiguous")
    >>> x
    array([[0, 1, 2, 3],
           [4, 5, 6, 7]], dtype=uint8)
    >>> y
    array([[1, 2, 3, 4],
           [5, 6, 7, 8]], dtype=uint8)
    >>> x, y = lm_windows(data, 4, num_windows=3, seed=0)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    ((3, 4), True)
    """
    data, sequence_length = _check_windows_args(data, sequence_length)
    mode = v.check_choice("mode", mode, ("random", "contiguous"))
    seed = v.check_seed(seed)
    max_contiguous = (len(data) - 1) // sequence_length
    if num_windows is None:
        num_windows = max_contiguous
    num_windows = v.check_int("num_windows", num_windows, min_value=1)
    if mode == "contiguous":
        if num_windows > max_contiguous:
            raise ValueError(
                "`num_windows` must be at most (len(data) - 1) // "
                f"sequence_length = {max_contiguous} for contiguous windows. "
                f"Received: num_windows={num_windows}"
            )
        starts = np.arange(num_windows) * sequence_length
    else:
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, len(data) - sequence_length, size=num_windows)
    return _gather(data, starts, sequence_length, dtype)


class LMWindowDataset(keras.utils.PyDataset):
    """A `keras.utils.PyDataset` of random language-model windows.

    Batch `index` of epoch `e` holds `batch_size` windows at random start
    positions drawn from a generator seeded with `(seed, e, index)`, so a
    batch depends only on the seed, the epoch and its index: it is the same
    whatever the order in which batches are asked for, or the number of
    workers. The epoch counter (`self.epoch`) starts at 0 and is increased
    by `on_epoch_end()`, which `fit()` calls after every epoch (Keras may
    call it once more, e.g. when `fit()` starts), so each epoch sees fresh
    windows. Each item is a tuple `(inputs, targets)` as in `lm_windows()`.

    Args:
        data: 1D integer array (or `bytes`), e.g. from `load_enwik8()`.
        sequence_length: length `n` of each window.
        batch_size: number of windows in a batch. Defaults to `32`.
        num_batches: number of batches per epoch. Defaults to `None`,
            which means `max(1, (len(data) - 1) // (sequence_length *
            batch_size))`, about one pass over the data per epoch.
        seed: seed of the windows. Defaults to `None`, which draws a seed
            once, at construction.
        dtype: numpy dtype of the batches. Defaults to `"int32"`.
        **kwargs: `workers`, `use_multiprocessing` and `max_queue_size`,
            passed to `keras.utils.PyDataset`.

    Example:

    >>> data = np.frombuffer(b"hello world, " * 100, dtype="uint8")
    >>> dataset = LMWindowDataset(data, 16, batch_size=4, num_batches=3,
    ...                           seed=0)
    >>> len(dataset)
    3
    >>> x, y = dataset[0]
    >>> x.shape, y.shape, x.dtype
    ((4, 16), (4, 16), dtype('int32'))
    """

    def __init__(
        self,
        data,
        sequence_length,
        batch_size=32,
        num_batches=None,
        seed=None,
        dtype="int32",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.data, self.sequence_length = _check_windows_args(
            data, sequence_length
        )
        self.batch_size = v.check_int("batch_size", batch_size, min_value=1)
        if num_batches is None:
            num_batches = max(
                1, (len(self.data) - 1) // (sequence_length * batch_size)
            )
        self._num_batches = v.check_int(
            "num_batches", num_batches, min_value=1
        )
        seed = v.check_seed(seed)
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % (2**63))
        self.seed = seed
        self.dtype = dtype
        self.epoch = 0

    def __len__(self):
        return self._num_batches

    def __getitem__(self, index):
        if not -self._num_batches <= index < self._num_batches:
            raise IndexError(
                f"Batch index {index} out of range for a dataset of "
                f"{self._num_batches} batches."
            )
        index = index % self._num_batches
        rng = np.random.default_rng([self.seed, self.epoch, index])
        starts = rng.integers(
            0, len(self.data) - self.sequence_length, size=self.batch_size
        )
        return _gather(self.data, starts, self.sequence_length, self.dtype)

    def on_epoch_end(self):
        self.epoch += 1
