"""Offline datasets and seeded generators for long-sequence models.

Nothing in this package downloads anything:

* byte-level text: `load_enwik8()` (a local enwik8 file),
  `load_wiki_sample()` / `load_wiki_articles()` (the Wikipedia sample
  shipped in gensim's test data), `lm_windows()` and `LMWindowDataset`;
* images: `load_digits_sequences()` (scikit-learn's 8x8 digits as pixel
  sequences at a chosen resolution);
* seeded generators: `make_listops()`, `make_pathfinder()`,
  `make_associative_recall()` and `make_document_matching()`.

Everything returns numpy arrays or a `keras.utils.PyDataset`, usable with
any Keras backend.
"""

from keras_longattn.datasets.digits import load_digits_sequences
from keras_longattn.datasets.digits import quantize
from keras_longattn.datasets.digits import resize_images
from keras_longattn.datasets.listops import LISTOPS_VOCABULARY
from keras_longattn.datasets.listops import decode_listops
from keras_longattn.datasets.listops import listops_token_id
from keras_longattn.datasets.listops import make_listops
from keras_longattn.datasets.matching import make_document_matching
from keras_longattn.datasets.matching import wiki_article_splits
from keras_longattn.datasets.pathfinder import PATHFINDER_BACKGROUND
from keras_longattn.datasets.pathfinder import PATHFINDER_ENDPOINT
from keras_longattn.datasets.pathfinder import PATHFINDER_PATH
from keras_longattn.datasets.pathfinder import make_pathfinder
from keras_longattn.datasets.recall import make_associative_recall
from keras_longattn.datasets.text import ENWIK8_ENV_VAR
from keras_longattn.datasets.text import ENWIK8_URL
from keras_longattn.datasets.text import DatasetNotFoundError
from keras_longattn.datasets.text import LMWindowDataset
from keras_longattn.datasets.text import lm_windows
from keras_longattn.datasets.text import load_enwik8
from keras_longattn.datasets.text import load_wiki_articles
from keras_longattn.datasets.text import load_wiki_sample
from keras_longattn.datasets.text import wiki_sample_path

__all__ = [
    "DatasetNotFoundError",
    "ENWIK8_ENV_VAR",
    "ENWIK8_URL",
    "LISTOPS_VOCABULARY",
    "LMWindowDataset",
    "PATHFINDER_BACKGROUND",
    "PATHFINDER_ENDPOINT",
    "PATHFINDER_PATH",
    "decode_listops",
    "listops_token_id",
    "lm_windows",
    "load_digits_sequences",
    "load_enwik8",
    "load_wiki_articles",
    "load_wiki_sample",
    "make_associative_recall",
    "make_document_matching",
    "make_listops",
    "make_pathfinder",
    "quantize",
    "resize_images",
    "wiki_article_splits",
    "wiki_sample_path",
]
