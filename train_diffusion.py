"""The sync driver: one process that runs the rollouts and trains the trainer groups in order.

Per rollout (docs/architecture.md)::

    refs = rollout_manager.generate(rollout_id)                    # one Box per DP rank
    for role, group in groups:                                     # dmd2: critic, then actor
        outs[role] = group.train(rollout_id, refs, external_data=outs so far)   # rank i gets rank i's boxes
        actor: push weights to the engine (unless --train-only); colocated groups sleep right after their train
    save / evaluate periodically (the checkpoint first, so a failing eval hook cannot cost it)

Train the bundled digits pipeline with SFT on 2 CPU ranks::

    python -m miles.models.digits init /tmp/digits
    python -m miles.eval.digits.data /tmp/digits_data
    python train_diffusion.py --loss-type sft_loss --train-only --hf-checkpoint /tmp/digits \\
        --prompt-data /tmp/digits_data/train.jsonl --actor-num-gpus-per-node 2 --rollout-batch-size 32 \\
        --micro-batch-size 16 --num-rollout 150 --lr 1e-3 --save /tmp/ckpt --save-interval 50 \\
        --output-dir outputs/digits_sft

Add ``--load /tmp/ckpt`` to resume at the rollout after the newest checkpoint.
"""

import logging
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import trange

logger = logging.getLogger("train_diffusion")


