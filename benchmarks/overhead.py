"""What miles' machinery costs on top of the DMD2 math: bare loops of the same math against ``train_diffusion.py``.

    python benchmarks/overhead.py                 # issue 32's four ratios, both sizes (about 15 minutes on 2 cores)
    python benchmarks/overhead.py --quick         # the same, 8 and 4 rollouts: a quick look
    python benchmarks/overhead.py --size tiny --skip-side-by-side --json /tmp/overhead.json
    python benchmarks/overhead.py --size compute --rollouts 12 --warmup 2  # 14.2M parameters, every comparison

One invocation times, on one digits pipeline and the same sizes (defaults: the ``init`` pipeline with
``--max-length 8``, 0.63M parameters, or 14.2M with ``--size compute``; 40 prompts per rollout, K = 5 critic steps, 4 student steps, teacher CFG 3,
micro-batch 8):

(a) a bare DMD2 loop that this script holds in its own process: plain PyTorch and diffusers'
    ``SD3Transformer2DModel`` for the student, the critic and the frozen teacher, the prompts encoded once up front.
    Per rollout it does the trainer's work and nothing else (no Ray, FSDP, hooks or weight push):

    - generation: each sample's stop step uniform in ``[0, S)`` and its initial noise, the S-step ``dmd2`` sampler
      (``x̂0 = x − σ·v``, re-noised with fresh noise) run to the largest stop step, in chunks of ``--micro-batch-size``;
      ``x_i`` and ``x̂0_i`` kept at each sample's stop step;
    - critic steps: K optimizer windows over the rollout's pairs, each in micro-batches, the SFT flow-matching loss on
      ``x̂0_i`` (σ from the 1000-point grid at flow shift 3), loss / window pairs, clip 1.0, AdamW;
    - scoring: per micro-batch ``x̂0_i`` re-noised at a σ of that grid inside 2–98% of the timesteps, the teacher
      with CFG in one forward over ``[uncond; cond]``, the critic unguided, ``x0 = x_σ − σ·v``;
    - actor: one window of all pairs in micro-batches, ``x0 = x_i − σ_i·v``,
      ``g = nan_to_num((x̂0_fake − x̂0_real) / mean|x0 − x̂0_real|)``, the surrogate ``0.5·mean((x0 − sg(x0 − g))²)``
      summed, / pairs, clip 1.0, AdamW.

    Every draw uses the trainer's ``make_generator`` keys, so its stop steps, noise and losses are the trainer's
    (``tests/fast/benchmarks/test_overhead_bare_loop.py`` checks them against the engine and the loss hooks).

(b) the same loop as 2 processes of ``fully_shard`` over gloo (this script with ``--bare-rank``): each rank takes half
    of every rollout's samples (their rollout-wide ids), each model is one FSDP2 unit that stays gathered through a
    phase and reduce-scatters once per optimizer window, as miles' default; no Ray, hooks or driver.

(c) ``train_diffusion.py --loss-type dmd2`` on the same pipeline (student, teacher and critic all from it) and sizes,
    at 1 DP rank (micro-batch 8) and 2 DP ranks (micro-batch 4), as subprocesses with their own ``--output-dir`` and
    log file; their per-rollout ``perf/*`` records (``metrics.jsonl``) give the phase breakdown.

(d) two 2-rank runs of (c) side by side, each its own local Ray cluster, every phase against the run alone.

It prints the medians over rollouts ``--warmup``..``--rollouts − 1``, one breakdown table per run and issue 32's four
ratios: miles 1 rank / (a) at the tiny size (≤ 1.25×) and at the compute size (≤ 1.05×), miles 2 ranks / (b)
(≤ 1.15×), and the worst phase of (d) / alone (≤ 2.5×). The figures depend on the machine and its load; the bars are
meant for a quiet 2-core machine.
"""

import argparse
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from miles.utils.misc import make_generator

REPO = Path(__file__).resolve().parents[1]

# A trainer rank runs as many torch threads as its bundle has CPUs (miles.ray.placement_group.bundle_cpus): at one
# rank on a machine of its own, all of them. The bare loop gets the same by default.
TRAINER_THREADS = max(1, os.cpu_count() or 1)
# The two sizes, each with its bars (miles 1 rank / bare loop, 2 ranks / 1 rank): the recipe's 0.63M
# denoiser, where a rollout's fixed cost (Ray, hooks, collectives' latency) weighs most, and the same digits pipeline
# at 14.2M parameters (4 layers of width 320), where the work per rollout outweighs it as it does at SD3.5 scale.
SIZES = {
    "tiny": {"init_flags": [], "bars": (1.25, 1.15)},
    "compute": {"init_flags": ["--num-attention-heads", "5", "--attention-head-dim", "64"], "bars": (1.05, 1.15)},
}
# Two runs side by side, each against itself alone, in every phase (issue 32).
SIDE_BY_SIDE_BAR = 2.5
# A phase shorter than this alone (seconds, median) is left out of the side-by-side ratio: its ratio is noise.
SIDE_BY_SIDE_MIN_S = 0.02
# --quick: (rollouts, warmup) per size.
QUICK = {"tiny": (8, 2), "compute": (4, 1)}
NUM_TRAIN_TIMESTEPS = 1000
BARE_PHASES = ("generation", "critic_steps", "scoring", "actor")
ROLES = ("critic", "actor")
DERIVED = {"untimed": "step − driver phases", "gaps": "step − in-worker phases"}
DATA_MODULE = "miles.eval.digits.data"


