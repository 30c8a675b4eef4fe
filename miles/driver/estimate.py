"""How long a rollout should take: model FLOPs per DP rank at an assumed MFU. An estimate until measured.

``--dry-run`` prints it (:func:`log_estimate`); so does ``python -m miles.driver.estimate <train_diffusion.py flags>``,
which checks the flags only and reads nothing of the pipeline but ``model_index.json`` and the component configs
(budget a run before downloading its weights). ``docs/cluster.md`` explains it and gives the SD3.5-Medium recipe's
figures. The count:

- one denoiser forward of one sample: the family's ``flops_per_sample``
  (:class:`~miles.models.capabilities.MemoryLayout`), counted by ``torch.utils.flop_counter.FlopCounterMode``
  (matmuls and attention) on the meta device as the family's ``predict_velocity`` runs it, at its latent size and
  text tokens (SD3: 77 CLIP + 256 T5 tokens; digits: its ``max_length``), so no weight is read. Any family that
  declares the capability gets an estimate; the estimate knows none;
- each phase's forwards and backwards per rank from :func:`miles.driver.work.work_per_rank`, a backward counted as
  two forwards (and one more forward per backward with ``--gradient-checkpointing``). The rollout phase counts every
  step of the schedule for every sample (DMD2 samples stop at a random step, so it is an upper bound);
- seconds = FLOPs / (MFU × the GPU's dense bf16 peak), for a bf16 (or fp16) run only: the peaks are the vendors'
  dense bf16 data-sheet figures. The GPU is ``--gpu-type``'s, else this machine's first CUDA device when the table
  knows it, else the estimate assumes an H100 and says so. A float32 run gets its FLOPs and no seconds (a float32 run on the CPU is not
  a GPU run, and a GPU's float32 peak is another figure). The MFU is an assumption (:data:`ASSUMED_MFU`) until
  ``benchmarks/gpu_check.py`` measures it.

Left out: data loading, the driver's and Ray's gaps, sleep/wake between groups, saves, evaluations, the export.
"""

import argparse
import logging
from dataclasses import dataclass

import torch

from miles.utils.device import DEFAULT_DEVICE, PEAK_TFLOPS

__all__ = ["ASSUMED_MFU", "PEAK_TFLOPS", "Estimate", "assumed_gpu", "estimate_rollout", "log_estimate"]

logger = logging.getLogger(__name__)

# An assumed model-FLOPs utilisation for bf16 DiT training with FSDP2; replaced by a measurement once
# benchmarks/gpu_check.py has run on the cluster's GPU.
ASSUMED_MFU = 0.30
# The compute dtypes whose seconds the bf16 peaks give.
TIMED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Estimate:
    """One DP rank's model FLOPs per rollout and, for a bf16 run, the seconds they take at ``mfu`` of
    ``peak_tflops``.

    Attributes:
        forward_flops: one denoiser forward of one sample.
        parameters: the denoiser's.
        image_tokens, text_tokens: tokens per sample (the family's ``tokens_per_sample``).
        phases: ``(group, phase, FLOPs)`` per rank and rollout.
        device: the GPU the seconds assume, as :func:`assumed_gpu` names it.
        peak_tflops: its dense bf16 peak; None for a run whose compute dtype no bf16 peak times (float32).
        mfu: the assumed model-FLOPs utilisation.
        compute_dtype: ``--train-dtype``.
    """

    forward_flops: float
    parameters: int
    image_tokens: int
    text_tokens: int
    phases: list[tuple[str, str, float]]
    device: str
    peak_tflops: float | None
    mfu: float
    compute_dtype: torch.dtype = torch.bfloat16

    @property
    def flops(self) -> float:
        return sum(flops for _, _, flops in self.phases)

    @property
    def seconds(self) -> float | None:
        """Seconds per rollout and rank, None without a peak (a float32 run)."""
        if self.peak_tflops is None:
            return None
        return self.flops / (self.mfu * self.peak_tflops * 1e12)


def assumed_gpu(gpu_type: str | None = None) -> tuple[str, float, str]:
    """``(name, dense bf16 peak TFLOP/s, where the name comes from)``: ``gpu_type`` (``--gpu-type``, a key of
    :data:`PEAK_TFLOPS`) when given, else this machine's first CUDA device when :data:`PEAK_TFLOPS` knows it, else
    an H100, assumed."""
    if gpu_type is not None:
        return gpu_type, PEAK_TFLOPS[gpu_type], "--gpu-type"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peak = next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)
        if peak is not None:
            return name, peak, "this machine"
    return DEFAULT_DEVICE, PEAK_TFLOPS[DEFAULT_DEVICE], "assumed: no known CUDA device here; --gpu-type names another"


