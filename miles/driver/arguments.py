"""Command-line arguments of ``train_diffusion.py``: the parser and ``parse_args``.

``parse_args`` builds the parser (the generic groups here, plus each method's own group from ``miles.methods``),
fills defaults that depend on other flags (the generic ones here, then the chosen method's ``set_defaults`` and its
typed settings), then runs the validators (:mod:`miles.driver.validators`: generic, then the method's). Validators
only reject: each rejection is one line naming the flags and the fix, exit code 2. ``docs/cli-reference.md`` is
generated from ``build_parser()`` (``python -m miles.driver.cli_reference``).
"""

import argparse

from miles.driver.family_defaults import fill_flow_shifts, fill_negative_prompt
from miles.driver.validators import NUMBER_RULES, group_paths, method_flag_dests, run_paths, validate_args
from miles.methods import METHODS, get_method
from miles.models.lora import parse_target_modules
from miles.utils.device import DEFAULT_DEVICE, PEAK_TFLOPS
from miles.utils.profiling import add_profiling_args
from miles.utils.validation import ArgumentValidationError, float_list, rollout_pairs

__all__ = [
    "ArgumentValidationError",
    "build_parser",
    "group_paths",
    "method_flag_dests",
    "NUMBER_RULES",
    "parse_args",
    "run_paths",
    "set_default_diffusion_args",
    "validate_args",
]


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default: ``(default: 1e-05)``; none for unset (None) and on/off flags."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class _OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage dump), exit code 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# One add_argument call per flag, here and in each method's add_arguments: the repeated shape is argparse's API (a
# flag's name, type, default and help), not logic to share.
def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster and placement")
    group.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes for the trainer groups.")
    group.add_argument(
        "--actor-num-gpus-per-node",
        type=int,
        default=1,
        help="Trainer ranks per node: GPUs with CUDA, CPU ranks without. DP size = nodes x this / --context-parallel-size.",
    )
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Ranks that split one sample's sequence (Ulysses context parallelism through diffusers' "
        "ContextParallelConfig; Wan, FLUX, FLUX.2, Qwen-Image). DP size = trainer ranks / this; FSDP shards over "
        "all ranks. The image/video token count and the head count must divide by it.",
    )
    group.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=0,
        help="Bundles for dedicated rollout-engine replicas (must divide the DP size); 0: the actor ranks generate.",
    )
    group.add_argument(
        "--num-cpus-per-rank",
        type=int,
        default=None,
        help="CPUs (and torch threads, at most $OMP_NUM_THREADS when set) of each rank's bundle; default: a node's "
        "CPUs / its ranks.",
    )
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=60.0,
        help="How long a rank waits for the others in a collective before giving up (the process groups' timeout; "
        "NCCL's own default is 10). Rank 0 alone exports pipelines and pushes weights to engine replicas meanwhile.",
    )
    group.add_argument(
        "--ray-address",
        type=str,
        default=None,
        help="Ray cluster to join, host:port (default: RAY_ADDRESS if set, else a new local cluster of this run's "
        "own). --dry-run checks its form; a run checks that a cluster answers there.",
    )
    group.add_argument(
        "--dry-run", action="store_true", help="Validate, print groups, placement, schedule and memory plan, exit."
    )
    group.add_argument(
        "--gpu-memory-gib",
        "--gpu-memory-gb",
        dest="gpu_memory_gb",
        metavar="GIB",
        type=float,
        default=None,
        help="GiB (2^30 bytes) of memory per GPU that --dry-run checks each rank's planned peak against (default: the "
        "CUDA device's); a plan that does not fit exits with code 2. --gpu-memory-gb is its older name.",
    )
    group.add_argument(
        "--gpu-type",
        choices=sorted(PEAK_TFLOPS),
        default=None,
        help="The GPU whose dense bf16 peak --dry-run's time estimate assumes (default: this machine's CUDA device "
        f"when known, else {DEFAULT_DEVICE}).",
    )


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "--hf-checkpoint", type=str, default=None, help="Student pipeline directory (diffusers layout)."
    )
    group.add_argument(
        "--teacher-load",
        type=str,
        default=None,
        help="Frozen teacher pipeline directory; needs a consumer (dmd2, or a custom prepare/loss/train-output hook).",
    )
    group.add_argument(
        "--teacher-lora",
        type=str,
        action="append",
        default=None,
        metavar="PATH[:WEIGHT]",
        help="A LoRA in diffusers' format (a save_lora_weights folder or its .safetensors) fused into the teacher at "
        "WEIGHT (default 1), repeatable: distill your fine-tune. The fused pipeline is written to "
        "<output-dir>/teacher_lora; the student and the critic start from it where they start from --teacher-load.",
    )
    group.add_argument(
        "--teacher-lora-teacher-only",
        action="store_true",
        help="Fuse --teacher-lora into the teacher alone: the student and the critic start from their own pipelines.",
    )
    group.add_argument(
        "--diffusion-model-family",
        type=str,
        default=None,
        help="Model family: a registered name (sd3, digits, qwen_image, flux, flux2, wan) or a dotted path to a family class "
        "(my_pkg.family.MyFamily); default: the registered family of --hf-checkpoint's model_index.json.",
    )
    group.add_argument(
        "--train-dtype",
        type=str,
        default="float32",
        choices=("float32", "bfloat16"),
        help="Compute dtype of forward/backward; trainable weights and optimizer stay float32, frozen ones use it.",
    )
    group.add_argument(
        "--fsdp-reshard-every-microbatch",
        action="store_true",
        help="Reshard parameters after every forward and reduce-scatter every micro-batch (less memory, 3x collectives).",
    )
    group.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="Recompute each transformer block's activations in backward (less memory, ~1/3 more compute).",
    )
    group.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="Train the student as a LoRA of this rank on its frozen base (peft); 0 trains full weights.",
    )
    group.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        help="With --lora-rank: lora_alpha (the update is scaled by alpha / rank); default the rank.",
    )
    group.add_argument(
        "--lora-target-modules",
        type=parse_target_modules,
        default=None,
        help="With --lora-rank: module-name suffixes to adapt, e.g. 'to_q,to_k,to_v,to_out.0'; default the "
        "attention and MLP projections of the diffusers DiTs (miles.models.lora).",
    )
    group.add_argument(
        "--lora-dropout", type=float, default=0.0, help="With --lora-rank: dropout on the adapter's input."
    )


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FSDP training")
    group.add_argument(
        "--loss-type",
        type=str,
        default="sft_loss",
        choices=tuple(METHODS),
        help="Training algorithm: " + "; ".join(f"{name}: {method.description}" for name, method in METHODS.items()),
    )
    group.add_argument("--num-rollout", type=int, default=None, help="Rollouts to run (one actor update each).")
    group.add_argument("--num-steps-per-rollout", type=int, default=1, help="Optimizer steps per rollout.")
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Train pairs per optimizer step over all DP ranks; default: rollout pairs / --num-steps-per-rollout.",
    )
    group.add_argument("--micro-batch-size", type=int, default=1, help="Train pairs per forward on one rank.")
    group.add_argument(
        "--fsdp-flow-shift",
        type=float,
        default=None,
        help="Flow shift of the trainer's 1000-point sigma grid (SFT noise levels, DMD2 scoring); default: the "
        "model family's (its stock pipeline's at the pipeline's resolution), else 3.0.",
    )
    group.add_argument("--seed", type=int, default=1234, help="Seed of the trainers' draws (noise, sigma).")
    group.add_argument(
        "--train-only",
        action="store_true",
        help="Train on --prompt-data images without the rollout engine (sft_loss, e.g. the digits teacher).",
    )
    group.add_argument(
        "--train-output-before-step",
        type=int,
        default=None,
        help="Run the train-output hook before this optimizer step instead of after the last (dmd2's critic: "
        "--dmd2-critic-scoring original).",
    )
    group.add_argument(
        "--sft-uncond-prob",
        type=float,
        default=0.0,
        help="SFT: share of pairs trained on the negative prompt's cond, so the model learns CFG's unconditional.",
    )


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("optimizer")
    group.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the actor (student).")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1 of every group.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW beta2 of every group.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon.")
    group.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay.")
    group.add_argument("--clip-grad", type=float, default=1.0, help="Max global grad norm; 0 disables clipping.")
    group.add_argument(
        "--lr-decay-style",
        type=str,
        default="constant",
        choices=("constant", "cosine"),
        help="Learning-rate schedule after the warmup; cosine decays to --min-lr over the run.",
    )
    group.add_argument("--lr-warmup-steps", type=int, default=0, help="Linear warmup in optimizer steps.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Final learning rate of the cosine schedule.")
    group.add_argument(
        "--max-skipped-steps",
        type=int,
        default=3,
        help="Optimizer steps in a row (>= 1) a group may skip for a non-finite gradient norm before the run stops.",
    )
    group.add_argument(
        "--ema-decay",
        type=float,
        default=None,
        help="Keep an EMA of the student's weights with this decay (e.g. 0.99; diffusers' EMAModel warm-up).",
    )
    group.add_argument(
        "--ema-min-decay",
        type=float,
        default=0.0,
        help="Floor of the EMA's warm-up decay (diffusers' EMAModel min_decay); = --ema-decay turns the warm-up off.",
    )
    group.add_argument(
        "--ema-update-after-step",
        type=int,
        default=0,
        help="The EMA copies the live weights until this optimizer step, then averages (diffusers' update_after_step).",
    )
    group.add_argument(
        "--ema-for-eval",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --ema-decay: evaluate and export the EMA weights (rollouts always use the live ones).",
    )


