"""What the DMD2 discriminator knows, measured at every evaluation on held-out real samples
(``--dmd2-gan-eval-real-data``), logged as ``eval/disc_*``.

Three sets of the same size N, scored by the critic group's own train-output hook (so D is exactly the one the
student's GAN gradient comes from: the critic and its head, on inputs noised at a diffusion-GAN level, σ and noise
keyed by the rollout id ``"disc_eval"`` and the position, so the three sets share them position by position):

* **real**: the held-out samples with their own prompts;
* **wrong prompt**: the same samples with another record's prompt (for record j the first later record, cyclically,
  whose prompt differs);
* **fake**: the student's samples of the held-out prompts (its ``x̂0_i`` at a random stop step, the samples D is
  trained on).

Figures: ``disc_prompt_auc``, the ROC AUC of the real-prompt logits against the wrong-prompt logits (0.5: D ignores
the prompt; 1: it always prefers the right one); ``disc_real_fake_auc``, the ROC AUC of real against fake; the
mean logits ``disc_logit_real``, ``disc_logit_wrong_prompt``, ``disc_logit_fake``, and ``disc_real_minus_fake``.
"""

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["DISC_EVAL_ROLLOUT_ID", "disc_quality", "wrong_prompts"]

logger = logging.getLogger(__name__)

# The noise-seed key of the discriminator evaluation's draws (generation and scoring).
DISC_EVAL_ROLLOUT_ID = "disc_eval"


def wrong_prompts(prompts: list[str]) -> list[str]:
    """For each prompt j, the first later prompt (j + 1, j + 2, ... cyclically) that differs from it.

    Raises:
        ValueError: when every prompt is the same (no wrong prompt exists).
    """
    wrong = []
    for j, prompt in enumerate(prompts):
        others = (prompts[(j + step) % len(prompts)] for step in range(1, len(prompts)))
        choice = next((other for other in others if other != prompt), None)
        if choice is None:
            raise ValueError("--dmd2-gan-eval-real-data holds a single prompt; the prompt AUC needs two or more")
        wrong.append(choice)
    return wrong


def _logits(critic, pairs_per_rank: list[list]) -> np.ndarray:
    scores = critic.run_train_output(DISC_EVAL_ROLLOUT_ID, pairs_per_rank)
    return torch.cat([part["gan_logit_fake"] for part in scores]).double().numpy()


def disc_quality(args: Any, groups: dict) -> dict[str, float]:
    """The discriminator's figures on ``--dmd2-gan-eval-real-data`` (see the module docstring).

    Args:
        args: run args; reads the DMD2 settings' ``gan_eval_real_data`` and ``input_key``.
        groups: ``{"actor": RayTrainGroup, "critic": RayTrainGroup}``; the actor generates the fakes (and encodes
            the prompts), the critic's train-output hook scores (with the GAN head, it returns ``gan_logit_fake``).

    Returns:
        ``{"disc_prompt_auc", "disc_real_fake_auc", "disc_logit_real", "disc_logit_wrong_prompt",
        "disc_logit_fake", "disc_real_minus_fake"}`` as floats.

    Raises:
        ValueError: for an empty file or one with a single prompt.
    """
    from sklearn.metrics import roc_auc_score

    from miles.backends.fsdp_utils.loss_hub.dmd2_types import REAL_DATA, dmd2_settings
    from miles.rollout.data_source import make_prompt_shard
    from miles.rollout.engine import data_base_dir
    from miles.utils.types import SideRecords

    path = dmd2_settings(args).gan_eval_real_data
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise ValueError(f"--dmd2-gan-eval-real-data {path} holds no records")
    key = args.input_key
    swapped = [
        dict(record, **{key: prompt}) for record, prompt in zip(records, wrong_prompts([str(r[key]) for r in records]))
    ]
    actor, critic = groups["actor"], groups["critic"]
    base_dir = data_base_dir(path)

    def generate(chosen: list[dict]) -> list[list]:
        # Each record is also its own sample's real side input (pair.extras[REAL_DATA]).
        shard = make_prompt_shard(
            DISC_EVAL_ROLLOUT_ID,
            chosen,
            input_key=key,
            base_dir=base_dir,
            side_data={REAL_DATA: SideRecords(chosen, base_dir)},
        )
        boxes, _ = actor.generate_shard(DISC_EVAL_ROLLOUT_ID, shard)  # the padded positions come last
        return actor.unbox(boxes)

    right = generate(records)
    wrong = generate(swapped)

    def as_real(pairs_per_rank: list[list]) -> list[list]:
        # Each pair's real side sample in its place: its clean latent, with its own (right or wrong) prompt's cond.
        return [
            [
                dataclasses.replace(p, x0=p.extras[REAL_DATA].x0, pos_cond=p.extras[REAL_DATA].env.pos_cond)
                for p in pairs
            ]
            for pairs in pairs_per_rank
        ]

    keep = len(records)
    real = _logits(critic, as_real(right))[:keep]
    wrong_prompt = _logits(critic, as_real(wrong))[:keep]
    fake = _logits(critic, right)[:keep]  # the padded positions are the last ones, dropped by the [:keep]
    labels = np.r_[np.ones(keep), np.zeros(keep)]
    figures = {
        "disc_prompt_auc": float(roc_auc_score(labels, np.r_[real, wrong_prompt])),
        "disc_real_fake_auc": float(roc_auc_score(labels, np.r_[real, fake])),
        "disc_logit_real": float(real.mean()),
        "disc_logit_wrong_prompt": float(wrong_prompt.mean()),
        "disc_logit_fake": float(fake.mean()),
        "disc_real_minus_fake": float(real.mean() - fake.mean()),
    }
    logger.info("discriminator on %d held-out reals (%s): %s", keep, Path(path).name,
                ", ".join(f"{name} {value:.3f}" for name, value in figures.items()))  # fmt: skip
    return figures
