"""Sample-quality figures for generated digits: class accuracy, Fréchet distance and diversity against real digits.

All distances live in the feature space of :class:`miles.eval.classifier.DigitsClassifier` (its ReLU hidden layer),
and the real reference is the held-out split of :mod:`miles.eval.digits_data`, which neither the teacher nor the
classifier trained on.

* ``accuracy``: fraction of generated images that the classifier assigns to the class of their prompt.
* ``fd``: Fréchet distance between Gaussians fitted to generated and real features (Heusel et al., 2017, "GANs
  Trained by a Two Time-Scale Update Rule Converge to a Local Nash Equilibrium", eq. 6 — FID with the digits
  classifier in place of Inception-v3). Lower is better; it grows both when samples are off-manifold and when they
  lack variety.
* ``precision`` / ``recall``: k-NN manifold estimates of Kynkäänniemi et al., 2019 ("Improved Precision and Recall
  Metric for Assessing Generative Models"), k = 3. Recall is the fraction of real digits that fall inside the
  generated manifold: low recall means the generator covers few of the real styles (mode collapse).
* ``spread_ratio``: per class, the mean pairwise feature distance among generated images divided by the same among
  real held-out images, averaged over classes. 1 means real-like within-class variety; CFG pushes it below 1.
"""

import logging
import os
import warnings
from typing import Any

import numpy as np
import scipy.linalg
from scipy.spatial.distance import cdist, pdist

from miles.eval.classifier import DigitsClassifier, load_classifier
from miles.eval.digits_data import load_split
from miles.utils.misc import stable_hash

__all__ = [
    "frechet_distance",
    "class_accuracy",
    "precision_recall",
    "spread_ratio",
    "evaluate_images",
    "evaluate_real_baseline",
]

logger = logging.getLogger(__name__)


def _as_features(feats: Any, name: str) -> np.ndarray:
    array = np.asarray(feats, dtype=np.float64)
    if array.ndim != 2 or len(array) < 2:
        raise ValueError(f"{name} must be a feature matrix [N, F] with N >= 2, got shape {list(array.shape)}")
    return array


