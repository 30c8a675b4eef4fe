"""What an exported student records of how it samples."""

from typing import Any

from miles.methods import get_method

__all__ = ["export_schedule"]


def export_schedule(args) -> dict[str, Any]:
    """Keyword arguments of ``write_sampling_schedule`` for the run's student: the engine's schedule
    (``--diffusion-num-steps`` or ``--diffusion-timesteps``, ``--diffusion-flow-shift``, ``--diffusion-step-rule``,
    ``--diffusion-guidance-scale``) and what the method adds (DMD2: the teacher's CFG scale it was distilled from)."""
    timesteps = args.diffusion_timesteps
    return {
        "num_steps": len(timesteps) if timesteps else args.diffusion_num_steps,
        "shift": args.diffusion_flow_shift,
        "step_rule": args.diffusion_step_rule,
        "timesteps": timesteps,
        "guidance_scale": args.diffusion_guidance_scale,
        **get_method(args).export_schedule(args),
    }
