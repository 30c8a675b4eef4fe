"""A small digits classifier whose hidden layer is the feature space of the evaluation metrics.

The classifier is a scikit-learn ``MLPClassifier`` (one ReLU hidden layer of 128 units, L2 penalty 1e-2, Adam,
fixed ``random_state``) trained on the *train* split of :mod:`miles.eval.digits.data`, with pixels scaled to
``[0, 1]``. It reaches about 98% accuracy on the held-out split; training refuses to return a model below
``MIN_HELDOUT_ACCURACY``. Training takes a couple of seconds on one CPU core; the trained model is cached with joblib
in ``cache_dir`` (default ``$MILES_CACHE_DIR`` or ``~/.cache/miles/eval``) under a name that carries the
scikit-learn version, the split seed and this module's format version, so an upgrade retrains instead of unpickling
an incompatible model.

Features are the hidden-layer activations ``relu(x · W₁ + b₁)`` computed from ``coefs_`` / ``intercepts_``: the
classifier's own representation of a digit, as Inception-v3 pool features are for FID (Heusel et al., 2017).
"""

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import joblib
import numpy as np
import sklearn
from sklearn.neural_network import MLPClassifier
from threadpoolctl import threadpool_limits

from miles.eval.digits.data import SPLIT_SEED, load_split
from miles.eval.images import to_uint8_images
from miles.utils.misc import stable_hash