def frechet_distance(feats_a: Any, feats_b: Any, *, eps: float = 1e-6) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (Heusel et al., 2017, eq. 6).

    ``d² = ‖μ_a − μ_b‖² + Tr(Σ_a + Σ_b − 2·(Σ_a Σ_b)^{1/2})`` with sample means and unbiased sample covariances
    (``ddof = 1``). The matrix square root is ``scipy.linalg.sqrtm``; its real part is used because rounding can
    leave tiny imaginary parts. When the product is singular enough that ``sqrtm`` returns non-finite values,
    ``eps·I`` is added to both covariances before retrying (the usual FID-implementation fallback).

    Args:
        feats_a: float ``[N_a, F]`` features, N_a ≥ 2.
        feats_b: float ``[N_b, F]`` features, N_b ≥ 2, same F.
        eps: diagonal offset of the fallback.

    Returns:
        the squared Fréchet distance (``float`` ≥ 0; rounding below zero is clamped), in squared feature units.

    Raises:
        ValueError: if either input is not 2-D with at least 2 rows, or the feature widths differ.
    """
    a = _as_features(feats_a, "feats_a")
    b = _as_features(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature widths differ: feats_a has {a.shape[1]}, feats_b has {b.shape[1]}")
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a = np.atleast_2d(np.cov(a, rowvar=False))
    cov_b = np.atleast_2d(np.cov(b, rowvar=False))
    with warnings.catch_warnings():
        # ReLU units that never fire make the covariances singular and sqrtm warns on every call; on the digits
        # features its trace still agrees with an eigendecomposition of Σ_a^{1/2} Σ_b Σ_a^{1/2} to ~1e-7, and
        # non-finite results are caught below.
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        covmean = scipy.linalg.sqrtm(cov_a @ cov_b)
    if not np.all(np.isfinite(covmean)):
        logger.warning("frechet_distance: singular covariance product; adding %g to the diagonals", eps)
        offset = eps * np.eye(len(cov_a))
        covmean = scipy.linalg.sqrtm((cov_a + offset) @ (cov_b + offset))
    covmean = np.real(covmean)
    diff = mu_a - mu_b
    distance = float(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(covmean))
    return max(distance, 0.0)


def class_accuracy(images: Any, labels: Any, *, classifier: DigitsClassifier | None = None) -> float:
    """Fraction of ``images`` that ``classifier`` labels as their intended class.

    Args:
        images: uint8 ``[N, 8, 8]`` / ``[N, 8, 8, 1]`` pixels or float latents ``[N, 1, 8, 8]`` in ``[-1, 1]``.
        labels: int ``[N]`` intended digit (the class of each image's prompt).
        classifier: defaults to :func:`miles.eval.classifier.load_classifier`.

    Returns:
        accuracy in ``[0, 1]``.

    Raises:
        ValueError: if the number of labels differs from the number of images.
    """
    classifier = classifier or load_classifier()
    labels = np.asarray(labels, dtype=np.int64)
    predicted = classifier.predict(images)
    if len(predicted) != len(labels):
        raise ValueError(f"got {len(predicted)} images but {len(labels)} labels")
    return float(np.mean(predicted == labels))


def _knn_radii(feats: np.ndarray, k: int) -> np.ndarray:
    # Column 0 of the sorted distances is each point's distance to itself, so the k-th neighbour is column k.
    distances = cdist(feats, feats)
    return np.partition(distances, k, axis=1)[:, k]


def precision_recall(real_feats: Any, fake_feats: Any, *, k: int = 3) -> tuple[float, float]:
    """k-NN precision and recall of generated features against real ones (Kynkäänniemi et al., 2019, eqs. 1–3).

    Each set's manifold is the union of balls centred on its points with radius the distance to the point's k-th
    nearest neighbour within the same set. Precision = fraction of generated points inside the real manifold;
    recall = fraction of real points inside the generated manifold. Euclidean distance, ball boundaries included.

    Args:
        real_feats: float ``[N_r, F]``, N_r > k.
        fake_feats: float ``[N_g, F]``, N_g > k.
        k: neighbourhood size (the paper uses 3).

    Returns:
        ``(precision, recall)``, each in ``[0, 1]``.

    Raises:
        ValueError: if a set has at most ``k`` points or the widths differ.
    """
    real = _as_features(real_feats, "real_feats")
    fake = _as_features(fake_feats, "fake_feats")
    if real.shape[1] != fake.shape[1]:
        raise ValueError(f"feature widths differ: real has {real.shape[1]}, generated has {fake.shape[1]}")
    if min(len(real), len(fake)) <= k:
        raise ValueError(
            f"precision/recall with k={k} needs more than {k} points per set; got {len(real)} real, "
            f"{len(fake)} generated"
        )
    real_radii = _knn_radii(real, k)
    fake_radii = _knn_radii(fake, k)
    cross = cdist(fake, real)  # [N_g, N_r]
    precision = float(np.mean(np.any(cross <= real_radii[None, :], axis=1)))
    recall = float(np.mean(np.any(cross.T <= fake_radii[None, :], axis=1)))
    return precision, recall


def spread_ratio(feats: Any, labels: Any, ref_feats: Any, ref_labels: Any) -> float:
    """Within-class spread of generated features relative to real ones, averaged over classes.

    For each class c with at least two generated and two reference images:
    ``r_c = mean pairwise ‖f_i − f_j‖ over generated images of c / the same over reference images of c``.
    Returns the mean of ``r_c`` over those classes (1 = real-like variety, 0 = one image per class repeated).

    Args:
        feats: float ``[N, F]`` generated features; labels: int ``[N]`` their intended classes.
        ref_feats: float ``[M, F]`` real features; ref_labels: int ``[M]``.

    Raises:
        ValueError: if lengths disagree, or no class has two images in both sets.
    """
    feats = _as_features(feats, "feats")
    ref_feats = _as_features(ref_feats, "ref_feats")
    labels = np.asarray(labels, dtype=np.int64)
    ref_labels = np.asarray(ref_labels, dtype=np.int64)
    if len(feats) != len(labels) or len(ref_feats) != len(ref_labels):
        raise ValueError(
            f"spread_ratio: {len(feats)} features vs {len(labels)} labels, "
            f"{len(ref_feats)} reference features vs {len(ref_labels)} reference labels"
        )
    ratios = []
    for label in np.unique(labels):
        gen = feats[labels == label]
        ref = ref_feats[ref_labels == label]
        if len(gen) < 2 or len(ref) < 2:
            continue
        ratios.append(pdist(gen).mean() / pdist(ref).mean())
    if not ratios:
        raise ValueError("spread_ratio needs at least two generated and two reference images of some class")
    return float(np.mean(ratios))


def evaluate_images(
    images: Any,
    labels: Any,
    *,
    seed: int,
    name: str,
    classifier: DigitsClassifier | None = None,
    cache_dir: str | os.PathLike | None = None,
    k: int = 3,
    meta: dict | None = None,
) -> dict:
    """All figures for one set of generated digits, against the real held-out split.

    Args:
        images: generated images, uint8 ``[N, 8, 8]`` / ``[N, 8, 8, 1]`` pixels 0..255 or float latents
            ``[N, 1, 8, 8]`` in ``[-1, 1]`` (numpy or torch).
        labels: int ``[N]``, the digit each image was prompted for.
        seed: the sampling seed that produced ``images`` (reported, not used).
        name: row name, e.g. ``"student-4step-cfg3"``.
        classifier: defaults to ``load_classifier(cache_dir)``.
        cache_dir: classifier cache directory when ``classifier`` is None.
        k: neighbourhood size of precision/recall.
        meta: extra fields copied into the result first (e.g. ``{"model": "student", "sampler": "dmd2",
            "steps": 4, "guidance_scale": 3.0}``); computed figures take precedence on a key clash.

    Returns:
        a JSON-serialisable dict with ``name``, ``seed``, ``n_samples`` (N), ``n_reference`` (held-out images),
        ``accuracy``, ``per_class_accuracy`` (10 floats, None for classes without samples), ``fd``, ``precision``,
        ``recall``, ``k``, ``spread_ratio`` and ``classifier_heldout_accuracy``, plus ``meta``'s fields.

    Raises:
        ValueError: if the label count differs from the image count or there are at most ``k`` images.
    """
    classifier = classifier or load_classifier(cache_dir)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    feats = classifier.features(images)
    if len(feats) != len(labels):
        raise ValueError(f"evaluate_images({name!r}): got {len(feats)} images but {len(labels)} labels")
    predicted = classifier.predict(images)
    ref_images, ref_labels = load_split("heldout", classifier.split_seed)
    ref_feats = classifier.features(ref_images)
    precision, recall = precision_recall(ref_feats, feats, k=k)
    per_class = [float(np.mean(predicted[labels == c] == c)) if np.any(labels == c) else None for c in range(10)]
    result = dict(meta or {})
    result.update(
        name=name,
        seed=int(seed),
        n_samples=int(len(labels)),
        n_reference=int(len(ref_labels)),
        accuracy=float(np.mean(predicted == labels)),
        per_class_accuracy=per_class,
        fd=frechet_distance(feats, ref_feats),
        precision=precision,
        recall=recall,
        k=k,
        spread_ratio=spread_ratio(feats, labels, ref_feats, ref_labels),
        classifier_heldout_accuracy=classifier.heldout_accuracy,
    )
    logger.info(
        "eval %s: n=%d seed=%d accuracy=%.4f fd=%.4f recall=%.3f spread=%.3f",
        name,
        result["n_samples"],
        result["seed"],
        result["accuracy"],
        result["fd"],
        recall,
        result["spread_ratio"],
    )
    return result


def evaluate_real_baseline(
    n_samples: int,
    *,
    seed: int,
    classifier: DigitsClassifier | None = None,
    cache_dir: str | os.PathLike | None = None,
    k: int = 3,
) -> dict:
    """The same figures for ``n_samples`` *real* train-split digits: the floor a perfect generator would reach.

    FD, precision and recall are biased by sample size (two disjoint halves of the held-out split are ~1.6 apart in
    FD, the whole train split is ~0.4 from it), so generated figures should be read beside real ones at the same N.
    The images are drawn class-balanced like prompt-conditioned samples: ``n_samples // 10`` per class plus one more
    for the first ``n_samples % 10`` classes, without replacement, with
    ``numpy.random.default_rng(stable_hash("real_baseline", seed, label))``.

    Returns:
        :func:`evaluate_images`'s dict with ``name="real-train"`` and meta ``{"model": "real", "sampler": "-"}``.

    Raises:
        ValueError: if a class has fewer train images than requested (``n_samples`` > 1390: digit 8 has 139 train images).
    """
    classifier = classifier or load_classifier(cache_dir)
    train_images, train_labels = load_split("train", classifier.split_seed)
    chosen = []
    for label in range(10):
        count = n_samples // 10 + (1 if label < n_samples % 10 else 0)
        members = np.flatnonzero(train_labels == label)
        if count > len(members):
            raise ValueError(
                f"real baseline: n_samples={n_samples} asks for {count} train images of digit {label}, "
                f"only {len(members)} exist; use n_samples <= {10 * min(np.bincount(train_labels))}"
            )
        rng = np.random.default_rng(stable_hash("real_baseline", seed, label))
        chosen.append(np.sort(rng.choice(members, size=count, replace=False)))
    indices = np.concatenate(chosen)
    return evaluate_images(
        train_images[indices],
        train_labels[indices],
        seed=seed,
        name="real-train",
        classifier=classifier,
        k=k,
        meta={"model": "real", "sampler": "-"},
    )