def estimate_rollout(args: argparse.Namespace, mfu: float = ASSUMED_MFU, groups: list | None = None) -> Estimate:
    """The estimate of one rollout for the command ``args`` (see the module docstring); ``groups``: the run's
    (default: as the flags lay them out).

    Raises:
        ValueError: for a family without :class:`~miles.models.capabilities.MemoryLayout`, or a config it cannot
            count.
        OSError: for a pipeline without its configs.
    """
    from miles.backends.fsdp_utils.model import resolve_dtype
    from miles.driver.work import work_per_rank
    from miles.models import MemoryLayout, get_model_family, require

    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    require(family, MemoryLayout, "the time estimate")
    image_tokens, text_tokens = family.tokens_per_sample(args.hf_checkpoint)
    fwd, params = family.flops_per_sample(args.hf_checkpoint)
    recompute = 1 if args.gradient_checkpointing else 0
    phases = [
        (who, phase.phase, (phase.forwards + (2 + recompute) * phase.backwards) * phase.batch * fwd)
        for who, phase in work_per_rank(args, groups)
    ]
    device, peak, _ = assumed_gpu(args.gpu_type)
    dtype = resolve_dtype(args.train_dtype)
    peak = peak if dtype in TIMED_DTYPES else None
    return Estimate(fwd, params, image_tokens, text_tokens, phases, device, peak, mfu, dtype)


def log_estimate(args: argparse.Namespace, rollouts: int, groups: list | None = None) -> Estimate | None:
    """Log the estimate of one rollout and of ``rollouts`` of them (None, with a note, when it cannot be made)."""
    try:
        found = estimate_rollout(args, groups=groups)
    # A family of one's own whose count fails on the meta device must not fail the dry run's other checks.
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError) as exc:
        logger.info("time estimate: none (%s: %s)", type(exc).__name__, exc)
        return None
    _, _, origin = assumed_gpu(args.gpu_type)
    gpu = f"{found.device} ({origin})"
    dtype = str(found.compute_dtype).removeprefix("torch.")
    if found.seconds is None:
        timing = (
            f"{dtype} compute: no seconds, the peaks are dense bf16 figures (train with --train-dtype bfloat16 on a "
            f"GPU for them; the GPU would be {gpu})"
        )
    else:
        timing = (
            f"at an assumed {100 * found.mfu:.0f}% MFU of the {found.device}'s {found.peak_tflops:.4g} TFLOP/s "
            f"dense bf16 peak, GPU {gpu}"
        )
    logger.info(
        "time estimate (an estimate, not a measurement: no CUDA line of miles has run yet): one denoiser forward is "
        "%.4g GFLOP per sample (%.4gM parameters, %d image + %d text tokens); %s; per DP rank and rollout:",
        found.forward_flops / 1e9,
        found.parameters / 1e6,
        found.image_tokens,
        found.text_tokens,
        timing,
    )
    per_second = None if found.seconds is None else found.mfu * found.peak_tflops * 1e12
    for who, phase, flops in found.phases:
        seconds = "" if per_second is None else f"  {flops / per_second:8.3g} s"
        logger.info("  %-16s %-24s %10.4g TFLOP%s", who, phase, flops / 1e12, seconds)
    if found.seconds is None:
        total = found.flops * rollouts / 1e12
        logger.info("  total: %.4g TFLOP per rollout, %.4g TFLOP for %d rollouts", found.flops / 1e12, total, rollouts)
        return found
    logger.info(
        "  total: %.4g TFLOP, about %.3g s per rollout, %.3g h for %d rollouts (compute only: no saves, "
        "evaluations, sleep/wake or data loading)",
        found.flops / 1e12,
        found.seconds,
        found.seconds * rollouts / 3600,
        rollouts,
    )
    return found


def main(argv: list[str] | None = None) -> None:
    """``python -m miles.driver.estimate <train_diffusion.py flags>``: the estimate of that command, from the
    pipeline's configuration alone."""
    from miles.driver.arguments import parse_args
    from miles.utils.log import setup_logging

    args = parse_args(argv)
    setup_logging(args.log_level)
    start = 0
    if args.load:
        from miles.driver.run_dir import read_latest

        start = read_latest(args.load) + 1
    if log_estimate(args, args.num_rollout - start) is None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
