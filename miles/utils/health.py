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

:func:`alarms` names the figures outside ``THRESHOLDS``; the driver prints one warning line when a figure first
crosses (docs/reliability.md lists them).
"""

import math
from collections import defaultdict

import torch

__all__ = ["THRESHOLDS", "alarms", "health_figures"]

# figure -> (lowest healthy value, highest healthy value)
THRESHOLDS = {
    "health/diversity_ratio": (0.3, math.inf),
    "health/saturated_frac": (-math.inf, 0.05),
    "health/mean_drift": (-math.inf, 0.5),
    "health/std_ratio": (0.5, 2.0),
}


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
    rows = defaultdict(list)
    for row, prompt in enumerate(prompts):
        rows[prompt].append(row)
    groups = [indices for indices in rows.values() if len(indices) > 1]
    student_spread, teacher_spread = _within_prompt_spread(student, groups), _within_prompt_spread(teacher, groups)
    if student_spread is not None and teacher_spread is not None:
        figures["health/diversity_ratio"] = student_spread / max(teacher_spread, 1e-12)
    return figures


def alarms(metrics: dict[str, float]) -> list[str]:
    """``"health/<name>=<value> (healthy: lo..hi)"`` for each figure of ``metrics`` outside its threshold."""
    out = []
    for name, (low, high) in THRESHOLDS.items():
        value = metrics.get(name)
        if isinstance(value, (int, float)) and not low <= value <= high:
            out.append(f"{name}={value:.3g} (healthy: {low:g}..{high:g})")
    return out
