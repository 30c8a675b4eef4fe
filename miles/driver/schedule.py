"""When the driver saves and whether groups take turns on the devices."""

__all__ = ["needs_sleep", "should_save"]


def needs_sleep(num_groups: int, use_gpu: bool) -> bool:
    """Colocated groups sleep while another one trains when they share GPUs; on the CPU, or for a group alone on
    its GPU, there is nothing to free."""
    return use_gpu and num_groups > 1


def should_save(args, rollout_id: int) -> bool:
    """Save at every ``--save-interval`` rollouts and after the last one (with ``--save``)."""
    if not args.save:
        return False
    last = rollout_id == args.num_rollout - 1
    return last or bool(args.save_interval and (rollout_id + 1) % args.save_interval == 0)
