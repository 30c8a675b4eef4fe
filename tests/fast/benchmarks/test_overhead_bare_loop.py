"""The bare DMD2 loop of ``benchmarks/overhead.py`` does the trainer's work: same draws, same math, same forwards.

Real parts throughout: a 2-layer digits pipeline, the MiniLM encoder, miles' own engine, converter, step strategy
and loss hooks as the reference (run on the loop's plain modules, without Ray or FSDP).
"""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from miles.backends.fsdp_utils.hooks import split_windows
from miles.backends.fsdp_utils.loss_hub.dmd2 import (
    dmd2_loss_formula,
    predict_teacher_and_critic_x0,
    prepare_critic_batch,
    prepare_generator_batch,
)
from miles.backends.fsdp_utils.loss_hub.sft import sft_loss_formula
from miles.backends.fsdp_utils.loss_hub.types import TrainContext
from miles.driver.arguments import parse_args
from miles.models import get_model_family
from miles.models.base import read_scheduler_config
from miles.models.digits import init_digits_pipeline
from miles.ray.data_conversion_hub.dmd2 import expand_samples_to_train_pairs
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.data_source import make_prompt_shard
from miles.rollout.engine import RolloutEngine
from miles.rollout.step_strategy_hub import stop_at_random_step
from tests.support.trainer import run_spec

REPO = Path(__file__).resolve().parents[3]
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PROMPTS = [f"a handwritten digit {name}" for name in DIGITS]
N, K, MB, STEPS = 40, 5, 8, 4


