"""The digits figures on real digits: the generic distances on classifier features, evaluate_images, the real
baseline and the summary notes."""

import json

import numpy as np
import pytest

from miles.eval.digits.metrics import evaluate_images, evaluate_real_baseline, summary_notes
from miles.eval.metrics import frechet_distance, precision_recall, spread_ratio
from miles.eval.report import write_summary


def _noise_images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(n, 8, 8), dtype=np.uint8)


def test_frechet_distance_on_digits(clf, heldout, train):
    held_feats, train_feats = clf.features(heldout[0]), clf.features(train[0])
    real = frechet_distance(held_feats, train_feats)
    noise = frechet_distance(held_feats, clf.features(_noise_images(359, seed=1)))
    assert real < 1.0
    assert noise > 10.0
    assert noise > 20 * real


def test_precision_recall_and_spread(clf, heldout, train):
    held_feats, train_feats = clf.features(heldout[0]), clf.features(train[0])
    precision, recall = precision_recall(held_feats, train_feats, k=3)
    assert precision > 0.85 and recall > 0.85
    assert precision_recall(held_feats, held_feats) == (1.0, 1.0)

    one_image = np.repeat(train[0][:1], 300, axis=0)
    precision, recall = precision_recall(held_feats, clf.features(one_image), k=3)
    assert recall < 0.05  # a single repeated image covers (at most) itself
    assert precision == 1.0  # ... and that image is a real digit

    assert spread_ratio(train_feats, train[1], held_feats, heldout[1]) == pytest.approx(1.0, abs=0.1)
    one_per_class = np.stack([train[0][np.flatnonzero(train[1] == c)[0]] for c in range(10)])
    collapsed = np.repeat(one_per_class, 20, axis=0)
    assert spread_ratio(clf.features(collapsed), np.repeat(np.arange(10), 20), held_feats, heldout[1]) == 0.0
    with pytest.raises(ValueError, match="more than 3 points"):
        precision_recall(held_feats, held_feats[:3])


def test_evaluate_images_real_and_noise(clf, heldout):
    images, labels = heldout
    real = evaluate_images(images, labels, seed=5, name="real-heldout", classifier=clf, meta={"model": "real"})
    assert real["model"] == "real" and real["name"] == "real-heldout"
    assert (real["n_samples"], real["seed"], real["n_reference"], real["k"]) == (359, 5, 359, 3)
    assert real["accuracy"] == pytest.approx(clf.heldout_accuracy)
    assert real["fd"] == pytest.approx(0.0, abs=1e-6)
    assert (real["precision"], real["recall"], real["spread_ratio"]) == (1.0, 1.0, pytest.approx(1.0))
    assert len(real["per_class_accuracy"]) == 10 and min(real["per_class_accuracy"]) > 0.85
    json.dumps(real)

    noise = evaluate_images(_noise_images(100, seed=2), np.arange(100) % 10, seed=2, name="noise", classifier=clf)
    assert noise["accuracy"] < 0.3 and noise["fd"] > 10 * 1.0 and noise["recall"] < 0.05
    with pytest.raises(ValueError, match="100 images but 99 labels"):
        evaluate_images(_noise_images(100, seed=2), np.arange(99) % 10, seed=2, name="bad", classifier=clf)


def test_real_baseline_is_balanced_and_seeded(clf):
    base = evaluate_real_baseline(105, seed=3, classifier=clf)
    assert base["name"] == "real-train" and base["n_samples"] == 105 and base["seed"] == 3
    assert base["accuracy"] > 0.97 and base["fd"] < 3.0 and base["recall"] > 0.5
    assert evaluate_real_baseline(105, seed=3, classifier=clf)["fd"] == base["fd"]
    assert evaluate_real_baseline(105, seed=4, classifier=clf)["fd"] != base["fd"]
    with pytest.raises(ValueError, match="n_samples <="):
        evaluate_real_baseline(5000, seed=3, classifier=clf)


def test_summary_notes_name_the_classifier_and_the_reference(tmp_path):
    rows = [
        {"name": "teacher-28", "n_reference": 359, "classifier_heldout_accuracy": 0.98, "fd": 0.5612},
        {"name": "student-4", "n_reference": 359, "classifier_heldout_accuracy": 0.98, "fd": 0.7},
    ]
    md_path, _ = write_summary(rows, tmp_path / "eval", title="Digits evaluation", notes=summary_notes(rows))
    markdown = open(md_path).read()
    assert markdown.startswith("# Digits evaluation\n\nFigures use the features of a digits MLP classifier")
    assert "held-out accuracy 98.0%" in markdown and "(359 images)" in markdown
    assert "| teacher-28 |" in markdown and "| student-4 |" in markdown
    # Rows that disagree on the classifier or the reference leave those numbers out rather than pick one.
    mixed = summary_notes(rows + [{"name": "x", "n_reference": 100, "classifier_heldout_accuracy": 0.97}])
    assert "held-out accuracy" not in mixed[0] and "images)" not in mixed[0]
