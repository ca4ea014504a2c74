"""The decoding properties of keras_longattn.testing.model_properties on
the causal language models of ``build_causal_language_model``: learned
positions with a ring cache (LocalAttention), tied embeddings and a full
cache (FullAttention), rotary positions (no position table). Tiny models
(one or two layers, width 16, vocabulary 32)."""

from keras_longattn.models import build_causal_language_model
from keras_longattn.testing.model_properties import CausalModelDecodingProperties

VOCAB = 32


def _model(**kwargs):
    args = dict(vocab_size=VOCAB, sequence_length=16, dim=16, num_layers=1, num_heads=2,
                attention={"class_name": "LocalAttention", "config": {"window": 4}})
    args.update(kwargs)
    return build_causal_language_model(**args)


class TestLearnedPositionsLocalCache(CausalModelDecodingProperties):
    vocab_size = VOCAB
    position_table = 16

    def make_model(self):
        return _model()


class TestTiedEmbeddingsFullCache(CausalModelDecodingProperties):
    vocab_size = VOCAB
    position_table = 12

    def make_model(self):
        return _model(sequence_length=12, num_layers=2, tie_embeddings=True,
                      attention={"class_name": "FullAttention"})


class TestRotaryPositions(CausalModelDecodingProperties):
    vocab_size = VOCAB
    position_table = None  # rotary: no table

    def make_model(self):
        return _model(sequence_length=None, positions="rotary")
