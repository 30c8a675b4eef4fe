"""SFT converter: each data sample becomes one flow-matching train pair on its clean latent."""

from miles.utils.types import Sample, TrainPair

__all__ = ["expand_samples_to_train_pairs"]


def expand_samples_to_train_pairs(args, samples: list[Sample]) -> list[TrainPair]:
    """One pair per sample, in order: ``x0`` is the sample's clean latent, float32 ``(C, H, W)``.

    ``x0`` is ``sample.x0`` (``--train-only`` data read from ``--image-key``), else the finished sample of a full
    trajectory (SFT on the engine's own generations). The cond comes from ``sample.env``.

    Args:
        args: unused; part of the converter signature.
        samples: the rollout's samples.

    Raises:
        ValueError: naming the sample, when it has no cond or neither a data latent nor a finished trajectory.
    """
    pairs = []
    for sample in samples:
        if sample.env is None:
            raise ValueError(f"sample {sample.index} has no denoising env (cond); the rollout must encode its prompt")
        if sample.x0 is not None:
            x0 = sample.x0
        elif sample.trajectory is not None and sample.trajectory.final is not None:
            x0 = sample.trajectory.final
        else:
            raise ValueError(
                f"sample {sample.index} has no clean latent: --loss-type sft_loss trains on --train-only data with "
                "images under --image-key, or on full-trajectory rollouts"
            )
        pairs.append(
            TrainPair(
                sample_index=sample.index,
                x0=x0.float(),
                pos_cond=dict(sample.env.pos_cond),
                neg_cond=dict(sample.env.neg_cond),
                prompt=sample.prompt,
            )
        )
    return pairs
