"""keras-hub's GPT-2 causal LM on a converted backbone."""

import keras

from keras_longattn.hub._keras_hub import GPT2CausalLM
from keras_longattn.hub.causal_lm import _LongCausalLMMixin
from keras_longattn.hub.gpt2_backbone import LongGPT2Backbone


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongGPT2CausalLM(_LongCausalLMMixin, GPT2CausalLM):
    """keras-hub's ``GPT2CausalLM`` on a :class:`LongGPT2Backbone`, whose
    ``generate`` decodes through our layers' caches (see
    :class:`_LongCausalLMMixin`). ``max_length`` is at most the backbone's
    ``max_sequence_length`` (its position table)."""

    backbone_cls = LongGPT2Backbone
