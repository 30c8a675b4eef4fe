"""``--loss-type dmd2``: distribution matching distillation (Yin et al. 2024), everything it wires in one place.

Groups (seed ``[DMD2 4/7]``): the critic ("fake score", initialised from ``--critic-load`` = the teacher by default)
trains first on every rollout, K = ``--dmd2-critic-steps-per-rollout`` flow-matching steps on the student's x̂0_i,
then scores the samples with the frozen teacher (CFG ``--dmd2-teacher-guidance-scale``) and itself; the actor
(student) takes one step along the distribution-matching gradient of those scores ([DMD2 5/7]). Only the critic
group holds the teacher.

The teacher at its stock settings (:func:`fill_teacher_guidance`): ``--dmd2-teacher-guidance-scale`` defaults to the
scale the teacher's stock pipeline samples with (``ModelFamily.stock_guidance_scale``: SD3 7.0, Qwen-Image 4.0,
FLUX.1-dev 3.5, FLUX.2-klein base 4.0, Wan 5.0; 1 for digits, a step- or guidance-distilled checkpoint, or a family
that names none), in the family's guidance form (true CFG against the negative prompt, or FLUX.1-dev's embedded
guidance input, for which no negative prompt is encoded); ``--dmd2-teacher-cfg-norm-rescale`` defaults to the
stock sampler's per-token norm rescale where it has one (Qwen-Image). The dry run prints both.

Hooks (by import): the converter ``data_conversion_hub.dmd2``, the step strategy ``stop_at_random_step`` (DMD2's
backward simulation), the actor's ``prepare_generator_batch`` / ``dmd2_loss_formula``, the critic's
``prepare_critic_batch`` / ``sft_loss_formula`` / ``predict_teacher_and_critic_x0`` (``loss_hub.dmd2``). The engine
encodes the negative prompt whenever the teacher runs true CFG; an export records the teacher's scale it was
distilled from.

Phase 2 (``--dmd2-gan-disc-weight > 0``, ``loss_hub.gan``): the critic group also holds a discriminator head on
its own features and trains it, and its backbone, on the student's samples against real ones
(``--dmd2-gan-real-data``, dealt by the RolloutManager one per sample); its scoring ships each sample's GAN
gradient, which the student adds with ``--dmd2-gan-gen-weight``. Reference values (tianweiy/DMD2): disc 1e-2,
gen 1e-3 (SD1.5) to 5e-3 (SDXL).

Reward (``--dmd2-reward-weight > 0``, DMDR, :mod:`miles.methods.dmd2_reward`): a frozen third group between the
critic and the actor ships each sample's ``∂reward/∂x̂0``, which the student subtracts, weighted, from its gradient.

Regression (``--dmd2-regression-weight > 0``, the first DMD paper's, :mod:`miles.methods.dmd2_regression`): each
sample brings a cached teacher pair (noise → ODE sample) as a side input, and the student's loss adds the distance of
its one-step output from that noise to the teacher's sample.

LoRA (``--lora-rank`` for the student, ``--critic-lora-rank`` for the critic, the latter defaulting to the former):
a critic LoRA sits on the teacher's own weights, so the critic group holds one base and the teacher is that base with
the adapters disabled (:mod:`miles.models.lora`). Teacher adapters and a reference model are not implemented, so
their flags do not exist.
"""

import argparse
from pathlib import Path
from typing import Any

from miles.backends.fsdp_utils.loss_hub import dmd2 as dmd2_loss
from miles.backends.fsdp_utils.loss_hub import gan, scoring_sigma
from miles.backends.fsdp_utils.loss_hub import sft as sft_loss
from miles.backends.fsdp_utils.loss_hub.dmd2_types import REAL_DATA, DMD2Settings
from miles.methods.base import Method, PhaseWork, fill_defaults, hook_path
from miles.methods.dmd2_debug import debug_records, dmd2_debug_grid
from miles.methods.dmd2_regression import (
    REGRESSION_ACTOR_HOOKS,
    add_regression_arguments,
    regression_enabled,
    regression_side_inputs,
    validate_regression_args,
)
from miles.methods.dmd2_reward import (
    add_reward_arguments,
    check_reward_family,
    reward_enabled,
    reward_trainer_config,
    reward_work,
    validate_reward_args,
)
from miles.models.capabilities import EmbeddedGuidance, TrueCFG, supports
from miles.models.lora import check_lora_flags, parse_target_modules
from miles.ray.data_conversion_hub import dmd2 as dmd2_conversion
from miles.rollout import step_strategy_hub
from miles.utils.trainer_config import TrainerConfig, sibling_dir
from miles.utils.types import SideInput
from miles.utils.validation import check_number, dp_size, int_list, reject, rollout_pairs

