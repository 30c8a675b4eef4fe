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
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.backends.fsdp_utils.loss_hub import dmd2 as dmd2_loss
from miles.backends.fsdp_utils.loss_hub import gan
from miles.backends.fsdp_utils.loss_hub import sft as sft_loss
from miles.backends.fsdp_utils.loss_hub.dmd2_types import REAL_DATA, DMD2Settings, dmd2_settings
from miles.config import CheckpointSpec, GroupHooks, GroupSpec, UserHooks
from miles.methods.base import Method, PhaseWork, optimizer_spec, register_method, schedule_spec, student_group
from miles.methods.dmd2_debug import debug_records, dmd2_debug_grid
from miles.methods.dmd2_regression import REGRESSION_ACTOR_HOOKS, regression_side_inputs, validate_regression_args
from miles.methods.dmd2_reward import check_reward_family, reward_group, reward_work, validate_reward_args
from miles.models.capabilities import EmbeddedGuidance, TrueCFG, supports
from miles.models.lora import LoraFlags, check_lora_flags
from miles.ray.data_conversion_hub import dmd2 as dmd2_conversion
from miles.rollout import step_strategy_hub
from miles.utils.flags import add_dataclass_arguments, check_fields
from miles.utils.paths import sibling_dir
from miles.utils.types import SideInput
from miles.utils.validation import context_parallel_size, dp_size, reject, rollout_pairs

__all__ = [
    "DMD2Method",
    "DMD2_ACTOR_HOOKS",
    "DMD2_CRITIC_HOOKS",
    "DMD2_GAN_CRITIC_HOOKS",
    "fill_teacher_guidance",
    "gan_enabled",
    "validate_dmd2_args",
]

# The actor's prepare and loss hooks (seed [DMD2 5/7]).
DMD2_ACTOR_HOOKS = GroupHooks(prepare=dmd2_loss.prepare_generator_batch, loss=dmd2_loss.dmd2_loss_formula)
# The critic's: flow matching on x̂0_i, then the scoring ([DMD2 4/7]).
DMD2_CRITIC_HOOKS = GroupHooks(
    prepare=dmd2_loss.prepare_critic_batch,
    loss=sft_loss.sft_loss_formula,
    train_output=dmd2_loss.predict_teacher_and_critic_x0,
)
# Phase 2: the critic holds the GAN head too and trains it beside its flow-matching loss.
DMD2_GAN_CRITIC_HOOKS = GroupHooks(
    prepare=dmd2_loss.prepare_critic_gan_batch, loss=dmd2_loss.critic_gan_loss, build_modules=gan.build_discriminator
)


# The GAN's noise range top when the flag is not given: a different value only changes the GAN head.
GAN_MAX_TIMESTEP_RATIO = DMD2Settings.gan_max_timestep_ratio


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
        family = get_model_family(args.teacher_load, args.diffusion_model_family)
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
    if args.negative_cond:
        return f"--negative-cond {args.negative_cond}"
    origin = args.negative_prompt_origin
    return f"the negative prompt {args.negative_prompt!r}" + (f" ({origin})" if origin else "")


def gan_enabled(args: argparse.Namespace) -> bool:
    """Phase 2 (the GAN head) is on when the critic trains a discriminator."""
    return dmd2_settings(args).gan_enabled


