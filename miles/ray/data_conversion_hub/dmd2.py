"""DMD2 converter: each rollout stopped at step i becomes one train pair ([DMD2 4/7]).

The student's rollouts come from the ``stop_at_random_step`` strategy (DMD2's backward simulation): the engine runs
the few-step sampler up to a random step i and returns only that step's input ``x_i`` and its ``x̂0_i``. The critic
learns ``x̂0_i``, the teacher and the critic score it, and the student recomputes its x0 at ``(x_i, t_i)``.
"""

from miles.backends.fsdp_utils.loss_hub.dmd2_types import DMD2Pair
from miles.utils.types import Sample

__all__ = ["expand_samples_to_train_pairs"]


def _stopped_step(sample: Sample) -> int:
    """The step a DMD2 rollout stopped at, or a ValueError that names the sample and what is wrong."""
    trajectory = sample.trajectory
    if trajectory is None:
        raise ValueError(
            f"sample {sample.index} has no trajectory; --loss-type dmd2 trains on student rollouts, "
            "not on --train-only data"
        )
    if sample.env is None:
        raise ValueError(
            f"sample {sample.index} has no denoising env (cond); the engine must return it with the rollout"
        )
    if trajectory.final is not None or len(trajectory.step_indices) > 1:
        raise ValueError(
            f"sample {sample.index} is a full trajectory (steps {trajectory.step_indices}, final sample present: "
            f"{trajectory.final is not None}); --loss-type dmd2 needs rollouts stopped at one step, use "
            "--diffusion-step-strategy-path miles.rollout.step_strategy_hub.stop_at_random_step"
        )
    if len(trajectory.step_indices) != 1:
        raise ValueError(f"sample {sample.index} returned no step; a dmd2 rollout must return its stopped step")
    step = trajectory.step_indices[0]
    if not 0 <= step < trajectory.num_steps:
        raise ValueError(
            f"sample {sample.index} stopped at step {step}, outside its {trajectory.num_steps}-step schedule"
        )
    if trajectory.latents.shape[0] != 1 or trajectory.x0_preds.shape[0] != 1:
        raise ValueError(
            f"sample {sample.index} returned {trajectory.latents.shape[0]} latents and "
            f"{trajectory.x0_preds.shape[0]} x0 predictions for one stopped step; it ran past its first returned step"
        )
    return step


def expand_samples_to_train_pairs(args, samples: list[Sample]) -> list[DMD2Pair]:
    """One ``DMD2Pair`` per sample stopped at step i; rewards are ignored.

    Each pair holds ``latent`` = ``x_i`` and ``x0`` = ``x̂0_i`` (float32 ``(C, H, W)``), ``timestep`` = ``t_i`` in
    [0, 1000], ``sigma`` = ``σ_i`` in [0, 1], ``step_index`` = i, the positive and negative cond of ``sample.env``
    and the sample's index, in the order of ``samples``.

    Args:
        args: unused; part of the converter signature.
        samples: the rollout's samples, each stopped at one step.

    Raises:
        ValueError: naming the sample index, for a sample without trajectory or env, a full trajectory (several
            returned steps or a final sample), or a trajectory that returned no step or more rows than one step.
    """
    pairs = []
    for sample in samples:
        step = _stopped_step(sample)
        trajectory = sample.trajectory
        pairs.append(
            DMD2Pair(
                sample_index=sample.index,
                x0=trajectory.x0_preds[0].float(),
                pos_cond=dict(sample.env.pos_cond),
                neg_cond=dict(sample.env.neg_cond),
                prompt=sample.prompt,
                latent=trajectory.latents[0].float(),
                sigma=float(trajectory.sigmas[step]),
                timestep=float(trajectory.timesteps[step]),
                step_index=step,
            )
        )
    return pairs
