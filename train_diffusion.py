"""The sync driver: one process that runs the rollouts and trains the trainer groups in order.

Per rollout (docs/architecture.md)::

    shards = rollout_manager.generate(rollout_id)                  # the prompts, one PromptShard per DP rank
    pairs  = actor.generate(rollout_id, shards)                    # rank i samples shard i on its own student
    for role, group in groups:                                     # dmd2: critic, then actor
        outs[role] = group.train(rollout_id, pairs, external_data=outs so far)   # rank i gets rank i's boxes
    save / evaluate periodically (the checkpoint first, so a failing eval hook cannot cost it)
    --keep-best: a new best evaluation is exported to <save-hf>-best and its checkpoint kept

Train the bundled digits pipeline with SFT on 2 CPU ranks::

    python -m miles.models.digits init /tmp/digits
    python -m miles.eval.digits.data /tmp/digits_data
    python train_diffusion.py --loss-type sft_loss --train-only --hf-checkpoint /tmp/digits \\
        --prompt-data /tmp/digits_data/train.jsonl --actor-num-gpus-per-node 2 --rollout-batch-size 32 \\
        --micro-batch-size 16 --num-rollout 150 --lr 1e-3 --save /tmp/ckpt --save-interval 50 \\
        --output-dir outputs/digits_sft

Add ``--load /tmp/ckpt`` to resume at the rollout after the newest checkpoint. What is checked before Ray starts,
what a crash costs and what is never overwritten: docs/reliability.md. Exit codes: 0 done, 1 a failure at run time
(one line naming the group, rank and rollout), 2 a bad command (one line naming the flag or path), 130 Ctrl-C,
143 SIGTERM.
"""

import errno
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager

logger = logging.getLogger("train_diffusion")


