"""LSH attention (Reformer, Kitaev et al. 2020): shared queries and keys
hashed by random rotations, exact attention inside sorted chunks of each
bucket, several hashing rounds combined by their log-sum-exps."""

import numbers
import random

import keras
import numpy as np
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn._validation import optional_seed as _optional_seed
from keras_longattn._validation import positive_int as _positive_int
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.dispatch import is_training
from keras_longattn.ops import lsh as lsh_ops
from keras_longattn.ops import paths as la_paths

#: Seeds are below this bound: calls with ``training=True`` put the seed in
#: an int32 tensor (PyTorch refuses larger ones, JAX those of 2**32 and up).
SEED_BOUND = 2**31


@keras.saving.register_keras_serializable(package="keras_longattn")
class LSHAttention(BaseAttention):
    """LSH attention (Reformer): each token attends to the tokens hashed to
    its bucket, in sorted chunks; O(n * bucket_size) per hashing round.

    **Shared queries and keys.** The key of a token is its query divided by
    its norm (the key projection is not used), so a query and its own key
    always share a bucket; a token does not attend to itself unless it has
    no other key to attend to. Self-attention only (``T == S``).

    **Hashing.** Round ``r`` draws a random rotation ``R_r`` ``(key_dim,
    c)`` per head; a token's bucket is ``argmax([x R_r, -x R_r])`` of its
    query ``x``, one of ``2c`` buckets. The products and the argmax are
    float32 whatever the compute dtype (the queries are cast up for hashing
    only).

    **Number of buckets.** ``num_buckets``, or when None ``2 * ceil(n / (2
    * bucket_size))`` of the sequence length ``n`` the layer is built with
    (or of its first call with a known length, when built without one),
    fixed from then on for every call and reported by ``get_config``. The
    bucket count is part of the hash function: a length-dependent count
    would hash the same tokens differently in sequences of different
    lengths, so a causal output would depend on the tokens after it
    (through their number) and a model would run with other buckets than
    it was trained with. With one count for every call, a causal call's
    outputs for a prefix equal the first outputs of the longer sequence,
    and an example's outputs do not depend on the padding of its batch.
    Buckets hold about ``bucket_size`` tokens at the build length and more
    at longer lengths (each token still attends to at most two chunks of
    its bucket).

    **Attention.** Per round, tokens are sorted by (bucket, position) and
    cut into chunks of ``bucket_size`` members aligned per bucket; a token
    attends to the keys of its own and of the previous chunk of its bucket
    (causal: only those not after it). The ``num_hashes`` rounds are
    combined as in the paper, by the log-sum-exp of each round's logits:
    one softmax over the union of the rounds, a key counting once per round
    that shows it. Exact attention under this data-dependent pattern: the
    ``"reference"`` path is dense attention under the same buckets and
    chunks (the same rotations), as a ``(T, S)`` mask per round.

    **Random rotations.** Drawn with NumPy from ``hash_seed`` (fixed per
    layer, stored in the config, so a saved model hashes the same way).
    ``hash_seed=None`` draws the seed at construction from Python's
    ``random`` module (as Keras's own default seeds), so
    ``keras.utils.set_random_seed`` makes it reproducible; the drawn value
    is stored. With ``redraw_in_training=True`` (default), calls with
    ``training=True`` draw fresh rotations every call instead (the
    Reformer's training), from a seed generator seeded by ``hash_seed``.

    **Cost.** ``"hashed"``: hashing O(R * n * c * d) (``c = num_buckets /
    2``), two sorts of ``n`` per round and head, and ``bucket_size x 2
    bucket_size`` score blocks over a buffer of at most ``n + 2c *
    bucket_size`` slots (``2c * bucket_size`` is about the build length
    when the count is derived): time and memory O(R * (n + 2c *
    bucket_size) * bucket_size) for the attention, no ``n x n`` tensor. All
    rounds run as one batch of ``R * H`` heads. ``"hashed_torch"`` (PyTorch
    only, preferred by ``"auto"`` there): the same attention with every
    chunk of every round in PyTorch's flash attention kernel (which returns
    each round's log-sum-exp), from a plan of sorted chunks without empty
    slots, the rounds combined and differentiated inside one autograd
    function (``keras_longattn/kernels/torch/lsh.py``); no attention
    dropout.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value. Defaults to ``key_dim``.
        bucket_size: members per chunk, the average bucket size at the
            build length when the number of buckets is derived. Defaults to
            64 (the paper's).
        num_hashes: hashing rounds R. Defaults to 4.
        num_buckets: an even number of buckets (>= 2) for every length, or
            None to fix it from the build length (see above). Needed when
            the layer is built and first called without a known sequence
            length (a variable-length model traced by TensorFlow).
            Defaults to None.
        hash_seed: int in ``[0, 2**31)``, the seed of the rotations.
            Defaults to None: drawn once at construction from Python's
            ``random`` (seeded by ``keras.utils.set_random_seed``) and
            stored.
        redraw_in_training: draw fresh rotations in every call with
            ``training=True``. Defaults to True.
        **kwargs: the arguments of :class:`BaseAttention` (those of
            ``keras.layers.MultiHeadAttention``, and ``implementation``:
            ``"auto"``, ``"hashed"``, ``"hashed_torch"`` (PyTorch only) or
            ``"reference"``). ``dropout`` applies to each round's weights
            (``"hashed"`` and ``"reference"`` only).

    Call arguments:
        As ``keras.layers.MultiHeadAttention``, self-attention lengths:
        ``query`` ``(B, n, dim)``, ``value`` ``(B, n, dim)``, ``key``
        (unused by the attention: keys are the normalised queries),
        ``query_mask``/``value_mask``/``key_mask`` ``(B, n)`` (a token
        padded in any of them takes no part), ``use_causal_mask``,
        ``training``, ``return_attention_scores`` (dense ``(B, H, n, n)``
        weights from the reference path). A dense ``attention_mask`` only
        with ``implementation="reference"``.

    Returns:
        ``(B, n, output_dim)`` (and the weights if requested). Padded
        tokens get a zero attention output.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.LSHAttention(
    ...     num_heads=2, key_dim=8, bucket_size=8, num_hashes=2, hash_seed=0)
    >>> x = np.random.rand(2, 100, 16).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (2, 100, 16)
    >>> layer.last_implementation in ("hashed", "hashed_torch")  # torch: hashed_torch
    True
    >>> tuple(layer.buckets(x).shape)  # (B, num_hashes * num_heads, n)
    (2, 4, 100)

    Reference:
        Kitaev, Kaiser and Levskaya, "Reformer: The Efficient Transformer",
        ICLR 2020 (arXiv:2001.04451).
    """

    supports_attention_mask = False
    reference_tolerance = 1e-5

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
        bucket_size=64,
        num_hashes=4,
        num_buckets=None,
        hash_seed=None,
        redraw_in_training=True,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim=value_dim, **kwargs)
        self.bucket_size = _positive_int("bucket_size", bucket_size)
        self.num_hashes = _positive_int("num_hashes", num_hashes)
        if num_buckets is not None and (
            isinstance(num_buckets, bool)
            or not isinstance(num_buckets, numbers.Integral)
            or num_buckets < 2
            or num_buckets % 2
        ):
            raise ValueError(
                "`num_buckets` must be an even integer >= 2 (argmax over "
                "[xR, -xR] makes buckets in pairs) or None. "
                f"Received: num_buckets={num_buckets!r}"
            )
        self.num_buckets = None if num_buckets is None else int(num_buckets)
        if hash_seed is None:
            # Python's `random`, as Keras's own default seeds
            # (keras.random.SeedGenerator): keras.utils.set_random_seed
            # seeds it.
            hash_seed = random.randrange(SEED_BOUND)
        self.hash_seed = _optional_seed("hash_seed", hash_seed, upper=SEED_BOUND)
        if not isinstance(redraw_in_training, bool):
            raise ValueError(
                "`redraw_in_training` must be a bool. "
                f"Received: redraw_in_training={redraw_in_training!r}"
            )
        self.redraw_in_training = redraw_in_training
        self._hash_generator = keras.random.SeedGenerator(self.hash_seed)
        self._fixed_rotations = {}

    # -------------------------------------------------------------- hashing
    def build_extra(self, query_shape, value_shape, key_shape):
        if self.num_buckets is None and query_shape[1] is not None:
            self.num_buckets = self._derived_buckets(query_shape[1])

    def _derived_buckets(self, length):
        return 2 * lsh_ops.rotation_columns(length, self.bucket_size)

    def _columns(self, length):
        """``c`` (half the buckets) of every call: ``num_buckets / 2``, which
        a layer built without a known length fixes at its first call with
        a known length."""
        if self.num_buckets is None:
            if not isinstance(length, int):
                raise ValueError(
                    "LSHAttention fixes its number of buckets from the "
                    "sequence length it is built with (or first called "
                    "with), and neither was known (built and traced with a "
                    "variable length). Pass num_buckets=... (an even number, "
                    "about n / bucket_size for the training length n). "
                    "Received: num_buckets=None"
                )
            if not self.built:
                return self._derived_buckets(length) // 2
            self.num_buckets = self._derived_buckets(length)
        return self.num_buckets // 2

    def rotations(self, columns, training=False):
        """The ``(num_hashes, columns, num_heads, key_dim)`` float32 random
        rotations of a call: fixed (NumPy, from ``hash_seed``; the first
        ``c`` columns are the same for any ``columns >= c``), or fresh ones
        in training with ``redraw_in_training``."""
        shape = (self.num_hashes, int(columns), self.num_heads, self.key_dim)
        if self.redraw_in_training and is_training(training):
            return keras.random.normal(shape, seed=self._hash_generator, dtype="float32")
        fixed = self._fixed_rotations.get(int(columns))
        if fixed is None:
            rounds = [
                np.random.default_rng([self.hash_seed, r]).standard_normal(shape[1:])
                for r in range(self.num_hashes)
            ]
            fixed = np.stack(rounds).astype("float32")
            self._fixed_rotations[int(columns)] = fixed
        return ops.convert_to_tensor(fixed)

    def _valid_tokens(self, context):
        return la_ops.combine_dense_masks(
            context.padding.query_mask, context.padding.key_mask
        )

    def _hash(self, query, context):
        """``(buckets, num_buckets, valid)`` of a call: int32
        ``(B, num_hashes * H, n)``, the static bucket count and the boolean
        ``(B, n)`` tokens that take part (or None)."""
        rot, valid, c = self._hash_inputs(query, context)
        return lsh_ops.hash_buckets(query, rot, valid), 2 * c, valid

    def _hash_inputs(self, query, context):
        """``(rotations, valid, c)``: the arguments of
        :func:`keras_longattn.ops.lsh.hash_buckets` (or a backend's faster
        form of it) after the query, and the column count ``c``.

        The caller calls the hash function itself: under ``torch.compile``
        the rotations break the graph here, and a function passed in as an
        argument and called after that break came back as None in the
        resumed frame (dynamo 2.13) once another implementation's call had
        been compiled in the same process."""
        c = self._columns(context.query_length)
        valid = self._valid_tokens(context)
        rot = self.rotations(c, context.training)
        return rot, valid, c

    def buckets(self, query, query_mask=None, training=False):
        """The buckets the layer's attention uses for inputs ``query``
        ``(B, n, dim)`` (the layer must be built, or is built here): int32
        ``(B, num_hashes * num_heads, n)``, round-major (round ``r``, head
        ``h`` is row ``r * num_heads + h``); ``2 * c`` for padded tokens."""
        if not self.built:
            self.build(tuple(query.shape), tuple(query.shape))
        q = self._query_dense(query)
        if self.rotary_max_wavelength is not None:
            q = la_ops.apply_rotary(q, self.rotary_max_wavelength)
        n = la_ops.length(q, 1)
        mask = None if query_mask is None else ops.cast(query_mask, "bool")
        context = self._context(n, mask, training)
        return self._hash(self._zero_padding(q, mask), context)[0]

    def _context(self, n, mask, training):
        from keras_longattn.layers.base_attention import AttentionContext

        return AttentionContext(
            padding=la_ops.PaddingMask(mask, None),
            causal=False,
            training=training,
            query_length=n,
            key_length=n,
        )

    @staticmethod
    def _zero_padding(query, valid):
        """Queries of padded tokens as exact zeros (their keys are the
        normalised queries: a NaN there must not reach a real token)."""
        if valid is None:
            return query
        keep = ops.cast(valid, "bool")[:, :, None, None]
        return ops.where(keep, query, ops.zeros_like(query))

    # -------------------------------------------------------------- checks
    def _dispatch(self, q, k, v, context):
        T, S = context.query_length, context.key_length
        if la_ops.shapes.is_static(T, S) and T != S:
            raise ValueError(
                "LSHAttention shares queries and keys (each key is its "
                "normalised query), so it needs self-attention lengths. "
                f"Received: query length {T}, key length {S}"
            )
        return super()._dispatch(q, k, v, context)

    # ------------------------------------------------------- efficient path
    @implementation("hashed")
    def _hashed(self, query, key, value, context):
        """Sorted chunks of all rounds as one batch of heads, combined by
        their log-sum-exps."""
        query = self._zero_padding(query, self._valid_tokens(context))
        buckets, k, _ = self._hash(query, context)
        return lsh_ops.lsh_attention(
            query,
            value,
            buckets,
            k,
            self.bucket_size,
            causal=context.causal,
            scale=self._inverse_sqrt_key_dim,
            dropout_fn=self._dropout_fn(context.training),
        )

    @implementation("hashed_torch", kind="fused", dropout=False)
    def _hashed_torch(self, query, key, value, context):
        """PyTorch only: the rounds' sorted chunks in the flash attention
        kernel, combined and differentiated in one autograd function
        (``keras_longattn.kernels.torch.lsh``)."""
        query = self._zero_padding(query, self._valid_tokens(context))
        rot, valid, c = self._hash_inputs(query, context)
        buckets = la_paths.lsh_hash_buckets(query, rot, valid)
        return la_paths.lsh_attention(
            query,
            lsh_ops.shared_keys(query),
            value,
            buckets,
            2 * c,
            self.bucket_size,
            causal=context.causal,
            scale=self._inverse_sqrt_key_dim,
        )

    @_hashed_torch.refuses
    def _hashed_torch(self, context):
        return la_paths.refusal("lsh")

    # ------------------------------------------------------------ reference
    def _attention_reference(self, query, key, value, context):
        """Dense attention under the same buckets and chunks (see
        :func:`keras_longattn.ops.lsh.lsh_weights`)."""
        query = self._zero_padding(query, self._valid_tokens(context))
        buckets, k, _ = self._hash(query, context)
        extra = None
        if context.attention_mask is not None:
            extra = ops.cast(context.attention_mask, "bool")[:, None]
        weights = lsh_ops.lsh_weights(
            query,
            buckets,
            k,
            self.bucket_size,
            causal=context.causal,
            scale=self._inverse_sqrt_key_dim,
            extra_mask=extra,
        )
        return self._weighted_values(weights, value, context)

    # ---------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "bucket_size": self.bucket_size,
                "num_hashes": self.num_hashes,
                "num_buckets": self.num_buckets,
                "hash_seed": self.hash_seed,
                "redraw_in_training": self.redraw_in_training,
            }
        )
        return config
