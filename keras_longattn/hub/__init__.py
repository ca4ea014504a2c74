"""Take a keras-hub model long: its attention swapped for ours, its weights kept.

:func:`longify` converts a keras-hub backbone (GPT-2, Llama, Mistral, BERT,
RoBERTa; built from its config or loaded from a preset) into the same
network in which every self-attention layer is one of this package's layers,
given as a Keras layer config such as
``{"class_name": "LocalAttention", "config": {"window": 128}}``. Our layer is
built with the backbone's heads, head size, key/value heads (grouped-query
attention) and rotary wavelength, and holds the trained query, key, value
and output projections. Norms, feed-forward networks and embeddings keep
their weights; a learned position table (GPT-2, BERT, RoBERTa) is extended to
``max_sequence_length`` by repeating the trained table, as the Longformer
paper (Beltagy et al. 2020) made RoBERTa long.

The result is a new backbone of a subclass of the original class
(:class:`LongGPT2Backbone`, :class:`LongLlamaBackbone`,
:class:`LongMistralBackbone`, :class:`LongBertBackbone`,
:class:`LongRobertaBackbone`): keras-hub's functional graph rebuilt with
blocks that subclass keras-hub's (:class:`LongTransformerDecoder`,
:class:`LongLlamaTransformerDecoder`, :class:`LongMistralTransformerDecoder`,
:class:`LongTransformerEncoder`). A new model rather than the original
edited in place, because a Keras functional graph cannot swap a layer once
it has been called, and because a subclass keeps every attribute keras-hub's
tasks read (``GPT2CausalLM(backbone=...)``,
``BertTextClassifier(backbone=...)``) and saves and loads as ``.keras`` from
its config. keras-hub's blocks build a dense ``(B, T, T)`` mask (causal AND
padding, and Mistral's band) for their attention; the blocks here pass the
``(B, T)`` padding mask (``value_mask``) and the causal flag instead, so no
O(T^2) tensor reaches an efficient layer, and refuse a dense mask.

For generation, :class:`LongGPT2CausalLM`, :class:`LongLlamaCausalLM` and
:class:`LongMistralCausalLM` (keras-hub's tasks on a converted backbone) run
keras-hub's ``generate`` and samplers through our layers' own caches.

Needs keras-hub (``pip install keras-longattn[hub]``).

Laid out like keras-hub: one block, backbone or task per module
(``gpt2_backbone``, ``llama_decoder``, ``gpt2_causal_lm``, ...), the
attention config in ``attention``, the converter in ``longify``, keras-hub's
own classes imported once in ``_keras_hub``, and ``tokenizers``
(vocabularies trained offline).
"""

from keras_longattn.hub.attention import attention_spec
from keras_longattn.hub.longify import extend_positions
from keras_longattn.hub.longify import longify
from keras_longattn.hub.transformer_decoder import LongTransformerDecoder
from keras_longattn.hub.llama_decoder import LongLlamaTransformerDecoder
from keras_longattn.hub.mistral_transformer_decoder import LongMistralTransformerDecoder
from keras_longattn.hub.transformer_encoder import LongTransformerEncoder
from keras_longattn.hub.gpt2_backbone import LongGPT2Backbone
from keras_longattn.hub.llama_backbone import LongLlamaBackbone
from keras_longattn.hub.mistral_backbone import LongMistralBackbone
from keras_longattn.hub.bert_backbone import LongBertBackbone
from keras_longattn.hub.roberta_backbone import LongRobertaBackbone
from keras_longattn.hub.gpt2_causal_lm import LongGPT2CausalLM
from keras_longattn.hub.llama_causal_lm import LongLlamaCausalLM
from keras_longattn.hub.mistral_causal_lm import LongMistralCausalLM

__all__ = [
    "attention_spec",
    "extend_positions",
    "longify",
    "LongTransformerDecoder",
    "LongLlamaTransformerDecoder",
    "LongMistralTransformerDecoder",
    "LongTransformerEncoder",
    "LongGPT2Backbone",
    "LongLlamaBackbone",
    "LongMistralBackbone",
    "LongBertBackbone",
    "LongRobertaBackbone",
    "LongGPT2CausalLM",
    "LongLlamaCausalLM",
    "LongMistralCausalLM",
]