def _add_rollout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollout engine")
    group.add_argument("--rollout-batch-size", type=int, default=None, help="Prompts per rollout.")
    group.add_argument("--n-samples-per-prompt", type=int, default=1, help="Samples generated per prompt.")
    group.add_argument("--diffusion-num-steps", type=int, default=4, help="Steps of the student's sampler.")
    group.add_argument(
        "--diffusion-flow-shift",
        type=float,
        default=None,
        help="Flow shift of the student's sampling schedule; default: the model family's (its stock pipeline's at "
        "the pipeline's resolution), else 3.0.",
    )
    group.add_argument(
        "--diffusion-timesteps",
        type=float_list,
        default=None,
        help="Explicit descending student timesteps in (0, 1000], e.g. '1000,750,500,250'; overrides steps/shift.",
    )
    group.add_argument(
        "--diffusion-guidance-scale", type=float, default=1.0, help="CFG scale of the student rollout; 1 = no CFG."
    )
    group.add_argument(
        "--diffusion-step-rule",
        type=str,
        default="dmd2",
        choices=("dmd2", "euler"),
        help="dmd2: predict x0 and re-noise with fresh noise; euler: the flow ODE step.",
    )
    group.add_argument(
        "--diffusion-step-strategy-path",
        type=str,
        default=None,
        help="fn(args, rollout_id, sample_indices, num_steps) -> stop step per sample (None = full trajectory).",
    )
    group.add_argument(
        "--negative-prompt",
        type=str,
        default=None,
        help='Negative prompt for CFG; default: the model family\'s stock one (""; Qwen-Image " ").',
    )
    group.add_argument(
        "--negative-cond",
        type=str,
        default=None,
        help="Cached cond (.safetensors) of the negative prompt; default: encode --negative-prompt.",
    )
    group.add_argument(
        "--encode-negative-prompt",
        action="store_true",
        help="Give every sample the negative prompt's cond (set by dmd2 with teacher CFG, SFT cond dropout).",
    )
    group.add_argument("--rollout-seed", type=int, default=42, help="Seed of the engine's noise and data shuffle.")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--prompt-data", type=str, default=None, help="JSONL file of prompts (and images for SFT).")
    group.add_argument("--input-key", type=str, default="prompt", help="JSONL key of the prompt.")
    group.add_argument("--image-key", type=str, default="image", help="JSONL key of the image for --train-only.")
    group.add_argument(
        "--condition-image-key",
        type=str,
        default="condition_image",
        help="JSONL key of the reference image an image-conditioned family (qwen_image_edit) edits: a .png / .npy "
        "path relative to the JSONL file, or nested uint8 pixels.",
    )
    group.add_argument(
        "--latent-key",
        type=str,
        default="latent",
        help="JSONL key of a stored latent file (.safetensors / .npy), used instead of the image when present.",
    )
    group.add_argument(
        "--cond-key",
        type=str,
        default="cond",
        help="JSONL key of a prompt's cached cond file (python -m miles.rollout.prompt_cache); else encoded.",
    )
    group.add_argument(
        "--rollout-shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reshuffle the prompts every epoch (seeded by --rollout-seed).",
    )


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoint")
    group.add_argument("--load", type=str, default=None, help="Checkpoint directory to resume from (its latest).")
    group.add_argument("--save", type=str, default=None, help="Checkpoint directory; the critic uses <save>_critic.")
    group.add_argument("--save-interval", type=int, default=None, help="Save every N rollouts (and at the end).")
    group.add_argument(
        "--save-hf", type=str, default=None, help="Export the student as a diffusers pipeline directory at the end."
    )
    group.add_argument(
        "--save-hf-lora",
        action="store_true",
        help="With --save-hf and --lora-rank: also write the student's adapter alone to <save-hf>/lora in diffusers' "
        "LoRA format (pipe.load_lora_weights on the base pipeline); --save-hf itself holds the merged weights.",
    )
    group.add_argument(
        "--overwrite-save-hf",
        action="store_true",
        help="Let --save-hf replace an existing pipeline directory (never anything else).",
    )
    group.add_argument(
        "--overwrite-save",
        action="store_true",
        help="Let --save start afresh in a directory holding another run's checkpoints: removes their latest, "
        "rollout_* and temporary entries (in every group's directory), never other files.",
    )
    group.add_argument(
        "--save-keep-last",
        type=int,
        default=None,
        help="Keep the N newest committed checkpoints; older ones are removed after each commit (default: all).",
    )
    group.add_argument(
        "--save-keep-every",
        type=int,
        default=None,
        help="With --save-keep-last: also keep every checkpoint whose rollout number is a multiple of K.",
    )
    group.add_argument(
        "--keep-best",
        type=str,
        default=None,
        metavar="METRIC:min|max",
        help="Keep the rollout whose evaluation scored best on eval/METRIC (min: lowest, e.g. fd:min; max: highest, "
        "e.g. accuracy:max; no default direction): its checkpoint spared by pruning (--save) and its student "
        "exported to <--save-hf>-best (--save-hf). Needs --eval-interval.",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument(
        "--output-dir", type=str, default="outputs/run", help="Run directory: metrics.jsonl, eval images, summary."
    )
    group.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    group.add_argument("--wandb-project", type=str, default="miles", help="W&B project name.")
    group.add_argument(
        "--wandb-run-name", type=str, default=None, help="W&B run name; default: the --output-dir name."
    )
    group.add_argument(
        "--wandb-mode", type=str, default="offline", choices=("offline", "online"), help="online needs a login."
    )
    group.add_argument("--eval-interval", type=int, default=None, help="Evaluate every N rollouts (and at the end).")
    group.add_argument(
        "--eval-prompt-data", type=str, default=None, help="JSONL of eval prompts; default: --prompt-data."
    )
    group.add_argument(
        "--eval-max-prompts",
        type=int,
        default=100,
        help="Evaluate at most this many eval prompts, evenly spaced through the file (the eval images travel to "
        "the driver and are tiled there).",
    )
    group.add_argument("--eval-n-samples-per-prompt", type=int, default=1, help="Eval images per eval prompt.")
    group.add_argument(
        "--eval-function-path",
        type=str,
        default=None,
        help="fn(args, images, records, rollout_id) -> dict of eval metrics (e.g. miles.eval.digits hook).",
    )
    group.add_argument(
        "--log-level",
        type=str,
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="Level of the driver's and workers' Python logging.",
    )


def _add_hook_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hooks (dotted paths)")
    group.add_argument(
        "--custom-expand-samples-to-train-pairs-path",
        type=str,
        default=None,
        help="fn(args, samples) -> train pairs; runs where the samples are generated (each actor rank).",
    )
    group.add_argument(
        "--custom-train-input-function-path",
        type=str,
        default=None,
        help="fn(ctx, train_pairs) -> train_pairs; per group, before micro-batching.",
    )
    group.add_argument(
        "--custom-prepare-train-batch-path",
        type=str,
        default=None,
        help="fn(ctx, train_pairs) -> PreparedBatch; per micro-batch.",
    )
    group.add_argument(
        "--custom-loss-function-path",
        type=str,
        default=None,
        help="fn(ctx, train_pairs, prepared, *, new_pred, metrics) -> summed loss; per micro-batch.",
    )
    group.add_argument(
        "--custom-train-output-function-path",
        type=str,
        default=None,
        help="fn(ctx, train_pairs) -> Any, no grad, after a group's steps; later groups read it as external_data.",
    )
    group.add_argument(
        "--custom-build-modules-path",
        type=str,
        default=None,
        help="fn(args, models) -> {name: nn.Module}: extra trainable modules of a group (DMD2's GAN head).",
    )
    group.add_argument(
        "--custom-trainer-path",
        type=str,
        default=None,
        help="A GroupTrainer subclass (e.g. whose step() takes a JVP); default miles' GroupTrainer.",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full parser, grouped as in ``docs/cli-reference.md``."""
    parser = _OneLineParser(
        prog="train_diffusion.py",
        allow_abbrev=False,
        description="Distill a flow-matching text-to-image teacher into a few-step student (DMD2), or train with SFT.",
        formatter_class=_DefaultsHelpFormatter,
    )
    for add in (
        _add_cluster_args,
        _add_model_args,
        _add_training_args,
        _add_optimizer_args,
        _add_rollout_args,
        _add_data_args,
        _add_checkpoint_args,
        _add_logging_args,
        _add_hook_args,
        add_profiling_args,
    ):
        add(parser)
    for method in METHODS.values():
        method.add_arguments(parser)
    return parser


def set_default_diffusion_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on other flags, in place; never overwrites a value the user set.

    The flow shifts and the negative prompt ← the model family's (:mod:`miles.driver.family_defaults`), then
    ``--global-batch-size`` ← rollout pairs / ``--num-steps-per-rollout``, then the method's ``set_defaults`` (its
    own flags' defaults, what the engine must encode; see ``miles.methods``), then ``args.method_settings``, the
    method's typed settings (``Method.settings``). Hook paths are left as typed: the method's own hooks fill the
    groups' specs where a path is unset (:mod:`miles.driver.specs`).
    """
    fill_flow_shifts(args)
    fill_negative_prompt(args)
    if args.global_batch_size is None and args.rollout_batch_size and args.num_steps_per_rollout:
        if rollout_pairs(args) % args.num_steps_per_rollout == 0:
            args.global_batch_size = rollout_pairs(args) // args.num_steps_per_rollout
    method = get_method(args)
    method.set_defaults(args)
    # Built once, after every default is filled; every group's copy of the args carries it to its hooks.
    args.method_settings = method.settings(args)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``), fill defaults, validate.

    A rejected combination prints ``train_diffusion.py: error: <message>`` on one line and exits with code 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    set_default_diffusion_args(args)
    try:
        validate_args(args)
    except ArgumentValidationError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return args