def load_overhead():
    spec = importlib.util.spec_from_file_location("overhead_benchmark", REPO / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


overhead = load_overhead()


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the benchmark runs the loop (and 10x faster than two on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return init_digits_pipeline(
        tmp_path_factory.mktemp("digits"), seed=0, num_layers=2, attention_head_dim=8, max_length=8
    )


def miles_args(pipeline):
    """The dmd2 run the benchmark launches, parsed by miles: (run args, critic group spec, actor group spec); the
    hooks' context holds the run args (``ctx.args``)."""
    # fmt: off
    args = parse_args([
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", "unused.jsonl", "--rollout-batch-size", str(N), "--micro-batch-size", str(MB),
        "--num-rollout", "2", "--diffusion-num-steps", str(STEPS), "--dmd2-critic-steps-per-rollout", str(K),
        "--dmd2-teacher-guidance-scale", "3", "--lr", "1e-4", "--critic-lr", "4e-4",
    ])
    # fmt: on
    critic, actor = run_spec(args).groups
    return args, critic, actor


def test_two_rollouts_have_finite_losses_and_repeat_exactly(pipeline):
    config = overhead.BareConfig(rollout_batch_size=N, micro_batch_size=MB, critic_steps=K, num_steps=STEPS)
    first = overhead.run_bare(pipeline, PROMPTS, config, rollouts=2)
    again = overhead.run_bare(pipeline, PROMPTS, config, rollouts=2)
    for stats in first:
        assert len(stats.critic_losses) == K
        assert all(math.isfinite(loss) for loss in [*stats.critic_losses, stats.actor_loss])
        assert set(stats.seconds) == {*overhead.BARE_PHASES, "total"}
    assert [(s.critic_losses, s.actor_loss) for s in first] == [(s.critic_losses, s.actor_loss) for s in again]
    # the second rollout trained on what the first changed
    assert first[0].critic_losses != first[1].critic_losses


class ForwardCounter:
    """Forward hooks on a module: (batch, grad enabled) per forward, and the backward passes through its output."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.forwards: list[tuple[int, bool]] = []
        self.backwards = 0
        module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.forwards.append((kwargs["hidden_states"].shape[0], torch.is_grad_enabled()))
        if output[0].requires_grad:
            output[0].register_hook(self._count_backward)

    def _count_backward(self, grad):
        self.backwards += 1

    def reset(self) -> None:
        self.forwards, self.backwards = [], 0


def test_forward_and_backward_counts_match_the_trainer(pipeline):
    args, _, _ = miles_args(pipeline)
    config = overhead.BareConfig(rollout_batch_size=N, micro_batch_size=MB, critic_steps=K, num_steps=STEPS)
    loop = overhead.BareDMD2Loop(pipeline, PROMPTS, config)
    student, critic, teacher = (ForwardCounter(m) for m in (loop.student, loop.critic, loop.teacher))
    # The trainer's own split: K critic windows and one actor window of whole micro-batches; scoring over the shard.
    critic_mbs = [len(mb) for window in split_windows(list(range(N)), K, MB) for mb in window]
    actor_mbs = [len(mb) for window in split_windows(list(range(N)), 1, MB) for mb in window]
    scoring_mbs = [len(range(N)[lo : lo + MB]) for lo in range(0, N, MB)]
    assert critic_mbs == actor_mbs == scoring_mbs == [MB] * 5
    for rollout_id in range(2):
        for counter in (student, critic, teacher):
            counter.reset()
        stats = loop.run_rollout(rollout_id)
        last_step = max(stop_at_random_step(args, rollout_id, list(range(N)), STEPS))
        assert stats.max_stop_step == last_step
        generation = [(MB, False)] * ((last_step + 1) * (N // MB))
        assert student.forwards == generation + [(b, True) for b in actor_mbs]
        assert student.backwards == len(actor_mbs)
        assert critic.forwards == [(b, True) for b in critic_mbs] + [(b, False) for b in scoring_mbs]
        assert critic.backwards == len(critic_mbs)
        # teacher CFG: one forward over [uncond; cond] per scoring micro-batch
        assert teacher.forwards == [(2 * b, False) for b in scoring_mbs] and teacher.backwards == 0
        # K critic optimizer steps and one student step per rollout; the teacher stays frozen
        critic_param, student_param = next(loop.critic.parameters()), next(loop.student.parameters())
        assert int(loop.critic_opt.state[critic_param]["step"]) == K * (rollout_id + 1)
        assert int(loop.student_opt.state[student_param]["step"]) == rollout_id + 1
    frozen = overhead.BareDMD2Loop(pipeline, PROMPTS[:1], config).teacher.state_dict()
    assert all(torch.equal(value, frozen[key]) for key, value in loop.teacher.state_dict().items())


def context(args, loop, rollout_id, microbatch_id=0, external=None, critic=True):
    family = get_model_family(args.hf_checkpoint)
    return TrainContext(
        args=args,
        models={"transformer": loop.critic if critic else loop.student},
        teacher_models={"transformer": loop.teacher} if critic else {},
        external_data=external or {},
        family=family,
        device=torch.device("cpu"),
        dtype=torch.float32,
        rollout_id=rollout_id,
        microbatch_id=microbatch_id,
    )


def test_each_phase_equals_the_trainer_hooks(pipeline):
    """Generation against the engine, the critic's SFT batches and loss, scoring and the surrogate against the hooks."""
    args, critic, actor = miles_args(pipeline)
    assert (critic.steps_per_rollout, critic.micro_batch_size, actor.steps_per_rollout) == (K, MB, 1)
    config = overhead.BareConfig(rollout_batch_size=N, micro_batch_size=MB, critic_steps=K, num_steps=STEPS)
    loop = overhead.BareDMD2Loop(pipeline, PROMPTS, config)
    rollout_id = 1
    close = {"atol": 1e-5, "rtol": 1e-5}

    # generation: the engine and the loop both run the rollout's 40 samples in micro-batches of 8
    prompts = [PROMPTS[(rollout_id * N + b) % len(PROMPTS)] for b in range(N)]
    stop_steps = stop_at_random_step(args, rollout_id, list(range(N)), STEPS)
    family = get_model_family(pipeline)
    spec = run_spec(args).engine
    engine = RolloutEngine(
        spec,
        family,
        family.load_denoiser(pipeline),
        PromptConditioner(spec, family, pipeline),
        family.latent_shape(pipeline),
        read_scheduler_config(pipeline)["num_train_timesteps"],
        args=args,
    )
    shard = make_prompt_shard(rollout_id, [{"prompt": p} for p in prompts], input_key="prompt")
    samples = engine.generate(shard)
    pairs = expand_samples_to_train_pairs(args, samples)
    rollout = loop.generate(rollout_id)
    assert rollout.stop_steps.tolist() == stop_steps
    torch.testing.assert_close(rollout.latents, torch.stack([p.latent for p in pairs]), **close)
    torch.testing.assert_close(rollout.x0, torch.stack([p.x0 for p in pairs]), **close)
    assert rollout.sigma.tolist() == [p.sigma for p in pairs]
    assert torch.equal(rollout.timestep, torch.tensor([p.timestep for p in pairs], dtype=torch.float32))

    # critic: each window's SFT draws and loss, with the critic of that window (after the windows before it)
    for window_index, window in enumerate(split_windows(list(range(N)), K, MB)):
        hook_total = 0.0
        for j, mb in enumerate(window):
            ctx = context(args, loop, rollout_id, window_index * len(window) + j)
            prepared = prepare_critic_batch(ctx, [pairs[i] for i in mb])
            x_sigma, timestep, target = loop.critic_batch(rollout.x0[mb], rollout_id, ctx.microbatch_id)
            torch.testing.assert_close(x_sigma, prepared.latents, **close)
            assert torch.equal(timestep, prepared.timestep)
            torch.testing.assert_close(target, prepared.target, **close)
            with torch.no_grad():
                new_pred = ctx.predict_velocity(loop.critic, prepared.latents, prepared.timestep, prepared.cond)
                loss = sft_loss_formula(ctx, [pairs[i] for i in mb], prepared, new_pred=new_pred, metrics={})
            hook_total += float(loss)
        assert loop.critic_window(rollout, rollout_id, window_index) == pytest.approx(hook_total / N * K, rel=1e-5)

    # scoring with the critic after its K steps
    scores = predict_teacher_and_critic_x0(context(args, loop, rollout_id), pairs)
    x0_real, x0_fake = loop.score(rollout, rollout_id)
    torch.testing.assert_close(x0_real, scores["x0_real"], **close)
    torch.testing.assert_close(x0_fake, scores["x0_fake"], **close)

    # actor: the surrogate's window mean before the step
    external = {"critic": scores}
    hook_total = 0.0
    with torch.no_grad():
        for j, mb in enumerate(split_windows(pairs, 1, MB)[0]):
            ctx = context(args, loop, rollout_id, j, external, critic=False)
            prepared = prepare_generator_batch(ctx, mb)
            new_pred = ctx.predict_velocity(loop.student, prepared.latents, prepared.timestep, prepared.cond)
            hook_total += float(dmd2_loss_formula(ctx, mb, prepared, new_pred=new_pred, metrics={}))
    assert loop.actor_step(rollout, x0_real, x0_fake) == pytest.approx(hook_total / N, rel=1e-4)


def test_breakdown_shows_absent_keys_as_dashes_and_derives_the_gaps():
    """The miles table from records as the driver and rank 0 write them: today's keys, then the full set of docs/architecture.md's "Metrics"."""
    today = {r: {"perf/step_time": 1.0 + r, "perf/rollout_time": 0.1, "perf/critic_train_time": 0.5} for r in range(3)}
    run = overhead.MilesRun(1, 8, [], Path("."), Path("train.log"), perf=today)
    table, medians = overhead.miles_table(run, first=1, last=2)
    assert medians["perf/step_time"] == 2.5 and medians["perf/actor-generate_time"] is None
    assert medians["untimed"] == pytest.approx(1.9) and medians["gaps"] is None
    row = next(line for line in table.splitlines() if "perf/critic-train_output_time" in line)
    assert row.split()[-1] == "–"
    logged = {
        r: {
            **today[r],
            "perf/actor-generate_time": 0.05,
            "perf/critic-train_steps_time": 0.3,
            "perf/critic-train_output_time": 0.1,
            "perf/new_phase_time": 0.2,
        }
        for r in range(3)
    }
    run.perf = logged
    table, medians = overhead.miles_table(run, first=1, last=2)
    assert medians["gaps"] == pytest.approx(2.5 - 0.45)
    assert medians["untimed"] == pytest.approx(2.5 - 0.6 - 0.2)  # the new driver key counts as a driver phase
    assert "other: new_phase_time" in table and medians["perf/new_phase_time"] == 0.2


def test_the_digits_data_module_is_found():
    assert importlib.util.find_spec(overhead.DATA_MODULE) is not None


def test_the_fully_shard_loop_splits_each_rollout_over_two_gloo_processes(pipeline, tmp_path):
    """The bare 2-process ``fully_shard`` loop the benchmark holds miles' 2 ranks against: each rank takes its half of
    a rollout's samples under their rollout-wide ids (its stop steps are the 1-process loop's for those samples),
    trains K windows of its share, and both ranks take the same optimizer steps (FSDP2 over gloo), so every figure
    is finite and rank 0 times every phase."""
    n, k, mb, rollouts = 8, 2, 4, 2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{prompt}"}}\n' for prompt in PROMPTS))
    args = overhead.build_parser().parse_args(
        ["--rollouts", str(rollouts), "--rollout-batch-size", str(n), "--micro-batch-size", str(mb),
         "--dmd2-critic-steps-per-rollout", str(k), "--diffusion-num-steps", str(STEPS)]
    )  # fmt: skip
    config = overhead.config_from(args)
    ranks = overhead.run_bare_sharded(args, config, pipeline, prompts, 2, tmp_path, log=lambda message: None)
    one_process = overhead.BareDMD2Loop(pipeline, PROMPTS, config)
    for rank, stats in enumerate(ranks):
        assert [s.rollout_id for s in stats] == list(range(rollouts))
        for s in stats:
            assert set(s.seconds) == {*overhead.BARE_PHASES, "total"} and all(v > 0 for v in s.seconds.values())
            assert len(s.critic_losses) == k
            assert all(math.isfinite(v) and v > 0 for v in [*s.critic_losses, s.actor_loss])
            # This rank's samples are n/2 · rank .. n/2 · (rank + 1) of the rollout.
            share = one_process.stop_steps(s.rollout_id)[rank * n // 2 : (rank + 1) * n // 2]
            assert s.max_stop_step == int(share.max())
    # The ranks' shares of a rollout are different samples, with different losses.
    assert ranks[0][0].critic_losses != ranks[1][0].critic_losses
