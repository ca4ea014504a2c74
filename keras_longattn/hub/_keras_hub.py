"""keras-hub's classes and helpers that the converter subclasses and calls (imported here once: keras-hub keeps them under ``keras_hub.src``)."""

try:
    from keras_hub.src.layers.modeling.position_embedding import PositionEmbedding
    from keras_hub.src.layers.modeling.transformer_decoder import TransformerDecoder
    from keras_hub.src.layers.modeling.transformer_encoder import TransformerEncoder
    from keras_hub.src.layers.modeling.token_and_position_embedding import (
        TokenAndPositionEmbedding,
    )
    from keras_hub.src.models.backbone import Backbone
    from keras_hub.src.models.bert.bert_backbone import BertBackbone
    from keras_hub.src.models.bert.bert_backbone import bert_kernel_initializer
    from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
    from keras_hub.src.models.gpt2.gpt2_backbone import _gpt_2_kernel_initializer
    from keras_hub.src.models.gpt2.gpt2_causal_lm import GPT2CausalLM
    from keras_hub.src.models.llama.llama_backbone import LlamaBackbone
    from keras_hub.src.models.llama.llama_backbone import _llama_kernel_initializer
    from keras_hub.src.models.llama.llama_causal_lm import LlamaCausalLM
    from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder
    from keras_hub.src.models.llama.llama_layernorm import LlamaLayerNorm
    from keras_hub.src.models.mistral.mistral_backbone import MistralBackbone
    from keras_hub.src.models.mistral.mistral_backbone import _mistral_kernel_initializer
    from keras_hub.src.models.mistral.mistral_causal_lm import MistralCausalLM
    from keras_hub.src.models.mistral.mistral_layer_norm import MistralLayerNormalization
    from keras_hub.src.models.mistral.mistral_transformer_decoder import (
        MistralTransformerDecoder,
    )
    from keras_hub.src.models.roberta.roberta_backbone import RobertaBackbone
    from keras_hub.src.models.roberta.roberta_backbone import roberta_kernel_initializer
    from keras_hub.src.utils.keras_utils import clone_initializer
    from keras_hub.src.utils.keras_utils import gelu_approximate
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "keras_longattn.hub converts keras-hub models and needs keras-hub: "
        "pip install keras-longattn[hub]"
    ) from error
