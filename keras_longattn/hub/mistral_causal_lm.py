"""keras-hub's Mistral causal LM on a converted backbone."""

import keras

from keras_longattn.hub._keras_hub import MistralCausalLM
from keras_longattn.hub.causal_lm import _LongCausalLMMixin
from keras_longattn.hub.mistral_backbone import LongMistralBackbone


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongMistralCausalLM(_LongCausalLMMixin, MistralCausalLM):
    """keras-hub's ``MistralCausalLM`` on a :class:`LongMistralBackbone`,
    whose ``generate`` decodes through our layers' caches (see
    :class:`_LongCausalLMMixin`)."""

    backbone_cls = LongMistralBackbone
