"""Classifier, metrics and summary report on real digits (the classifier is trained once per session in a tmp dir)."""

import json

import numpy as np
import pytest
import torch

from miles.eval import classifier as classifier_module
from miles.eval.classifier import MIN_HELDOUT_ACCURACY, load_classifier
from miles.eval.digits_data import load_split
from miles.eval.metrics import (
    class_accuracy,
    evaluate_images,
    evaluate_real_baseline,
    frechet_distance,
    precision_recall,
    spread_ratio,
)
from miles.eval.report import format_summary_table, log_to_wandb, write_summary


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("classifier_cache")


@pytest.fixture(scope="session")
def clf(cache_dir):
    return load_classifier(cache_dir)


@pytest.fixture(scope="session")
def heldout():
    return load_split("heldout")


@pytest.fixture(scope="session")
def train():
    return load_split("train")


def _noise_images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(n, 8, 8), dtype=np.uint8)


# ---------------------------------------------------------------- classifier


def test_classifier_accuracy_and_cache(clf, cache_dir, heldout):
    images, labels = heldout
    assert clf.heldout_accuracy >= MIN_HELDOUT_ACCURACY
    assert class_accuracy(images, labels, classifier=clf) == pytest.approx(clf.heldout_accuracy)
    assert class_accuracy(images, labels, classifier=clf) >= 0.97

    cached = list(cache_dir.glob("digits_mlp_v1_sklearn-*_split-0.joblib"))
    assert len(cached) == 1
    # A fresh process would read the file: clear the in-process memo and compare a reload bit for bit.
    classifier_module._load_cached.cache_clear()
    reloaded = load_classifier(cache_dir)
    assert reloaded is not clf
    assert np.array_equal(reloaded.features(images), clf.features(images))
    assert reloaded.heldout_accuracy == clf.heldout_accuracy


def test_features_are_the_hidden_layer(clf, heldout):
    images, _ = heldout
    feats = clf.features(images[:5])
    assert feats.shape == (5, 128) and feats.dtype == np.float64 and feats.min() >= 0.0
    x = images[:5].reshape(5, 64) / 255.0
    manual = np.maximum(x @ clf.model.coefs_[0] + clf.model.intercepts_[0], 0.0)
    np.testing.assert_allclose(feats, manual, rtol=0, atol=1e-12)
    # The output layer on these features reproduces sklearn's own class probabilities.
    logits = feats @ clf.model.coefs_[1] + clf.model.intercepts_[1]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probs / probs.sum(1, keepdims=True), clf.predict_proba(images[:5]), atol=1e-10)


def test_latent_input_matches_pixels(clf, heldout):
    images, _ = heldout
    latents = torch.from_numpy(images[:20].astype(np.float32)[:, None] / 127.5 - 1.0)  # [20, 1, 8, 8]
    assert np.array_equal(clf.predict(latents), clf.predict(images[:20]))
    assert np.array_equal(clf.features(images[:20, :, :, None]), clf.features(images[:20]))
    with pytest.raises(ValueError, match="single-channel 8x8"):
        clf.predict(np.zeros((2, 16, 16), dtype=np.uint8))


# ---------------------------------------------------------------- Fréchet distance


def test_frechet_distance_reference_math():
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(400, 6)) @ rng.normal(size=(6, 6))
    assert frechet_distance(feats, feats) == pytest.approx(0.0, abs=1e-8)
    # Equal covariances (a pure shift): the trace terms cancel and d² = ‖Δμ‖² exactly.
    delta = np.array([0.5, -1.0, 2.0, 0.0, 0.25, 3.0])
    assert frechet_distance(feats, feats + delta) == pytest.approx(float(delta @ delta), rel=1e-7)
    # One dimension: d² = (μ_a − μ_b)² + (s_a − s_b)² with unbiased sample standard deviations.
    a, b = rng.normal(1.0, 2.0, size=(300, 1)), rng.normal(-0.5, 0.5, size=(200, 1))
    expected = (a.mean() - b.mean()) ** 2 + (a.std(ddof=1) - b.std(ddof=1)) ** 2
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)
    # Exactly diagonal sample covariances (orthonormal zero-mean columns, scaled): the trace term is Σ (s_a − s_b)².
    std_a, std_b = np.array([1.0, 2.0, 3.0]), np.array([3.0, 1.0, 0.5])
    mu_a, mu_b = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.0])
    # QR of column-centred data: the orthonormal columns span a space orthogonal to the ones vector, so mean zero.
    raw_a, raw_b = rng.normal(size=(250, 3)), rng.normal(size=(150, 3))
    basis_a, basis_b = np.linalg.qr(raw_a - raw_a.mean(0))[0], np.linalg.qr(raw_b - raw_b.mean(0))[0]
    c = mu_a + basis_a * std_a * np.sqrt(249)
    d = mu_b + basis_b * std_b * np.sqrt(149)
    np.testing.assert_allclose(np.cov(c, rowvar=False), np.diag(std_a**2), atol=1e-10)
    expected = float((mu_a - mu_b) @ (mu_a - mu_b) + np.sum((std_a - std_b) ** 2))
    assert frechet_distance(c, d) == pytest.approx(expected, rel=1e-8)
    with pytest.raises(ValueError, match="feature widths differ"):
        frechet_distance(feats, feats[:, :3])
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance(feats[:1], feats)


