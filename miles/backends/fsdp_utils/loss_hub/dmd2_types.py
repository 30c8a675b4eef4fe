"""What the DMD2 pieces share: the converter's train pair and the method's typed settings.

The DMD2 converter (``miles.ray.data_conversion_hub.dmd2``) makes :class:`DMD2Pair` s and the hooks of
``loss_hub.dmd2`` read them; ``miles.methods.dmd2`` builds :class:`DMD2Settings` once from the parsed flags
(``args.method_settings``) and the hooks read that. Both live here, below the converter and the method, so that every
layer that needs them can import them.
"""

import argparse
from dataclasses import dataclass

import torch

from miles.utils.types import TrainPair

__all__ = ["DMD2Pair", "DMD2Settings", "REAL_DATA", "dmd2_settings"]

# The DMD2 GAN's side input: one real sample per generated one (``pair.extras[REAL_DATA]``, a data Sample).
REAL_DATA = "real"


@dataclass(kw_only=True)
class DMD2Pair(TrainPair):
    """A DMD2 train pair: a rollout stopped at step i ([DMD2 4/7]). ``x0`` is the rollout's ``x̂0_i``.

    Attributes:
        latent: ``x_i``, float32 ``(C, H, W)``, the student's input at the stopped step.
        sigma: ``σ_i`` in [0, 1].
        timestep: ``t_i = σ_i · 1000``.
        step_index: the stopped step ``i``.
    """

    latent: torch.Tensor
    sigma: float
    timestep: float
    step_index: int


@dataclass(frozen=True)
class DMD2Settings:
    """The ``--loss-type dmd2`` flags, typed, as its hooks read them (see ``miles.methods.dmd2`` for each flag).

    Attributes:
        critic_steps_per_rollout: K critic steps per student step.
        teacher_guidance_scale: CFG scale of the teacher's score (1 = no CFG).
        teacher_cfg_norm_rescale: rescale the teacher's true-CFG velocity per token as its stock sampler does
            (``TrueCFG.norm_rescaled_cfg``; Qwen-Image).
        critic_scoring: ``"fused"`` or ``"original"``.
        min_timestep_ratio, max_timestep_ratio: the scoring range of timesteps / 1000.
        scoring_sigma: the scoring σ rule, ``"grid"``, ``"shift"`` or ``"logit-normal"``
            (``loss_hub.scoring_sigma``); scoring_shift, scoring_logit_mean, scoring_logit_std: its parameters.
        gan_disc_weight, gan_gen_weight: phase 2's discriminator and generator GAN weights (0: off).
        gan_real_data: phase 2's JSONL of real samples, or None.
        gan_max_timestep_ratio: the top of the diffusion-GAN noise range, timestep / 1000.
        gan_feature_blocks: the critic blocks the discriminator head reads, or None for the middle one.
        gan_start_rollout: the first rollout whose student step adds the GAN gradient (0: from the start).
        gan_projection: the head's projection term on the pooled prompt embedding.
        gan_mismatch_weight: weight of the reals shown with another prompt (matching-aware, 0: off).
        gan_r1_weight, gan_r1_alpha: weight (0: off) and pixel-noise std of the approximate R1 penalty.
        gan_eval_real_data: held-out real samples for the discriminator's figures at evaluations, or None.
        reward_weight: w of the reward term (DMDR): the student's x0 gradient gains ``−w·∂reward/∂x̂0`` (0: off).
        reward_function_path: the reward hook ``fn(images, prompts) -> rewards`` by dotted path, or None.
        regression_weight: w of DMD's regression loss on cached teacher pairs (``loss_hub.regression``; 0: off).
        regression_pairs: the JSONL of those pairs (``python -m miles.rollout.regression_pairs``), or None.
    """

    critic_steps_per_rollout: int = 5
    teacher_guidance_scale: float = 1.0
    teacher_cfg_norm_rescale: bool = False
    critic_scoring: str = "fused"
    min_timestep_ratio: float = 0.02
    max_timestep_ratio: float = 0.98
    scoring_sigma: str = "grid"
    scoring_shift: float = 1.0
    scoring_logit_mean: float = 0.0
    scoring_logit_std: float = 1.0
    gan_disc_weight: float = 0.0
    gan_gen_weight: float = 0.0
    gan_real_data: str | None = None
    gan_max_timestep_ratio: float = 0.98
    gan_feature_blocks: tuple[int, ...] | None = None
    gan_start_rollout: int = 0
    gan_projection: bool = False
    gan_mismatch_weight: float = 0.0
    gan_r1_weight: float = 0.0
    gan_r1_alpha: float = 0.1
    gan_eval_real_data: str | None = None
    reward_weight: float = 0.0
    reward_function_path: str | None = None
    regression_weight: float = 0.0
    regression_pairs: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DMD2Settings":
        """The settings of parsed ``--dmd2-*`` flags."""
        blocks = args.dmd2_gan_feature_blocks
        return cls(
            critic_steps_per_rollout=args.dmd2_critic_steps_per_rollout,
            teacher_guidance_scale=float(args.dmd2_teacher_guidance_scale),
            teacher_cfg_norm_rescale=bool(getattr(args, "dmd2_teacher_cfg_norm_rescale", False)),
            critic_scoring=args.dmd2_critic_scoring,
            min_timestep_ratio=args.dmd2_min_timestep_ratio,
            max_timestep_ratio=args.dmd2_max_timestep_ratio,
            scoring_sigma=args.dmd2_scoring_sigma,
            scoring_shift=float(args.dmd2_scoring_shift),
            scoring_logit_mean=float(args.dmd2_scoring_logit_mean),
            scoring_logit_std=float(args.dmd2_scoring_logit_std),
            gan_disc_weight=float(args.dmd2_gan_disc_weight),
            gan_gen_weight=float(args.dmd2_gan_gen_weight),
            gan_real_data=args.dmd2_gan_real_data,
            gan_max_timestep_ratio=args.dmd2_gan_max_timestep_ratio,
            gan_feature_blocks=tuple(int(block) for block in blocks) if blocks else None,
            gan_start_rollout=int(args.dmd2_gan_start_rollout),
            gan_projection=bool(args.dmd2_gan_projection),
            gan_mismatch_weight=float(args.dmd2_gan_mismatch_weight),
            gan_r1_weight=float(args.dmd2_gan_r1_weight),
            gan_r1_alpha=float(args.dmd2_gan_r1_alpha),
            gan_eval_real_data=args.dmd2_gan_eval_real_data,
            reward_weight=float(args.dmd2_reward_weight),
            reward_function_path=args.dmd2_reward_function_path,
            regression_weight=float(args.dmd2_regression_weight),
            regression_pairs=args.dmd2_regression_pairs,
        )

    @property
    def gan_enabled(self) -> bool:
        """Phase 2 (the GAN head) is on when the critic trains a discriminator."""
        return self.gan_disc_weight > 0

    @property
    def reward_enabled(self) -> bool:
        """The reward group (DMDR) runs when the reward term has a weight."""
        return self.reward_weight > 0


def dmd2_settings(args) -> DMD2Settings:
    """The DMD2 settings a group's args carry (``args.method_settings``, built once by ``--loss-type dmd2``).

    Raises:
        ValueError: if the args carry another method's settings (a DMD2 hook under another loss type).
    """
    settings = args.method_settings
    if not isinstance(settings, DMD2Settings):
        raise ValueError(
            f"the DMD2 hooks read --loss-type dmd2's settings, but this group's args carry {type(settings).__name__}; "
            "use --loss-type dmd2"
        )
    return settings
