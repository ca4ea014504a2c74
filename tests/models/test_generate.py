"""Generation with the causal language model: the cached forward pass
(``call_with_cache``) gives the logits of the full forward pass, and
``generate()`` with keras-hub's samplers gives what a loop that re-runs the
full model for every token gives, on every backend (compiled: ``jax.jit``,
``tf.function(jit_compile=True)``; torch eager)."""

import sys

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LSHAttention
from keras_longattn.models import PositionEmbedding
from keras_longattn.models import TransformerBlock
from keras_longattn.models import build_causal_language_model
from keras_longattn.models.causal_language_model import CausalLanguageModel

keras_hub = pytest.importorskip("keras_hub")

B, N, DIM, HEADS, VOCAB = 2, 20, 16, 2, 23
#: Largest absolute difference of cached logits from the full forward pass
#: (float32; logits of order 1).
TOL = 5e-5

#: Local's window 4 keeps a ring of look_back = 3 positions: a sequence of
#: N = 20 crosses the window edge at position 3 and wraps the ring 6 times.
LOCAL = {"class_name": "LocalAttention", "config": {"window": 4}}
FULL = "FullAttention"
LINEAR = {"class_name": "LinearAttention", "config": {"chunk_size": 4}}
PERFORMER = {
    "class_name": "PerformerAttention",
    "config": {"num_features": 16, "chunk_size": 4, "seed": 3},
}
SPARSE = {
    "class_name": "SparseAttention",
    "config": {"pattern": "strided", "block_length": 4},
}
#: Causal Routing (2 of its heads local) and Longformer, whose later
#: chunks decode token by token inside the layer.
ROUTING = {"class_name": "RoutingAttention",
           "config": {"num_clusters": 2, "window": 4, "local_heads": 1, "seed": 2}}
LONGFORMER = {"class_name": "LongformerAttention", "config": {"window": 4}}
ATTENTION = {
    "local": LOCAL,
    "routing": ROUTING,
    "longformer": LONGFORMER,
    "full": FULL,
    "linear": LINEAR,
    "performer": PERFORMER,
    "sparse": SPARSE,
    "local+full": [LOCAL, FULL],
    "local+linear": [LOCAL, LINEAR],
}


def make_model(attention="local+full", positions="learned", **kwargs):
    """A small model; learned position vectors are redrawn with unit scale
    (their initial 0.02 would hardly change a logit, and a test of where
    decoding reads them could not fail)."""
    keras.utils.set_random_seed(0)
    spec = ATTENTION.get(attention, attention) if isinstance(attention, str) else attention
    num_layers = len(spec) if isinstance(spec, list) else 2
    model = build_causal_language_model(
        vocab_size=VOCAB,
        sequence_length=N,
        dim=DIM,
        num_layers=num_layers,
        num_heads=HEADS,
        attention=spec,
        positions=positions,
        **kwargs,
    )
    for layer in model.layers:
        if isinstance(layer, PositionEmbedding):
            table = layer.embeddings
            rng = np.random.default_rng(1)
            table.assign(rng.normal(size=tuple(table.shape)).astype("float32"))
    return model


