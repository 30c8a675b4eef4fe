"""The digits figures: class accuracy, and the generic figures in the feature space of the digits classifier.

All distances live in the feature space of :class:`miles.eval.digits.classifier.DigitsClassifier` (its ReLU hidden
layer), and the real reference is the held-out split of :mod:`miles.eval.digits.data`, which neither the teacher
nor the classifier trained on. The distances themselves are :mod:`miles.eval.metrics`'s.

* ``accuracy``: fraction of generated images that the classifier assigns to the class of their prompt.
* ``fd``: Fréchet distance of classifier features (FID with the digits classifier in place of Inception-v3).
* ``precision`` / ``recall``: k-NN manifold estimates, k = 3.
* ``spread_ratio``: within-class feature spread relative to real held-out digits.
"""

import logging
import os
from typing import Any

import numpy as np

from miles.eval.digits.classifier import DigitsClassifier, load_classifier
from miles.eval.digits.data import load_split
from miles.eval.metrics import feature_figures
from miles.utils.misc import stable_hash

__all__ = ["class_accuracy", "evaluate_images", "evaluate_real_baseline", "summary_notes"]

logger = logging.getLogger(__name__)


def class_accuracy(images: Any, labels: Any, *, classifier: DigitsClassifier | None = None) -> float:
    """Fraction of ``images`` that ``classifier`` labels as their intended class.

    Args:
        images: uint8 ``[N, 8, 8]`` / ``[N, 8, 8, 1]`` pixels or float latents ``[N, 1, 8, 8]`` in ``[-1, 1]``.
        labels: int ``[N]`` intended digit (the class of each image's prompt).
        classifier: defaults to :func:`miles.eval.digits.classifier.load_classifier`.

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
    figures = feature_figures(feats, ref_feats, labels=labels, ref_labels=ref_labels, k=k)
    per_class = [float(np.mean(predicted[labels == c] == c)) if np.any(labels == c) else None for c in range(10)]
    result = dict(meta or {})
    result.update(
        name=name,
        seed=int(seed),
        n_samples=int(len(labels)),
        n_reference=int(len(ref_labels)),
        accuracy=float(np.mean(predicted == labels)),
        per_class_accuracy=per_class,
        fd=figures["fd"],
        precision=figures["precision"],
        recall=figures["recall"],
        k=k,
        spread_ratio=figures["spread_ratio"],
        classifier_heldout_accuracy=classifier.heldout_accuracy,
    )
    logger.debug(
        "eval %s: n=%d seed=%d accuracy=%.4f fd=%.4f recall=%.3f spread=%.3f",
        name,
        result["n_samples"],
        result["seed"],
        result["accuracy"],
        result["fd"],
        result["recall"],
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
        ValueError: if a class has fewer train images than requested (``n_samples`` > 1390: digit 8 has 139 train
            images).
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


def summary_notes(results: list[dict]) -> list[str]:
    """How to read a digits summary: the paragraphs :func:`miles.eval.report.write_summary` puts above the table.

    Names the classifier's held-out accuracy and the reference size when every result agrees on them.
    """
    references = sorted({r["n_reference"] for r in results if r.get("n_reference") is not None})
    classifier_acc = sorted({r["classifier_heldout_accuracy"] for r in results if "classifier_heldout_accuracy" in r})
    return [
        "Figures use the features of a digits MLP classifier"
        + (f" (held-out accuracy {100 * classifier_acc[0]:.1f}%)" if len(classifier_acc) == 1 else "")
        + " and compare against the real held-out digits"
        + (f" ({references[0]} images)" if len(references) == 1 else "")
        + ".",
        "accuracy: generated images classified as their prompt's digit. FD: Fréchet distance of classifier features "
        "(Heusel et al. 2017; lower is better, biased upward at small n: compare rows at equal n and against the "
        "real-digits row). precision / recall: k-NN manifold estimates (Kynkäänniemi et al. 2019). spread: "
        "within-class feature spread relative to real digits (1 = real-like variety).",
    ]