@contextmanager
def _timer(metrics: dict[str, float], key: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = time.perf_counter() - start


def needs_sleep(args, num_groups: int) -> bool:
    """Groups sleep between trains when something else uses their device: another group or the colocated engine."""
    return num_groups > 1 or (not args.rollout_num_gpus and not args.train_only)


def should_save(args, rollout_id: int) -> bool:
    """Save at every ``--save-interval`` rollouts and after the last one (with ``--save``)."""
    if not args.save:
        return False
    last = rollout_id == args.num_rollout - 1
    return last or bool(args.save_interval and (rollout_id + 1) % args.save_interval == 0)


def should_evaluate(args, rollout_id: int) -> bool:
    """Evaluate at every ``--eval-interval`` rollouts and after the last one (with ``--eval-interval``)."""
    if not args.eval_interval:
        return False
    return rollout_id == args.num_rollout - 1 or (rollout_id + 1) % args.eval_interval == 0


def load_eval_records(args) -> list[dict]:
    """The eval prompts: every record of ``--eval-prompt-data`` (default ``--prompt-data``), each repeated
    ``--eval-n-samples-per-prompt`` times, in file order."""
    import json

    path = args.eval_prompt_data or args.prompt_data
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [record for record in records for _ in range(args.eval_n_samples_per_prompt)]


def maybe_evaluate(args, rollout_id: int, rollout_manager, tracker) -> None:
    """Every ``--eval-interval`` rollouts: sample the eval prompts with the engine's current student, score them with
    ``--eval-function-path`` and log the figures as ``eval/<name>``. The PNG grid ``<output-dir>/eval/rollout_<id>.png``
    is the hook's own if it writes one there, else the images tiled in order; it is logged as wandb media with
    ``--use-wandb``."""
    if not should_evaluate(args, rollout_id):
        return
    import ray

    from miles.eval.grids import save_image_grid
    from miles.utils.misc import load_function

    records = load_eval_records(args)
    prompts = [record[args.input_key] for record in records]
    # Fixed sample indices: every evaluation of a run starts from the same noise, so the grids are comparable.
    images = ray.get(rollout_manager.evaluate.remote(prompts, list(range(len(prompts)))))
    grid = Path(args.output_dir) / "eval" / f"rollout_{rollout_id}.png"
    grid.unlink(missing_ok=True)  # a resumed run's earlier grid must not stand in for this one
    metrics = {}
    if args.eval_function_path:
        hook = load_function(args.eval_function_path)
        metrics = {f"eval/{key}": value for key, value in hook(args, images, records, rollout_id).items()}
    if not grid.exists():
        # The hook may draw its own grid there (the digits hook labels one row per digit); else tile the images.
        save_image_grid(images, grid, per_row=10)
    tracker.log(metrics, rollout_id, images={"eval/samples": grid})
    logger.info("eval after rollout %d: %s (grid %s)", rollout_id, metrics, grid)


def log_plan(args) -> None:
    """``--dry-run``: log the trainer groups, their placement and the schedule, without starting Ray."""
    import torch

    from miles.ray.placement_group import engine_colocated, rollout_resources, trainer_resources
    from miles.utils.trainer_config import compute_trainer_args, compute_trainer_configs

    configs = compute_trainer_configs(args)
    use_gpu = torch.cuda.is_available()
    ranks = args.actor_num_nodes * args.actor_num_gpus_per_node
    gpus, cpus = trainer_resources(len(configs), engine_colocated(args), use_gpu)
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    logger.info(
        "placement: %d bundles of %s (one per DP rank); each rank of each group takes GPU %.2f CPU %.2f",
        ranks,
        bundle,
        gpus,
        cpus,
    )
    r_gpus, r_cpus = rollout_resources(engine_colocated(args), use_gpu)
    where = "colocated on bundle 0" if engine_colocated(args) else f"own {args.rollout_num_gpus} bundles"
    logger.info(
        "rollout manager: %s, GPU %.2f CPU %.2f, engine %s",
        where,
        r_gpus,
        r_cpus,
        "off (--train-only)" if args.train_only else "on",
    )
    for config in configs:
        group_args = compute_trainer_args(args, config)
        hooks = {
            name: getattr(group_args, f"custom_{name}_path", None)
            for name in ("train_input_function", "prepare_train_batch", "loss_function", "train_output_function")
        }
        logger.info(
            "group %s: overrides %s; init %s, teacher %s, lr %g, %d optimizer steps per rollout; hooks %s",
            config.role,
            config.overrides,
            group_args.hf_checkpoint,
            group_args.teacher_load,
            group_args.lr,
            group_args.num_steps_per_rollout,
            hooks,
        )
    start = 0
    if args.load:
        from miles.backends.fsdp_utils.checkpoint import read_latest

        start = read_latest(args.load) + 1
    saves = [r for r in range(start, args.num_rollout) if should_save(args, r)]
    logger.info(
        "schedule: rollouts %d..%d, sleep between trains: %s, saves after rollouts %s, export %s",
        start,
        args.num_rollout - 1,
        needs_sleep(args, len(configs)),
        saves,
        args.save_hf,
    )


def run_rollouts(args, rollout_manager, groups: dict, start_rollout_id: int, tracker) -> None:
    """Rollouts ``start_rollout_id..--num-rollout − 1``: generate, train each group in order, push, save, eval.

    Args:
        rollout_manager: the ``RolloutManager`` actor handle.
        groups: ``{role: RayTrainGroup}`` in training order (``create_training_models``).
        tracker: the driver's ``MetricsTracker`` (``perf/*`` timers).
    """
    import ray

    sleep = needs_sleep(args, len(groups))
    for rollout_id in trange(
        start_rollout_id, args.num_rollout, initial=start_rollout_id, total=args.num_rollout, desc="rollout"
    ):
        perf: dict[str, float] = {}
        step_start = time.perf_counter()
        with _timer(perf, "perf/rollout_time"):
            refs = ray.get(rollout_manager.generate.remote(rollout_id))
        outs = {}
        for role, group in groups.items():
            with _timer(perf, f"perf/{role}_train_time"):
                if sleep:
                    ray.get(group.async_wake_up())
                # Earlier groups' boxes only: the payloads stay in the object store until rank i unboxes them.
                outs[role] = ray.get(group.async_train(rollout_id, refs, external_data=dict(outs)))
            if role == "actor" and not args.train_only:
                with _timer(perf, "perf/update_weights_time"):
                    ray.get(group.async_update_weights(rollout_manager))
            if sleep:
                ray.get(group.async_sleep())
        # Save before evaluating: a failing eval hook must not cost the rollout's checkpoint.
        if should_save(args, rollout_id):
            data_state = ray.get(rollout_manager.state_dict.remote())
            # One group at a time: a sleeping group wakes onto the shared device to save.
            for group in groups.values():
                ray.get(group.async_save(rollout_id, data_state))
        if args.train_only and should_evaluate(args, rollout_id):
            # Without rollouts the engine only needs the student's weights when it draws the eval images.
            ray.get(groups["actor"].async_update_weights(rollout_manager))
        maybe_evaluate(args, rollout_id, rollout_manager, tracker)
        perf["perf/step_time"] = time.perf_counter() - step_start
        tracker.log(perf, rollout_id)


def train(args) -> None:
    """Place and start the rollout manager and the trainer groups, resume if asked, run the rollouts, export."""
    import ray

    from miles.backends.fsdp_utils.checkpoint import read_data_state
    from miles.ray.placement_group import create_placement_groups, create_rollout_manager, create_training_models
    from miles.utils.tracking import MetricsTracker

    pgs = create_placement_groups(args)
    rollout_manager = create_rollout_manager(args, pgs)
    groups = create_training_models(args, pgs)
    actor = groups["actor"]
    start = actor.start_rollout_id
    if start > 0:
        _, data_state = read_data_state(args.load)
        if data_state is not None:
            ray.get(rollout_manager.load_state_dict.remote(data_state))
    if not args.train_only:
        # The engine loaded --hf-checkpoint; after a resume the actor's weights differ.
        ray.get(actor.async_update_weights(rollout_manager))
    if needs_sleep(args, len(groups)):
        ray.get([ref for group in groups.values() for ref in group.async_sleep()])
    tracker = MetricsTracker(args, job="driver")
    try:
        run_rollouts(args, rollout_manager, groups, start, tracker)
        if args.save_hf:
            ray.get(actor.async_export_hf(args.save_hf))
    finally:
        tracker.finish()


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``; ``--dry-run`` logs the plan and returns; otherwise start Ray, train, and shut Ray down."""
    from miles.utils.arguments import ArgumentValidationError, parse_args
    from miles.utils.preflight import validate_inputs

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    try:
        # Paths, data and hooks before Ray starts; a dry run checks the hooks and --load only (the data may live on
        # the cluster).
        validate_inputs(args, check_paths=not args.dry_run)
    except ArgumentValidationError as exc:
        print(f"train_diffusion.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.dry_run:
        log_plan(args)
        return
    import ray

    # Ray 2.60 wants an auth mode for local clusters; the driver and its workers are all local processes.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    # SIGTERM (a scheduler's cancel) takes the same clean path as Ctrl-C; set after ray.init, which installs its own
    # handlers. SIGINT is reset too: a driver started in the background inherits it ignored.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    try:
        train(args)
    except KeyboardInterrupt:
        logger.warning("interrupted; shutting down Ray")
        raise
    finally:
        # Ends every actor of this job, so no trainer or engine process outlives the driver.
        ray.shutdown()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        # Ray is already shut down (main's finally); the user asked to stop, so no traceback. 130 = 128 + SIGINT.
        sys.exit(130)
