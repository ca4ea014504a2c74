"""Which path runs a call: the ``implementation`` selection shared by every
attention layer (:class:`keras_longattn.layers.BaseAttention` mixes it in).

A layer's paths are the methods it declares with
:func:`keras_longattn.layers.dispatch.implementation` (its
``_implementation_table``); :meth:`SelectionMixin._select` returns the one a
call runs (the named one, or under ``"auto"`` the first that does not refuse
in the backend's order of preference, else the reference path) and
:meth:`SelectionMixin._dispatch` runs it and records its name in
``last_implementation``."""

import dataclasses
import warnings

from keras_longattn import ops as la_ops
from keras_longattn.layers import dispatch as la_dispatch
from keras_longattn.layers.dispatch import auto_preference as dispatch_auto_preference

#: ``(layer class name, reasons)`` pairs already warned about.
_WARNED_FALLBACKS = set()


@dataclasses.dataclass
class AttentionContext:
    """Everything an attention path needs besides the projected tensors.

    Attributes:
        padding: a :class:`keras_longattn.ops.PaddingMask` (structural).
        causal: whether query ``i`` may only see keys ``j <= i``.
        attention_mask: optional dense boolean ``(B, T, S)`` mask.
        training: the Keras training flag.
        return_scores: whether dense weights were requested.
        query_length: T.
        key_length: S.
    """

    padding: la_ops.PaddingMask
    causal: bool
    attention_mask: object = None
    training: object = None
    return_scores: bool = False
    query_length: object = None
    key_length: object = None


class SelectionMixin:
    """The path selection of :class:`keras_longattn.layers.BaseAttention`."""

    def select_implementation(
        self,
        use_causal_mask=False,
        attention_mask=False,
        return_attention_scores=False,
        training=False,
        query_length=None,
        key_length=None,
    ):
        """Returns the name of the implementation a call with these
        properties would run (without running anything)."""
        context = AttentionContext(
            padding=la_ops.PaddingMask(),
            causal=bool(use_causal_mask),
            attention_mask=True if attention_mask is not None and attention_mask is not False else None,
            training=training,
            return_scores=bool(return_attention_scores),
            query_length=query_length,
            key_length=key_length,
        )
        return self._select(context)

    def _select(self, context):
        if context.return_scores:
            if not self.supports_scores:
                raise ValueError(
                    f"{type(self).__name__} cannot return attention scores: it "
                    "never forms per-query weights over the keys. Received: "
                    "return_attention_scores=True"
                )
            return "reference"
        if context.causal and not self.supports_causal:
            raise ValueError(
                f"{type(self).__name__} has no causal mode. Received: "
                "use_causal_mask=True"
            )
        if not context.causal and not self.supports_bidirectional:
            raise ValueError(
                f"{type(self).__name__} only supports causal attention. "
                "Received: use_causal_mask=False"
            )
        requested = self.implementation
        if requested == "reference":
            return "reference"
        if context.attention_mask is not None and not self.supports_attention_mask:
            raise ValueError(
                f"{type(self).__name__} cannot honour a dense `attention_mask` "
                "without building a (B, T, S) tensor, which its efficient "
                "paths never do. Pass padding through `query_mask`, "
                "`value_mask` or `key_mask` (or Keras masks, e.g. "
                "`Embedding(mask_zero=True)`) and causality through "
                "`use_causal_mask=True`; or construct the layer with "
                "implementation='reference' to accept the dense mask at "
                "O(T*S) cost. Received: attention_mask with shape "
                f"{getattr(context.attention_mask, 'shape', '(dense)')}"
            )
        candidates = self.auto_order() if requested == "auto" else (requested,)
        reasons = []
        for name in candidates:
            # A path that failed to compile or launch here is not tried
            # again by "auto" (see layers/dispatch.py).
            reason = (la_dispatch.path_failure(self, name) if requested == "auto" else None)
            if reason is None:
                reason = self._implementation_table[name].refusal(self, context)
            if reason is None:
                return name
            reasons.append(f"{name}: {reason}")
        if requested == "auto":
            return "reference"
        raise ValueError(
            f"implementation={requested!r} of {type(self).__name__} cannot "
            f"run this call ({'; '.join(reasons)}). Use implementation='auto' "
            "or 'reference'."
        )

    #: Whether ``"auto"`` warns when it falls to the reference path (False
    #: where the reference costs what the efficient paths cost).
    warns_on_reference_fallback = True

    def _warn_reference_fallback(self, context):
        """Warns once per layer class and set of reasons that ``"auto"``
        runs the O(T*S) reference path because every efficient path refused
        the call."""
        if not self.warns_on_reference_fallback:
            return
        table = self._implementation_table
        order = self.auto_order()
        reasons = tuple(f"{name}: {table[name].refusal(self, context)}" for name in order)
        key = (type(self).__name__, reasons)
        if key in _WARNED_FALLBACKS:
            return
        _WARNED_FALLBACKS.add(key)
        why = "; ".join(reasons) if reasons else (
            f"no efficient path of {type(self).__name__} runs on this backend")
        warnings.warn(
            f"{type(self).__name__} with implementation='auto' runs the "
            f"O(T*S) reference path for this call: {why}. Name a path with "
            "`implementation=` to make this an error instead.",
            stacklevel=3,
        )

    def auto_order(self):
        """Efficient implementations in the order ``"auto"`` tries them on
        the active backend: by kind, in the backend's order of preference
        (:attr:`keras_longattn.kernels.BackendOps.auto_preference`: fused
        kernels first on PyTorch, explicit einsums first where XLA fuses
        them), then in declaration order."""
        preference = dispatch_auto_preference()
        table = self._implementation_table
        # A kind the backend does not list (e.g. "pallas" off JAX GPU/TPU)
        # only runs when named.
        names = [name for name in table if table[name].kind in preference]
        return tuple(
            sorted(names, key=lambda name: preference.index(table[name].kind))
        )

    def implementation_kind(self, name):
        """The kind (``"explicit"``, ``"fused"``, ``"pallas"``, ``"flex"``,
        ``"cudnn"`` or ``"context_parallel"``) of implementation ``name``;
        ``"reference"`` for the reference path."""
        if name == "reference":
            return "reference"
        return self._implementation_table[name].kind

    def _dispatch(self, q, k, v, context):
        while True:
            name = self._select(context)
            if name == "reference":
                if self.implementation == "auto" and not context.return_scores:
                    self._warn_reference_fallback(context)
                result = self._attention_reference(q, k, v, context)
                ran = name
                break
            path = self._implementation_table[name]
            if self.implementation == "auto" and la_dispatch.is_accelerator(path):
                # An accelerator path "auto" chose that fails to compile or
                # launch: one warning, then the next path "auto" takes.
                try:
                    result = la_dispatch.run_accelerated(self, path, q, k, v, context)
                except Exception as error:
                    la_dispatch.record_failure(self, path, error)
                    continue
            else:
                result = path.run(self, q, k, v, context)
            variant = path.variant(self, context)
            ran = name if variant is None else f"{name}:{variant}"
            break
        self.last_implementation = ran
        return result
