"""Calibration data (normpass/calibration.py) and the sentence sets of models/text.py, without a model.

* Sentences tokenized one by one are split between the roles sentence by sentence, then batched
  padded to the longest of their batch (shortest first): every sentence lands in exactly one role,
  unchanged.
* `.txt` / `.jsonl` reading, the checks (non-finite values, indices outside their table, too few
  samples) and their messages.
* Sentence sets: deterministic for a seed, the deciding and measuring sentences disjoint.
"""

from __future__ import annotations

import numpy as np
import pytest

from normpass.calibration import InputSpec, check_indices, load_batches, read_texts, split_batches
from normpass.errors import InputError
from normpass.models import text

SPEC = InputSpec({"input_ids": (np.dtype(np.int64), 2), "attention_mask": (np.dtype(np.int64), 2)}, {"input_ids": 50})


def _sentence(length: int, token: int) -> dict:
    return {"input_ids": np.full((1, length), token, np.int64), "attention_mask": np.ones((1, length), np.int64)}


def test_sentences_of_different_lengths_are_split_one_by_one_then_padded_per_batch():
    sentences = [_sentence(3 + i % 7, i) for i in range(30)]
    parts = split_batches(sentences, (0.4, 0.2, 0.2, 0.2), seed=3, batch_size=4)
    seen = []
    for part in parts:
        for batch in part:
            lengths = batch["attention_mask"].sum(1)
            assert batch["input_ids"].shape[1] == lengths.max() and list(lengths) == sorted(lengths)
            for row, length in zip(batch["input_ids"], lengths, strict=True):
                assert np.all(row[:length] == row[0]) and np.all(row[length:] == 0)  # padded with zeros
                seen.append(int(row[0]))
    assert sorted(seen) == list(range(30))
    assert [sum(b["input_ids"].shape[0] for b in part) for part in parts] == [12, 6, 6, 6]
    again = split_batches(sentences, (0.4, 0.2, 0.2, 0.2), seed=3, batch_size=4)
    assert all(
        np.array_equal(a["input_ids"], b["input_ids"])
        for p, q in zip(parts, again, strict=True)
        for a, b in zip(p, q, strict=True)
    )


def test_text_files_are_read_as_sentences(tmp_path):
    txt = tmp_path / "s.txt"
    txt.write_text("# a comment\nFirst sentence.\n\n  Second one.  \n")
    assert read_texts(txt) == ["First sentence.", "Second one."]
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text('{"text": "One."}\n\n{"text": "Two.", "label": 3}\n')
    assert read_texts(jsonl) == ["One.", "Two."]
    jsonl.write_text('{"text": "One."}\n{"body": "no text"}\n')
    with pytest.raises(InputError, match=r's\.jsonl:2: no "text" field'):
        read_texts(jsonl)


def test_bad_arrays_are_named():
    ids = np.ones((10, 4), np.int64)
    values = np.zeros((10, 3), np.float32)
    values[2, 1], values[5, 0] = np.nan, np.inf
    with pytest.raises(InputError, match=r"calibration data: input x has 2 non-finite values \(NaN or ±inf\)"):
        load_batches({"x": values}, InputSpec({"x": (np.dtype(np.float32), 2)}))
    with pytest.raises(InputError, match="index 50, outside the table of 50 rows"):
        check_indices([{"input_ids": ids * 50, "attention_mask": ids}], SPEC.index_bounds, "calibration data")
    with pytest.raises(InputError, match="4 samples; the pass needs at least 8"):
        load_batches({"input_ids": ids[:4], "attention_mask": ids[:4]}, SPEC)
    assert len(load_batches({"input_ids": ids, "attention_mask": ids}, SPEC, batch_size=4)) == 3


def test_sentence_sets_are_deterministic_and_keep_deciding_and_measuring_apart():
    first = text.split("repository", decide=60, measure=100, seed=5)
    again = text.split("repository", decide=60, measure=100, seed=5)
    other = text.split("repository", decide=60, measure=100, seed=6)
    assert first == again and first.decide != other.decide
    assert len(first.decide) == 60 and len(first.measure) == 100 and not set(first.decide) & set(first.measure)
    across = text.split("repository", decide=40, measure=200, seed=1, measure_source="docstrings")
    assert not set(across.decide) & set(across.measure) and across.source == "repository/docstrings"
    docstrings = text.sentences("docstrings")
    assert len(docstrings) > 1000 and all(40 <= len(s) <= 220 for s in docstrings)
    with pytest.raises(ValueError, match="fewer than"):
        text.split("repository", decide=200, measure=100)
