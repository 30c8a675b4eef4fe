"""The digits classifier: held-out accuracy, its joblib cache, features = the hidden layer, latent input."""

import numpy as np
import pytest
import torch

from miles.eval.digits import classifier as classifier_module
from miles.eval.digits.classifier import MIN_HELDOUT_ACCURACY, load_classifier
from miles.eval.digits.metrics import class_accuracy


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