def test_frechet_distance_on_digits(clf, heldout, train):
    held_feats, train_feats = clf.features(heldout[0]), clf.features(train[0])
    real = frechet_distance(held_feats, train_feats)
    noise = frechet_distance(held_feats, clf.features(_noise_images(359, seed=1)))
    assert real < 1.0
    assert noise > 10.0
    assert noise > 20 * real


# ---------------------------------------------------------------- diversity


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


def test_knn_recall_small_example():
    # Real points on a line at 0..9 (3rd-neighbour radius 3 inside, 3 at the ends); generated: only 0, 1, 2, 3.
    real = np.arange(10, dtype=np.float64)[:, None]
    fake = np.array([0.0, 1.0, 2.0, 3.0])[:, None]
    precision, recall = precision_recall(real, fake, k=3)
    assert precision == 1.0
    # Generated radii: 3, 2, 2, 3 → balls cover [-3, 6]; real points 0..6 are inside.
    assert recall == pytest.approx(7 / 10)


# ---------------------------------------------------------------- evaluate_images + report


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


def test_write_summary(tmp_path):
    results = [
        {
            "name": "teacher-28",
            "model": "teacher",
            "sampler": "euler",
            "steps": 28,
            "guidance_scale": 3.0,
            "n_samples": 500,
            "seed": 7,
            "n_reference": 359,
            "accuracy": 0.987,
            "fd": 0.5612,
            "precision": 0.9,
            "recall": np.float64(0.75),
            "spread_ratio": 0.83,
            "classifier_heldout_accuracy": 0.98,
            "per_class_accuracy": [1.0] * 9 + [None],
        },
        {
            "name": "student-4",
            "model": "student",
            "sampler": "dmd2",
            "steps": 4,
            "guidance_scale": 1,
            "n_samples": 500,
            "seed": 7,
            "n_reference": 359,
            "accuracy": 0.95,
            "fd": float("nan"),
            "recall": 0.5,
            "spread_ratio": 1.02,
            "classifier_heldout_accuracy": 0.98,
        },
    ]
    md_path, json_path = write_summary(results, tmp_path / "eval")
    markdown = open(md_path).read()
    assert (
        "| name | model | sampler | steps | CFG | n | seed | accuracy | FD ↓ | precision | recall | spread |"
        in markdown
    )
    assert "| teacher-28 | teacher | euler | 28 | 3 | 500 | 7 | 98.7% | 0.561 | 0.900 | 0.750 | 0.83 |" in markdown
    assert "| student-4 | student | dmd2 | 4 | 1 | 500 | 7 | 95.0% | nan | – | 0.500 | 1.02 |" in markdown
    assert "held-out accuracy 98.0%" in markdown and "(359 images)" in markdown
    data = json.loads(open(json_path).read())
    assert data["results"][0]["recall"] == 0.75 and data["results"][1]["fd"] is None
    assert format_summary_table([]).count("\n") == 1


def test_log_to_wandb_without_run_is_a_no_op():
    import wandb

    assert wandb.run is None
    assert log_to_wandb([{"name": "x", "fd": 1.0}], {"grid": np.zeros((4, 4), dtype=np.uint8)}, step=3) is False


def test_log_to_wandb_offline_run(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="miles-test")
    try:
        grid = np.zeros((20, 30), dtype=np.uint8)
        result = {"name": "student-4", "accuracy": 0.9, "fd": 0.5, "recall": 0.7, "n_samples": 10, "seed": 1}
        assert log_to_wandb([result], {"grid-student-4": grid}, step=2) is True
    finally:
        run.finish()
    media = list(tmp_path.glob("wandb/offline-run-*/files/media/images/eval_media/grid-student-4_*.png"))
    assert len(media) == 1