def tokens(batch=B, length=N, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype("int32")


def full_logits(model, seq):
    """Logits of the full forward pass over ``seq`` (padded to N; the
    model is causal, so the padding changes no earlier logit)."""
    padded = np.zeros((seq.shape[0], N), "int32")
    padded[:, : seq.shape[1]] = seq
    return to_np(model(padded))[:, : seq.shape[1]]


def cached_logits(model, seq, chunks):
    """Logits of decoding ``seq`` in chunks of the given sizes."""
    caches = model.init_caches(seq.shape[0], N)
    outs, index = [], 0
    for size in chunks:
        logits, hidden, caches = model.call_with_cache(
            seq[:, index : index + size], caches, index
        )
        assert tuple(hidden.shape) == (seq.shape[0], size, DIM)
        outs.append(to_np(logits))
        index += size
    assert index == seq.shape[1]
    return np.concatenate(outs, axis=1)


def greedy_reference(model, prompt, max_length, lengths=None):
    """Greedy decoding without a cache: the full model for every token."""
    batch = prompt.shape[0]
    lengths = [prompt.shape[1]] * batch if lengths is None else lengths
    seq = np.zeros((batch, max_length), "int32")
    seq[:, : prompt.shape[1]] = prompt
    for index in range(min(lengths), max_length):
        logits = full_logits(model, seq[:, :index])[:, -1]
        for row in range(batch):
            if index >= lengths[row]:
                seq[row, index] = logits[row].argmax()
    return seq


# ------------------------------------------------------ call_with_cache
SCHEDULES = {
    # prefill 5 (past the window edge), then one token at a time
    "prefill-then-steps": [5] + [1] * (N - 5),
    "chunks-across-the-ring": [2, 1, 4, 3, 1, 5, 1, 3],
}


@pytest.mark.every_backend
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("attention", ["local", "full", "linear"])
def test_call_with_cache_gives_the_full_forward_logits(attention, positions, schedule):
    model = make_model(attention, positions)
    seq = tokens()
    expected = full_logits(model, seq)
    got = cached_logits(model, seq, SCHEDULES[schedule])
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("attention", ["performer", "sparse", "local+linear"])
def test_call_with_cache_other_caches_and_mixed_stacks(attention):
    model = make_model(attention, "rotary")
    seq = tokens(seed=1)
    got = cached_logits(model, seq, SCHEDULES["prefill-then-steps"])
    np.testing.assert_allclose(got, full_logits(model, seq), rtol=0, atol=TOL)


def test_call_with_cache_post_norm_and_tied_embeddings():
    model = make_model("local+full", normalize_first=False, tie_embeddings=True)
    assert model._decoding_layers()[3:] == (None, None)
    seq = tokens(seed=2)
    got = cached_logits(model, seq, SCHEDULES["chunks-across-the-ring"])
    np.testing.assert_allclose(got, full_logits(model, seq), rtol=0, atol=TOL)


def test_caches_have_each_layers_shape():
    model = make_model("local+linear")
    local, linear = [s.attention for s in model._attention_sublayers()]
    caches = model.init_caches(3, N)
    assert [tuple(c.shape) for c in caches] == [
        tuple(local.cache_shape(3, N)),
        tuple(linear.cache_shape(3, N)),
    ]
    assert tuple(caches[0].shape)[2] == 3  # Local's ring: look_back positions


def test_call_with_cache_refuses_a_wrong_number_of_caches():
    model = make_model("local+full")
    caches = model.init_caches(B, N)
    with pytest.raises(ValueError, match="tuple of 2 caches"):
        model.call_with_cache(tokens()[:, :2], caches[:1], 0)


def test_transformer_block_passes_the_cache_through():
    keras.utils.set_random_seed(0)
    block = TransformerBlock(LocalAttention(HEADS, DIM // HEADS, window=4), causal=True)
    x = np.random.default_rng(0).normal(size=(B, N, DIM)).astype("float32")
    expected = to_np(block(x))
    cache = block.attention.init_cache(B, N)
    out, cache = block(x[:, :7], cache=cache, cache_update_index=0)
    outs = [to_np(out)]
    for i in range(7, N):
        out, cache = block(x[:, i : i + 1], cache=cache, cache_update_index=i)
        outs.append(to_np(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), expected, rtol=0, atol=TOL)


def test_sublayer_refuses_a_padding_mask_with_a_cache():
    model = make_model("local+full")
    sublayer = model._attention_sublayers()[0]
    x = np.zeros((B, 3, DIM), "float32")
    cache = sublayer.attention.init_cache(B, N)
    with pytest.raises(ValueError, match="without a padding mask"):
        sublayer(x, mask=np.ones((B, 3), bool), cache=cache, cache_update_index=0)


def test_position_embedding_starts_at_the_index():
    layer = PositionEmbedding(N)
    x = np.zeros((1, 3, 4), "float32")
    layer(x)
    table = to_np(layer.embeddings)
    np.testing.assert_allclose(to_np(layer(x, start_index=5))[0], table[5:8])
    with pytest.raises(ValueError, match="start_index=18"):
        layer(x, start_index=18)
    with pytest.raises(ValueError, match="start_index"):
        layer(x, start_index=-1)


# -------------------------------------------------------------- generate
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_greedy_generate_equals_the_uncached_greedy_loop(positions):
    model = make_model("local+full", positions)
    prompt = tokens(length=5, seed=3)
    out = model.generate(prompt, max_length=N, sampler="greedy")
    expected = greedy_reference(model, prompt, N)
    np.testing.assert_array_equal(out["token_ids"], expected)
    assert out["token_ids"].dtype == np.int32
    assert out["padding_mask"].all()


@pytest.mark.parametrize("prompt_length", [1, 6])
def test_greedy_generate_with_a_recurrent_state(prompt_length):
    # Linear's state adds every token once: a prompt token fed twice (in
    # the prefill and again in the first step) would change it.
    model = make_model("local+linear", "rotary")
    prompt = tokens(length=prompt_length, seed=4)
    out = model.generate(prompt, max_length=12)
    np.testing.assert_array_equal(out["token_ids"], greedy_reference(model, prompt, 12))


# ------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("attention", ["local+full", "local+linear", "sparse",
                                       "routing", "longformer"])
def test_prefill_in_chunks_equals_one_call(attention):
    """The chunks' logits and caches are those of one call of the whole
    prompt: the steps after either prefill give the full forward logits."""
    model = make_model(attention, "rotary")
    seq = tokens(seed=7)
    expected = full_logits(model, seq)
    prompt_length = 13
    for chunk_size in (None, 1, 3, 5, 13, 50):
        caches = model.init_caches(B, N)
        logits, hidden, caches = model.prefill(seq[:, :prompt_length], caches,
                                               chunk_size=chunk_size)
        assert tuple(hidden.shape) == (B, prompt_length, DIM)
        np.testing.assert_allclose(to_np(logits), expected[:, :prompt_length],
                                   rtol=0, atol=TOL, err_msg=f"chunk_size={chunk_size}")
        steps = []
        for index in range(prompt_length, N):
            step, _, caches = model.call_with_cache(seq[:, index:index + 1], caches, index)
            steps.append(to_np(step))
        np.testing.assert_allclose(np.concatenate(steps, axis=1), expected[:, prompt_length:],
                                   rtol=0, atol=TOL, err_msg=f"chunk_size={chunk_size}")


def test_prefill_continues_at_the_index_it_is_given():
    model = make_model("local+full", "learned")
    seq = tokens(seed=8)
    caches = model.init_caches(B, N)
    first, _, caches = model.call_with_cache(seq[:, :4], caches, 0)
    rest, _, _ = model.prefill(seq[:, 4:15], caches, cache_update_index=4, chunk_size=4)
    np.testing.assert_allclose(to_np(rest), full_logits(model, seq)[:, 4:15], rtol=0, atol=TOL)


@pytest.mark.parametrize("chunk_size", [0, -2, 2.5, True, "4"])
def test_prefill_refuses_a_bad_chunk_size(model, chunk_size):
    with pytest.raises(ValueError, match=f"`chunk_size`.*Received: chunk_size={chunk_size!r}"):
        model.prefill(tokens(length=3), model.init_caches(B, N), chunk_size=chunk_size)


def test_generate_eagerly_when_the_model_runs_eagerly():
    model = make_model("local+linear")
    prompt = tokens(length=3, seed=14)
    compiled = model.generate(prompt, 8)["token_ids"]
    model.compile(run_eagerly=True)
    eager = model.generate(prompt, 8)["token_ids"]
    np.testing.assert_array_equal(eager, compiled)
    np.testing.assert_array_equal(eager, greedy_reference(model, prompt, 8))


def test_generate_ragged_prompts_with_a_padding_mask():
    model = make_model("local+full")
    prompt = tokens(length=7, seed=5)
    lengths = [7, 3]
    mask = np.arange(7)[None, :] < np.array(lengths)[:, None]
    out = model.generate({"token_ids": prompt, "padding_mask": mask}, max_length=15)
    expected = greedy_reference(model, np.where(mask, prompt, 0), 15, lengths)
    np.testing.assert_array_equal(out["token_ids"], expected)
    np.testing.assert_array_equal(out["token_ids"][1, :3], prompt[1, :3])


def test_top_k_of_one_and_a_single_beam_equal_greedy():
    model = make_model("local+full", "rotary")
    prompt = tokens(length=4, seed=6)
    greedy = model.generate(prompt, 14, sampler="greedy")["token_ids"]
    top1 = model.generate(prompt, 14, keras_hub.samplers.TopKSampler(k=1, seed=7))
    beam1 = model.generate(prompt, 14, keras_hub.samplers.BeamSampler(num_beams=1))
    np.testing.assert_array_equal(top1["token_ids"], greedy)
    np.testing.assert_array_equal(beam1["token_ids"], greedy)


def beam_reference(model, prompt, max_length, num_beams):
    """Beam search without a cache: each step scores every continuation of
    every beam with the full model and keeps the ``num_beams`` most likely
    sequences; returns the most likely one per row."""
    result = []
    for row in prompt:
        beams = [(0.0, list(row))]
        for _ in range(prompt.shape[1], max_length):
            logits = full_logits(model, np.array([seq for _, seq in beams]))[:, -1]
            logits = logits.astype("float64")
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            candidates = [
                (score + logp[i, token], seq + [token])
                for i, (score, seq) in enumerate(beams)
                for token in range(VOCAB)
            ]
            candidates.sort(key=lambda c: -c[0])
            beams = candidates[:num_beams]
        result.append(max(beams, key=lambda c: c[0])[1])
    return np.array(result, "int32")


def test_beam_search_equals_the_uncached_beam_search():
    model = make_model("local+full")
    prompt = tokens(length=4, seed=8)
    out = model.generate(prompt, 10, keras_hub.samplers.BeamSampler(num_beams=3))
    np.testing.assert_array_equal(out["token_ids"], beam_reference(model, prompt, 10, 3))


def test_seeded_samplers_are_deterministic():
    model = make_model("local+full")
    prompt = tokens(length=3, seed=9)
    runs = [
        model.generate(prompt, 16, keras_hub.samplers.TopKSampler(k=5, seed=11))
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0]["token_ids"], runs[1]["token_ids"])
    top_p = [
        model.generate(prompt, 16, keras_hub.samplers.TopPSampler(p=0.9, seed=12))
        for _ in range(2)
    ]
    np.testing.assert_array_equal(top_p[0]["token_ids"], top_p[1]["token_ids"])
    for out in runs + top_p:
        np.testing.assert_array_equal(out["token_ids"][:, :3], prompt)
        assert out["token_ids"].min() >= 0 and out["token_ids"].max() < VOCAB


