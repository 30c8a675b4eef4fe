"""What the DMD2 pieces share: the converter's train pair and the method's typed settings.

The DMD2 converter (``miles.ray.data_conversion_hub.dmd2``) makes :class:`DMD2Pair` s and the hooks of
``loss_hub.dmd2`` read them; ``miles.methods.dmd2`` builds :class:`DMD2Settings` once from the parsed flags
(``args.method_settings``) and the hooks read that. Both live here, below the converter and the method, so that every
layer that needs them can import them.
"""

import argparse
from dataclasses import dataclass

import torch

from miles.models.lora import parse_target_modules
from miles.utils.flags import derived, from_namespace, option
from miles.utils.types import TrainPair
from miles.utils.validation import int_list

__all__ = ["DMD2Pair", "DMD2Settings", "REAL_DATA", "SCORING_SIGMA_RULES", "dmd2_settings"]

# The DMD2 GAN's side input: one real sample per generated one (``pair.extras[REAL_DATA]``, a data Sample).
REAL_DATA = "real"
# The scoring σ rules of --dmd2-scoring-sigma (drawn in loss_hub.scoring_sigma).
SCORING_SIGMA_RULES = ("grid", "shift", "logit-normal")


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
    """The ``--loss-type dmd2`` flags, typed, as its hooks read them; each field declares its own flag
    (:func:`miles.utils.flags.option`: ``--dmd2-<name>`` unless named otherwise), so a flag is written once.

    Attributes:
        critic_load: the critic's init pipeline (``--critic-load``; filled with ``--teacher-load``).
        critic_lr: the critic's learning rate (``--critic-lr``; filled with ``--lr``).
        critic_lora_rank, critic_lora_alpha, critic_lora_target_modules, critic_lora_dropout: the critic's LoRA
            (``--critic-lora-*``; filled with the student's ``--lora-*``).
        critic_steps_per_rollout: K critic steps per student step.
        teacher_guidance_scale: CFG scale of the teacher's score (1 = no CFG; filled with the teacher's stock scale).
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
        teacher_guidance_form: derived: ``"true CFG"`` or ``"embedded"``, the teacher family's guidance form.
        teacher_guidance_origin: derived: one line for the dry run on where the teacher's guidance came from.
    """

    flag_prefix = "dmd2-"

    critic_load: str | None = option(
        help="Critic (fake score) init pipeline directory; defaults to --teacher-load.", flag="--critic-load"
    )
    critic_lr: float | None = option(
        help="Critic learning rate; defaults to --lr.", flag="--critic-lr", check={"low": 0}
    )
    critic_lora_rank: int | None = option(
        help="Train the critic as a LoRA of this rank on the teacher's weights (one base in the critic group; "
        "the teacher runs with the adapters off); 0 trains full weights. Defaults to --lora-rank.",
        flag="--critic-lora-rank",
    )
    critic_lora_alpha: float | None = option(
        help="Critic's lora_alpha; defaults to --lora-alpha.", flag="--critic-lora-alpha"
    )
    critic_lora_target_modules: tuple[str, ...] | None = option(
        help="Critic's LoRA target modules; defaults to --lora-target-modules.",
        flag="--critic-lora-target-modules",
        parse=parse_target_modules,
    )
    critic_lora_dropout: float | None = option(
        help="Critic's LoRA dropout; defaults to --lora-dropout.", flag="--critic-lora-dropout"
    )
    critic_steps_per_rollout: int = option(
        5, help="K critic (fake score) updates per student update, over the same DP shard.", check={"low": 1}
    )
    teacher_guidance_scale: float = option(
        1.0,
        help="Guidance scale of the teacher's score (1 = none; true CFG, or FLUX.1-dev's guidance input); the "
        "critic scores unguided. Default: the teacher's stock pipeline's (SD3 7, Qwen-Image 4, FLUX.1-dev 3.5, "
        "FLUX.2-klein base 4, Wan 5; else 1).",
        flag_default=None,
        check={"low": 1, "hint": "(1 = no CFG)"},
    )
    teacher_cfg_norm_rescale: bool = option(
        False,
        help="Rescale the teacher's true-CFG velocity to the conditional one's norm per token, as the stock "
        "Qwen-Image sampler does, so the scale means its true_cfg_scale. Default: on for qwen_image.",
        action=argparse.BooleanOptionalAction,
        flag_default=None,
    )
    critic_scoring: str = option(
        "fused",
        help="fused: score after the K critic steps; original: score before the last critic step (reference).",
        choices=("fused", "original"),
    )
    min_timestep_ratio: float = option(0.02, help="Lowest scoring timestep / 1000 (reference 2%%).", check={})
    max_timestep_ratio: float = option(0.98, help="Highest scoring timestep / 1000 (reference 98%%).", check={})
    scoring_sigma: str = option(
        "grid",
        help="Scoring σ draw: grid (uniform over the --fsdp-flow-shift grid), shift (--dmd2-scoring-shift) or "
        "logit-normal (SD3's, --dmd2-scoring-logit-mean/-std); all within the min/max timestep ratios.",
        choices=SCORING_SIGMA_RULES,
    )
    scoring_shift: float = option(
        1.0,
        help="With --dmd2-scoring-sigma shift: σ = k·s/(1+(k−1)·s), s uniform; 1 = uniform σ, < 1 favours low σ.",
        check={"low": 0, "low_open": True},
    )
    scoring_logit_mean: float = option(
        0.0,
        help="With --dmd2-scoring-sigma logit-normal: mean of logit(σ) (SD3: 0; negative favours low σ).",
        check={},
    )
    scoring_logit_std: float = option(
        1.0,
        help="With --dmd2-scoring-sigma logit-normal: standard deviation of logit(σ) (SD3: 1).",
        check={"low": 0, "low_open": True},
    )
    gan_disc_weight: float = option(
        0.0,
        help="Phase 2: weight of the critic's discriminator loss (reference 1e-2); > 0 adds the GAN head.",
        check={"low": 0},
    )
    gan_gen_weight: float = option(
        0.0,
        help="Phase 2: weight of the student's GAN loss (reference 1e-3 to 5e-3); needs the disc weight.",
        check={"low": 0},
    )
    gan_real_data: str | None = option(
        help="Phase 2: JSONL of real samples (image or latent, and prompt) the discriminator sees."
    )
    gan_max_timestep_ratio: float = option(
        0.98,
        help="Phase 2: highest diffusion-GAN noise timestep / 1000 (tianweiy/DMD2's diffusion_gan_max_timestep).",
        check={},
    )
    gan_feature_blocks: tuple[int, ...] | None = option(
        help="Phase 2: critic blocks whose image tokens feed the head, e.g. '6,12'; default the middle one.",
        parse=int_list,
    )
    gan_start_rollout: int = option(
        0,
        help="Phase 2: the student adds the GAN gradient from this rollout on (the head trains from the start).",
        check={"low": 0},
    )
    gan_projection: bool = option(
        False,
        help="Phase 2: add the projection term <V·pooled prompt embedding, φ(x)> to the head (Miyato & Koyama 2018).",
        action=argparse.BooleanOptionalAction,
    )
    gan_mismatch_weight: float = option(
        0.0,
        help="Phase 2: weight of real images shown with another sample's prompt as fakes (Reed et al. 2016).",
        check={"low": 0},
    )
    gan_r1_weight: float = option(
        0.0,
        help="Phase 2: weight of the approximate R1 penalty mean((D(real) − D(real + α·ε))²) (FastGen, APT).",
        check={"low": 0},
    )
    gan_r1_alpha: float = option(
        0.1,
        help="Phase 2: α, the std of the approximate R1's pixel perturbation of the clean reals (FastGen: 0.1).",
        check={"low": 0},
    )
    gan_eval_real_data: str | None = option(
        help="Phase 2: held-out real samples (JSONL like --dmd2-gan-real-data) on which every evaluation logs the "
        "discriminator's quality (eval/disc_*)."
    )
    reward_weight: float = option(
        0.0,
        help="DMDR: w of the reward term; the student's x0 gradient gains −w·∂reward/∂x̂0 from a frozen reward group "
        "(0 = off: no reward group).",
        check={"low": 0},
    )
    reward_function_path: str | None = option(
        help="DMDR: the reward hook fn(images, prompts) -> rewards by dotted path; images float32 (B, C, H, W) in "
        "[0, 1] with autograd, rewards (B,), higher is better (digits: miles.eval.digits.reward.digit_log_prob)."
    )
    regression_weight: float = option(
        0.0,
        help="DMD's regression loss: w of mean((x0 - y)^2) between the student's one-step output from a cached "
        "noise and the teacher's ODE sample y from it (DMD: 0.25 with LPIPS; 0 = off).",
        check={"low": 0},
    )
    regression_pairs: str | None = option(
        help="With --dmd2-regression-weight: the pairs' JSONL, written once by python -m "
        "miles.rollout.regression_pairs TEACHER PROMPTS OUT_DIR (OUT_DIR/pairs.jsonl)."
    )
    teacher_guidance_form: str = derived("true CFG")
    teacher_guidance_origin: str = derived("")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DMD2Settings":
        """The settings of parsed (and default-filled) ``--loss-type dmd2`` flags."""
        return from_namespace(cls, args)

    @property
    def gan_enabled(self) -> bool:
        """Phase 2 (the GAN head) is on when the critic trains a discriminator."""
        return self.gan_disc_weight > 0

    @property
    def reward_enabled(self) -> bool:
        """The reward group (DMDR) runs when the reward term has a weight."""
        return self.reward_weight > 0

    @property
    def regression_enabled(self) -> bool:
        """DMD's regression term is on when it has a weight."""
        return self.regression_weight > 0


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