__all__ = [
    "DMD2Method",
    "DMD2_ACTOR_HOOKS",
    "DMD2_CRITIC_HOOKS",
    "DMD2_GAN_CRITIC_HOOKS",
    "fill_teacher_guidance",
    "gan_enabled",
    "validate_dmd2_args",
]

DMD2_ACTOR_HOOKS = {
    "custom_expand_samples_to_train_pairs_path": hook_path(dmd2_conversion.expand_samples_to_train_pairs),
    "custom_prepare_train_batch_path": hook_path(dmd2_loss.prepare_generator_batch),
    "custom_loss_function_path": hook_path(dmd2_loss.dmd2_loss_formula),
    "diffusion_step_strategy_path": hook_path(step_strategy_hub.stop_at_random_step),
}
DMD2_CRITIC_HOOKS = {
    "custom_prepare_train_batch_path": hook_path(dmd2_loss.prepare_critic_batch),
    "custom_loss_function_path": hook_path(sft_loss.sft_loss_formula),
    "custom_train_output_function_path": hook_path(dmd2_loss.predict_teacher_and_critic_x0),
}
# Phase 2: the critic holds the GAN head too and trains it beside its flow-matching loss.
DMD2_GAN_CRITIC_HOOKS = {
    "custom_build_modules_path": hook_path(gan.build_discriminator),
    "custom_prepare_train_batch_path": hook_path(dmd2_loss.prepare_critic_gan_batch),
    "custom_loss_function_path": hook_path(dmd2_loss.critic_gan_loss),
}


# The GAN's noise range top when the flag is not given: a different value only changes the GAN head.
GAN_MAX_TIMESTEP_RATIO = DMD2Settings.gan_max_timestep_ratio
# The student's LoRA flags (dests) the critic's --critic-* copies default to and map onto in the critic's args.
CRITIC_LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout")


# The guidance forms a teacher's family declares (args.dmd2_teacher_guidance_form); true CFG when it cannot be read
# here (a dry run for a cluster's paths): the conservative choice, which encodes the negative prompt.
TRUE_CFG, EMBEDDED = "true CFG", "embedded"


def fill_teacher_guidance(args: argparse.Namespace) -> None:
    """The teacher's stock guidance settings where the flags left them unset, in place; never over a set value.

    - ``--dmd2-teacher-guidance-scale`` ← the teacher family's ``stock_guidance_scale(--teacher-load)`` (the default
      of its stock pipeline's call), 1 where it names none or the pipeline cannot be read here;
    - ``--dmd2-teacher-cfg-norm-rescale`` ← the family's ``stock_cfg_norm_rescale`` (Qwen-Image: on), else off;
    - ``args.dmd2_teacher_guidance_form``: ``"true CFG"`` or ``"embedded"`` (the family's guidance form);
    - ``args.encode_negative_prompt`` ← True when the teacher runs true CFG (scale > 1): every sample then carries
      the negative cond, though the student samples unguided. An embedded-guidance teacher (FLUX.1-dev) reads none;
    - ``args.dmd2_teacher_guidance_origin``: one line for the dry run on where the scale and the form came from.
    """
    from miles.models import get_model_family

    family, unread = None, None
    try:
        family = get_model_family(args.teacher_load, getattr(args, "diffusion_model_family", None))
        stock_scale = family.stock_guidance_scale(args.teacher_load)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        family, unread, stock_scale = None, exc, None
    if args.dmd2_teacher_guidance_scale is not None:
        scale_origin = "set on the command line"
    elif family is None:
        args.dmd2_teacher_guidance_scale = 1.0
        scale_origin = f"the default 1 (the teacher {args.teacher_load} could not be read here: {unread})"
    elif stock_scale is None:
        args.dmd2_teacher_guidance_scale = 1.0
        scale_origin = f"the default 1 (the {family.name} family names no stock guidance scale)"
    else:
        args.dmd2_teacher_guidance_scale = float(stock_scale)
        scale_origin = f"the {family.name} family's stock scale (its pipeline's default)"
    embedded = family is not None and supports(family, EmbeddedGuidance)
    args.dmd2_teacher_guidance_form = EMBEDDED if embedded else TRUE_CFG
    stock_rescale = family is not None and supports(family, TrueCFG) and bool(family.stock_cfg_norm_rescale)
    if args.dmd2_teacher_cfg_norm_rescale is None:
        args.dmd2_teacher_cfg_norm_rescale = stock_rescale
        rescale_origin = f"the {family.name} family's" if family is not None else "the default"
    else:
        rescale_origin = "set on the command line"
    scale = args.dmd2_teacher_guidance_scale
    if scale > 1 and not embedded:
        # The teacher's CFG in scoring needs every sample's negative cond, though the student samples unguided.
        args.encode_negative_prompt = True
    if scale == 1:
        form = "none (scale 1)"
    elif embedded:
        form = "embedded: the scale is the teacher's guidance input, one forward, no negative prompt"
    else:
        rescale = args.dmd2_teacher_cfg_norm_rescale
        form = (
            "true CFG u + w·(c − u) over two branches, "
            + ("with" if rescale else "without")
            + f" the stock per-token norm rescale (--dmd2-teacher-cfg-norm-rescale: {rescale_origin}), against "
            + _negative_source(args)
        )
    args.dmd2_teacher_guidance_origin = f"--dmd2-teacher-guidance-scale {scale:g}: {scale_origin}; {form}"


