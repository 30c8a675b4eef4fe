"""Fréchet distance, k-NN precision/recall, spread ratio and feature_figures on synthetic features."""

import numpy as np
import pytest

from miles.eval.metrics import feature_figures, frechet_distance, precision_recall, spread_ratio


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


def test_knn_recall_small_example():
    # Real points on a line at 0..9 (3rd-neighbour radius 3 inside, 3 at the ends); generated: only 0, 1, 2, 3.
    real = np.arange(10, dtype=np.float64)[:, None]
    fake = np.array([0.0, 1.0, 2.0, 3.0])[:, None]
    precision, recall = precision_recall(real, fake, k=3)
    assert precision == 1.0
    # Generated radii: 3, 2, 2, 3 → balls cover [-3, 6]; real points 0..6 are inside.
    assert recall == pytest.approx(7 / 10)


def test_spread_ratio_small_example():
    # Class 0: generated at 0 and 2 (mean pairwise distance 2), real at 0 and 1 (1): ratio 2.
    # Class 1: generated at 0 and 1 (1), real at 0 and 4 (4): ratio 0.25. Class 2 has one generated point: skipped.
    feats = np.array([0.0, 2.0, 0.0, 1.0, 5.0])[:, None]
    labels = np.array([0, 0, 1, 1, 2])
    ref = np.array([0.0, 1.0, 0.0, 4.0, 0.0, 3.0])[:, None]
    ref_labels = np.array([0, 0, 1, 1, 2, 2])
    assert spread_ratio(feats, labels, ref, ref_labels) == pytest.approx((2.0 + 0.25) / 2)
    with pytest.raises(ValueError, match="at least two generated and two reference"):
        spread_ratio(feats[:3], [0, 1, 2], ref, ref_labels)
    with pytest.raises(ValueError, match="5 features vs 4 labels"):
        spread_ratio(feats, labels[:4], ref, ref_labels)


def test_feature_figures_are_the_individual_figures():
    rng = np.random.default_rng(3)
    real = rng.normal(size=(60, 4))
    fake = rng.normal(0.3, 0.8, size=(40, 4))
    labels, ref_labels = np.arange(40) % 4, np.arange(60) % 4
    figures = feature_figures(fake, real, labels=labels, ref_labels=ref_labels, k=5)
    precision, recall = precision_recall(real, fake, k=5)
    assert figures == {
        "fd": frechet_distance(fake, real),
        "precision": precision,
        "recall": recall,
        "k": 5,
        "spread_ratio": spread_ratio(fake, labels, real, ref_labels),
    }
    assert figures["fd"] > 0.1 and 0 < figures["spread_ratio"] < 1  # shifted and narrower than the reference
    assert set(feature_figures(fake, real)) == {"fd", "precision", "recall", "k"}  # no labels: no spread ratio
    with pytest.raises(ValueError, match="both labels and ref_labels"):
        feature_figures(fake, real, labels=labels)
