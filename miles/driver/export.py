"""What an exported student records of how it samples."""

from typing import Any

from miles.methods import get_method

__all__ = ["engine_schedule", "export_schedule"]


def engine_schedule(args) -> dict[str, Any]:
    """The engine's schedule as ``write_sampling_schedule`` keyword arguments (``--diffusion-num-steps`` or
    ``--diffusion-timesteps``, ``--diffusion-flow-shift``, ``--diffusion-step-rule``, ``--diffusion-guidance-scale``).
    """
    timesteps = args.diffusion_timesteps
    return {
        "num_steps": len(timesteps) if timesteps else args.diffusion_num_steps,
        "shift": args.diffusion_flow_shift,
        "step_rule": args.diffusion_step_rule,
        "timesteps": timesteps,
        "guidance_scale": args.diffusion_guidance_scale,
    }


def export_schedule(args) -> dict[str, Any] | None:
    """What the run's export records of how it samples: the method's say (DMD2: the engine's few-step schedule and
    the teacher's CFG it was distilled from), or None to keep the source pipeline's scheduler (SFT trains a
    teacher-like model)."""
    return get_method(args).export_schedule(args, engine_schedule(args))