@contextmanager
def _timer(perf: dict[str, float], key: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        perf[key] = perf.get(key, 0.0) + time.perf_counter() - start


class DeviceTurns:
    """Colocated trainer groups take turns on their devices: with ``enabled`` (GPUs shared by several groups) one
    group at a time holds its state on the device and the others sleep (their state on the CPU), as the memory plan
    assumes. Off (the CPU, or a group alone on its GPU), nothing sleeps.

    Every call of a group that computes on the device (generate, train, its train-output hook alone, save, evaluate,
    update_weights, export: :class:`~miles.ray.actor_group.RayTrainGroup`) first asks :meth:`hand_to` for its turn,
    so a save, an evaluation or the DMD2 debug grid never wakes a group beside another; a group never wakes itself.
    """

    def __init__(self, groups: dict, enabled: bool) -> None:
        self.groups, self.enabled, self.awake = groups, enabled, None
        self.perf: dict[str, float] = {}
        if enabled:
            for group in groups.values():
                group.take_turns(self)
            # The actor generates first: everyone else sleeps. A group may already sleep (both calls are no-ops then).
            for role, group in groups.items():
                if role != "actor":
                    group.get(group.async_sleep(), "sleep")
            actor = groups["actor"]
            actor.get(actor.async_wake_up(), "wake_up")
            self.awake = "actor"

    def hand_to(self, role: str) -> None:
        """Put the awake group to sleep, then wake ``role`` (no-op when it is awake or turns are off); the seconds
        add to :attr:`perf`."""
        if not self.enabled or self.awake == role:
            return
        with _timer(self.perf, "perf/sleep_wake_time"):
            if self.awake is not None:
                asleep = self.groups[self.awake]
                self._add(f"perf/{self.awake}-sleep_time", asleep.get(asleep.async_sleep(), "sleep"))
            self.awake = None  # until the wake below returns, no group holds the device
            group = self.groups[role]
            self._add(f"perf/{role}-wake_time", group.get(group.async_wake_up(), "wake_up"))
        self.awake = role

    def _add(self, key: str, seconds_per_rank: list[float]) -> None:
        self.perf[key] = self.perf.get(key, 0.0) + max(seconds_per_rank)

    def take_perf(self) -> dict[str, float]:
        """The hand-overs' seconds since the last call: ``perf/sleep_wake_time`` on the driver's clock,
        ``perf/<role>-sleep_time`` and ``perf/<role>-wake_time`` inside the slowest rank; ``{}`` when none."""
        perf, self.perf = self.perf, {}
        return perf


def run_rollouts(
    args,
    rollout_manager,
    groups: dict,
    engines,
    start_rollout_id: int,
    tracker,
    turns: DeviceTurns | None = None,
    eval_hook=None,
    keep_best=None,
) -> None:
    """Rollouts ``start_rollout_id..--num-rollout − 1``: generate, train each group in order, save, evaluate.

    Args:
        rollout_manager: the ``RolloutManager`` actor handle (prompts, DP split, data cursor).
        groups: ``{role: RayTrainGroup}`` in training order.
        engines: the ``--rollout-num-gpus`` ``EngineGroup``, or None when the actor ranks generate.
        tracker: the driver's ``MetricsTracker``: every train, perf and eval figure of the run.
        turns: the groups' :class:`DeviceTurns`; default: made here (:func:`device_turns`).
        eval_hook: ``--eval-function-path``'s function (``RunSpec.eval_hook``), or None.
        keep_best: ``--keep-best``'s :class:`~miles.driver.keep_best.KeepBest` (restored on a resume), or None.
    """
    from miles.driver.console import RolloutProgress
    from miles.driver.evaluation import maybe_evaluate
    from miles.driver.schedule import should_save
    from miles.ray.errors import get_all
    from miles.utils.health import alarms

    actor = groups["actor"]
    # Each group's call below takes its turn on the device first (DeviceTurns.hand_to), save and evaluation included.
    if turns is None:
        turns = device_turns(groups)
    progress = RolloutProgress(args, start_rollout_id)
    alarmed: set[str] = set()  # health figures outside their threshold, warned about once until they recover
    eval_alarmed: set[str] = set()  # the same for the evaluations' figures, which only evaluations update
    best = keep_best.state() if keep_best is not None else None
    try:
        for rollout_id in range(start_rollout_id, args.num_rollout):
            perf: dict[str, float] = {}
            step_start = time.perf_counter()
            with _timer(perf, "perf/rollout_time"):
                (shards,) = get_all(
                    [rollout_manager.generate.remote(rollout_id)], "rollout manager", "generate", rollout_id
                )
                if engines is not None:
                    refs = engines.async_generate(rollout_id, shards)
                    runs = get_all(refs, [f"engine replica {i}" for i in range(len(refs))], "generate", rollout_id)
                    results = [result for run in runs for result in run]
                else:
                    results = actor.get(actor.async_generate(rollout_id, shards), "generate", rollout_id)
            pairs = [result.pairs for result in results]
            perf.update(results[0].perf)
            outs, step_metrics = {}, {}
            for role, group in groups.items():
                with _timer(perf, f"perf/{role}_train_time"):
                    # Earlier groups' boxes only: the payloads stay in the object store until rank i unboxes them.
                    trained = group.get(
                        group.async_train(rollout_id, pairs, external_data=dict(outs)), "train", rollout_id
                    )
                outs[role] = [result.output for result in trained]
                perf.update(trained[0].perf)
                for metrics in trained[0].metrics:
                    tracker.log(metrics, rollout_id)
                step_metrics.update(trained[0].metrics[-1] if trained[0].metrics else {})
            current = {alarm.split("=")[0]: alarm for alarm in alarms(step_metrics)}
            for name in sorted(set(current) - alarmed):
                progress.note(f"warning: rollout {rollout_id}: {current[name]}; the student may be collapsing")
            alarmed = set(current)
            if engines is not None:
                with _timer(perf, "perf/update_weights_time"):
                    actor.get(actor.async_update_weights(engines.engines), "update_weights", rollout_id)
            # Save before evaluating: a failing eval hook must not cost the rollout's checkpoint.
            saved = should_save(args, rollout_id)
            if saved:
                with _timer(perf, "perf/save_time"):
                    save_rollout(args, rollout_id, rollout_manager, groups, tracker.wandb_run_id, best)
                progress.note(f"saved rollout {rollout_id} to {args.save}")
            with _timer(perf, "perf/eval_time"):
                eval_metrics = maybe_evaluate(args, rollout_id, engines or actor, tracker, groups, eval_hook)
            if eval_metrics:
                progress.note(f"eval after rollout {rollout_id}: {progress.format(eval_metrics)}")
                current = {alarm.split("=")[0]: alarm for alarm in alarms(eval_metrics)}
                for name in sorted(set(current) - eval_alarmed):
                    progress.note(
                        f"warning: eval after rollout {rollout_id}: {current[name]}; the student's samples may be "
                        "collapsing or oversaturated"
                    )
                eval_alarmed = set(current)
            if eval_metrics and keep_best is not None and keep_best.update(eval_metrics, rollout_id):
                best = keep_best.state()
                with _timer(perf, "perf/save_time"):
                    progress.note(keep_new_best(args, rollout_id, best, saved, rollout_manager, groups, tracker))
            perf.update(turns.take_perf())
            perf["perf/step_time"] = time.perf_counter() - step_start
            tracker.log(perf, rollout_id)
            progress.update(rollout_id, {**step_metrics, **perf})
    finally:
        # A failure's one line must start on a line of its own, not after the bar.
        progress.close()


def device_turns(groups: dict) -> DeviceTurns:
    """The groups' :class:`DeviceTurns`: on when several groups share GPUs (:func:`miles.driver.schedule.needs_sleep`)."""
    from miles.driver.schedule import needs_sleep
    from miles.ray.placement_group import use_gpu_bundles

    return DeviceTurns(groups, needs_sleep(len(groups), use_gpu_bundles()))


def keep_new_best(args, rollout_id: int, best: dict, saved: bool, rollout_manager, groups: dict, tracker) -> str:
    """``--keep-best``: rollout ``rollout_id`` evaluated best so far. Export its student to ``<save-hf>-best`` first
    (so that the export never holds a worse rollout than the run records), then keep its checkpoint: save it now
    (a rollout between two saves) or record the best in its run record (a save rollout's, written before its
    evaluation), so that pruning spares it and a resume continues from it. Logs ``best/<metric>`` and
    ``best/rollout_id``; returns the line to print."""
    from miles.driver.arguments import run_paths
    from miles.driver.export import export_schedule
    from miles.driver.keep_best import best_export_dir
    from miles.driver.resume import run_record, write_run_record

    actor = groups["actor"]
    kept = []
    if args.save_hf:
        out = best_export_dir(args.save_hf)
        paths = [*run_paths(args), ("--save-hf", args.save_hf)]
        actor.get(actor.async_export_hf(str(out), export_schedule(args), paths, best), "export_hf", rollout_id)
        kept.append(f"exported to {out}")
    if args.save:
        if saved:
            write_run_record(
                group_dirs([group.spec for group in groups.values()], "save")[0],
                run_record(args, rollout_id, tracker.wandb_run_id, best),
            )
        else:
            save_rollout(args, rollout_id, rollout_manager, groups, tracker.wandb_run_id, best)
        kept.append(f"kept {os.path.join(args.save, f'rollout_{rollout_id}')}")
    name = best["metric"].removeprefix("eval/")
    tracker.log({f"best/{name}": best["value"], "best/rollout_id": rollout_id}, rollout_id)
    return (
        f"new best {best['metric']}={best['value']:.6g} ({best['mode']}) after rollout {rollout_id}: {', '.join(kept)}"
    )


def group_dirs(groups, name: str) -> list[str]:
    """Every trainer group's ``"load"`` or ``"save"`` directory (``name``; ``groups``: their specs, in training
    order), the actor's first; a frozen group has none."""
    ordered = sorted(groups, key=lambda group: group.role != "actor")
    dirs = [group.checkpoint.load if name == "load" else group.checkpoint.save for group in ordered]
    # A frozen group (the DMD2 reward group) has no checkpoint directory.
    return [directory for directory in dirs if directory]


def save_rollout(
    args, rollout_id: int, rollout_manager, groups: dict, wandb_run_id: str | None = None, best: dict | None = None
) -> None:
    """One commit: every group saves the rollout (the actor's with the data cursor, then the run record of
    ``miles.driver.resume``, with ``best``: ``--keep-best``'s state), then ``<save>/latest`` moves to it, then old
    checkpoints beyond ``--save-keep-last`` go, the best rollout's spared. A crash before the commit costs this
    rollout only."""
    from miles.driver.resume import run_record, write_run_record
    from miles.driver.run_dir import commit, prune
    from miles.ray.errors import get_all

    (data_state,) = get_all([rollout_manager.state_dict.remote()], "rollout manager", "state_dict", rollout_id)
    # One group at a time: with turns on, each group's save first puts the awake one to sleep (DeviceTurns). The
    # last group to train is the one awake after a rollout: it saves first, which spares one hand-over.
    for role, group in reversed(groups.items()):
        if group.spec.checkpoint.save:  # a frozen group (the DMD2 reward group) has nothing to save
            group.get(group.async_save(rollout_id, data_state if role == "actor" else None), "save", rollout_id)
    dirs = group_dirs([group.spec for group in groups.values()], "save")
    write_run_record(dirs[0], run_record(args, rollout_id, wandb_run_id, best))
    commit(dirs, rollout_id)
    keep = (best["rollout_id"],) if best and best.get("rollout_id") is not None else ()
    for path in prune(dirs, rollout_id, args.save_keep_last, args.save_keep_every, keep):
        logger.debug("pruned %s", path)


def train(args, run=None) -> None:
    """Place and start the rollout manager, the trainer groups (and engine replicas), resume if asked, run the
    rollouts, export the student.

    Args:
        run: the run's specs (:func:`miles.driver.specs.build_run_spec`); default: built here from ``args``.
    """
    from miles.driver.arguments import run_paths
    from miles.driver.console import log_groups_ready
    from miles.driver.evaluation import move_aside_earlier_eval
    from miles.driver.export import export_schedule
    from miles.driver.keep_best import KeepBest, read_best_export
    from miles.driver.resume import read_run_record, resumed_line
    from miles.driver.run_dir import read_data_state, remove_checkpoints, remove_uncommitted, resume_rollout
    from miles.driver.specs import build_run_spec
    from miles.methods import get_method
    from miles.ray.errors import get_all
    from miles.ray.placement_group import (
        create_engine_group,
        create_placement_groups,
        create_rollout_manager,
        create_training_models,
    )
    from miles.utils.paths import check_export_target
    from miles.utils.tracking import MetricsTracker, drop_records_from, move_aside_earlier_metrics

    start_time = time.perf_counter()
    run = build_run_spec(args) if run is None else run
    load_rollout_id = resume_rollout(group_dirs(run.groups, "load")) if args.load else None
    if args.save and args.overwrite_save:
        # Preflight made sure this is not what --load resumes from; only the entries a checkpoint writes go.
        for path in remove_checkpoints(group_dirs(run.groups, "save")):
            logger.info("removed %s (--overwrite-save)", path)
    elif args.save:
        # What a crashed rollout left in the directories this run writes: partial and uncommitted checkpoints.
        committed = load_rollout_id if args.load and _same_dir(args.load, args.save) else None
        for path in remove_uncommitted(group_dirs(run.groups, "save"), committed):
            logger.info("removed %s (not committed by the run that wrote it)", path)
    if load_rollout_id is not None:
        # The resumed rollouts log again: their records of an earlier attempt in this --output-dir move aside.
        moved, aside = drop_records_from(args.output_dir, load_rollout_id + 1)
        if moved:
            logger.info(
                "moved %d metrics records of rollouts after %d to %s (logged again)", moved, load_rollout_id, aside
            )
    else:
        aside = move_aside_earlier_metrics(args.output_dir)
        if aside is not None:
            logger.info("an earlier run's metrics.jsonl in --output-dir is now %s; this run writes its own", aside)
        aside = move_aside_earlier_eval(args.output_dir)
        if aside is not None:
            logger.info("an earlier run's eval images in --output-dir are now in %s; this run writes its own", aside)
    started = []  # what this run starts, ended in reverse order whatever happens
    tracker = None
    try:
        pgs = create_placement_groups(args)
        started += [("placement group", pg) for pg, _ in pgs.values()]
        rollout_manager = create_rollout_manager(run, get_method(args).side_inputs(args))
        started.append(("actor", rollout_manager))
        groups = create_training_models(args, run, pgs, started=started, load_rollout_id=load_rollout_id)
        engines = create_engine_group(args, run, pgs)
        if engines is not None:
            started += [("actor", engine) for engine in engines.engines]
        log_groups_ready(groups, engines, time.perf_counter() - start_time)
        # From here every call that computes on a shared GPU hands it over first: the weight push below, the
        # rollouts, saves, evaluations and the export.
        turns = device_turns(groups)
        actor = groups["actor"]
        start = actor.start_rollout_id
        record = None
        keep_best = KeepBest.from_args(args)
        if load_rollout_id is not None:
            _, data_state = read_data_state(args.load, load_rollout_id)
            if data_state is not None:
                get_all([rollout_manager.load_state_dict.remote(data_state)], "rollout manager", "load_state_dict")
            record = read_run_record(args.load, load_rollout_id)
            for line in resumed_line(args, start, sorted(groups, key=lambda role: role != "actor"), record):
                logger.info("%s", line)
            if keep_best is not None:
                # The record's best, or the best export's when a crash came between the export and the commit.
                for line in keep_best.restore((record or {}).get("keep_best"), read_best_export(args.save_hf)):
                    logger.info("%s", line)
        if engines is not None:
            # The replicas loaded --hf-checkpoint; after a resume the actor's weights differ.
            actor.get(actor.async_update_weights(engines.engines), "update_weights")
        # A resumed run continues the wandb run whose id its checkpoint kept.
        tracker = MetricsTracker(args, job="driver", wandb_run_id=(record or {}).get("wandb_run_id"))
        run_rollouts(args, rollout_manager, groups, engines, start, tracker, turns, run.eval_hook, keep_best)
        if keep_best is not None:
            logger.info("%s", keep_best.summary(args.save, args.save_hf))
        if args.save_hf:
            # Checked again now (the directory may have appeared during the training), and by the writing rank
            # right before it renames the export into place.
            paths = run_paths(args)
            check_export_target(args.save_hf, args.hf_checkpoint, args.overwrite_save_hf, paths)
            actor.get(actor.async_export_hf(args.save_hf, export_schedule(args), paths), "export_hf")
            # DMD2 trains a student; SFT (a teacher) and custom methods train the model itself.
            logger.info("exported the %s to %s", "student" if args.loss_type == "dmd2" else "model", args.save_hf)
    finally:
        if tracker is not None:
            tracker.finish()
        _end(started)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _end(started: list) -> None:
    """End the actors and remove the placement groups this run started (newest first). A run that joined a Ray
    cluster it did not start (``--ray-address``, or a test session) leaves nothing behind on it."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for kind, handle in reversed(started):
        try:
            if kind == "actor":
                ray.kill(handle)
            else:
                remove_placement_group(handle)
        except Exception:  # noqa: BLE001 - best effort: Ray may already be down
            logger.debug("could not end %s %s", kind, handle, exc_info=True)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver; ``signum`` says which (the exit code is 128 + it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(signum)


def _fail(message: str, code: int, details: str = "") -> None:
    """Print ``train_diffusion.py: error: <message>`` (and the worker's traceback below it) and exit with ``code``."""
    print(f"train_diffusion.py: error: {message}", file=sys.stderr)
    if details:
        print(details, file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``; ``--dry-run`` logs the plan and returns; otherwise start Ray, train, and shut Ray down.

    A bad command exits with code 2 and one line naming the flag or path (before Ray starts, or before the export
    for a ``--save-hf`` directory that appeared during training); a failed or dead Ray worker with code 1 and one
    line naming the group, rank, method and rollout, the worker's own traceback below it. SIGINT and SIGTERM raise
    :class:`Interrupted` after Ray is shut down.
    """
    from miles.driver.arguments import parse_args
    from miles.driver.preflight import validate_inputs
    from miles.utils.log import setup_logging
    from miles.utils.validation import ArgumentValidationError

    args = parse_args(argv)
    setup_logging(args.log_level)
    _importable_working_dir()
    try:
        # Hooks (imported once) and the run's specs, then --load, pipelines, data and outputs, checked against the
        # specs before Ray starts, in a dry run too.
        run = validate_inputs(args)
    except ArgumentValidationError as exc:
        _fail(str(exc), 2)
    if args.teacher_lora and not args.dry_run:
        from miles.driver.specs import build_run_spec
        from miles.models.teacher_lora import apply_teacher_loras

        # Every group and the engine then read the fused pipeline like any other, so the specs are built again from
        # the flags that now name it (the hooks' modules are already imported); a dry run plans the same shapes
        # from the teacher as given.
        try:
            logger.info("teacher LoRAs fused into %s", apply_teacher_loras(args))
            run = build_run_spec(args)
        except ValueError as exc:
            _fail(str(exc), 2)
    if args.dry_run:
        from miles.driver.plan import log_plan

        refusal = log_plan(args, run)
        if refusal is not None:
            _fail(refusal, 2)
        return
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    from miles.driver.cluster import check_cluster_fits, check_ray_address
    from miles.driver.evaluation import EvalHookError
    from miles.ray.errors import WorkerError, describe_failure
    from miles.utils.validation import RunError

    # Ray 2.60 wants an auth mode for local clusters; the driver and its workers are all local processes.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The driver reports a group's first failure itself; the refs of the ranks it never waited for would otherwise
    # each print their error again when collected.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    # SIGTERM (a scheduler's cancel) takes the same clean path as Ctrl-C, from here on: while Ray starts too. SIGINT
    # is set as well: a driver started in the background inherits it ignored.
    _handle_signals()
    owns_ray = not ray.is_initialized()
    try:
        if owns_ray:
            # Without --ray-address (or RAY_ADDRESS, which ray.init reads) a run starts a local cluster of its own:
            # ray.init(address=None) would join any other cluster on this machine, and die with it.
            address = args.ray_address or os.environ.get("RAY_ADDRESS") or "local"
            check_ray_address(address, "--ray-address" if args.ray_address else "RAY_ADDRESS")
            if address == "local":
                from miles.driver.watchdog import start_watchdog

                # Ends the local cluster's processes should this process die without shutting Ray down (kill -9);
                # after a clean shutdown it finds nothing left and exits.
                start_watchdog()
            _init_ray(ray, address)
            if address == "local":
                check_cluster_fits(args)  # a local cluster never grows: refuse now rather than wait for bundles
        train(args, run)
    except Interrupted as exc:
        logger.warning("interrupted by %s; shutting down Ray", exc)
        raise
    except ArgumentValidationError as exc:
        _fail(str(exc), 2)
    except WorkerError as exc:
        _fail(exc.summary, 1, exc.details)
    except EvalHookError as exc:
        _fail(exc.summary, 1, exc.details)
    except RunError as exc:
        _fail(str(exc), 1)
    except (RayTaskError, RayActorError) as exc:
        # A worker call outside the driver's per-group waits (an evaluation, a method's debug grid).
        who = getattr(exc, "function_name", None) or "a Ray worker"
        failure = describe_failure(exc, "a Ray worker", who.rsplit(".", 1)[-1])
        _fail(failure.summary, 1, failure.details)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        # The driver's own writes (the commit, the run record, metrics.jsonl, an eval grid); a commit is atomic.
        _fail(f"could not write {exc.filename or 'a file'}: No space left on device; the last commit is intact", 1)
    finally:
        if owns_ray:
            # Ends every actor of this job, so no trainer or engine process outlives the driver.
            ray.shutdown()


def _importable_working_dir() -> None:
    """Let hook paths name modules of the directory the command runs in (``my_hooks.loss``), as ``python -m``
    would: ``python train_diffusion.py`` puts only the script's directory on ``sys.path``. Appended, so that no
    file there shadows an installed package. Ray gives every worker the driver's working directory as well."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _handle_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)


def _init_ray(ray, address: str) -> None:
    """``ray.init``, with SIGTERM during it ending the run as :class:`Interrupted` too: ray.init installs its own
    SIGTERM handler (``sys.exit(15)``, no word printed) for its duration.

    Raises:
        RunError: Ray's local node did not register within its 30 s (a bare ``Exception`` "The current node timed
            out during startup" from ``ray._private.node``): one line saying what to try instead of its traceback.
    """
    from miles.utils.validation import RunError

    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except SystemExit as exc:
        if exc.code == signal.SIGTERM:
            raise Interrupted(signal.SIGTERM) from None
        raise
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()  # the processes that did start
        raise RunError(
            "Ray's local node did not start within 30 s (its raylet never registered): the machine is overloaded, "
            "/tmp/ray is full or not writable, or another run's Ray processes are in the way (`ray stop` ends this "
            "user's); run again, or start Ray yourself (`ray start --head`) and pass --ray-address HOST:PORT"
        ) from None
    finally:
        _handle_signals()


if __name__ == "__main__":
    try:
        main()
    except Interrupted as exc:
        # Ray is already shut down (main's finally); the user or the scheduler asked to stop, so no traceback.
        sys.exit(128 + exc.signum)
    except KeyboardInterrupt:
        sys.exit(130)
