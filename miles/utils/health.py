"""Collapse alarms: cheap health figures of the student's samples against the teacher's, per rollout.

The most reported DMD failure (FastVideo's and Self-Forcing's issues) is a silent collapse: solid colours, samples
that stop changing with the noise, oversaturation. Each rollout, the DMD2 scoring hook compares the student's
x̂0_i with the teacher's x0 predictions of the same samples (its ``x̂0_real``) and logs:

* ``health/diversity_ratio``: within-prompt spread of the student's x̂0 (the mean over prompts with several samples
  of the per-element standard deviation across them) divided by the teacher's at the same samples; ~1 when the
  student varies with the noise as the teacher does, → 0 when every sample of a prompt is the same image.
* ``health/saturated_frac``: the share of the student's values beyond 1.5 × the teacher's 99th percentile of
  |value| (blown-out pixels, latents off the data manifold).
* ``health/mean_drift``: |mean(student) − mean(teacher)| / std(teacher).
* ``health/std_ratio``: std(student) / std(teacher).

Each evaluation adds figures of the decoded eval samples (:func:`eval_health_figures`; the fixed-noise images a user
looks at, several seeds of each prompt with ``--eval-n-samples-per-prompt`` ≥ 2):

* ``health/eval_diversity``: the per-prompt spread across seeds: for each prompt with at least two samples, the
  standard deviation of each pixel value across its samples (pixels scaled to [0, 1]), averaged over the pixels,
  then over the prompts. 0 when every seed of a prompt draws the same image.
* ``health/eval_saturated_frac``: the share of decoded values at either end of the range (0 or 255).

An eval hook that holds real data returns the same two figures relative to it (:func:`reference_figures`; the
digits hook compares with the held-out digits of each prompt's class), logged as ``eval/diversity_ratio`` (the
student's spread over the real data's) and ``eval/saturated_excess`` (the student's share at the ends minus the real
data's).

:func:`alarms` names the figures outside ``THRESHOLDS``; the driver prints one warning line when a figure first
crosses (docs/reliability.md lists them).
"""

import math
from collections import defaultdict

import torch

__all__ = [
    "EVAL_FIGURES",
    "THRESHOLDS",
    "alarms",
    "eval_health_figures",
    "health_figures",
    "reference_figures",
    "sample_figures",
]

# figure -> (lowest healthy value, highest healthy value)
THRESHOLDS = {
    "health/diversity_ratio": (0.3, math.inf),
    "health/saturated_frac": (-math.inf, 0.05),
    "health/mean_drift": (-math.inf, 0.5),
    "health/std_ratio": (0.5, 2.0),
    # Evaluation: a per-pixel spread across seeds below 2% of the range is the same image drawn again; a spread
    # below 0.6 of the real data's is what the digits teacher shows at CFG 3 (recall 0.05) or in 4 Euler steps
    # (0.53, 0.52; 0.91 at its 28 unguided steps); more values at the ends of the range than the real data's,
    # 5 points over, is an oversaturated sample (docs/reliability.md). The absolute share at the ends has no
    # threshold: it depends on the data (58% of the digits' pixels are exactly 0 or 255).
    "health/eval_diversity": (0.02, math.inf),
    "eval/diversity_ratio": (0.6, math.inf),
    "eval/saturated_excess": (-math.inf, 0.05),
}
# The evaluation's health figures, logged and alarmed at each --eval-interval (the others: each rollout).
EVAL_FIGURES = ("health/eval_diversity", "health/eval_saturated_frac", "eval/diversity_ratio", "eval/saturated_excess")


def _prompt_groups(prompts: list[str]) -> list[list[int]]:
    """The rows of each prompt that has at least two samples, in first-occurrence order."""
    rows = defaultdict(list)
    for row, prompt in enumerate(prompts):
        rows[prompt].append(row)
    return [indices for indices in rows.values() if len(indices) > 1]


def _within_prompt_spread(x: torch.Tensor, groups: list[list[int]]) -> float | None:
    spreads = [x[rows].std(dim=0, unbiased=False).mean() for rows in groups]
    return float(torch.stack(spreads).mean()) if spreads else None


