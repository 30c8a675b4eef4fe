"""How long a rollout should take: model FLOPs per DP rank at an assumed MFU. An estimate until measured.

``--dry-run`` prints it (:func:`log_estimate`); so does ``python -m miles.driver.estimate <train_diffusion.py flags>``,
which checks the flags only and reads nothing of the pipeline but ``model_index.json`` and
``transformer/config.json`` (budget a run before downloading its weights). ``docs/cluster.md`` explains it and gives
the SD3.5-Medium recipe's figures. The count:

- one denoiser forward of one sample, counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and
  attention) on the meta device, from the pipeline's own ``transformer/config.json`` at its latent size and the
  family's ``text_tokens`` (SD3: 77 CLIP + 256 T5 tokens; digits: its ``max_length``), so no weight is read;
- each phase's forwards and backwards per rank from :func:`miles.driver.work.work_per_rank`, a backward counted as
  two forwards (and one more forward per backward with ``--gradient-checkpointing``). The rollout phase counts every
  step of the schedule for every sample (DMD2 samples stop at a random step, so it is an upper bound);
- seconds = FLOPs / (MFU × the device's dense bf16 peak). The MFU is an assumption (:data:`ASSUMED_MFU`) until
  ``benchmarks/gpu_check.py`` measures it; the peak is the vendor's data-sheet figure of the GPU this machine has,
  else of an H100.

Left out: data loading, the driver's and Ray's gaps, sleep/wake between groups, saves, evaluations, the export.
"""

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ASSUMED_MFU", "PEAK_TFLOPS", "Estimate", "estimate_rollout", "forward_flops", "log_estimate"]

logger = logging.getLogger(__name__)

# An assumed model-FLOPs utilisation for bf16 DiT training with FSDP2; replaced by a measurement once
# benchmarks/gpu_check.py has run on the cluster's GPU.
ASSUMED_MFU = 0.30
# Dense bf16 peak TFLOP/s by device name (vendor data sheets; the same table as benchmarks/gpu_check.py).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
DEFAULT_DEVICE = "H100"


@dataclass
class Estimate:
    """One DP rank's model FLOPs per rollout and the seconds they take at ``mfu`` of ``peak_tflops``."""

    forward_flops: float  # one denoiser forward of one sample
    parameters: int  # the denoiser's
    text_tokens: int
    phases: list[tuple[str, str, float]]  # (group, phase, FLOPs) per rank and rollout
    device: str
    peak_tflops: float
    mfu: float

    @property
    def flops(self) -> float:
        return sum(flops for _, _, flops in self.phases)

    @property
    def seconds(self) -> float:
        return self.flops / (self.mfu * self.peak_tflops * 1e12)


def forward_flops(pipeline: str | Path, latent_shape: tuple[int, ...], text_tokens: int) -> tuple[float, int]:
    """``(FLOPs, parameters)`` of one forward of the pipeline's denoiser (``<pipeline>/transformer``) on one
    sample of ``latent_shape`` (``(C, H, W)``), counted on the meta device (no weight is read).

    Raises:
        ValueError: for a denoiser whose forward is not SD3's (``encoder_hidden_states`` of ``joint_attention_dim``
            and ``pooled_projections``).
    """
    import diffusers
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from miles.models.base import DENOISER, read_json

    folder = Path(pipeline) / DENOISER
    config = read_json(folder / "config.json", "denoiser config")
    cls = getattr(diffusers, str(config.get("_class_name")), None)
    if cls is None or "joint_attention_dim" not in config or "pooled_projection_dim" not in config:
        raise ValueError(f"{folder}: no FLOP count for a {config.get('_class_name')} denoiser")
    with torch.device("meta"):
        model = cls.from_config(config)
        inputs = {
            "hidden_states": torch.empty(1, *latent_shape),
            "encoder_hidden_states": torch.empty(1, text_tokens, config["joint_attention_dim"]),
            "pooled_projections": torch.empty(1, config["pooled_projection_dim"]),
            "timestep": torch.full((1,), 500.0),
        }
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs)
    return float(counter.get_total_flops()), sum(p.numel() for p in model.parameters())


def _device() -> tuple[str, float]:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peak = next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)
        if peak is not None:
            return name, peak
    return DEFAULT_DEVICE, PEAK_TFLOPS[DEFAULT_DEVICE]


def estimate_rollout(args: argparse.Namespace, mfu: float = ASSUMED_MFU, groups: list | None = None) -> Estimate:
    """The estimate of one rollout for the command ``args`` (see the module docstring); ``groups``: the run's
    (default: as the flags lay them out)."""
    from miles.driver.work import work_per_rank
    from miles.models import get_model_family

    family = get_model_family(args.hf_checkpoint, args.diffusion_model_family)
    tokens = family.text_tokens(args.hf_checkpoint)
    fwd, params = forward_flops(args.hf_checkpoint, family.latent_shape(args.hf_checkpoint), tokens)
    recompute = 1 if args.gradient_checkpointing else 0
    phases = [
        (who, phase.phase, (phase.forwards + (2 + recompute) * phase.backwards) * phase.batch * fwd)
        for who, phase in work_per_rank(args, groups)
    ]
    device, peak = _device()
    return Estimate(fwd, params, tokens, phases, device, peak, mfu)


def log_estimate(args: argparse.Namespace, rollouts: int, groups: list | None = None) -> Estimate | None:
    """Log the estimate of one rollout and of ``rollouts`` of them (None, with a note, when it cannot be made)."""
    try:
        found = estimate_rollout(args, groups=groups)
    # RuntimeError includes NotImplementedError: a family that does not say its text tokens.
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        logger.info("time estimate: none (%s)", exc)
        return None
    per_second = found.mfu * found.peak_tflops * 1e12
    logger.info(
        "time estimate (an estimate, not a measurement: no CUDA line of miles has run yet): one denoiser forward is "
        "%.4g GFLOP per sample (%.4gM parameters, %d text tokens); at an assumed %.0f%% MFU of a %s's %.4g TFLOP/s "
        "bf16 peak, per DP rank and rollout:",
        found.forward_flops / 1e9,
        found.parameters / 1e6,
        found.text_tokens,
        100 * found.mfu,
        found.device,
        found.peak_tflops,
    )
    for who, phase, flops in found.phases:
        logger.info("  %-16s %-24s %10.4g TFLOP  %8.3g s", who, phase, flops / 1e12, flops / per_second)
    hours = found.seconds * rollouts / 3600
    logger.info(
        "  total: %.4g TFLOP, about %.3g s per rollout, %.3g h for %d rollouts (compute only: no saves, "
        "evaluations, sleep/wake or data loading)",
        found.flops / 1e12,
        found.seconds,
        hours,
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