def validate_dmd2_args(args: argparse.Namespace) -> None:
    """Reject what ``--loss-type dmd2`` cannot run (seed ``[DMD2 4/7]``). Reads the generic flags from ``args`` and
    the method's own from its settings (``args.method_settings``): each field's number check first
    (:func:`miles.utils.flags.check_fields`), then what ties the flags together.

    Raises:
        ArgumentValidationError: one line naming the flags and the fix.
    """
    if not args.teacher_load:
        reject("--loss-type dmd2 needs --teacher-load (the frozen teacher pipeline directory)")
    s = dmd2_settings(args)
    check_fields(s)
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
    if s.critic_lr is not None and args.min_lr > s.critic_lr:
        reject(f"--min-lr {args.min_lr} must be <= --critic-lr {s.critic_lr} (the critic's schedule decays to it)")
    k = s.critic_steps_per_rollout
    shard = rollout_pairs(args) // dp_size(args)
    if shard % k != 0 or (shard // k) % args.micro_batch_size != 0:
        reject(
            f"--dmd2-critic-steps-per-rollout {k} must split each DP shard of {shard} pairs into equal steps of "
            f"whole micro-batches (--micro-batch-size {args.micro_batch_size}); pick K dividing {shard}"
        )
    ratios = (s.min_timestep_ratio, s.max_timestep_ratio)
    if not 0 <= ratios[0] < ratios[1] <= 1:
        reject(f"need 0 <= --dmd2-min-timestep-ratio < --dmd2-max-timestep-ratio <= 1, got {ratios}")
    if s.gan_enabled and not s.min_timestep_ratio < s.gan_max_timestep_ratio <= 1:
        reject(
            f"need --dmd2-min-timestep-ratio < --dmd2-gan-max-timestep-ratio <= 1, got "
            f"{(s.min_timestep_ratio, s.gan_max_timestep_ratio)}"
        )
    if s.gan_gen_weight > 0 and not s.gan_enabled:
        reject("--dmd2-gan-gen-weight needs a trained discriminator: set --dmd2-gan-disc-weight > 0 (reference 1e-2)")
    if s.gan_enabled and not s.gan_real_data:
        reject(
            "--dmd2-gan-disc-weight > 0 needs --dmd2-gan-real-data (a JSONL of real images or latents with prompts)"
        )
    for block in s.gan_feature_blocks or []:
        if block < 0:
            reject(f"--dmd2-gan-feature-blocks holds {block}; block indices are >= 0")
    if s.gan_real_data and not s.gan_enabled:
        reject("--dmd2-gan-real-data is read by the GAN head only: set --dmd2-gan-disc-weight > 0, or remove it")
    if s.gan_enabled and context_parallel_size(args) > 1:
        # Under context parallelism each rank's tapped block features hold its own part of the sequence only.
        reject(
            f"--dmd2-gan-disc-weight > 0 with --context-parallel-size {context_parallel_size(args)}: the GAN head "
            "reads block features that context parallelism splits over the ranks; use --context-parallel-size 1"
        )
    _validate_scoring_sigma(s)
    # A range between two grid points is valid on its own and empty on the grid: found here, not in a rank.
    grid = sft_loss.trainer_flow_grid(args)
    try:
        if s.scoring_sigma == "grid":
            dmd2_loss.scoring_grid_indices(args, grid)
        if s.gan_enabled:
            dmd2_loss.gan_grid_indices(args, grid)
    except ValueError as exc:
        reject(str(exc))
    gan_only = {
        "--dmd2-gan-projection": s.gan_projection,
        "--dmd2-gan-mismatch-weight": s.gan_mismatch_weight > 0,
        "--dmd2-gan-r1-weight": s.gan_r1_weight > 0,
        "--dmd2-gan-start-rollout": s.gan_start_rollout > 0,
        "--dmd2-gan-eval-real-data": bool(s.gan_eval_real_data),
        "--dmd2-gan-max-timestep-ratio": s.gan_max_timestep_ratio != GAN_MAX_TIMESTEP_RATIO,
    }
    for flag, used in gan_only.items():
        if used and not s.gan_enabled:
            reject(f"{flag} changes the GAN head: set --dmd2-gan-disc-weight > 0, or remove it")
    if s.gan_mismatch_weight > 0 and args.micro_batch_size < 2:
        reject(
            "--dmd2-gan-mismatch-weight shows each real with another real's prompt from its micro-batch: set "
            f"--micro-batch-size >= 2 (got {args.micro_batch_size})"
        )
    if s.gan_eval_real_data and not args.eval_interval:
        reject("--dmd2-gan-eval-real-data is read at evaluations only: set --eval-interval, or remove it")
    if not s.critic_lora_rank:
        # The critic's LoRA flags default to the student's, so one that differs was set for a critic without LoRA.
        for name, critic, student in (
            ("--critic-lora-alpha", s.critic_lora_alpha, args.lora_alpha),
            ("--critic-lora-target-modules", s.critic_lora_target_modules, args.lora_target_modules),
            ("--critic-lora-dropout", s.critic_lora_dropout, args.lora_dropout),
        ):
            if critic != student:
                reject(
                    f"{name} is read with a critic LoRA only (the critic trains full weights): set --critic-lora-rank"
                )
    check_lora_flags("--critic-", _critic_lora(s), s.critic_load, teacher=args.teacher_load)
    validate_reward_args(s)
    validate_regression_args(args, s)


def _critic_lora(s: DMD2Settings) -> LoraFlags:
    return LoraFlags(s.critic_lora_rank, s.critic_lora_alpha, s.critic_lora_target_modules, s.critic_lora_dropout)


def _check_norm_rescale(args: argparse.Namespace) -> None:
    """``--dmd2-teacher-cfg-norm-rescale`` only for a true-CFG teacher whose stock sampler has the rescale."""
    if not dmd2_settings(args).teacher_cfg_norm_rescale:
        return
    from miles.models import get_model_family

    family = get_model_family(args.teacher_load, args.diffusion_model_family)
    if not (supports(family, TrueCFG) and family.stock_cfg_norm_rescale):
        reject(
            f"--dmd2-teacher-cfg-norm-rescale is the Qwen-Image sampler's per-token norm rescale; the {family.name} "
            f"teacher {args.teacher_load} has none: remove it"
        )


def _validate_scoring_sigma(s: DMD2Settings) -> None:
    rule = s.scoring_sigma
    defaults = {"--dmd2-scoring-shift": (s.scoring_shift, 1.0, "shift")}
    defaults["--dmd2-scoring-logit-mean"] = (s.scoring_logit_mean, 0.0, "logit-normal")
    defaults["--dmd2-scoring-logit-std"] = (s.scoring_logit_std, 1.0, "logit-normal")
    for flag, (value, default, needs) in defaults.items():
        if value != default and rule != needs:
            reject(f"{flag} is read by --dmd2-scoring-sigma {needs} only (got --dmd2-scoring-sigma {rule})")


@register_method
class DMD2Method(Method):
    name = "dmd2"
    description = "distribution matching distillation: critic (fake score) group, then the student"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group(
            "DMD2",
            "Distribution matching distillation (Yin et al. 2024). Teacher adapters and a reference model are not "
            "implemented, so their upstream flags do not exist. Read only by --loss-type dmd2.",
        )
        add_dataclass_arguments(group, DMD2Settings)  # one flag per settings field, in field order

    def set_defaults(self, args: argparse.Namespace) -> None:
        # The critic starts from the teacher at the student's learning rate and LoRA, unless told otherwise.
        values = vars(args)
        for critic, source in (
            ("critic_load", "teacher_load"),
            ("critic_lr", "lr"),
            *((f"critic_{name}", name) for name in ("lora_rank", "lora_alpha", "lora_target_modules", "lora_dropout")),
        ):
            if values[critic] is None:
                values[critic] = values[source]
        fill_teacher_guidance(args)

    def validate(self, args: argparse.Namespace) -> None:
        validate_dmd2_args(args)

    def default_hooks(self, args: argparse.Namespace) -> GroupHooks:
        # The regression rows ride in the student's own forward: its prepare and loss hooks in their place.
        return REGRESSION_ACTOR_HOOKS if dmd2_settings(args).regression_enabled else DMD2_ACTOR_HOOKS

    def converter(self, args: argparse.Namespace) -> Callable:
        return dmd2_conversion.expand_samples_to_train_pairs

    def step_strategy(self, args: argparse.Namespace) -> Callable:
        """DMD2's backward simulation: each sample stops at a random step ([DMD2 3/7])."""
        return step_strategy_hub.stop_at_random_step

    def guided_pipelines(self, args: argparse.Namespace) -> list[tuple[str, float, str, str]]:
        scale = dmd2_settings(args).teacher_guidance_scale
        if scale is None or not args.teacher_load:
            return []
        return [("--dmd2-teacher-guidance-scale", scale, "--teacher-load", args.teacher_load)]

    def hook_flags(self, args: argparse.Namespace) -> dict[str, str | None]:
        return {"dmd2_reward_function_path": dmd2_settings(args).reward_function_path}

    def check_inputs(self, args: argparse.Namespace) -> None:
        """``--dmd2-gan-feature-blocks`` name blocks the critic's transformer has (its config's ``num_layers``); the
        reward group's family decodes with autograd."""
        check_reward_family(args)
        _check_norm_rescale(args)
        s = dmd2_settings(args)
        if not s.gan_enabled or not s.gan_feature_blocks:
            return
        from miles.models.base import DENOISER, read_json

        config = read_json(Path(s.critic_load) / DENOISER / "config.json", "critic transformer config")
        layers = config.get("num_layers") if isinstance(config, dict) else None
        for block in s.gan_feature_blocks:
            if isinstance(layers, int) and block >= layers:
                where = "--critic-load" if s.critic_load != args.teacher_load else "--teacher-load (the critic's init)"
                reject(
                    f"--dmd2-gan-feature-blocks holds block {block}, but {where} {s.critic_load} has {layers} "
                    f"transformer blocks (0..{layers - 1})"
                )

    def plan_lines(self, args: argparse.Namespace) -> list[str]:
        """The teacher's guidance: its scale, where it came from, its form and its negative prompt."""
        return [f"teacher guidance: {dmd2_settings(args).teacher_guidance_origin}"]

    def groups(self, args: argparse.Namespace, hooks: UserHooks) -> list[GroupSpec]:
        """The critic first, so it catches up with the student that produced the rollout and then scores it for the
        actor's step (then, with ``--dmd2-reward-weight``, the frozen reward group); only the critic group holds
        the teacher.

        The critic starts from ``--critic-load`` at ``--critic-lr`` with its own LoRA (``--critic-lora-*``), trains
        K = ``--dmd2-critic-steps-per-rollout`` steps per rollout on the same DP shard, keeps no EMA (the student's
        is the generator's) and checkpoints into ``<load>_critic`` / ``<save>_critic``; its prepare, loss and
        train-output hooks are DMD2's (the GAN's under phase 2), the user's train-input hook and trainer class
        apply to it as to the actor."""
        s = dmd2_settings(args)
        student = student_group(args, hooks.group.over(self.default_hooks(args)))
        k = s.critic_steps_per_rollout
        critic_hooks = dataclasses.replace(
            DMD2_CRITIC_HOOKS,
            train_input=hooks.group.train_input,
            build_modules=hooks.group.build_modules,
            trainer=hooks.group.trainer,
        )
        if s.gan_enabled:
            critic_hooks = DMD2_GAN_CRITIC_HOOKS.over(critic_hooks)
        critic = dataclasses.replace(
            student,
            role="critic",
            hooks=critic_hooks,
            init=s.critic_load,
            lora=_critic_lora(s).settings(),
            optimizer=optimizer_spec(args, s.critic_lr),
            schedule=schedule_spec(args, k),
            ema=None,  # the generator EMA is the student's; the critic tracks the student and keeps no average
            checkpoint=CheckpointSpec(load=sibling_dir(args.load, "_critic"), save=sibling_dir(args.save, "_critic")),
            steps_per_rollout=k,
            train_output_before_step=k - 1 if s.critic_scoring == "original" else None,
            # Its init is --critic-load, which defaults to --teacher-load; its teacher is the command's.
            path_flags={
                "init": "--teacher-load" if s.critic_load == args.teacher_load else "--critic-load",
                "teacher": "--teacher-load",
            },
        )
        reward = [reward_group(args, hooks)] if s.reward_enabled else []  # DMDR's frozen group, before the actor
        return [critic, *reward, dataclasses.replace(student, teacher=None)]

    def settings(self, args: argparse.Namespace) -> DMD2Settings:
        return DMD2Settings.from_args(args)

    def side_inputs(self, args: argparse.Namespace) -> list[SideInput]:
        """Phase 2: ``--dmd2-gan-real-data``, one real sample per generated one (``pair.extras["real"]``); with
        ``--dmd2-regression-weight``: one cached teacher pair per generated sample (``pair.extras["regression"]``)."""
        s = dmd2_settings(args)
        real = [SideInput(REAL_DATA, s.gan_real_data, "--dmd2-gan-real-data")] if s.gan_enabled else []
        return real + regression_side_inputs(s)

    def eval_data(self, args: argparse.Namespace) -> list[SideInput]:
        """Phase 2: ``--dmd2-gan-eval-real-data``, the held-out reals of the discriminator's figures."""
        s = dmd2_settings(args)
        if not (s.gan_enabled and s.gan_eval_real_data and args.eval_interval):
            return []
        return [SideInput(REAL_DATA, s.gan_eval_real_data, "--dmd2-gan-eval-real-data")]

    def export_schedule(self, args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any] | None:
        """The student's few-step schedule and the teacher's CFG scale it was distilled from."""
        return {**engine, "distilled_guidance_scale": dmd2_settings(args).teacher_guidance_scale}

    def eval_media(self, args: argparse.Namespace, groups: dict, eval_records: list[dict], rollout_id: int) -> dict:
        """The DMD2 debug grid (:mod:`miles.methods.dmd2_debug`) of fixed eval samples (tianweiy/DMD2 issue #33: to
        debug a collapsing run, look at exactly these): per sample ``x_i``, the student's x̂0_i, the teacher's and the
        critic's x0 predictions of it re-noised, and the gradient map g (and ``g_gan`` under phase 2), decoded
        through the family's VAE where there is one. The samples' noise and stop steps are keyed by the rollout id
        ``"debug"``, so every evaluation of a run draws the same ones: one per distinct eval prompt
        (:func:`debug_records`). Saved as ``<output-dir>/eval/dmd2_debug_<rollout>.png`` (a video family's clips as
        frame strips, and the animation ``dmd2_debug_<rollout>.gif`` beside it, logged as ``eval/dmd2_debug_video``).
        """
        records = debug_records(eval_records, args.input_key)
        return dmd2_debug_grid(args, groups, records, rollout_id)

    def eval_metrics(self, args: argparse.Namespace, groups: dict, rollout_id: int) -> dict[str, float]:
        """With ``--dmd2-gan-eval-real-data``: the discriminator's prompt AUC, real-vs-fake AUC and mean logits on
        held-out reals (:func:`miles.methods.dmd2_disc_eval.disc_quality`)."""
        s = dmd2_settings(args)
        if not (s.gan_enabled and s.gan_eval_real_data):
            return {}
        from miles.methods.dmd2_disc_eval import disc_quality

        return disc_quality(args, groups)

    def train_forward_batch(self, args: argparse.Namespace, group: GroupSpec) -> int:
        """The GAN critic's forward carries its flow-matching rows, the noised fakes and the reals: 3 per pair,
        plus one for the mismatched-prompt reals (``--dmd2-gan-mismatch-weight``) and one for the perturbed reals
        (``--dmd2-gan-r1-weight``); the student's with ``--dmd2-regression-weight`` 2 per pair."""
        if group.hooks.prepare is REGRESSION_ACTOR_HOOKS.prepare:
            return 2 * group.micro_batch_size  # the student's rows and as many regression rows
        if group.hooks.prepare is not DMD2_GAN_CRITIC_HOOKS.prepare:
            return group.micro_batch_size
        s = dmd2_settings(args)
        rows = 3 + (s.gan_mismatch_weight > 0) + (s.gan_r1_weight > 0)
        return rows * group.micro_batch_size

    def train_output_work(self, args: argparse.Namespace, group: GroupSpec, pairs_per_rank: int) -> list[PhaseWork]:
        s = dmd2_settings(args)
        if not group.trains and s.reward_enabled:
            return reward_work(group, pairs_per_rank)
        if group.hooks.train_output is not DMD2_CRITIC_HOOKS.train_output:
            return []
        micro_batches = -(-pairs_per_rank // group.micro_batch_size)
        # true CFG runs [uncond; cond] in one forward; an embedded-guidance teacher runs once
        cfg = 2 if s.teacher_guidance_scale > 1 and s.teacher_guidance_form == TRUE_CFG else 1
        return [
            PhaseWork("scoring: teacher", micro_batches, 0, cfg * group.micro_batch_size),
            PhaseWork("scoring: critic", micro_batches, 0, group.micro_batch_size),
        ]
