"""The digits split, prompts and JSONL writer (real sklearn data, no mocks)."""

import json

import numpy as np
import pytest

from miles.eval.digits.data import DIGIT_PROMPTS, load_split, prompt_for_label, split_indices, write_digits_jsonl


def test_prompts():
    assert len(DIGIT_PROMPTS) == 10
    assert prompt_for_label(0) == "a handwritten digit zero"
    assert prompt_for_label(np.int64(7)) == "a handwritten digit seven"
    assert prompt_for_label(9) == "a handwritten digit nine"
    for bad in (-1, 10, 2.5, True):
        with pytest.raises(ValueError, match="0..9"):
            prompt_for_label(bad)


def test_split_is_fixed_stratified_and_disjoint():
    train_idx, heldout_idx = split_indices("train"), split_indices("heldout")
    assert (len(train_idx), len(heldout_idx)) == (1438, 359)
    assert np.intersect1d(train_idx, heldout_idx).size == 0
    assert np.array_equal(np.sort(np.concatenate([train_idx, heldout_idx])), np.arange(1797))
    assert np.all(np.diff(heldout_idx) > 0)
    _, heldout_labels = load_split("heldout")
    # round(0.2 · class size) per class: class sizes are 178 182 177 183 181 182 181 179 174 180.
    assert np.bincount(heldout_labels).tolist() == [36, 36, 35, 37, 36, 36, 36, 36, 35, 36]
    # The split is a pure function of the seed: a different seed moves images, the same seed never does.
    assert not np.array_equal(split_indices("heldout", seed=1), heldout_idx)
    assert np.array_equal(split_indices("heldout", seed=0), heldout_idx)
    with pytest.raises(ValueError, match="unknown digits split 'test'"):
        load_split("test")


def test_pixels_are_rescaled_digits():
    from sklearn.datasets import load_digits

    images, labels = load_split("train")
    assert images.dtype == np.uint8 and images.shape == (1438, 8, 8)
    assert labels.dtype == np.int64 and labels.shape == (1438,)
    raw = load_digits()
    index = int(split_indices("train")[5])
    # uint8 = floor(v · 255/16 + 0.5): 0 → 0, 8 → 128, 16 → 255.
    expected = np.floor(raw.images[index] * 255 / 16 + 0.5).astype(np.uint8)
    assert np.array_equal(images[5], expected)
    assert labels[5] == raw.target[index]
    assert set(np.unique(images)) <= {int(np.floor(v * 255 / 16 + 0.5)) for v in range(17)}
    assert images.max() == 255 and images.min() == 0
    original = int(images[0, 0, 0])
    images[0, 0, 0] = 77  # not one of the 17 pixel levels; must not leak into the cached dataset
    assert load_split("train")[0][0, 0, 0] == original


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_write_digits_jsonl_records_and_reuse(tmp_path, caplog):
    out = tmp_path / "digits"
    paths = write_digits_jsonl(out, prompt_repeats=3)
    assert set(paths) == {"train", "heldout", "prompts", "eval_prompts", "manifest"}

    train = _read_jsonl(paths["train"])
    images, labels = load_split("train")
    assert len(train) == 1438
    assert train[5] == {"prompt": prompt_for_label(labels[5]), "label": int(labels[5]), "image": images[5].tolist()}
    heldout = _read_jsonl(paths["heldout"])
    assert len(heldout) == 359 and np.array_equal(np.array([r["image"] for r in heldout]), load_split("heldout")[0])

    prompts = _read_jsonl(paths["prompts"])
    assert len(prompts) == 30 and all(set(r) == {"prompt", "label"} for r in prompts)
    assert sorted(r["label"] for r in prompts) == sorted(list(range(10)) * 3)
    assert all(r["prompt"] == prompt_for_label(r["label"]) for r in prompts)
    assert [r["label"] for r in prompts] != sorted(r["label"] for r in prompts)  # shuffled ...
    assert _read_jsonl(write_digits_jsonl(tmp_path / "again", prompt_repeats=3)["prompts"]) == prompts  # ... fixed

    eval_prompts = _read_jsonl(paths["eval_prompts"])
    assert [r["label"] for r in eval_prompts] == [label for label in range(10) for _ in range(10)]
    assert all(r["prompt"] == prompt_for_label(r["label"]) for r in eval_prompts)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"train": 1438, "heldout": 359, "prompts": 30, "eval_prompts": 100}

    # Complete output is reused untouched; a truncated file or different settings trigger a rewrite.
    mtime = (out / "train.jsonl").stat().st_mtime_ns
    with caplog.at_level("INFO", logger="miles.eval.digits.data"):
        write_digits_jsonl(out, prompt_repeats=3)
    assert "reusing" in caplog.text and (out / "train.jsonl").stat().st_mtime_ns == mtime
    lines = (out / "heldout.jsonl").read_text().splitlines(keepends=True)
    (out / "heldout.jsonl").write_text("".join(lines[:10]))
    write_digits_jsonl(out, prompt_repeats=3)
    assert len(_read_jsonl(out / "heldout.jsonl")) == 359
    write_digits_jsonl(out, prompt_repeats=5)
    assert len(_read_jsonl(out / "prompts.jsonl")) == 50
    with pytest.raises(ValueError, match="prompt_repeats=0"):
        write_digits_jsonl(out, prompt_repeats=0)


def test_cli_writes_files(tmp_path):
    from miles.eval.digits.data import main

    main([str(tmp_path), "--prompt-repeats", "2"])
    assert len(_read_jsonl(tmp_path / "prompts.jsonl")) == 20