def health_figures(student: torch.Tensor, teacher: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """The health figures of one DP shard.

    Args:
        student: the student's x̂0, float ``(N, C, H, W)``.
        teacher: the teacher's x0 predictions of the same samples, ``(N, C, H, W)``.
        prompts: each sample's prompt (samples of a prompt form its group for the diversity ratio).

    Returns:
        ``{"health/<name>": float}``; ``diversity_ratio`` only when some prompt has at least two samples.
    """
    student, teacher = student.detach().double(), teacher.detach().double()
    teacher_std = teacher.std(unbiased=False).clamp_min(1e-12)
    threshold = 1.5 * torch.quantile(teacher.abs().flatten(), 0.99)
    figures = {
        "health/saturated_frac": float((student.abs() > threshold).double().mean()),
        "health/mean_drift": float((student.mean() - teacher.mean()).abs() / teacher_std),
        "health/std_ratio": float(student.std(unbiased=False) / teacher_std),
    }
    groups = _prompt_groups(prompts)
    student_spread, teacher_spread = _within_prompt_spread(student, groups), _within_prompt_spread(teacher, groups)
    if student_spread is not None and teacher_spread is not None:
        figures["health/diversity_ratio"] = student_spread / max(teacher_spread, 1e-12)
    return figures


def sample_figures(images, prompts: list[str]) -> dict[str, float]:
    """The per-prompt spread across seeds and the share of values at the ends of the range of decoded images.

    Args:
        images: uint8 ``(N, H, W, C)`` (or ``(N, H, W)``; a video family's ``(N, F, H, W, C)``), values 0..255,
            a tensor or an array.
        prompts: each image's prompt; the images of one prompt are its seeds.

    Returns:
        ``{"diversity": float, "saturated_frac": float}``: the mean over prompts with at least two images of the mean
        over values of their standard deviation across the prompt's images (population std, values scaled to
        [0, 1]); the share of values equal to 0 or 255. ``diversity`` is left out when no prompt has two images.

    Raises:
        ValueError: if the counts of images and prompts differ.
    """
    pixels = torch.as_tensor(images)
    if len(pixels) != len(prompts):
        raise ValueError(f"{len(pixels)} images for {len(prompts)} prompts; pass one prompt per image")
    figures = {"saturated_frac": float(((pixels == 0) | (pixels == 255)).double().mean())}
    spread = _within_prompt_spread(pixels.double() / 255.0, _prompt_groups(prompts))
    if spread is not None:
        figures["diversity"] = spread
    return figures


def eval_health_figures(images, prompts: list[str]) -> dict[str, float]:
    """``health/eval_diversity`` and ``health/eval_saturated_frac`` of an evaluation's decoded images
    (:func:`sample_figures`)."""
    return {f"health/eval_{name}": value for name, value in sample_figures(images, prompts).items()}


def reference_figures(images, prompts: list[str], reference, reference_prompts: list[str]) -> dict[str, float]:
    """The evaluation's figures relative to real data (or the teacher's samples) of the same prompts.

    Args:
        images, prompts: the student's decoded images and their prompts (as :func:`sample_figures`).
        reference, reference_prompts: the reference images (uint8, same layout) and their prompts; the spread of
            each is taken over the prompts the two share.

    Returns:
        ``{"diversity_ratio": student spread / reference spread, "saturated_excess": student share at the ends −
        the reference's}``; ``diversity_ratio`` only when some shared prompt has two images on both sides, ``{}``
        when the two share no prompt. An eval hook returns them as its own figures (``eval/diversity_ratio``,
        ``eval/saturated_excess``).
    """
    shared = set(prompts) & set(reference_prompts)
    if not shared:
        return {}
    mine = [row for row, prompt in enumerate(prompts) if prompt in shared]
    theirs = [row for row, prompt in enumerate(reference_prompts) if prompt in shared]
    student = sample_figures(torch.as_tensor(images)[mine], [prompts[row] for row in mine])
    real = sample_figures(torch.as_tensor(reference)[theirs], [reference_prompts[row] for row in theirs])
    figures = {"saturated_excess": student["saturated_frac"] - real["saturated_frac"]}
    if "diversity" in student and real.get("diversity"):
        figures["diversity_ratio"] = student["diversity"] / real["diversity"]
    return figures


def alarms(metrics: dict[str, float]) -> list[str]:
    """``"health/<name>=<value> (healthy: lo..hi)"`` for each figure of ``metrics`` outside its threshold."""
    out = []
    for name, (low, high) in THRESHOLDS.items():
        value = metrics.get(name)
        if isinstance(value, (int, float)) and not low <= value <= high:
            out.append(f"{name}={value:.3g} (healthy: {low:g}..{high:g})")
    return out