def _negative_source(args: argparse.Namespace) -> str:
    if getattr(args, "negative_cond", None):
        return f"--negative-cond {args.negative_cond}"
    origin = getattr(args, "negative_prompt_origin", None)
    return f"the negative prompt {args.negative_prompt!r}" + (f" ({origin})" if origin else "")


def gan_enabled(args: argparse.Namespace) -> bool:
    """Phase 2 (the GAN head) is on when the critic trains a discriminator."""
    return args.dmd2_gan_disc_weight > 0


def validate_dmd2_args(args: argparse.Namespace) -> None:
    """Reject what ``--loss-type dmd2`` cannot run (seed ``[DMD2 4/7]``).

    Raises:
        ArgumentValidationError: one line naming the flags and the fix.
    """
    if not args.teacher_load:
        reject("--loss-type dmd2 needs --teacher-load (the frozen teacher pipeline directory)")
    check_number("--dmd2-teacher-guidance-scale", args.dmd2_teacher_guidance_scale, low=1, hint="(1 = no CFG)")
    if args.diffusion_guidance_scale != 1:
        reject(
            f"--loss-type dmd2 needs unguided student rollouts: set --diffusion-guidance-scale 1 "
            f"(got {args.diffusion_guidance_scale}); the teacher's CFG is --dmd2-teacher-guidance-scale"
        )
    if args.num_steps_per_rollout != 1:
        reject(
            f"--loss-type dmd2 takes one actor step per rollout: set --num-steps-per-rollout 1 "
            f"(got {args.num_steps_per_rollout})"
        )
    if args.train_only:
        reject("--train-only has no rollouts, which --loss-type dmd2 trains on: remove --train-only")
    if args.sft_uncond_prob > 0:
        reject(
            "--sft-uncond-prob trains SFT's unconditional velocity; it has no use under --loss-type dmd2: remove it"
        )
    if args.critic_lr is not None:
        check_number("--critic-lr", args.critic_lr, low=0)
        if args.min_lr > args.critic_lr:
            reject(
                f"--min-lr {args.min_lr} must be <= --critic-lr {args.critic_lr} (the critic's schedule decays to it)"
            )
    k = args.dmd2_critic_steps_per_rollout
    if k < 1:
        reject(f"--dmd2-critic-steps-per-rollout must be >= 1, got {k}")
    shard = rollout_pairs(args) // dp_size(args)
    if shard % k != 0 or (shard // k) % args.micro_batch_size != 0:
        reject(
            f"--dmd2-critic-steps-per-rollout {k} must split each DP shard of {shard} pairs into equal steps of "
            f"whole micro-batches (--micro-batch-size {args.micro_batch_size}); pick K dividing {shard}"
        )
    ratios = (args.dmd2_min_timestep_ratio, args.dmd2_max_timestep_ratio)
    for name, value in zip(("--dmd2-min-timestep-ratio", "--dmd2-max-timestep-ratio"), ratios):
        check_number(name, value)
    if not 0 <= ratios[0] < ratios[1] <= 1:
        reject(f"need 0 <= --dmd2-min-timestep-ratio < --dmd2-max-timestep-ratio <= 1, got {ratios}")
    for flag, value in (
        ("--dmd2-gan-disc-weight", args.dmd2_gan_disc_weight),
        ("--dmd2-gan-gen-weight", args.dmd2_gan_gen_weight),
    ):
        check_number(flag, value, low=0)
    check_number("--dmd2-gan-max-timestep-ratio", args.dmd2_gan_max_timestep_ratio)
    if gan_enabled(args) and not args.dmd2_min_timestep_ratio < args.dmd2_gan_max_timestep_ratio <= 1:
        reject(
            f"need --dmd2-min-timestep-ratio < --dmd2-gan-max-timestep-ratio <= 1, got "
            f"{(args.dmd2_min_timestep_ratio, args.dmd2_gan_max_timestep_ratio)}"
        )
    if args.dmd2_gan_gen_weight > 0 and not gan_enabled(args):
        reject("--dmd2-gan-gen-weight needs a trained discriminator: set --dmd2-gan-disc-weight > 0 (reference 1e-2)")
    if gan_enabled(args) and not args.dmd2_gan_real_data:
        reject(
            "--dmd2-gan-disc-weight > 0 needs --dmd2-gan-real-data (a JSONL of real images or latents with prompts)"
        )
    for block in args.dmd2_gan_feature_blocks or []:
        if block < 0:
            reject(f"--dmd2-gan-feature-blocks holds {block}; block indices are >= 0")
    if args.dmd2_gan_real_data and not gan_enabled(args):
        reject("--dmd2-gan-real-data is read by the GAN head only: set --dmd2-gan-disc-weight > 0, or remove it")
    _validate_scoring_sigma(args)
    # A range between two grid points is valid on its own and empty on the grid: found here, not in a rank.
    grid = sft_loss.trainer_flow_grid(args)
    try:
        if args.dmd2_scoring_sigma == "grid":
            dmd2_loss.scoring_grid_indices(args, grid)
        if gan_enabled(args):
            dmd2_loss.gan_grid_indices(args, grid)
    except ValueError as exc:
        reject(str(exc))
    for flag, value in (
        ("--dmd2-gan-mismatch-weight", args.dmd2_gan_mismatch_weight),
        ("--dmd2-gan-r1-weight", args.dmd2_gan_r1_weight),
        ("--dmd2-gan-r1-alpha", args.dmd2_gan_r1_alpha),
        ("--dmd2-gan-start-rollout", args.dmd2_gan_start_rollout),
    ):
        check_number(flag, value, low=0)
    gan_only = {
        "--dmd2-gan-projection": args.dmd2_gan_projection,
        "--dmd2-gan-mismatch-weight": args.dmd2_gan_mismatch_weight > 0,
        "--dmd2-gan-r1-weight": args.dmd2_gan_r1_weight > 0,
        "--dmd2-gan-start-rollout": args.dmd2_gan_start_rollout > 0,
        "--dmd2-gan-eval-real-data": bool(args.dmd2_gan_eval_real_data),
        "--dmd2-gan-max-timestep-ratio": args.dmd2_gan_max_timestep_ratio != GAN_MAX_TIMESTEP_RATIO,
    }
    for flag, used in gan_only.items():
        if used and not gan_enabled(args):
            reject(f"{flag} changes the GAN head: set --dmd2-gan-disc-weight > 0, or remove it")
    if args.dmd2_gan_mismatch_weight > 0 and args.micro_batch_size < 2:
        reject(
            "--dmd2-gan-mismatch-weight shows each real with another real's prompt from its micro-batch: set "
            f"--micro-batch-size >= 2 (got {args.micro_batch_size})"
        )
    if args.dmd2_gan_eval_real_data and not args.eval_interval:
        reject("--dmd2-gan-eval-real-data is read at evaluations only: set --eval-interval, or remove it")
    if not args.critic_lora_rank:
        # The critic's LoRA flags default to the student's, so one that differs was set for a critic without LoRA.
        for name in CRITIC_LORA_FLAGS[1:]:
            if getattr(args, f"critic_{name}") != getattr(args, name):
                flag = f"--critic-{name.replace('_', '-')}"
                reject(
                    f"{flag} is read with a critic LoRA only (the critic trains full weights): set --critic-lora-rank"
                )
    check_lora_flags("--critic-", args, args.critic_load, teacher=args.teacher_load)
    validate_reward_args(args)
    validate_regression_args(args)


def _check_norm_rescale(args: argparse.Namespace) -> None:
    """``--dmd2-teacher-cfg-norm-rescale`` only for a true-CFG teacher whose stock sampler has the rescale."""
    if not args.dmd2_teacher_cfg_norm_rescale:
        return
    from miles.models import get_model_family

    family = get_model_family(args.teacher_load, getattr(args, "diffusion_model_family", None))
    if not (supports(family, TrueCFG) and family.stock_cfg_norm_rescale):
        reject(
            f"--dmd2-teacher-cfg-norm-rescale is the Qwen-Image sampler's per-token norm rescale; the {family.name} "
            f"teacher {args.teacher_load} has none: remove it"
        )


def _validate_scoring_sigma(args: argparse.Namespace) -> None:
    rule = args.dmd2_scoring_sigma
    check_number("--dmd2-scoring-shift", args.dmd2_scoring_shift, low=0, low_open=True)
    check_number("--dmd2-scoring-logit-mean", args.dmd2_scoring_logit_mean)
    check_number("--dmd2-scoring-logit-std", args.dmd2_scoring_logit_std, low=0, low_open=True)
    defaults = {"--dmd2-scoring-shift": (args.dmd2_scoring_shift, 1.0, "shift")}
    defaults["--dmd2-scoring-logit-mean"] = (args.dmd2_scoring_logit_mean, 0.0, "logit-normal")
    defaults["--dmd2-scoring-logit-std"] = (args.dmd2_scoring_logit_std, 1.0, "logit-normal")
    for flag, (value, default, needs) in defaults.items():
        if value != default and rule != needs:
            reject(f"{flag} is read by --dmd2-scoring-sigma {needs} only (got --dmd2-scoring-sigma {rule})")


class DMD2Method(Method):
    name = "dmd2"
    description = "distribution matching distillation: critic (fake score) group, then the student"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        # One add_argument call per flag, shaped like the generic ones (miles/driver/arguments.py).
        group = parser.add_argument_group(
            "DMD2",
            "Distribution matching distillation (Yin et al. 2024). Teacher adapters and a reference model are not "
            "implemented, so their upstream flags do not exist. Read only by --loss-type dmd2.",
        )
        group.add_argument(
            "--critic-load",
            type=str,
            default=None,
            help="Critic (fake score) init pipeline directory; defaults to --teacher-load.",
        )
        group.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate; defaults to --lr.")
        group.add_argument(
            "--critic-lora-rank",
            type=int,
            default=None,
            help="Train the critic as a LoRA of this rank on the teacher's weights (one base in the critic group; "
            "the teacher runs with the adapters off); 0 trains full weights. Defaults to --lora-rank.",
        )
        group.add_argument(
            "--critic-lora-alpha", type=float, default=None, help="Critic's lora_alpha; defaults to --lora-alpha."
        )
        group.add_argument(
            "--critic-lora-target-modules",
            type=parse_target_modules,
            default=None,
            help="Critic's LoRA target modules; defaults to --lora-target-modules.",
        )
        group.add_argument(
            "--critic-lora-dropout",
            type=float,
            default=None,
            help="Critic's LoRA dropout; defaults to --lora-dropout.",
        )
        group.add_argument(
            "--dmd2-critic-steps-per-rollout",
            type=int,
            default=5,
            help="K critic (fake score) updates per student update, over the same DP shard.",
        )
        group.add_argument(
            "--dmd2-teacher-guidance-scale",
            type=float,
            default=None,
            help="Guidance scale of the teacher's score (1 = none; true CFG, or FLUX.1-dev's guidance input); the "
            "critic scores unguided. Default: the teacher's stock pipeline's (SD3 7, Qwen-Image 4, FLUX.1-dev 3.5, "
            "FLUX.2-klein base 4, Wan 5; else 1).",
        )
        group.add_argument(
            "--dmd2-teacher-cfg-norm-rescale",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Rescale the teacher's true-CFG velocity to the conditional one's norm per token, as the stock "
            "Qwen-Image sampler does, so the scale means its true_cfg_scale. Default: on for qwen_image.",
        )
        group.add_argument(
            "--dmd2-critic-scoring",
            type=str,
            default="fused",
            choices=("fused", "original"),
            help="fused: score after the K critic steps; original: score before the last critic step (reference).",
        )
        group.add_argument(
            "--dmd2-min-timestep-ratio",
            type=float,
            default=0.02,
            help="Lowest scoring timestep / 1000 (reference 2%%).",
        )
        group.add_argument(
            "--dmd2-max-timestep-ratio",
            type=float,
            default=0.98,
            help="Highest scoring timestep / 1000 (reference 98%%).",
        )
        group.add_argument(
            "--dmd2-scoring-sigma",
            type=str,
            default="grid",
            choices=scoring_sigma.SCORING_SIGMA_RULES,
            help="Scoring σ draw: grid (uniform over the --fsdp-flow-shift grid), shift (--dmd2-scoring-shift) or "
            "logit-normal (SD3's, --dmd2-scoring-logit-mean/-std); all within the min/max timestep ratios.",
        )
        group.add_argument(
            "--dmd2-scoring-shift",
            type=float,
            default=1.0,
            help="With --dmd2-scoring-sigma shift: σ = k·s/(1+(k−1)·s), s uniform; 1 = uniform σ, < 1 favours low σ.",
        )
        group.add_argument(
            "--dmd2-scoring-logit-mean",
            type=float,
            default=0.0,
            help="With --dmd2-scoring-sigma logit-normal: mean of logit(σ) (SD3: 0; negative favours low σ).",
        )
        group.add_argument(
            "--dmd2-scoring-logit-std",
            type=float,
            default=1.0,
            help="With --dmd2-scoring-sigma logit-normal: standard deviation of logit(σ) (SD3: 1).",
        )
        group.add_argument(
            "--dmd2-gan-disc-weight",
            type=float,
            default=0.0,
            help="Phase 2: weight of the critic's discriminator loss (reference 1e-2); > 0 adds the GAN head.",
        )
        group.add_argument(
            "--dmd2-gan-gen-weight",
            type=float,
            default=0.0,
            help="Phase 2: weight of the student's GAN loss (reference 1e-3 to 5e-3); needs the disc weight.",
        )
        group.add_argument(
            "--dmd2-gan-real-data",
            type=str,
            default=None,
            help="Phase 2: JSONL of real samples (image or latent, and prompt) the discriminator sees.",
        )
        group.add_argument(
            "--dmd2-gan-max-timestep-ratio",
            type=float,
            default=GAN_MAX_TIMESTEP_RATIO,
            help="Phase 2: highest diffusion-GAN noise timestep / 1000 (tianweiy/DMD2's diffusion_gan_max_timestep).",
        )
        group.add_argument(
            "--dmd2-gan-feature-blocks",
            type=int_list,
            default=None,
            help="Phase 2: critic blocks whose image tokens feed the head, e.g. '6,12'; default the middle one.",
        )
        group.add_argument(
            "--dmd2-gan-start-rollout",
            type=int,
            default=0,
            help="Phase 2: the student adds the GAN gradient from this rollout on (the head trains from the start).",
        )
        group.add_argument(
            "--dmd2-gan-projection",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="Phase 2: add the projection term <V·pooled prompt embedding, φ(x)> to the head (Miyato & Koyama 2018).",
        )
        group.add_argument(
            "--dmd2-gan-mismatch-weight",
            type=float,
            default=0.0,
            help="Phase 2: weight of real images shown with another sample's prompt as fakes (Reed et al. 2016).",
        )
        group.add_argument(
            "--dmd2-gan-r1-weight",
            type=float,
            default=0.0,
            help="Phase 2: weight of the approximate R1 penalty mean((D(real) − D(real + α·ε))²) (FastGen, APT).",
        )
        group.add_argument(
            "--dmd2-gan-r1-alpha",
            type=float,
            default=0.1,
            help="Phase 2: α, the std of the approximate R1's pixel perturbation of the clean reals (FastGen: 0.1).",
        )
        group.add_argument(
            "--dmd2-gan-eval-real-data",
            type=str,
            default=None,
            help="Phase 2: held-out real samples (JSONL like --dmd2-gan-real-data) on which every evaluation logs the "
            "discriminator's quality (eval/disc_*).",
        )
        add_reward_arguments(group)
        add_regression_arguments(group)

    def set_defaults(self, args: argparse.Namespace) -> None:
        fill_defaults(
            args,
            {
                **DMD2_ACTOR_HOOKS,
                # The regression rows ride in the student's own forward: its prepare and loss hooks in their place.
                **(REGRESSION_ACTOR_HOOKS if regression_enabled(args) else {}),
                "critic_load": args.teacher_load,
                "critic_lr": args.lr,
                **{f"critic_{name}": getattr(args, name) for name in CRITIC_LORA_FLAGS},
            },
        )
        fill_teacher_guidance(args)

    def validate(self, args: argparse.Namespace) -> None:
        validate_dmd2_args(args)

    def check_inputs(self, args: argparse.Namespace) -> None:
        """``--dmd2-gan-feature-blocks`` name blocks the critic's transformer has (its config's ``num_layers``); the
        reward group's family decodes with autograd."""
        check_reward_family(args)
        _check_norm_rescale(args)
        if not gan_enabled(args) or not args.dmd2_gan_feature_blocks:
            return
        from miles.models.base import DENOISER, read_json

        config = read_json(Path(args.critic_load) / DENOISER / "config.json", "critic transformer config")
        layers = config.get("num_layers") if isinstance(config, dict) else None
        for block in args.dmd2_gan_feature_blocks:
            if isinstance(layers, int) and block >= layers:
                where = (
                    "--critic-load" if args.critic_load != args.teacher_load else "--teacher-load (the critic's init)"
                )
                reject(
                    f"--dmd2-gan-feature-blocks holds block {block}, but {where} {args.critic_load} has {layers} "
                    f"transformer blocks (0..{layers - 1})"
                )

    def plan_lines(self, args: argparse.Namespace) -> list[str]:
        """The teacher's guidance: its scale, where it came from, its form and its negative prompt."""
        return [f"teacher guidance: {getattr(args, 'dmd2_teacher_guidance_origin', '')}"]

    def trainer_configs(self, args: argparse.Namespace) -> list[TrainerConfig]:
        """The critic first, so it catches up with the student that produced the rollout and then scores it for the
        actor's step (then, with ``--dmd2-reward-weight``, the frozen reward group); the actor's copy drops
        ``teacher_load`` so only the critic group holds the teacher."""
        k = args.dmd2_critic_steps_per_rollout
        critic = {
            "hf_checkpoint": args.critic_load,
            "lr": args.critic_lr,
            "load": sibling_dir(args.load, "_critic"),
            "save": sibling_dir(args.save, "_critic"),
            "save_hf": None,
            # The generator EMA is the student's; the critic tracks the student and keeps no average.
            "ema_decay": None,
            "num_steps_per_rollout": k,
            "global_batch_size": rollout_pairs(args) // k,
            **DMD2_CRITIC_HOOKS,
            "train_output_before_step": k - 1 if args.dmd2_critic_scoring == "original" else None,
        }
        # Only LoRA runs override the critic's LoRA flags, so a full-weight run's plan lists none of them.
        if args.critic_lora_rank:
            critic.update({name: getattr(args, f"critic_{name}") for name in CRITIC_LORA_FLAGS})
        elif args.lora_rank:
            critic["lora_rank"] = 0  # a LoRA student beside a full-weight critic
        if gan_enabled(args):
            critic.update(DMD2_GAN_CRITIC_HOOKS)
        reward = [reward_trainer_config()] if reward_enabled(args) else []  # DMDR's frozen group, before the actor
        return [TrainerConfig("critic", critic), *reward, TrainerConfig("actor", {"teacher_load": None})]

    def settings(self, args: argparse.Namespace) -> DMD2Settings:
        return DMD2Settings.from_args(args)

    def side_inputs(self, args: argparse.Namespace) -> list[SideInput]:
        """Phase 2: ``--dmd2-gan-real-data``, one real sample per generated one (``pair.extras["real"]``); with
        ``--dmd2-regression-weight``: one cached teacher pair per generated sample (``pair.extras["regression"]``)."""
        real = [SideInput(REAL_DATA, args.dmd2_gan_real_data, "--dmd2-gan-real-data")] if gan_enabled(args) else []
        return real + regression_side_inputs(args)

    def export_schedule(self, args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any] | None:
        """The student's few-step schedule and the teacher's CFG scale it was distilled from."""
        return {**engine, "distilled_guidance_scale": args.dmd2_teacher_guidance_scale}

    def eval_media(self, args: argparse.Namespace, groups: dict, eval_records: list[dict], rollout_id: int) -> dict:
        """The DMD2 debug grid (:mod:`miles.methods.dmd2_debug`) of fixed eval samples (tianweiy/DMD2 issue #33: to
        debug a collapsing run, look at exactly these): per sample ``x_i``, the student's x̂0_i, the teacher's and the
        critic's x0 predictions of it re-noised, and the gradient map g (and ``g_gan`` under phase 2), decoded
        through the family's VAE where there is one. The samples' noise and stop steps are keyed by the rollout id
        ``"debug"``, so every evaluation of a run draws the same ones: one per distinct eval prompt
        (:func:`debug_records`). Saved as ``<output-dir>/eval/dmd2_debug_<rollout>.png``."""
        records = debug_records(eval_records, args.input_key)
        return {"eval/dmd2_debug": dmd2_debug_grid(args, groups, records, rollout_id)}

    def eval_metrics(self, args: argparse.Namespace, groups: dict, rollout_id: int) -> dict[str, float]:
        """With ``--dmd2-gan-eval-real-data``: the discriminator's prompt AUC, real-vs-fake AUC and mean logits on
        held-out reals (:func:`miles.methods.dmd2_disc_eval.disc_quality`)."""
        if not (gan_enabled(args) and args.dmd2_gan_eval_real_data):
            return {}
        from miles.methods.dmd2_disc_eval import disc_quality

        return disc_quality(args, groups)

    def train_forward_batch(self, group_args: argparse.Namespace) -> int:
        """The GAN critic's forward carries its flow-matching rows, the noised fakes and the reals: 3 per pair,
        plus one for the mismatched-prompt reals (``--dmd2-gan-mismatch-weight``) and one for the perturbed reals
        (``--dmd2-gan-r1-weight``); the student's with ``--dmd2-regression-weight`` 2 per pair."""
        prepare = group_args.custom_prepare_train_batch_path
        if prepare == REGRESSION_ACTOR_HOOKS["custom_prepare_train_batch_path"]:
            return 2 * group_args.micro_batch_size  # the student's rows and as many regression rows
        if prepare != DMD2_GAN_CRITIC_HOOKS["custom_prepare_train_batch_path"]:
            return group_args.micro_batch_size
        rows = 3 + (group_args.dmd2_gan_mismatch_weight > 0) + (group_args.dmd2_gan_r1_weight > 0)
        return rows * group_args.micro_batch_size

    def train_output_work(self, group_args: argparse.Namespace, pairs_per_rank: int) -> list[PhaseWork]:
        if group_args.num_steps_per_rollout == 0 and reward_enabled(group_args):
            return reward_work(group_args, pairs_per_rank)
        if group_args.custom_train_output_function_path != DMD2_CRITIC_HOOKS["custom_train_output_function_path"]:
            return []
        micro_batches = -(-pairs_per_rank // group_args.micro_batch_size)
        # true CFG runs [uncond; cond] in one forward; an embedded-guidance teacher runs once
        true_cfg = getattr(group_args, "dmd2_teacher_guidance_form", TRUE_CFG) == TRUE_CFG
        cfg = 2 if group_args.dmd2_teacher_guidance_scale > 1 and true_cfg else 1
        return [
            PhaseWork("scoring: teacher", micro_batches, 0, cfg * group_args.micro_batch_size),
            PhaseWork("scoring: critic", micro_batches, 0, group_args.micro_batch_size),
        ]
