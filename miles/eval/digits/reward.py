"""The digits reward for DMD2 + reward (DMDR): the log-probability of the prompt's digit under a small classifier.

The classifier is a multinomial logistic regression on the 64 raw pixels in [0, 1] (scikit-learn
``LogisticRegression``, lbfgs, L2 with ``C = 1``), trained on the *train* split of :mod:`miles.eval.digits.data`
only, and run in torch so that the reward has a gradient with respect to the pixels. It is deliberately **not** the
evaluator's classifier (:mod:`miles.eval.digits.classifier`, a one-hidden-layer ReLU MLP whose hidden features the FD,
precision and recall are computed on): another model on other features (a linear map of the pixels, no hidden layer),
so a student that learns to please the reward does not by that alone please the evaluator's feature space. It
reaches 96.9% on the held-out split (the evaluator's MLP about 98%); training refuses a model below
``MIN_HELDOUT_ACCURACY``.

Fitting takes seconds on one core; the weights are cached as ``.npz`` in ``cache_dir`` (default
``$MILES_CACHE_DIR/eval`` or ``~/.cache/miles/eval``, as the evaluator's) under a name carrying the scikit-learn
version, the split seed and this module's format version.

Use it as ``--dmd2-reward-function-path miles.eval.digits.reward.digit_log_prob``.
"""

import functools
import logging
import os
from pathlib import Path

import numpy as np
import sklearn
import torch
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from miles.eval.digits.classifier import default_cache_dir, load_or_train, prepare_images
from miles.eval.digits.data import DIGIT_PROMPTS, SPLIT_SEED, load_split

__all__ = ["MIN_HELDOUT_ACCURACY", "RewardClassifier", "digit_log_prob", "label_of_prompt", "load_reward_classifier"]

logger = logging.getLogger(__name__)

MIN_HELDOUT_ACCURACY = 0.95
_FORMAT_VERSION = 1
_C = 1.0


class RewardClassifier(torch.nn.Module):
    """Logistic regression over 8×8 pixels: ``log_softmax(x·Wᵀ + b)``, x the row-major pixels in [0, 1].

    Args:
        weight: float ``(10, 64)``; bias: float ``(10,)`` (scikit-learn's ``coef_`` and ``intercept_``).
        heldout_accuracy: its accuracy on the held-out split, in [0, 1].
    """

    def __init__(self, weight: np.ndarray, bias: np.ndarray, heldout_accuracy: float) -> None:
        super().__init__()
        self.register_buffer("weight", torch.as_tensor(weight, dtype=torch.float32))
        self.register_buffer("bias", torch.as_tensor(bias, dtype=torch.float32))
        self.heldout_accuracy = float(heldout_accuracy)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """float pixels ``(B, 1, 8, 8)`` (or ``(B, 64)``) in [0, 1] → float32 log-probabilities ``(B, 10)``."""
        x = pixels.float().flatten(1)
        weight, bias = self.weight.to(x.device), self.bias.to(x.device)
        return torch.log_softmax(x @ weight.T + bias, dim=1)


def train_reward_classifier(split_seed: int = SPLIT_SEED) -> RewardClassifier:
    """Fit the logistic regression on the train split of ``split_seed`` and measure it on the held-out split.

    Raises:
        RuntimeError: if held-out accuracy is below ``MIN_HELDOUT_ACCURACY``.
    """
    train_images, train_labels = load_split("train", split_seed)
    heldout_images, heldout_labels = load_split("heldout", split_seed)
    model = LogisticRegression(C=_C, max_iter=2000)  # lbfgs: deterministic, no random state
    with threadpool_limits(limits=1):  # tiny matrices: threads only add synchronisation on a shared machine
        model.fit(prepare_images(train_images), train_labels)
    accuracy = float(np.mean(model.predict(prepare_images(heldout_images)) == heldout_labels))
    if accuracy < MIN_HELDOUT_ACCURACY:
        raise RuntimeError(
            f"digits reward classifier reached held-out accuracy {accuracy:.4f} < {MIN_HELDOUT_ACCURACY}"
        )
    logger.info("trained digits reward classifier: held-out accuracy %.4f", accuracy)
    return RewardClassifier(model.coef_, model.intercept_, accuracy)


def _read_reward(path: Path) -> RewardClassifier:
    with np.load(path) as payload:
        return RewardClassifier(payload["weight"], payload["bias"], float(payload["heldout_accuracy"]))


def _write_reward(classifier: RewardClassifier, path: Path) -> None:
    np.savez(
        path,
        weight=classifier.weight.numpy(),
        bias=classifier.bias.numpy(),
        heldout_accuracy=np.float64(classifier.heldout_accuracy),
    )


@functools.lru_cache(maxsize=4)
def _load_cached(cache_dir: str, split_seed: int) -> RewardClassifier:
    name = f"digits_reward_logreg_v{_FORMAT_VERSION}_sklearn-{sklearn.__version__}_split-{split_seed}.npz"
    train = functools.partial(train_reward_classifier, split_seed)
    return load_or_train(Path(cache_dir) / name, "digits reward", _read_reward, train, _write_reward)


def load_reward_classifier(cache_dir: str | os.PathLike | None = None, split_seed: int = SPLIT_SEED):
    """The cached reward classifier (trained and cached on first use), memoised per process."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _load_cached(str(directory.expanduser().resolve()), split_seed)


_LABEL_OF_PROMPT = {prompt: label for label, prompt in enumerate(DIGIT_PROMPTS)}


def label_of_prompt(prompt: str) -> int:
    """The digit a prompt asks for: ``"a handwritten digit seven"`` → 7 (the prompts of
    :func:`miles.eval.digits.data.prompt_for_label`).

    Raises:
        ValueError: naming the prompt, if it is not one of the ten digit prompts.
    """
    label = _LABEL_OF_PROMPT.get(prompt.strip())
    if label is None:
        raise ValueError(f"the digits reward reads the digit from prompts like {DIGIT_PROMPTS[7]!r}; got {prompt!r}")
    return label


def digit_log_prob(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The digits reward hook: ``log p(prompt's digit | image)`` under :class:`RewardClassifier`.

    Args:
        images: float ``(B, 1, 8, 8)`` pixels in [0, 1] (the digits family's ``latents_to_pixels``), with autograd.
        prompts: B digit prompts (:func:`label_of_prompt`).

    Returns:
        float32 ``(B,)`` log-probabilities (≤ 0; higher is better), differentiable in ``images``.

    Raises:
        ValueError: for a prompt that names no digit, or a count of prompts other than B.
    """
    if len(prompts) != len(images):
        raise ValueError(f"the digits reward got {len(images)} images and {len(prompts)} prompts")
    labels = torch.tensor([label_of_prompt(prompt) for prompt in prompts], dtype=torch.long, device=images.device)
    log_probs = load_reward_classifier()(images)
    return log_probs.gather(1, labels[:, None]).squeeze(1)