# -- the bare loop ----------------------------------------------------------------------------------------------------
@dataclass
class BareConfig:
    """Sizes and settings of the bare loop (defaults: the issue's measurement and miles' flag defaults).

    Attributes:
        rollout_batch_size: prompts (= samples, one per prompt) per rollout (``--rollout-batch-size``).
        micro_batch_size: samples per forward in every phase (``--micro-batch-size``).
        critic_steps: K, critic optimizer windows per rollout (``--dmd2-critic-steps-per-rollout``).
        num_steps: S, steps of the student's sampler (``--diffusion-num-steps``).
        guidance_scale: the teacher's CFG scale w (``--dmd2-teacher-guidance-scale``); 1 runs one unguided forward.
        sampling_shift: flow shift of the student's S-step schedule (``--diffusion-flow-shift``).
        train_shift: flow shift of the trainer's 1000-point grid (``--fsdp-flow-shift``).
        lr, critic_lr: AdamW learning rates (``--lr``, ``--critic-lr``), constant.
        clip_grad: max global gradient L2 norm (``--clip-grad``).
        seed: the trainers' seed (``--seed``: critic σ and noise, scoring σ and noise).
        rollout_seed: the engine's seed (``--rollout-seed``: stop steps, initial and re-noise noise).
        min_timestep_ratio, max_timestep_ratio: the scoring range as a share of 1000 timesteps.
        negative_prompt: the unconditional prompt of the teacher's CFG.
    """

    rollout_batch_size: int = 40
    micro_batch_size: int = 8
    critic_steps: int = 5
    num_steps: int = 4
    guidance_scale: float = 3.0
    sampling_shift: float = 3.0
    train_shift: float = 3.0
    lr: float = 1e-4
    critic_lr: float = 4e-4
    clip_grad: float = 1.0
    seed: int = 1234
    rollout_seed: int = 42
    min_timestep_ratio: float = 0.02
    max_timestep_ratio: float = 0.98
    negative_prompt: str = ""

    def validate(self) -> None:
        """Reject sizes the trainer would reject (windows of whole micro-batches).

        Raises:
            ValueError: naming the flag to change.
        """
        n, k, mb = self.rollout_batch_size, self.critic_steps, self.micro_batch_size
        if min(n, k, mb, self.num_steps) < 1:
            raise ValueError("--rollout-batch-size, --critic-steps, --micro-batch-size and --num-steps must be >= 1")
        if n % k or (n // k) % mb:
            raise ValueError(
                f"--critic-steps {k} must split the {n} pairs into equal windows of whole micro-batches of "
                f"--micro-batch-size {mb}"
            )


def shifted_grid(num_points: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The flow-matching σ grid: ``s = linspace(1, 1/N, N)``, ``σ = k·s / (1 + (k − 1)·s)`` plus a terminal 0.

    Same formula as diffusers' ``FlowMatchEulerDiscreteScheduler`` shift (SD3 paper, eq. 23). Returns float64
    ``sigmas (N + 1,)`` in [0, 1], descending, and float64 ``timesteps (N,)`` = ``σ · 1000``.
    """
    s = torch.linspace(1.0, 1.0 / num_points, num_points, dtype=torch.float64)
    sigmas = shift * s / (1 + (shift - 1) * s)
    return torch.cat([sigmas, sigmas.new_zeros(1)]), sigmas * NUM_TRAIN_TIMESTEPS


@dataclass
class Rollout:
    """One rollout's train pairs, sample ``b`` stopped at step ``stop_steps[b]``.

    Attributes:
        prompt_rows: int64 ``(N,)``, each sample's row in the encoded prompt table.
        stop_steps: int64 ``(N,)`` in ``[0, S)``.
        latents: ``x_i``, float32 ``(N, C, H, W)``.
        x0: ``x̂0_i``, float32 ``(N, C, H, W)``.
        sigma: ``σ_i``, float64 ``(N,)`` in [0, 1]; timestep: ``t_i = σ_i · 1000``, float32 ``(N,)``.
    """

    prompt_rows: torch.Tensor
    stop_steps: torch.Tensor
    latents: torch.Tensor
    x0: torch.Tensor
    sigma: torch.Tensor
    timestep: torch.Tensor


@dataclass
class RolloutStats:
    """What one rollout of the bare loop measured: wall seconds per phase and its losses."""

    rollout_id: int
    seconds: dict[str, float]
    critic_losses: list[float]
    actor_loss: float
    max_stop_step: int


def _velocity(model: nn.Module, x: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor]):
    """One ``SD3Transformer2DModel`` forward: the velocity ``v = ε − x0``, float32 ``(B, C, H, W)``."""
    return model(hidden_states=x, timestep=timestep, return_dict=False, **cond)[0].float()


class BareDMD2Loop:
    """The DMD2 trainer's work per rollout in one process, with plain PyTorch modules and optimizers.

    Args:
        pipeline: a digits pipeline directory; student, critic and teacher all load its ``transformer/``.
        prompts: the prompt pool; rollout r takes the next ``rollout_batch_size`` prompts, cycling.
        config: sizes and settings.

    Raises:
        ValueError: from ``BareConfig.validate``.
    """

    def __init__(
        self, pipeline: str | Path, prompts: list[str], config: BareConfig, rank: int = 0, world_size: int = 1
    ) -> None:
        from diffusers import SD3Transformer2DModel

        from miles.models import get_model_family

        self.rank, self.world_size = rank, world_size
        if world_size == 1:
            config.validate()
        else:
            # config.micro_batch_size is this rank's; the rollout's samples split evenly over the ranks.
            check_miles_sizes(replace(config, micro_batch_size=config.micro_batch_size * world_size), world_size)
        self.config = config
        self.local_n = config.rollout_batch_size // world_size
        self.first = rank * self.local_n  # this rank's first sample of each rollout
        folder = Path(pipeline) / "transformer"
        self.student = SD3Transformer2DModel.from_pretrained(folder, torch_dtype=torch.float32).train()
        self.critic = SD3Transformer2DModel.from_pretrained(folder, torch_dtype=torch.float32).train()
        self.teacher = SD3Transformer2DModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
        self.teacher.requires_grad_(False)
        if world_size > 1:
            # What miles does by default (miles.backends.fsdp_utils.model): each model one FSDP2 unit over gloo that
            # stays gathered through a phase; a window reduce-scatters its gradients once, after its last backward.
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world_size,))
            for model in (self.student, self.critic, self.teacher):
                fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model_config = self.student.config
        self.latent_shape = (model_config.in_channels, model_config.sample_size, model_config.sample_size)

        # Encoded once: the trainer memoises each prompt's encoding too (MiniLMPromptEncoder).
        family = get_model_family(pipeline)
        encoder = family.load_text_encoder(pipeline)
        unique = sorted(set(prompts))
        row_of = {prompt: row for row, prompt in enumerate(unique)}
        self.cond_table = family.encode_prompts(encoder, unique)
        self.pool_rows = torch.tensor([row_of[prompt] for prompt in prompts], dtype=torch.long)
        self.neg_cond = family.encode_prompts(encoder, [config.negative_prompt])

        self.sampling_sigmas, self.sampling_timesteps = shifted_grid(config.num_steps, config.sampling_shift)
        self.grid_sigmas, self.grid_timesteps = shifted_grid(NUM_TRAIN_TIMESTEPS, config.train_shift)
        low = config.min_timestep_ratio * NUM_TRAIN_TIMESTEPS
        high = config.max_timestep_ratio * NUM_TRAIN_TIMESTEPS
        self.scoring_indices = torch.nonzero((self.grid_timesteps >= low) & (self.grid_timesteps <= high)).flatten()

        # torch's AdamW defaults for plain CPU tensors (foreach=None picks the per-tensor loop on the CPU; betas and
        # eps are also miles' defaults) without weight decay (miles' --weight-decay 0), and a constant learning-rate
        # schedule stepped per window, as the trainer's LambdaLR.
        # Sharded: foreach=True, as miles (foreach=None takes the per-tensor loop for DTensors, 20% of a rank's time).
        foreach = True if world_size > 1 else None
        self.student_opt = torch.optim.AdamW(
            self.student.parameters(), lr=config.lr, weight_decay=0.0, foreach=foreach
        )
        self.critic_opt = torch.optim.AdamW(
            self.critic.parameters(), lr=config.critic_lr, weight_decay=0.0, foreach=foreach
        )
        self.student_sched = torch.optim.lr_scheduler.LambdaLR(self.student_opt, lambda step: 1.0)
        self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, lambda step: 1.0)

    def _sync(self, model: nn.Module, last_micro_batch: bool) -> None:
        """Sharded: reduce-scatter and reshard only after a window's last backward (miles' ``window_sync``)."""
        if self.world_size > 1:
            model.set_requires_gradient_sync(last_micro_batch)
            model.set_reshard_after_backward(last_micro_batch)

    def _reshard(self, *models: nn.Module) -> None:
        """Sharded: free the gathered parameters at a no-grad phase's end, as the trainer does."""
        if self.world_size > 1:
            for model in models:
                model.reshard()

    def cond(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Batched positive cond kwargs of the prompt-table rows ``rows``."""
        return {key: value[rows] for key, value in self.cond_table.items()}

    # -- generation ------------------------------------------------------------------------------------------------
    def stop_steps(self, rollout_id: int) -> torch.Tensor:
        """Sample b's stop step, uniform in ``[0, S)`` from ``make_generator("stop_step", rollout_seed, r, b)``."""
        c = self.config
        draws = [
            torch.randint(c.num_steps, (1,), generator=make_generator("stop_step", c.rollout_seed, rollout_id, b))
            for b in range(self.first, self.first + self.local_n)
        ]
        return torch.cat(draws)

    def _noise(self, purpose: str, rollout_id: int, indices: range, *step: int) -> torch.Tensor:
        seed = self.config.rollout_seed
        return torch.stack(
            [
                torch.randn(self.latent_shape, generator=make_generator(purpose, seed, rollout_id, b, *step))
                for b in indices
            ]
        )

    @torch.no_grad()
    def generate(self, rollout_id: int) -> Rollout:
        """The student's rollout of ``rollout_batch_size`` samples, in chunks of ``micro_batch_size``.

        Every chunk runs steps ``0..max(stop steps of the rollout)`` of the dmd2 sampler, as today's engine carries
        its whole batch to the last step any sample needs; the chunks are the trainer's coming per-rank
        micro-batches. Sample b starts from ``make_generator("init_noise", rollout_seed, r, b)`` and is re-noised
        after step k from ``make_generator("renoise", rollout_seed, r, b, k)``.
        """
        c = self.config
        n = self.local_n
        start = rollout_id * c.rollout_batch_size + self.first
        prompt_rows = self.pool_rows[[(start + b) % len(self.pool_rows) for b in range(n)]]
        stop = self.stop_steps(rollout_id)
        last_step = int(stop.max())
        latents = torch.empty(n, *self.latent_shape)
        x0_kept = torch.empty(n, *self.latent_shape)
        for lo in range(0, n, c.micro_batch_size):
            indices = range(lo, min(lo + c.micro_batch_size, n))
            cond = self.cond(prompt_rows[lo : indices.stop])
            keys = range(self.first + indices.start, self.first + indices.stop)  # the samples' rollout-wide ids
            x = self._noise("init_noise", rollout_id, keys)
            for k in range(last_step + 1):
                sigma, sigma_next = float(self.sampling_sigmas[k]), float(self.sampling_sigmas[k + 1])
                timestep = torch.full((len(indices),), float(self.sampling_timesteps[k]), dtype=torch.float32)
                x0 = x - sigma * _velocity(self.student, x, timestep, cond)
                here = (stop[lo : indices.stop] == k).nonzero().flatten()
                latents[lo + here] = x[here]
                x0_kept[lo + here] = x0[here]
                if k < last_step:
                    x = (1.0 - sigma_next) * x0 + sigma_next * self._noise("renoise", rollout_id, keys, k)
        self._reshard(self.student)
        return Rollout(
            prompt_rows=prompt_rows,
            stop_steps=stop,
            latents=latents,
            x0=x0_kept,
            sigma=self.sampling_sigmas[stop],
            timestep=self.sampling_timesteps[stop].float(),
        )

    # -- critic ------------------------------------------------------------------------------------------------------
    def critic_batch(self, x0: torch.Tensor, rollout_id: int, microbatch_id: int):
        """SFT inputs of one critic micro-batch: ``(x_σ, timestep, target = ε − x0)``.

        One generator, ``make_generator("sample", seed, rollout, microbatch, 0)``, draws the grid indices (uniform
        over the 1000 points) and then ``ε``, as the trainer's SFT hook does.
        """
        generator = make_generator("sample", self.config.seed, rollout_id, microbatch_id, self.rank)
        grid_index = torch.randint(0, NUM_TRAIN_TIMESTEPS, (len(x0),), generator=generator)
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
        sigma = self.grid_sigmas[grid_index].float().view(-1, 1, 1, 1)
        return (1 - sigma) * x0 + sigma * noise, self.grid_timesteps[grid_index].float(), noise - x0

    def critic_steps(self, rollout: Rollout, rollout_id: int) -> list[float]:
        """K optimizer windows of the critic's SFT loss on ``x̂0_i``; returns each window's mean loss."""
        return [self.critic_window(rollout, rollout_id, w) for w in range(self.config.critic_steps)]

    def critic_window(self, rollout: Rollout, rollout_id: int, window_index: int) -> float:
        """Critic window ``window_index`` (pairs ``w·N/K .. (w+1)·N/K``): forward/backward per micro-batch, then one
        clipped AdamW step. Micro-batch ids count on over the windows, as in the trainer. Returns the window's mean
        per-pair loss."""
        c = self.config
        size = self.local_n // c.critic_steps
        first = window_index * size
        per_window = math.ceil(size / c.micro_batch_size)
        total = 0.0
        for j, lo in enumerate(range(first, first + size, c.micro_batch_size)):
            sl = slice(lo, min(lo + c.micro_batch_size, first + size))
            self._sync(self.critic, j == per_window - 1)
            x_sigma, timestep, target = self.critic_batch(rollout.x0[sl], rollout_id, window_index * per_window + j)
            v = _velocity(self.critic, x_sigma, timestep, self.cond(rollout.prompt_rows[sl]))
            loss = (v - target).pow(2).flatten(1).mean(dim=1).sum()
            # The loss is a sum over pairs; dividing by the window's pair count makes the step the window mean.
            (loss / size).backward()
            total += float(loss.detach())
        self._step(self.critic, self.critic_opt, self.critic_sched)
        return total / size

    def _step(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], self.config.clip_grad)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    # -- scoring -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, rollout: Rollout, rollout_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher (CFG) and critic (unguided) x0 predictions of the re-noised ``x̂0_i``: float32 ``(N, C, H, W)`` each.

        Per micro-batch m, ``make_generator("dmd2_score", seed, rollout, m, 0)`` draws the grid positions (uniform
        over the points inside 2–98% of the timesteps) and then ``ε``.
        """
        c = self.config
        x0_real, x0_fake = [], []
        for m, lo in enumerate(range(0, self.local_n, c.micro_batch_size)):
            sl = slice(lo, lo + c.micro_batch_size)
            x0_hat = rollout.x0[sl]
            generator = make_generator("dmd2_score", c.seed, rollout_id, m, self.rank)
            grid_index = self.scoring_indices[
                torch.randint(0, len(self.scoring_indices), (len(x0_hat),), generator=generator)
            ]
            noise = torch.randn(x0_hat.shape, generator=generator, dtype=torch.float32)
            sigma = self.grid_sigmas[grid_index].float().view(-1, 1, 1, 1)
            timestep = self.grid_timesteps[grid_index].float()
            x_sigma = (1 - sigma) * x0_hat + sigma * noise
            cond = self.cond(rollout.prompt_rows[sl])
            if c.guidance_scale == 1.0:
                v_real = _velocity(self.teacher, x_sigma, timestep, cond)
            else:
                batch = len(x0_hat)
                both = {
                    key: torch.cat([self.neg_cond[key].expand(batch, *value.shape[1:]), value])
                    for key, value in cond.items()
                }
                uncond, cond_v = _velocity(
                    self.teacher, torch.cat([x_sigma, x_sigma]), torch.cat([timestep, timestep]), both
                ).chunk(2)
                v_real = uncond + c.guidance_scale * (cond_v - uncond)
            v_fake = _velocity(self.critic, x_sigma, timestep, cond)
            x0_real.append(x_sigma - sigma * v_real)
            x0_fake.append(x_sigma - sigma * v_fake)
        self._reshard(self.teacher, self.critic)
        return torch.cat(x0_real), torch.cat(x0_fake)

    # -- actor -------------------------------------------------------------------------------------------------------
    def actor_step(self, rollout: Rollout, x0_real: torch.Tensor, x0_fake: torch.Tensor) -> float:
        """One optimizer window of the DMD2 generator surrogate over all pairs; returns its mean per-pair loss."""
        c = self.config
        n = self.local_n
        total = 0.0
        for lo in range(0, n, c.micro_batch_size):
            sl = slice(lo, lo + c.micro_batch_size)
            self._sync(self.student, lo + c.micro_batch_size >= n)
            v = _velocity(self.student, rollout.latents[sl], rollout.timestep[sl], self.cond(rollout.prompt_rows[sl]))
            x0 = rollout.latents[sl] - rollout.sigma[sl].float().view(-1, 1, 1, 1) * v
            with torch.no_grad():
                normalizer = (x0.detach() - x0_real[sl]).abs().mean(dim=(1, 2, 3), keepdim=True)
                grad = torch.nan_to_num((x0_fake[sl] - x0_real[sl]) / normalizer)
            loss = (0.5 * (x0 - (x0 - grad).detach()).pow(2).mean(dim=(1, 2, 3))).sum()
            (loss / n).backward()
            total += float(loss.detach())
        self._step(self.student, self.student_opt, self.student_sched)
        return total / n

    def run_rollout(self, rollout_id: int) -> RolloutStats:
        """Generation, K critic steps, scoring and the actor step of one rollout, each timed (wall seconds)."""
        seconds = {}
        start = time.perf_counter()
        rollout = self.generate(rollout_id)
        seconds["generation"] = time.perf_counter() - start
        mark = time.perf_counter()
        critic_losses = self.critic_steps(rollout, rollout_id)
        seconds["critic_steps"] = time.perf_counter() - mark
        mark = time.perf_counter()
        x0_real, x0_fake = self.score(rollout, rollout_id)
        seconds["scoring"] = time.perf_counter() - mark
        mark = time.perf_counter()
        actor_loss = self.actor_step(rollout, x0_real, x0_fake)
        seconds["actor"] = time.perf_counter() - mark
        seconds["total"] = time.perf_counter() - start
        return RolloutStats(rollout_id, seconds, critic_losses, actor_loss, int(rollout.stop_steps.max()))


def run_bare(pipeline: Path, prompts: list[str], config: BareConfig, rollouts: int, log=None) -> list[RolloutStats]:
    """``rollouts`` rollouts of a fresh ``BareDMD2Loop``; ``log(str)`` reports progress."""
    loop = BareDMD2Loop(pipeline, prompts, config)
    stats = []
    for rollout_id in range(rollouts):
        stats.append(loop.run_rollout(rollout_id))
        if log is not None:
            log(f"bare loop: rollout {rollout_id + 1}/{rollouts} {stats[-1].seconds['total']:.3f} s")
    return stats


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bare_rank_command(args: argparse.Namespace, config: BareConfig, pipeline: Path, prompt_data: Path, rank: int,
                      world_size: int, port: int, out: Path) -> list[str]:  # fmt: skip
    """This script's command for rank ``rank`` of the bare ``fully_shard`` loop (``config.micro_batch_size`` is the
    rank's micro-batch)."""
    # fmt: off
    return [
        sys.executable, str(Path(__file__).resolve()), "--bare-rank", f"{rank}/{world_size}", "--bare-port", str(port),
        "--pipeline", str(pipeline), "--prompt-data", str(prompt_data), "--rollouts", str(args.rollouts),
        "--threads", str(max(1, (os.cpu_count() or 1) // world_size)), "--json", str(out),
        "--rollout-batch-size", str(config.rollout_batch_size), "--micro-batch-size", str(config.micro_batch_size),
        "--dmd2-critic-steps-per-rollout", str(config.critic_steps), "--diffusion-num-steps", str(config.num_steps),
        "--guidance-scale", str(config.guidance_scale), "--lr", str(config.lr), "--critic-lr", str(config.critic_lr),
        "--seed", str(config.seed), "--rollout-seed", str(config.rollout_seed),
    ]
    # fmt: on


def bare_rank_main(args: argparse.Namespace) -> int:
    """One rank of the bare ``fully_shard`` loop (``--bare-rank R/W``): a gloo process group on this machine, the
    rollouts of :class:`BareDMD2Loop` on this rank's share, rank 0's :class:`RolloutStats` written to ``--json``."""
    import torch.distributed as dist

    rank, world_size = (int(part) for part in args.bare_rank.split("/"))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.bare_port}", rank=rank, world_size=world_size)
    try:
        loop = BareDMD2Loop(args.pipeline, read_prompts(args.prompt_data), config_from(args), rank, world_size)
        stats = [loop.run_rollout(rollout_id) for rollout_id in range(args.rollouts)]
    finally:
        dist.destroy_process_group()
    args.json.write_text(json.dumps([asdict(each) for each in stats]) + "\n")
    return 0


def run_bare_sharded(
    args: argparse.Namespace, config: BareConfig, pipeline: Path, prompt_data: Path, world_size: int, work_dir: Path,
    log,
) -> list[list[RolloutStats]]:  # fmt: skip
    """The bare loop as ``world_size`` processes of ``fully_shard`` over gloo (the rollout's samples split evenly,
    micro-batch ``config.micro_batch_size / world_size``), each as many torch threads as a miles rank gets on this
    machine; every rank's per-rollout stats, rank 0's first (its seconds are the loop's).

    Raises:
        RuntimeError: when a rank fails or exceeds ``--run-timeout``; the message holds its last log lines.
    """
    run_dir = work_dir / f"bare_fsdp_{world_size}rank"
    run_dir.mkdir(parents=True, exist_ok=True)
    local = replace(config, micro_batch_size=miles_micro_batch(config, world_size))
    port = _free_port()
    outs = [run_dir / f"rank{rank}.json" for rank in range(world_size)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    logs = [run_dir / f"rank{rank}.log" for rank in range(world_size)]
    for rank, path in enumerate(logs):
        command = bare_rank_command(args, local, pipeline, prompt_data, rank, world_size, port, outs[rank])
        with open(path, "w") as log_file:
            ChildProcess.procs.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
            )
    codes = ChildProcess.wait_all(args.run_timeout)
    for rank, code in enumerate(codes):
        if code != 0:
            what = "exceeded the timeout" if code is None else f"failed with exit code {code}"
            raise RuntimeError(f"bare fully_shard rank {rank} {what}; last lines of {logs[rank]}:\n{tail(logs[rank])}")
    log(f"bare fully_shard loop, {_ranks(world_size)}: done")
    return [[RolloutStats(**each) for each in json.loads(out.read_text())] for out in outs]


# -- inputs ------------------------------------------------------------------------------------------------------------
def _run_quiet(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({shlex.join(cmd)}):\n{result.stdout}{result.stderr}")


def make_inputs(
    work_dir: Path, pipeline: Path | None, prompt_data: Path | None, size: str = "tiny"
) -> tuple[Path, Path]:
    """The pipeline (``python -m miles.models.digits init DIR --max-length 8`` with the ``SIZES[size]`` flags) and
    ``prompts.jsonl``, unless given."""
    if pipeline is None:
        pipeline = work_dir / ("pipeline" if size == "tiny" else f"pipeline-{size}")
        if not (pipeline / "model_index.json").is_file():
            cmd = [sys.executable, "-m", "miles.models.digits", "init", str(pipeline), "--max-length", "8"]
            cmd += SIZES[size]["init_flags"]
            _run_quiet(cmd, "writing the digits pipeline")
    if prompt_data is None:
        data_dir = work_dir / "data"
        prompt_data = data_dir / "prompts.jsonl"
        if not prompt_data.is_file():
            _run_quiet([sys.executable, "-m", DATA_MODULE, str(data_dir)], "writing the digits data")
    return pipeline, prompt_data


def read_prompts(path: Path, key: str = "prompt") -> list[str]:
    """The ``key`` field of every record of a JSONL file, in file order."""
    with open(path) as f:
        prompts = [json.loads(line)[key] for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


# -- the miles runs ----------------------------------------------------------------------------------------------------
@dataclass
class MilesRun:
    """One ``train_diffusion.py`` subprocess: its command, directories and, once done, its ``perf/*`` records."""

    ranks: int
    micro_batch_size: int
    command: list[str]
    output_dir: Path
    log_path: Path
    wall_seconds: float = 0.0
    perf: dict[int, dict[str, float]] = field(default_factory=dict)
    # memory/<role>-<kind>_bytes of the last rollout: what rank 0 of each group holds
    memory: dict[str, float] = field(default_factory=dict)


MEMORY_KINDS = ("parameters", "gradients", "optimizer", "frozen")


def memory_table(run: "MilesRun") -> str:
    """Bytes rank 0 of each group holds (MiB): its parameter shards, gradients, optimizer state, frozen models."""
    roles = sorted({key.removeprefix("memory/").rsplit("-", 1)[0] for key in run.memory})
    rows = []
    for role in roles:
        values = [run.memory.get(f"memory/{role}-{kind}_bytes") for kind in MEMORY_KINDS]
        rows.append([role, *("–" if v is None else f"{v / 2**20:.2f}" for v in values)])
    return format_table(["MiB per rank", *MEMORY_KINDS], rows, "<>>>>") if rows else ""


def miles_command(
    args: argparse.Namespace, config: BareConfig, pipeline: Path, prompt_data: Path, ranks: int, out: Path
) -> list[str]:
    """The ``train_diffusion.py --loss-type dmd2`` command of a run at ``ranks`` DP ranks."""
    # fmt: off
    cmd = [
        sys.executable, str(REPO / "train_diffusion.py"), "--loss-type", "dmd2",
        "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline), "--prompt-data", str(prompt_data),
        "--actor-num-gpus-per-node", str(ranks), "--micro-batch-size", str(miles_micro_batch(config, ranks)),
        "--rollout-batch-size", str(config.rollout_batch_size), "--num-rollout", str(args.rollouts),
        "--diffusion-num-steps", str(config.num_steps), "--diffusion-flow-shift", str(config.sampling_shift),
        "--fsdp-flow-shift", str(config.train_shift), "--dmd2-critic-steps-per-rollout", str(config.critic_steps),
        "--dmd2-teacher-guidance-scale", str(config.guidance_scale), "--lr", str(config.lr),
        "--critic-lr", str(config.critic_lr), "--clip-grad", str(config.clip_grad), "--seed", str(config.seed),
        "--rollout-seed", str(config.rollout_seed), "--output-dir", str(out),
    ]
    # fmt: on
    return cmd + shlex.split(args.miles_args)


def miles_micro_batch(config: BareConfig, ranks: int) -> int:
    """The per-rank micro-batch at ``ranks`` DP ranks: the bare loop's, divided by the ranks (8 → 4 at 2 ranks)."""
    return max(1, config.micro_batch_size // ranks)


def check_miles_sizes(config: BareConfig, ranks: int) -> None:
    """Reject sizes ``train_diffusion.py`` would reject at ``ranks`` DP ranks, before the bare loop runs.

    Each rank's shard of the rollout must split into K windows of whole micro-batches (``validate_dmd2_args``).

    Raises:
        ValueError: naming the flags.
    """
    n, k, mb = config.rollout_batch_size, config.critic_steps, miles_micro_batch(config, ranks)
    if n % ranks or (n // ranks) % k or (n // ranks // k) % mb:
        raise ValueError(
            f"at {ranks} DP ranks the {n} pairs do not split into shards of {k} windows of whole micro-batches of "
            f"{mb} (--micro-batch-size / ranks); change --rollout-batch-size, --micro-batch-size or --ranks"
        )


class ChildProcess:
    """The subprocesses running now (a miles run, two side by side, or the bare loop's ranks), so that Ctrl-C can end
    them by their PIDs."""

    procs: list[subprocess.Popen] = []

    @classmethod
    def wait_all(cls, timeout: float) -> list[int | None]:
        """Each running subprocess's exit code, in start order; past ``timeout`` seconds (in all) the ones still
        running are stopped and read None. The list is then empty."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in cls.procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        cls.stop()
        return codes

    @classmethod
    def stop(cls, grace_seconds: float = 60.0) -> None:
        """SIGTERM each (train_diffusion.py then shuts Ray down), SIGKILL after ``grace_seconds``."""
        procs, cls.procs = cls.procs, []
        running = [proc for proc in procs if proc.poll() is None]
        for proc in running:
            os.kill(proc.pid, signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file."""
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


def run_miles(run: MilesRun, timeout: float, log, threads: int | None = None) -> None:
    """Run ``run.command`` with its output in ``run.log_path``; fill ``run.perf`` from its ``metrics.jsonl``.

    Raises:
        RuntimeError: when the run fails or exceeds ``timeout`` seconds; the message holds its last log lines.
    """
    run_miles_together([run], timeout, log, threads)


def run_miles_together(runs: list[MilesRun], timeout: float, log, threads: int | None = None) -> None:
    """Start every run of ``runs`` at once (each its own local Ray cluster, as two users' runs on one machine) and
    wait for all; fill each ``run.perf`` from its ``metrics.jsonl``. ``threads`` caps each rank's torch threads
    (``OMP_NUM_THREADS``, which the driver reads: ``miles.ray.placement_group.rank_threads``), so that ``--threads``
    holds for the bare loop and miles alike.

    Raises:
        RuntimeError: when a run fails or exceeds ``timeout`` seconds; the message holds its last log lines.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    start = time.perf_counter()
    for run in runs:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        with open(run.log_path, "w") as log_file:
            log_file.write(f"$ {shlex.join(run.command)}\n")
            log_file.flush()
            # Its own session: a terminal's Ctrl-C reaches only this script, which ends the run once, by PID.
            ChildProcess.procs.append(
                subprocess.Popen(
                    run.command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    codes = ChildProcess.wait_all(timeout)
    for run, returncode in zip(runs, codes):
        run.wall_seconds = time.perf_counter() - start
        if returncode is None:
            raise RuntimeError(
                f"{run.ranks}-rank run exceeded {timeout:.0f} s; log {run.log_path}:\n{tail(run.log_path)}"
            )
        if returncode != 0:
            raise RuntimeError(
                f"{run.ranks}-rank run failed with exit code {returncode}; last lines of {run.log_path}:\n"
                f"{tail(run.log_path)}"
            )
        _read_run(run, log)


def _read_run(run: MilesRun, log) -> None:
    from miles.utils.tracking import read_metrics

    for record in read_metrics(run.output_dir):
        values = {key: value for key, value in record.items() if key.startswith("perf/") and _is_number(value)}
        if values:
            run.perf.setdefault(int(record["rollout_id"]), {}).update(values)
        run.memory.update({key: value for key, value in record.items() if key.startswith("memory/")})
    log(f"miles, {_ranks(run.ranks)}: done in {run.wall_seconds:.0f} s")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- figures -----------------------------------------------------------------------------------------------------------
def median_over(per_rollout: dict[int, float], first: int, last: int) -> float | None:
    """Median of the values of rollouts ``first..last`` (inclusive) that have one; None when none has."""
    values = [value for rollout_id, value in per_rollout.items() if first <= rollout_id <= last]
    return statistics.median(values) if values else None


def worker_keys(perf: dict[int, dict[str, float]]) -> list[str]:
    """The in-worker ``perf/<role>-<phase>`` keys present in any rollout (rank 0 of a group logs them; see
    docs/architecture.md, "Metrics"); the driver's own keys, ``perf/<role>_train_time`` and the like, have no dash."""
    present = {key for values in perf.values() for key in values}
    return sorted(key for key in present if "-" in key.removeprefix("perf/"))


def driver_keys(perf: dict[int, dict[str, float]]) -> list[str]:
    """The driver's phase keys present in any rollout: everything but the step itself and in-worker keys."""
    present = {key for values in perf.values() for key in values}
    return sorted(present - {"perf/step_time"} - set(worker_keys(perf)))


def with_gaps(perf: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Per rollout, adds two derived figures to the ``perf/*`` values.

    ``gaps`` = ``perf/step_time`` − the sum of the in-worker phases (only when one is logged), and ``untimed`` =
    ``perf/step_time`` − the sum of the driver's phases (what no driver timer covers, e.g. the groups' sleep today).
    """
    workers, drivers = worker_keys(perf), driver_keys(perf)
    out = {}
    for rollout_id, values in perf.items():
        values = dict(values)
        step = values.get("perf/step_time")
        if step is not None:
            values["untimed"] = step - sum(values.get(key, 0.0) for key in drivers)
            if workers:
                values["gaps"] = step - sum(values.get(key, 0.0) for key in workers)
        out[rollout_id] = values
    return out


def phase_rows(perf: dict[int, dict[str, float]]) -> list[tuple[str, str]]:
    """``(label, key)`` rows of a miles run's breakdown: the names of docs/architecture.md ("Metrics") first, then
    any other ``perf/*`` key."""
    rows = [
        ("step (driver wall clock)", "perf/step_time"),
        ("  rollout: prompt shards + generation", "perf/rollout_time"),
        ("    generation (actor rank 0)", "perf/actor-generate_time"),
    ]
    for role in ROLES:
        rows += [
            (f"  {role} train (driver)", f"perf/{role}_train_time"),
            (f"    {role} wake (rank 0)", f"perf/{role}-wake_time"),
            (f"    {role} optimizer steps (rank 0)", f"perf/{role}-train_steps_time"),
        ]
        if role == "critic":
            rows.append(("    critic scoring (rank 0)", "perf/critic-train_output_time"))
        rows.append((f"    {role} sleep (rank 0)", f"perf/{role}-sleep_time"))
    rows += [
        ("  weight push to the engine", "perf/update_weights_time"),
        ("  sleep / wake (driver)", "perf/sleep_wake_time"),
        ("  no driver timer", "untimed"),
        ("  driver and Ray gaps", "gaps"),
    ]
    known = {key for _, key in rows}
    present = sorted({key for values in perf.values() for key in values} - known)
    rows += [(f"  other: {key.removeprefix('perf/')}", key) for key in present]
    return rows


def _ranks(ranks: int) -> str:
    return f"{ranks} DP rank" + ("" if ranks == 1 else "s")


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def format_table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """A plain-text table; ``align`` holds one ``<`` or ``>`` per column."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells):
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, align, widths)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def bare_table(stats: list[RolloutStats], first: int, last: int) -> tuple[str, dict[str, float | None]]:
    """The bare loop's breakdown (medians per phase) and the medians themselves."""
    medians = {}
    for phase in (*BARE_PHASES, "total"):
        medians[phase] = median_over({s.rollout_id: s.seconds[phase] for s in stats}, first, last)
    total = medians["total"]
    labels = {
        "generation": "generation (S-step sampler, chunks)",
        "critic_steps": "critic optimizer steps (K windows)",
        "scoring": "scoring (teacher CFG + critic)",
        "actor": "actor step",
        "total": "rollout",
    }
    rows = [[labels[p], _fmt(medians[p]), _share(medians[p], total)] for p in ("total", *BARE_PHASES)]
    return format_table(["bare loop phase", "median s", "share"], rows, "<>>"), medians


def _share(value: float | None, total: float | None) -> str:
    if value is None or not total:
        return ""
    return f"{100 * value / total:.0f}%"


def miles_table(run: MilesRun, first: int, last: int) -> tuple[str, dict[str, float | None]]:
    """A miles run's breakdown (medians of each ``perf/*`` key, "–" when not logged) and the medians."""
    perf = with_gaps(run.perf)
    medians = {}
    rows = []
    for label, key in phase_rows(perf):
        medians[key] = median_over({r: v[key] for r, v in perf.items() if key in v}, first, last)
        rows.append([label, DERIVED.get(key, key), _fmt(medians[key])])
        rows[-1].append(_share(medians[key], medians.get("perf/step_time")))
    title = f"miles, {_ranks(run.ranks)}, micro-batch {run.micro_batch_size}"
    return format_table([title, "key", "median s", "share"], rows, "<<>>"), medians


def ratio_row(name: str, numerator: float | None, denominator: float | None, bar: float) -> tuple[list[str], dict]:
    """A summary row for a ratio against its bar, and its JSON record."""
    if numerator is None or denominator is None or denominator == 0:
        return [name, "–", f"≤ {bar}×", "not measured"], {"value": None, "bar": bar, "met": None}
    value = numerator / denominator
    met = value <= bar
    return [name, f"{value:.2f}×", f"≤ {bar}×", "met" if met else "missed"], {"value": value, "bar": bar, "met": met}


# -- command line ------------------------------------------------------------------------------------------------------
def parse_ranks(text: str) -> list[int]:
    """``"1,2"`` → ``[1, 2]``."""
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--ranks takes comma-separated integers, got {text!r}") from exc
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"--ranks needs DP sizes >= 1, got {text!r}")
    return ranks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--size",
        choices=[*sorted(SIZES), "both"],
        default=None,
        help="The fresh pipeline's size and its bars: tiny (0.63M parameters), compute (14.2M), or both (the "
        "default: tiny with every comparison, then compute against the bare loop at 1 rank).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"A short look: {QUICK['tiny'][0]} rollouts (medians after {QUICK['tiny'][1]}) at the tiny size, "
        f"{QUICK['compute'][0]} (after {QUICK['compute'][1]}) at the compute size.",
    )
    parser.add_argument(
        "--skip-bare-fsdp", action="store_true", help="Do not run the bare fully_shard loop at 2 processes."
    )
    parser.add_argument(
        "--skip-side-by-side", action="store_true", help="Do not run two miles runs of the largest --ranks at once."
    )
    # Internal: one rank of the bare fully_shard loop, started by this script.
    parser.add_argument("--bare-rank", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bare-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", type=Path, default=None, help="Digits pipeline dir (default: a fresh init).")
    parser.add_argument("--prompt-data", type=Path, default=None, help="Prompts JSONL (default: digits prompts).")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="Inputs, run dirs and logs (default: a new temp dir, kept for its logs; the run names it at the end).",
    )
    parser.add_argument("--rollouts", type=int, default=None, help="Rollouts per loop / run (default 26; 10 at the "
                        "compute size).")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=None, help="Rollouts left out of the medians (default 5; 2 "
                        "at the compute size).")  # fmt: skip
    parser.add_argument("--ranks", type=parse_ranks, default=[1, 2], help="DP sizes of the miles runs, e.g. 1,2.")
    parser.add_argument("--skip-bare", action="store_true", help="Do not run the bare loop.")
    parser.add_argument("--skip-miles", action="store_true", help="Do not run train_diffusion.py.")
    parser.add_argument(
        "--threads",
        type=int,
        default=TRAINER_THREADS,
        help=f"torch threads of the bare loop, and at most those of each miles rank (OMP_NUM_THREADS); default "
        f"{TRAINER_THREADS}, what a 1-rank trainer process runs. --threads 1 on a machine shared with other work.",
    )
    defaults = BareConfig()
    parser.add_argument("--rollout-batch-size", type=int, default=defaults.rollout_batch_size)
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=defaults.micro_batch_size,
        help="Bare loop and 1-rank micro-batch; R ranks use it / R.",
    )
    parser.add_argument("--dmd2-critic-steps-per-rollout", type=int, default=defaults.critic_steps)
    parser.add_argument("--diffusion-num-steps", type=int, default=defaults.num_steps)
    parser.add_argument("--guidance-scale", type=float, default=defaults.guidance_scale, help="Teacher CFG.")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--critic-lr", type=float, default=defaults.critic_lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--rollout-seed", type=int, default=defaults.rollout_seed)
    parser.add_argument("--miles-args", type=str, default="", help="Extra train_diffusion.py flags (one string).")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="Seconds before a miles run is ended.")
    parser.add_argument("--json", type=Path, default=None, help="Write every figure to this JSON file.")
    return parser


def config_from(args: argparse.Namespace) -> BareConfig:
    return BareConfig(
        rollout_batch_size=args.rollout_batch_size,
        micro_batch_size=args.micro_batch_size,
        critic_steps=args.dmd2_critic_steps_per_rollout,
        num_steps=args.diffusion_num_steps,
        guidance_scale=args.guidance_scale,
        lr=args.lr,
        critic_lr=args.critic_lr,
        seed=args.seed,
        rollout_seed=args.rollout_seed,
    )


DEFAULT_ROLLOUTS = {"tiny": (26, 5), "compute": (10, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bare_rank is not None:
        args.rollouts = args.rollouts or 1
        return bare_rank_main(args)
    if (args.rollouts is not None and args.rollouts < 1) or (args.warmup is not None and args.warmup < 0):
        parser.error("--rollouts must be >= 1 and --warmup >= 0")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.pipeline is not None and args.size is not None:
        parser.error("--size makes a fresh pipeline; --pipeline brings one: give one of them")
    sizes = ["tiny", "compute"] if args.size in (None, "both") and args.pipeline is None else [args.size or "tiny"]
    config = config_from(args)
    try:
        config.validate()
        for ranks in [] if args.skip_miles else args.ranks:
            check_miles_sizes(config, ranks)
    except ValueError as exc:
        parser.error(str(exc))
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="miles_overhead_"))
    work_dir.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # Ctrl-C and SIGTERM both end the running miles run first; SIGINT is reset too, because a script started in the
    # background inherits it ignored.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)

    command = shlex.join(["python", "benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)])
    reports, status = {}, 0
    try:
        for size in sizes:
            size_args = argparse.Namespace(**vars(args))
            size_args.size = size
            rollouts, warmup = QUICK[size] if args.quick else DEFAULT_ROLLOUTS[size]
            size_args.rollouts = args.rollouts or rollouts
            size_args.warmup = min(warmup if args.warmup is None else args.warmup, size_args.rollouts - 1)
            if size != "tiny" and len(sizes) > 1:
                # The compute size answers one question: miles at 1 rank against the bare loop.
                size_args.ranks = [1]
                size_args.skip_bare_fsdp = size_args.skip_side_by_side = True
            first, last = size_args.warmup, size_args.rollouts - 1
            report = {}
            status = max(status, _measure(size_args, config, work_dir, first, last, log, command, report))
            reports[size] = report
    except KeyboardInterrupt:
        log("interrupted: ending the running subprocesses")
        ChildProcess.stop()
        return 130
    table, figures = summary_table(reports)
    print("\n" + table, flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ratios": figures, "sizes": reports}, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    return status


def summary_table(reports: dict[str, dict]) -> tuple[str, dict]:
    """The issue's four ratios from the sizes' reports, each against its bar ("not measured" when a run was
    skipped or failed), and their JSON records."""

    def ratio(size: str, name: str) -> dict:
        return reports.get(size, {}).get("ratios", {}).get(name, {"value": None})

    wanted = [
        ("digits size: miles 1 rank / bare loop", ratio("tiny", "miles_1rank_over_bare"), SIZES["tiny"]["bars"][0]),
        (
            "compute size: miles 1 rank / bare loop",
            ratio("compute", "miles_1rank_over_bare"),
            SIZES["compute"]["bars"][0],
        ),
        ("miles 2 ranks / bare fully_shard 2 ranks", ratio("tiny", "miles_2rank_over_bare_fsdp"), 1.15),
        ("two runs side by side / alone (worst phase)", ratio("tiny", "side_by_side_over_alone"), SIDE_BY_SIDE_BAR),
    ]
    rows, figures = [], {}
    for name, record, bar in wanted:
        value = record.get("value")
        verdict = "not measured" if value is None else ("met" if value <= bar else "missed")
        rows.append([name, "–" if value is None else f"{value:.2f}×", f"≤ {bar}×", verdict])
        figures[name] = {"value": value, "bar": bar, "met": None if value is None else value <= bar}
    return format_table(["issue 32 ratio", "value", "bar", "verdict"], rows, "<>><"), figures


def _measure(
    args,
    config: BareConfig,
    work_dir: Path,
    first: int,
    last: int,
    log: Callable[[str], None],
    command: str,
    report: dict,
) -> int:
    """Run what ``args`` asks for at ``args.size``, print its tables, fill ``report``; 1 when a run failed."""
    work_dir = work_dir / args.size
    work_dir.mkdir(parents=True, exist_ok=True)
    pipeline, prompt_data = make_inputs(work_dir, args.pipeline, args.prompt_data, args.size)
    bar_one_rank, _ = SIZES[args.size]["bars"]
    report.update(
        {
            "command": command,
            "size": args.size,
            "config": asdict(config),
            "rollouts": args.rollouts,
            "median_over_rollouts": [first, last],
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
            "pipeline": str(pipeline),
            "prompt_data": str(prompt_data),
            "work_dir": str(work_dir),
        }
    )
    out = [
        f"$ {report['command']}",
        f"size {args.size}: pipeline {pipeline}, prompts {prompt_data}; {os.cpu_count()} CPUs, torch {torch.__version__}",
        f"{config.rollout_batch_size} prompts per rollout, K = {config.critic_steps}, {config.num_steps} student "
        f"steps, teacher CFG {config.guidance_scale:g}, micro-batch {config.micro_batch_size}; "
        f"medians over rollouts {first}–{last} of {args.rollouts}",
    ]
    bare_median, bare_fsdp_median, miles_medians, failed = None, None, {}, None
    miles_runs: dict[int, MilesRun] = {}

    if not args.skip_bare:
        torch.set_num_threads(args.threads)
        log(f"bare loop ({args.size}): {args.rollouts} rollouts, torch threads: {torch.get_num_threads()}")
        stats = run_bare(pipeline, read_prompts(prompt_data), config, args.rollouts, log)
        table, medians = bare_table(stats, first, last)
        bare_median = medians["total"]
        report["bare"] = {"threads": args.threads, "median": medians, "per_rollout": [asdict(s) for s in stats]}
        out += ["", f"bare loop (one process, torch threads: {args.threads}):", table]

    if not args.skip_bare_fsdp and 2 in args.ranks:
        log(f"bare fully_shard loop ({args.size}), 2 processes over gloo: {args.rollouts} rollouts")
        try:
            stats = run_bare_sharded(args, config, pipeline, prompt_data, 2, work_dir, log)[0]
        except RuntimeError as exc:
            failed = str(exc)
        else:
            table, medians = bare_table(stats, first, last)
            bare_fsdp_median = medians["total"]
            report["bare_fsdp"] = {"ranks": 2, "median": medians, "per_rollout": [asdict(s) for s in stats]}
            out += ["", "bare fully_shard loop (2 processes over gloo, rank 0):", table]

    def miles_run(ranks: int, name: str) -> MilesRun:
        run_dir = work_dir / name
        return MilesRun(
            ranks=ranks,
            micro_batch_size=miles_micro_batch(config, ranks),
            command=miles_command(args, config, pipeline, prompt_data, ranks, run_dir / "output"),
            output_dir=run_dir / "output",
            log_path=run_dir / "train.log",
        )

    def record(run: MilesRun, medians: dict) -> dict:
        return {
            "ranks": run.ranks,
            "micro_batch_size": run.micro_batch_size,
            "command": shlex.join(run.command),
            "log": str(run.log_path),
            "wall_seconds": run.wall_seconds,
            "median": medians,
            "per_rollout": {str(r): v for r, v in sorted(run.perf.items())},
            "memory_bytes": run.memory,
        }

    if not args.skip_miles and failed is None:
        report["miles"] = {}
        for ranks in args.ranks:
            run = miles_run(ranks, f"miles_{ranks}rank")
            log(f"miles ({args.size}), {_ranks(ranks)}: {args.rollouts} rollouts, log {run.log_path}")
            try:
                run_miles(run, args.run_timeout, log, args.threads)
            except RuntimeError as exc:
                failed = str(exc)
                break
            table, medians = miles_table(run, first, last)
            miles_medians[ranks], miles_runs[ranks] = medians.get("perf/step_time"), run
            report["miles"][str(ranks)] = record(run, medians)
            out += ["", f"log: {run.log_path}", table]
            if run.memory:
                out += ["", memory_table(run)]

    side_ratio = None
    if not args.skip_side_by_side and miles_runs and failed is None:
        ranks = max(miles_runs)
        pair = [miles_run(ranks, f"side_by_side_{ranks}rank_{which}") for which in ("a", "b")]
        log(f"miles ({args.size}), two {_ranks(ranks)} runs side by side, each its own Ray cluster")
        try:
            run_miles_together(pair, args.run_timeout, log, args.threads)
        except RuntimeError as exc:
            failed = str(exc)
        else:
            table, side_ratio, per_phase = side_by_side_table(miles_runs[ranks], pair, first, last)
            report["side_by_side"] = {
                "ranks": ranks,
                "runs": [record(run, miles_table(run, first, last)[1]) for run in pair],
                "ratio_per_phase": per_phase,
            }
            out += ["", table]

    rows = [["bare loop", _fmt(bare_median)]] if bare_median is not None else []
    rows += [["bare fully_shard loop, 2 processes", _fmt(bare_fsdp_median)]] if bare_fsdp_median is not None else []
    rows += [[f"miles, {_ranks(ranks)}", _fmt(median)] for ranks, median in miles_medians.items()]
    if rows:
        out += ["", format_table(["summary", "median s / rollout"], rows, "<>")]
    ratio_rows, ratios = [], {}
    if 1 in miles_medians and bare_median is not None:
        row, ratios["miles_1rank_over_bare"] = ratio_row(
            "miles 1 rank / bare", miles_medians[1], bare_median, bar_one_rank
        )
        ratio_rows.append(row)
    if 2 in miles_medians and bare_fsdp_median is not None:
        row, ratios["miles_2rank_over_bare_fsdp"] = ratio_row(
            "miles 2 ranks / bare fully_shard 2 ranks", miles_medians[2], bare_fsdp_median, 1.15
        )
        ratio_rows.append(row)
    if 1 in miles_medians and 2 in miles_medians:
        # Not a bar any more (issue 32): on 2 cores two ranks have no more compute than one; shown for reference.
        value = miles_medians[2] / miles_medians[1] if miles_medians[1] else None
        ratios["miles_2rank_over_1rank"] = {"value": value, "bar": None, "met": None}
        ratio_rows.append(["miles 2 ranks / 1 rank", _fmt(value, 2) + "×", "–", "for reference"])
    if side_ratio is not None:
        row, ratios["side_by_side_over_alone"] = ratio_row(
            "side by side / alone (worst phase of either run)", side_ratio, 1.0, SIDE_BY_SIDE_BAR
        )
        ratio_rows.append(row)
    if ratio_rows:
        out += ["", format_table(["ratio", "value", "bar", "verdict"], ratio_rows, "<>><")]
    report["ratios"] = ratios
    print("\n".join(out), flush=True)
    if args.work_dir is None:
        size_mb = sum(path.stat().st_size for path in work_dir.rglob("*") if path.is_file()) / 2**20
        log(f"inputs, run dirs and logs kept in {work_dir} ({size_mb:.0f} MB); remove it when done")
    if failed is not None:
        report["failed"] = failed
        print(f"\n{failed}", file=sys.stderr)
        return 1
    return 0


def side_by_side_table(alone: MilesRun, pair: list[MilesRun], first: int, last: int) -> tuple[str, float, dict]:
    """Each phase's median in two runs side by side against the same phase alone: the table, the worst ratio (over
    the phases of at least :data:`SIDE_BY_SIDE_MIN_S` alone and the step, of either run) and the ratios per phase."""
    _, alone_medians = miles_table(alone, first, last)
    pair_medians = [miles_table(run, first, last)[1] for run in pair]
    rows, per_phase, worst = [], {}, 0.0
    for label, key in phase_rows(with_gaps(alone.perf)):
        base = alone_medians.get(key)
        if key in DERIVED or base is None or (base < SIDE_BY_SIDE_MIN_S and key != "perf/step_time"):
            continue
        values = [medians.get(key) for medians in pair_medians]
        ratios = [None if value is None else value / base for value in values]
        per_phase[key] = ratios
        worst = max([worst, *(r for r in ratios if r is not None)])
        rows.append([label, _fmt(base), *(_fmt(v) for v in values), *(_fmt(r, 2) + "×" for r in ratios)])
    headers = [f"side by side, {_ranks(alone.ranks)} each", "alone s", "run a s", "run b s", "a / alone", "b / alone"]
    return format_table(headers, rows, "<>>>>>"), worst, per_phase


if __name__ == "__main__":
    sys.exit(main())
