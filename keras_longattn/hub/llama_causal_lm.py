"""keras-hub's Llama causal LM on a converted backbone."""

import keras

from keras_longattn.hub._keras_hub import LlamaCausalLM
from keras_longattn.hub.causal_lm import _LongCausalLMMixin
from keras_longattn.hub.llama_backbone import LongLlamaBackbone


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongLlamaCausalLM(_LongCausalLMMixin, LlamaCausalLM):
    """keras-hub's ``LlamaCausalLM`` on a :class:`LongLlamaBackbone`, whose
    ``generate`` decodes through our layers' caches (see
    :class:`_LongCausalLMMixin`)."""

    backbone_cls = LongLlamaBackbone