__all__ = [
    "MIN_HELDOUT_ACCURACY",
    "DigitsClassifier",
    "default_cache_dir",
    "prepare_images",
    "train_classifier",
    "load_classifier",
    "features",
    "predict",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

MIN_HELDOUT_ACCURACY = 0.97
_FORMAT_VERSION = 1
_HIDDEN_UNITS = 128
_IMAGE_SIZE = 8


def default_cache_dir() -> Path:
    """``$MILES_CACHE_DIR/eval`` when the variable is set, else ``~/.cache/miles/eval``."""
    root = os.environ.get("MILES_CACHE_DIR")
    return Path(root) / "eval" if root else Path.home() / ".cache" / "miles" / "eval"


def prepare_images(images: Any) -> np.ndarray:
    """Images as the classifier's input: float64 ``[N, 64]`` pixels in ``[0, 1]``, row-major.

    Args:
        images: uint8 ``[N, 8, 8]`` or ``[N, 8, 8, 1]`` pixels 0..255, or float latents ``[N, 1, 8, 8]`` in
            ``[-1, 1]`` (converted by :func:`miles.eval.images.to_uint8_images`, i.e. quantised to uint8 the
            way a saved PNG would be). numpy arrays or torch tensors.

    Raises:
        ValueError: if the images are not single-channel 8×8.
    """
    pixels = to_uint8_images(images)
    if pixels.ndim == 4 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if pixels.ndim != 3 or pixels.shape[1:] != (_IMAGE_SIZE, _IMAGE_SIZE):
        raise ValueError(
            f"the digits classifier takes single-channel 8x8 images [N, 8, 8]; got pixel shape {list(pixels.shape)}"
        )
    return pixels.reshape(len(pixels), -1).astype(np.float64) / 255.0


class DigitsClassifier:
    """A trained digits MLP plus what it was trained on.

    Attributes:
        model: the fitted ``sklearn.neural_network.MLPClassifier``.
        split_seed: seed of the digits split it was trained on.
        heldout_accuracy: accuracy on that split's held-out images, in ``[0, 1]``.
        sklearn_version: scikit-learn version that trained it.
    """

    def __init__(self, model: MLPClassifier, *, split_seed: int, heldout_accuracy: float, sklearn_version: str):
        self.model = model
        self.split_seed = split_seed
        self.heldout_accuracy = heldout_accuracy
        self.sklearn_version = sklearn_version

    @property
    def num_features(self) -> int:
        """F, the width of :meth:`features` (the hidden layer size)."""
        return int(self.model.coefs_[0].shape[1])

    def features(self, images: Any) -> np.ndarray:
        """Hidden-layer activations ``relu(x · W₁ + b₁)``, float64 ``[N, F]`` (x = pixels in [0, 1], F = 128).

        Args:
            images: see :func:`prepare_images`.
        """
        x = prepare_images(images)
        return np.maximum(x @ self.model.coefs_[0] + self.model.intercepts_[0], 0.0)

    def predict_proba(self, images: Any) -> np.ndarray:
        """Class probabilities, float64 ``[N, 10]`` (columns are digits 0..9)."""
        return self.model.predict_proba(prepare_images(images))

    def predict(self, images: Any) -> np.ndarray:
        """Predicted digit labels, int64 ``[N]``."""
        return self.model.predict(prepare_images(images)).astype(np.int64)


def train_classifier(split_seed: int = SPLIT_SEED) -> DigitsClassifier:
    """Train the classifier on the train split of ``split_seed`` and measure it on the held-out split.

    Raises:
        RuntimeError: if held-out accuracy is below ``MIN_HELDOUT_ACCURACY`` (the metrics would be meaningless).
    """
    train_images, train_labels = load_split("train", split_seed)
    heldout_images, heldout_labels = load_split("heldout", split_seed)
    # sklearn takes a 32-bit seed; derive it from the stable hash like every other random draw in the project.
    model = MLPClassifier(
        hidden_layer_sizes=(_HIDDEN_UNITS,),
        activation="relu",
        alpha=1e-2,
        max_iter=1000,
        random_state=stable_hash("digits_classifier", split_seed) % 2**32,
    )
    # The matrices are tiny (1438 × 64 · 64 × 128): multi-threaded BLAS only adds synchronisation, and on a shared
    # 2-core machine it made training ~10× slower (2 s → 25 s) than one thread.
    with threadpool_limits(limits=1):
        model.fit(prepare_images(train_images), train_labels)
    accuracy = float(np.mean(model.predict(prepare_images(heldout_images)) == heldout_labels))
    if accuracy < MIN_HELDOUT_ACCURACY:
        raise RuntimeError(
            f"digits classifier reached held-out accuracy {accuracy:.4f} < {MIN_HELDOUT_ACCURACY}; "
            f"check the scikit-learn install (version {sklearn.__version__})"
        )
    logger.info("trained digits classifier: held-out accuracy %.4f (%d images)", accuracy, len(heldout_labels))
    return DigitsClassifier(
        model, split_seed=split_seed, heldout_accuracy=accuracy, sklearn_version=sklearn.__version__
    )


def load_or_train(
    path: Path, what: str, load: Callable[[Path], T], train: Callable[[], T], save: Callable[[T, Path], None]
) -> T:
    """A model trained once and cached in the file ``path``: ``load(path)`` when the file is there (a corrupt or
    foreign file is retrained, with a warning naming ``what``), else ``train()``, then ``save(model, tmp)`` and an
    atomic rename to ``path``: two processes training at once both write a complete file and the last one wins."""
    if path.exists():
        try:
            model = load(path)
            logger.debug("loaded %s from %s", what, path)
            return model
        except Exception as exc:  # a corrupt or foreign cache file is rebuilt, not fatal
            logger.warning("could not load %s cache %s (%s); retraining", what, path, exc)
    model = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp{path.suffix}")
    save(model, tmp)
    os.replace(tmp, path)
    return model


def _read_classifier(path: Path) -> DigitsClassifier:
    payload = joblib.load(path)
    return DigitsClassifier(
        payload["model"],
        split_seed=payload["split_seed"],
        heldout_accuracy=payload["heldout_accuracy"],
        sklearn_version=payload["sklearn_version"],
    )


def _write_classifier(classifier: DigitsClassifier, path: Path) -> None:
    payload = {
        "model": classifier.model,
        "split_seed": classifier.split_seed,
        "heldout_accuracy": classifier.heldout_accuracy,
        "sklearn_version": classifier.sklearn_version,
    }
    joblib.dump(payload, path)


@functools.lru_cache(maxsize=8)
def _load_cached(cache_dir: str, split_seed: int) -> DigitsClassifier:
    path = Path(cache_dir) / f"digits_mlp_v{_FORMAT_VERSION}_sklearn-{sklearn.__version__}_split-{split_seed}.joblib"
    train = functools.partial(train_classifier, split_seed)
    return load_or_train(path, "digits classifier", _read_classifier, train, _write_classifier)


def load_classifier(cache_dir: str | os.PathLike | None = None, split_seed: int = SPLIT_SEED) -> DigitsClassifier:
    """The cached classifier for ``split_seed``, training and caching it on first use.

    Args:
        cache_dir: directory of the joblib cache (default :func:`default_cache_dir`).
        split_seed: digits split seed; keep the default.

    Returns:
        a :class:`DigitsClassifier`, memoised per ``(cache_dir, split_seed)`` within the process.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _load_cached(str(directory.expanduser().resolve()), split_seed)


def features(images: Any, *, cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """``load_classifier(cache_dir).features(images)``: float64 ``[N, F]`` classifier features."""
    return load_classifier(cache_dir).features(images)


def predict(images: Any, *, cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """``load_classifier(cache_dir).predict(images)``: int64 ``[N]`` predicted labels."""
    return load_classifier(cache_dir).predict(images)