def test_stop_token_ends_the_padding_mask():
    model = make_model("local+full")
    prompt = tokens(length=4, seed=10)
    greedy = model.generate(prompt, 12)["token_ids"]
    stop = int(greedy[0, 6])
    first = [4 + int(np.argmax(row[4:] == stop)) if (row[4:] == stop).any() else None
             for row in greedy]
    out = model.generate(prompt, 12, stop_token_ids=[stop])
    for row, end in enumerate(first):
        mask = out["padding_mask"][row]
        if end is None:
            assert mask.all()
        else:
            np.testing.assert_array_equal(out["token_ids"][row, : end + 1],
                                          greedy[row, : end + 1])
            assert mask[: end + 1].all() and not mask[end + 1 :].any()


def test_generate_after_a_keras_round_trip(tmp_path):
    model = make_model("local+linear", "rotary")
    path = tmp_path / "lm.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, CausalLanguageModel)
    prompt = tokens(length=3, seed=13)
    np.testing.assert_array_equal(
        loaded.generate(prompt, 9)["token_ids"], model.generate(prompt, 9)["token_ids"]
    )


# ---------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def model():
    return make_model("local+full")


@pytest.mark.parametrize(
    "max_length, match",
    [
        (1.5, "`max_length` must be an integer"),
        (True, "`max_length` must be an integer"),
        (1, "`max_length` must be at least 2"),
        (N + 1, f"learned position table \\({N}"),
        (4, "prompt must be shorter than `max_length`.*prompt_length=4, max_length=4"),
        (3, "prompt must be shorter than `max_length`.*prompt_length=4, max_length=3"),
    ],
)
def test_generate_refuses_a_bad_max_length(model, max_length, match):
    with pytest.raises(ValueError, match=match):
        model.generate(tokens(length=4), max_length)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt_tokens": np.ones((4,), "int32")}, "shape \\(batch, prompt_length\\)"),
        ({"prompt_tokens": np.ones((2, 3), "float32")}, "integer array"),
        ({"prompt_tokens": np.full((2, 3), VOCAB)}, f"in \\[0, {VOCAB}\\)"),
        ({"padding_mask": np.array([[1, 0, 1], [1, 1, 1]], bool)}, "rows \\[0\\]"),
        ({"padding_mask": np.array([[0, 0, 0], [1, 1, 1]], bool)}, "at least one token"),
        ({"padding_mask": np.ones((2, 4), bool)}, "shape of `prompt_tokens`"),
        ({"sampler": "nucleus"}, "sampler='nucleus'"),
        ({"sampler": 3}, "sampler=3"),
        ({"sampler": "Greedy"}, "lowercase"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": []}, "stop_token_ids"),
    ],
)
def test_generate_refuses_bad_inputs(model, kwargs, match):
    kwargs = {"prompt_tokens": tokens(length=3), "max_length": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        model.generate(**kwargs)


def test_generate_refuses_beams_it_cannot_return(model):
    sampler = keras_hub.samplers.BeamSampler(num_beams=2, return_all_beams=True)
    with pytest.raises(ValueError, match="return_all_beams=True"):
        model.generate(tokens(length=3), 8, sampler)


def test_generate_refuses_a_layer_without_a_cache_naming_it_and_why():
    lsh = {"class_name": "LSHAttention", "config": {"bucket_size": 4, "num_hashes": 1}}
    model = make_model([LOCAL, lsh])

    reason = model._attention_sublayers()[1].attention.decode_refusal()
    assert reason and isinstance(model._attention_sublayers()[1].attention, LSHAttention)
    assert model.decode_refusals() == [("sublayer_2_attention", reason)]
    for call in (
        lambda: model.generate(tokens(length=3), 8),
        lambda: model.init_caches(B, N),
    ):
        with pytest.raises(ValueError, match="sublayer_2_attention") as info:
            call()
        assert reason in str(info.value)


def test_generate_refuses_a_keras_layer_without_a_cache():
    mha = {"class_name": "MultiHeadAttention", "config": {"num_heads": 2, "key_dim": 8}}
    model = make_model([mha, LOCAL])
    with pytest.raises(ValueError, match="sublayer_0_attention: MultiHeadAttention has no "
                                         "decoding cache"):
        model.generate(tokens(length=3), 8)


def test_generate_without_keras_hub_says_how_to_install_it(monkeypatch):
    model = make_model("local+full")
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install keras-longattn\[hub\]"):
        model.generate(tokens(length=3), 8, sampler="top_k")
    # Everything but the sampling works without keras-hub.
    caches = model.init_caches(B, N)
    logits, _, _ = model.call_with_cache(tokens(length=3), caches, 0)
    assert tuple(logits.shape) == (B, 3, VOCAB)


def test_generate_follows_set_weights_and_fit():
    """The compiled generate function reads the model's current weights:
    after ``set_weights`` and after ``fit`` it still equals the uncached
    greedy loop (and the tokens changed)."""
    model = make_model("local+full")
    prompt = tokens(length=5, seed=3)
    before = model.generate(prompt, max_length=N)["token_ids"]
    rng = np.random.default_rng(1)
    model.set_weights([w + 0.5 * rng.normal(size=w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    moved = model.generate(prompt, max_length=N)["token_ids"]
    np.testing.assert_array_equal(moved, greedy_reference(model, prompt, N))
    assert not np.array_equal(moved, before)
    data = tokens(length=N + 1, seed=7)
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data[:, :-1], data[:, 1:], epochs=3, verbose=0)
    trained = model.generate(prompt, max_length=N)["token_ids"]
    np.testing.assert_array_equal(trained, greedy_reference(model, prompt, N))
    assert not np.array_equal(trained, moved)
