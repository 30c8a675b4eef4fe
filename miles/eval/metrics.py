"""Sample-quality figures on feature arrays the caller provides: Fréchet distance, precision/recall, spread ratio.

The module holds no feature extractor: compute features with whatever network suits the data (the digits
classifier's hidden layer in :mod:`miles.eval.digits.metrics`, Inception-v3 pool features for FID, CLIP image
embeddings, ...) and pass float arrays ``[N, F]``. Generated and reference features must come from the same
extractor.

* ``frechet_distance``: Fréchet distance between Gaussians fitted to generated and real features (Heusel et al.,
  2017, "GANs Trained by a Two Time-Scale Update Rule Converge to a Local Nash Equilibrium", eq. 6; FID when the
  features are Inception-v3's). Lower is better; it grows both when samples are off-manifold and when they lack
  variety.
* ``precision_recall``: k-NN manifold estimates of Kynkäänniemi et al., 2019 ("Improved Precision and Recall Metric
  for Assessing Generative Models"), k = 3 by default. Recall is the fraction of real samples that fall inside the
  generated manifold: low recall means the generator covers few of the real styles (mode collapse).
* ``spread_ratio``: per class, the mean pairwise feature distance among generated samples divided by the same among
  real samples, averaged over classes. 1 means real-like within-class variety; CFG pushes it below 1.
* ``feature_figures``: all of the above in one dict, the part of an evaluation that does not depend on the data.
"""

import logging
import warnings
from typing import Any

import numpy as np
import scipy.linalg
from scipy.spatial.distance import cdist, pdist

__all__ = ["frechet_distance", "precision_recall", "spread_ratio", "feature_figures"]

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


def feature_figures(
    feats: Any, ref_feats: Any, *, labels: Any = None, ref_labels: Any = None, k: int = 3
) -> dict[str, float | int]:
    """Fréchet distance, k-NN precision/recall and (with labels) the spread ratio of generated vs real features.

    Args:
        feats: float ``[N, F]`` features of the generated samples, N > k.
        ref_feats: float ``[M, F]`` features of the real reference samples, M > k, same F.
        labels: int ``[N]`` class of each generated sample (the class it was prompted for), or None.
        ref_labels: int ``[M]`` class of each reference sample; given together with ``labels``.
        k: neighbourhood size of precision/recall.

    Returns:
        ``{"fd", "precision", "recall", "k"}`` plus ``"spread_ratio"`` when labels are given: plain floats (``k`` an
        int), JSON-serialisable.

    Raises:
        ValueError: as :func:`frechet_distance`, :func:`precision_recall` and :func:`spread_ratio`, or when only one
            of ``labels`` / ``ref_labels`` is given.
    """
    if (labels is None) != (ref_labels is None):
        raise ValueError("feature_figures: pass both labels and ref_labels (for the spread ratio) or neither")
    precision, recall = precision_recall(ref_feats, feats, k=k)
    figures: dict[str, float | int] = {
        "fd": frechet_distance(feats, ref_feats),
        "precision": precision,
        "recall": recall,
        "k": k,
    }
    if labels is not None:
        figures["spread_ratio"] = spread_ratio(feats, labels, ref_feats, ref_labels)
    return figures
