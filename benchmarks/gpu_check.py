"""One unattended GPU check of miles, about 8.5 minutes on one H200 from a bare machine; ``--tiny`` runs the same
stages at toy size on the CPU (CI), ``--plan-only`` builds and checks every stage's full-size command without
training.

    python benchmarks/gpu_check.py --out "$OUT"              # one GPU: every stage, one report at the end
    python benchmarks/gpu_check.py --stages sd35_gc,lora     # a rerun of some stages
    python benchmarks/gpu_check.py --plan-only               # any machine: every command parsed, checked, planned
    python benchmarks/gpu_check.py --tiny                    # the CPU: every stage at toy size

Nothing is downloaded. docs/performance.md ("GPU check") gives the device command that packs what a bare GPU
machine lacks (ray, diffusers) and runs this. Stages, in this order, each with a time budget (seconds on one H200,
:data:`GPU_BUDGETS`) inside the run's deadline (``--deadline``): a stage past its budget is stopped (SIGTERM, then
SIGKILL) and recorded as ``timeout`` with what it measured by then, a stage that fails as ``failed``, one the
deadline leaves too little time as ``skipped``; the next stage runs either way. The exit code is 1 when a stage
failed or timed out, 2 for a bad command line.

``prepare``   an ``SD3Transformer2DModel`` of SD3.5-Medium's public configuration (stabilityai/stable-diffusion-3.5-
              medium ``transformer/config.json``: 24 layers, 24 heads × 64, dual attention in layers 0–12, RMS QK-norm)
              with random weights, written on the device as a pipeline without text encoders or VAE; a prompt cache
              (``miles.rollout.conditioning``'s format) of random embeddings of SD3's shapes, 77 CLIP + 256 T5 tokens
              of width 4096 and pooled 2048, so that no text encoder sits on the GPU; random real latents of 1024 px
              (16 × 128 × 128) with those conds for the GAN head; one forward's FLOPs, counted on the meta device.
``sd35``      ``train_diffusion.py --loss-type dmd2`` on it, DMD2 phase 2 (the GAN head, ``--dmd2-gan-*``, and the
              student's EMA, ``--ema-decay``), one DP rank, bf16 compute over float32 master weights, batch 2 per
              forward, 4 samples per rollout, K = 2 critic steps, teacher CFG 4.5, 3 rollouts (the first is warm-up).
``families``  every model family's tiny DMD2 phase-2 run in bf16 on the device, on the tiny stock pipelines the
              tests build (``tests.support.tiny_pipelines``, ``tests.support.sd3``), with a prompt cache, random real
              latents, a checkpoint per rollout and the ``--save-hf`` export: ``sd3``, ``sd3_encoders`` (the same
              without a prompt cache: its text encoders run on the device), ``flux``, ``flux2``, ``qwen_image``,
              ``wan``, ``digits`` (random MiniLM-shaped conds: the MiniLM package is not on the GPU machine, and the
              pipeline names no text encoder, so an encode anywhere fails the run). ``--family-jobs`` run at once,
              each with a Ray cluster of its own.
``sleep``     the sleep/wake check, in a process of its own without Ray: one ``GroupTrainer`` of the SD3.5-Medium
              student (full weights, EMA, bf16) takes a step, sleeps, wakes and takes another; device memory reserved
              and allocated in each state, the seconds and the bytes moved. On CUDA the memory reserved asleep must be
              at most :data:`SLEEP_RESERVED_SHARE` of the awake one.
``lora``      ``sd35`` with LoRA roles on one base (``--lora-rank 64 --critic-lora-rank 32``: the critic and the
              teacher share the base, the teacher being the base with the adapters off).
``sd35_gc``   ``sd35`` with ``--gradient-checkpointing``.

The report (printed at the end as markdown tables, and written to ``--out`` / ``--json``): each stage's status and
seconds; per SD3.5 run and phase the median seconds over rollouts ≥ 1, the measured peak device memory, the achieved
TFLOP/s and the MFU (model FLOPs per phase, :func:`phase_flops`, against the device's dense bf16 peak); the memory
planner's figures (``miles/driver/memory_plan.py``, what ``--dry-run`` prints) beside each group's measured peak per
phase (``memory/<role>-peak_<phase>_bytes``); each family's run; the sleep/wake figures.

On the CPU (``--tiny``) nothing is skipped, but what needs CUDA reads "–": the trainer records device peaks on CUDA
only, sleep moves nothing (the check then tests its plumbing), and there is no bf16 peak to divide by.
"""

import argparse
import concurrent.futures
import contextlib
import io
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # miles and tests.support (the tiny pipelines) when run as a script
    sys.path.insert(0, str(REPO))

# stabilityai/stable-diffusion-3.5-medium, transformer/config.json (public).
SD35_MEDIUM = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
    "qk_norm": "rms_norm",
}
# The same structure at toy size, for --tiny (CPU): 2 layers, one with dual attention.
TINY = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 32,
    "pos_embed_max_size": 8,
    "dual_attention_layers": [0],
    "qk_norm": "rms_norm",
}
# SD3's text conditioning: 77 CLIP tokens + 256 T5 tokens (diffusers' max_sequence_length).
TEXT_TOKENS = 77 + 256
GIB = 2**30

STAGES = ("sd35", "families", "sleep", "lora", "sd35_gc")
# Seconds per stage on one H200 (prepare runs first for every stage but families). They add up to GPU_DEADLINE; a stage
# that ends early leaves its rest to the deadline, not to the next stage's budget.
GPU_BUDGETS = {"prepare": 40, "sd35": 140, "families": 100, "sleep": 60, "lora": 70, "sd35_gc": 100}
GPU_DEADLINE = 510.0
# --tiny on a loaded 2-core machine: generous, the test's own timeout is the real bound.
TINY_BUDGET, TINY_DEADLINE = 900.0, 3600.0
# A stage is skipped when the deadline leaves less than this.
MIN_STAGE_SECONDS = 15.0
# After SIGTERM (train_diffusion.py shuts its Ray cluster down) a stopped process gets this long before SIGKILL.
STOP_GRACE_SECONDS = 15.0
# LoRA ranks of the lora stage (student, critic): the public dmdr setting for SD3.5 (docs/performance.md).
LORA_RANKS, TINY_LORA_RANKS = (64, 32), (4, 2)
# The sleep check: memory reserved asleep may be at most this share of the memory reserved awake.
SLEEP_RESERVED_SHARE = 0.05
# (table label, role, phase): the trainer's timers perf/<role>-<phase>_time and memory/<role>-peak_<phase>_bytes.
PHASES = (
    ("rollout (student)", "actor", "generate"),
    ("critic steps", "critic", "train_steps"),
    ("scoring (teacher CFG + critic)", "critic", "train_output"),
    ("student step", "actor", "train_steps"),
)
SD35_RUNS = {"sd35": "full weights", "lora": "LoRA roles", "sd35_gc": "full weights, gradient checkpointing"}


# ---- stages: budgets, a deadline, one failure never costs the rest -------------------------------------------------


@dataclass
class StageResult:
    """What one stage did: ``status`` is ``ok``, ``failed``, ``timeout`` or ``skipped``; ``data`` its figures."""

    name: str
    status: str
    seconds: float
    budget: float
    reason: str = ""
    data: dict = field(default_factory=dict)


class StageError(Exception):
    """A stage that did not finish as it should, with what it measured until then (``data``)."""

    status = "failed"

    def __init__(self, reason: str, data: dict | None = None) -> None:
        super().__init__(reason)
        self.data = data or {}


class StageTimeout(StageError):
    status = "timeout"


def run_stages(
    stages: list[tuple[str, float, Callable[[float], dict]]],
    deadline: float,
    log=None,
    after: Callable[[list["StageResult"]], None] | None = None,
) -> list[StageResult]:
    """Run ``(name, budget seconds, fn)`` in order; ``fn(stage_deadline)`` gets the ``time.monotonic()`` by which it
    must end (its budget, or the run's ``deadline`` when that comes first) and returns its figures.

    A stage that raises :class:`StageTimeout` is recorded as ``timeout``, one that raises anything else as
    ``failed`` (with the first line of the error); one that starts with less than :data:`MIN_STAGE_SECONDS` left
    before ``deadline`` is ``skipped``. Each ends with one line on ``log`` (default stderr), then ``after(results so
    far)`` (the report is written after every stage, so that a run killed from outside still leaves one).
    """
    log = log or sys.stderr
    results = []
    for name, budget, fn in stages:
        left = deadline - time.monotonic()
        if left < MIN_STAGE_SECONDS:
            result = StageResult(name, "skipped", 0.0, budget, f"the run's deadline: {max(left, 0):.0f} s left")
        else:
            start = time.monotonic()
            try:
                data = fn(start + min(budget, left))
                result = StageResult(name, "ok", time.monotonic() - start, budget, data=data)
            except StageError as exc:
                result = StageResult(name, exc.status, time.monotonic() - start, budget, str(exc), exc.data)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - one stage's failure must not cost the others
                reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                data = {"traceback": traceback.format_exc()}
                result = StageResult(name, "failed", time.monotonic() - start, budget, reason, data)
        note = f": {result.reason}" if result.reason else ""
        print(
            f"gpu_check: {name} {result.status} ({result.seconds:.0f} of {budget:.0f} s){note}", file=log, flush=True
        )
        results.append(result)
        if after is not None:
            after(results)
    return results


def run_process(cmd: list[str], log_path: Path, deadline: float, env: dict | None = None) -> int | None:
    """Run ``cmd`` in the repository with its output in ``log_path``; its exit code, or None when it was stopped at
    ``deadline`` (SIGTERM to its process group, SIGKILL after :data:`STOP_GRACE_SECONDS`)."""
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        # A session of its own: the stop reaches the command and whatever it started in its process group.
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            return None


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("" when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def error_line(path: Path) -> str:
    """The most telling line of a failed run's log: its last ``error`` line, else its last line."""
    lines = [line.strip() for line in log_tail(path, 200).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1][:300]


# ---- inputs ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """What a DMD2 command reads: the pipeline, the prompt records (cached conds, or prompts to encode), the
    negative prompt's cached cond (None: encode ``--negative-prompt``), the GAN's real latent records."""

    pipeline: Path
    prompts: Path
    negative: Path | None
    real: Path


def write_pipeline(out: Path, config: dict, device: str, weights: bool = True) -> Path:
    """A ``StableDiffusion3Pipeline`` directory holding only an SD3 transformer of ``config`` (random bf16 weights,
    initialised on ``device``) and a scheduler; ``weights=False`` writes the configs alone (what ``--plan-only``
    plans from)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers.utils import logging as diffusers_logging

    if weights:
        torch.manual_seed(0)
        with torch.device(device):
            transformer = SD3Transformer2DModel(**config)
        diffusers_logging.set_verbosity_error()  # the bf16 cast's note about float32 modules (SD3 keeps none)
        transformer.to(device="cpu", dtype=torch.bfloat16).save_pretrained(out / "transformer")
        del transformer
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the stages' processes need the device, not this one's cache
    else:
        (out / "transformer").mkdir(parents=True, exist_ok=True)
        meta = {"_class_name": "SD3Transformer2DModel", "_diffusers_version": diffusers.__version__, **config}
        (out / "transformer" / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(out / "scheduler")
    absent = [None, None]
    model_index = {
        "_class_name": "StableDiffusion3Pipeline",
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        **{name: absent for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")},
        **{name: absent for name in ("tokenizer", "tokenizer_2", "tokenizer_3")},
    }
    (out / "model_index.json").write_text(json.dumps(model_index, indent=2) + "\n")
    return out


def write_random_cache(out: Path, shapes: dict[str, tuple[int, ...]], count: int, tag: str) -> tuple[Path, Path]:
    """``prompts.jsonl`` whose ``count`` records name random cond files with tensors of ``shapes`` (no batch dim),
    and the negative prompt's file; draws from ``make_generator("gpu_check_cond", tag, index)``.

    Returns:
        ``(prompts.jsonl, negative.safetensors)``.
    """
    from miles.rollout.offline_files import save_tensors
    from miles.utils.misc import make_generator

    (out / "cond").mkdir(parents=True, exist_ok=True)

    def cond(index: int) -> dict[str, torch.Tensor]:
        gen = make_generator("gpu_check_cond", tag, index)
        return {key: torch.randn(shape, generator=gen) for key, shape in shapes.items()}

    records = []
    for index in range(count):
        save_tensors(out / "cond" / f"{index}.safetensors", cond(index))
        records.append({"prompt": f"random prompt {index}", "cond": f"cond/{index}.safetensors"})
    (out / "prompts.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    save_tensors(out / "negative.safetensors", cond(-1))
    return out / "prompts.jsonl", out / "negative.safetensors"


def write_real_latents(prompts: Path, latent_shape: tuple[int, ...], tag: str) -> Path:
    """``real.jsonl`` beside ``prompts`` (so that cond paths stay relative to it): one record per prompt record,
    with its prompt, its cached cond when it has one, and a random latent of ``latent_shape`` (the GAN head's real
    data; values from ``make_generator("gpu_check_real", tag, index)``)."""
    from miles.rollout.offline_files import save_tensors
    from miles.utils.misc import make_generator

    folder = prompts.parent
    (folder / "real").mkdir(exist_ok=True)
    records = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    lines = []
    for index, record in enumerate(records):
        latent = torch.randn(latent_shape, generator=make_generator("gpu_check_real", tag, index))
        save_tensors(folder / "real" / f"{index}.safetensors", {"latent": latent})
        real = {"prompt": record["prompt"], "latent": f"real/{index}.safetensors"}
        if "cond" in record:
            real["cond"] = record["cond"]
        lines.append(json.dumps(real) + "\n")
    (folder / "real.jsonl").write_text("".join(lines))
    return folder / "real.jsonl"


def sd3_cond_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """SD3's cond kwargs for one prompt: 77 + 256 tokens of ``joint_attention_dim`` and the pooled vector."""
    return {
        "encoder_hidden_states": (TEXT_TOKENS, config["joint_attention_dim"]),
        "pooled_projections": (config["pooled_projection_dim"],),
    }


def forward_flops(config: dict, batch: int = 1) -> tuple[float, int]:
    """FLOPs of one transformer forward of ``batch`` samples at the configuration's latent size, counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on the meta device (matmuls and attention), and the parameter
    count."""
    from diffusers import SD3Transformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
        latents = torch.randn(batch, config["in_channels"], config["sample_size"], config["sample_size"])
        text = torch.randn(batch, TEXT_TOKENS, config["joint_attention_dim"])
        pooled = torch.randn(batch, config["pooled_projection_dim"])
        timestep = torch.full((batch,), 500.0)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=timestep)
    return float(counter.get_total_flops()), sum(p.numel() for p in model.parameters())


def device_peak_tflops(override: float | None) -> tuple[str, float | None]:
    """The device's name and dense bf16 peak TFLOP/s (``--peak-tflops``, else by name; None on the CPU)."""
    from miles.driver.estimate import PEAK_TFLOPS

    if not torch.cuda.is_available():
        return "cpu", override
    name = torch.cuda.get_device_name(0)
    if override:
        return name, override
    return name, next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


# ---- commands -------------------------------------------------------------------------------------------------------


def sd35_argv(inputs: Inputs, out: Path, opts: argparse.Namespace, *, checkpointing=False, lora=None) -> list[str]:
    """The ``train_diffusion.py`` flags of an SD3.5 stage: DMD2 phase 2 with the EMA on one DP rank in bf16;
    ``lora=(student rank, critic rank)`` trains LoRA roles on one base."""
    argv = [
        "--loss-type", "dmd2", "--hf-checkpoint", str(inputs.pipeline), "--teacher-load", str(inputs.pipeline),
        "--prompt-data", str(inputs.prompts), "--negative-cond", str(inputs.negative),
        "--actor-num-gpus-per-node", "1", "--rollout-batch-size", str(opts.rollout_batch_size),
        "--micro-batch-size", str(opts.micro_batch_size), "--dmd2-critic-steps-per-rollout", "2",
        "--dmd2-teacher-guidance-scale", "4.5", "--diffusion-num-steps", "4",
        "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-gen-weight", "3e-3", "--dmd2-gan-real-data", str(inputs.real),
        "--ema-decay", "0.99", "--num-rollout", str(opts.rollouts), "--train-dtype", "bfloat16",
        "--lr", "1e-6", "--critic-lr", "4e-6", "--output-dir", str(out),
    ]  # fmt: skip
    if checkpointing:
        argv.append("--gradient-checkpointing")
    if lora:
        argv += ["--lora-rank", str(lora[0]), "--critic-lora-rank", str(lora[1])]
    if opts.ray_address:
        argv += ["--ray-address", opts.ray_address]
    return argv


@dataclass(frozen=True)
class FamilySpec:
    """A family's tiny run: its ``--diffusion-model-family``, the writer of its tiny pipeline (``fn(folder) ->
    path``), the teacher's guidance, the negative prompt, and how prompts are conditioned (``"cache"``: the prompt
    cache command; ``"encode"``: no cache, the text encoders run in the trainer; ``"random"``: random conds)."""

    family: str
    write: Callable[[Path], Path]
    guidance: float
    negative_prompt: str = ""
    prompts: str = "cache"


FAMILY_PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]


def _sized(write: Callable[[Path], Path], size: tuple[int, ...]) -> Callable[[Path], Path]:
    def writer(folder: Path) -> Path:
        from miles.models.stock_defaults import write_sample_size

        path = Path(write(folder))
        write_sample_size(path, size)
        return path

    return writer


def _write_sd3(folder: Path) -> Path:
    from tests.support.sd3 import tiny_sd3_pipeline

    return tiny_sd3_pipeline(folder)[1]


def _write_flux(folder: Path) -> Path:
    from tests.support.tiny_pipelines import write_tiny_flux

    return write_tiny_flux(folder, variant="dev")


def _write_flux2(folder: Path) -> Path:
    from tests.support.tiny_pipelines import write_tiny_flux2_klein

    return write_tiny_flux2_klein(folder)


def _write_qwen_image(folder: Path) -> Path:
    from tests.support.tiny_pipelines import write_tiny_qwen_image

    return write_tiny_qwen_image(folder)


def _write_wan(folder: Path) -> Path:
    from tests.support.tiny_pipelines import write_tiny_wan

    return write_tiny_wan(folder)


def _write_digits(folder: Path) -> Path:
    from miles.models.digits import init_digits_pipeline

    path = init_digits_pipeline(folder, seed=0, num_layers=2, attention_head_dim=8)
    # The GPU machine has no MiniLM package: this pipeline names no text encoder, so that an encode anywhere in the
    # run fails it (here on the CPU too) instead of passing where the package happens to be installed.
    settings = json.loads((path / "digits.json").read_text())
    settings["text_encoder"] = "none (benchmarks/gpu_check.py: random cached conds)"
    (path / "digits.json").write_text(json.dumps(settings, indent=2) + "\n")
    return path


# Sizes as the family tests train them (tests/support/family_e2e.py, tests/fast/models/test_{flux2,wan}.py).
FAMILIES = {
    "sd3": FamilySpec("sd3", _write_sd3, 4.5),
    "sd3_encoders": FamilySpec("sd3", _write_sd3, 4.5, prompts="encode"),
    "flux": FamilySpec("flux", _sized(_write_flux, (32, 32)), 3.5),
    "flux2": FamilySpec("flux2", _sized(_write_flux2, (32, 64)), 2.0),
    "qwen_image": FamilySpec("qwen_image", _sized(_write_qwen_image, (32, 32)), 2.0, negative_prompt=" "),
    "wan": FamilySpec("wan", _sized(_write_wan, (5, 16, 32)), 2.0),
    "digits": FamilySpec("digits", _write_digits, 3.0, prompts="random"),
}


def write_family_inputs(name: str, root: Path) -> Inputs:
    """The tiny pipeline of family ``name``, its prompts (cached by ``python -m miles.rollout.prompt_cache``, random,
    or left to encode) and random real latents of its latent shape."""
    from miles.models import get_model_family
    from miles.rollout.prompt_cache import main as prompt_cache

    spec = FAMILIES[name]
    pipeline = spec.write(root / "pipeline")
    source = root / "source.jsonl"
    source.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in FAMILY_PROMPTS))
    family = get_model_family(pipeline, spec.family)
    negative = None
    if spec.prompts == "cache":
        cache = ["--negative-prompt", spec.negative_prompt, "--batch-size", "2"]
        if prompt_cache([str(pipeline), str(source), str(root / "cache"), *cache]) != 0:
            raise RuntimeError(f"python -m miles.rollout.prompt_cache failed for the tiny {name} pipeline")
        prompts, negative = root / "cache" / "prompts.jsonl", root / "cache" / "negative.safetensors"
    elif spec.prompts == "random":
        from miles.models.digits import TEXT_DIM  # MiniLM's width: token states and their mean

        shapes = {"encoder_hidden_states": (family.text_tokens(pipeline), TEXT_DIM), "pooled_projections": (TEXT_DIM,)}
        prompts, negative = write_random_cache(root / "cache", shapes, len(FAMILY_PROMPTS), name)
    else:
        prompts = source
    real = write_real_latents(prompts, tuple(family.latent_shape(pipeline)), name)
    return Inputs(pipeline, prompts, negative, real)


def family_argv(name: str, inputs: Inputs, out: Path, opts: argparse.Namespace) -> list[str]:
    """The ``train_diffusion.py`` flags of family ``name``'s tiny run: DMD2 phase 2 (GAN head, EMA) on one DP rank
    in bf16, 2 rollouts of 4 samples, a checkpoint after each, the export."""
    spec = FAMILIES[name]
    negative = (
        ["--negative-cond", str(inputs.negative)] if inputs.negative else ["--negative-prompt", spec.negative_prompt]
    )
    argv = [
        "--loss-type", "dmd2", "--diffusion-model-family", spec.family,
        "--hf-checkpoint", str(inputs.pipeline), "--teacher-load", str(inputs.pipeline),
        "--prompt-data", str(inputs.prompts), *negative,
        "--actor-num-gpus-per-node", "1", "--num-cpus-per-rank", str(opts.family_cpus),
        "--rollout-batch-size", "4", "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "2",
        "--dmd2-teacher-guidance-scale", str(spec.guidance), "--diffusion-num-steps", "2",
        "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-gen-weight", "3e-3", "--dmd2-gan-real-data", str(inputs.real),
        "--ema-decay", "0.9", "--num-rollout", "2", "--train-dtype", "bfloat16", "--lr", "1e-4", "--critic-lr", "1e-4",
        "--save", str(out.parent / "ckpt"), "--save-interval", "1", "--save-hf", str(out.parent / "student"),
        "--output-dir", str(out),
    ]  # fmt: skip
    if opts.ray_address:
        argv += ["--ray-address", opts.ray_address]
    return argv


def sleep_argv(inputs: Inputs, out: Path) -> list[str]:
    """The flags the sleep check parses for its one-rank student group: SFT steps on stored latents (the simplest
    trainer step), full weights, the EMA, bf16 compute."""
    return [
        "--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(inputs.pipeline),
        "--prompt-data", str(inputs.real), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "2",
        "--micro-batch-size", "1", "--num-rollout", "2", "--lr", "1e-6", "--train-dtype", "bfloat16",
        "--ema-decay", "0.99", "--output-dir", str(out),
    ]  # fmt: skip


def check_command(argv: list[str], check_paths: bool) -> None:
    """What ``train_diffusion.py --dry-run`` checks before Ray, in this process: the flags (``parse_args``), the
    hooks, and with ``check_paths`` the pipelines, data files and outputs (``validate_inputs``)."""
    from miles.driver.arguments import parse_args
    from miles.driver.preflight import validate_inputs

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_args(argv)
    except SystemExit:  # argparse's error(): one line naming the flag
        lines = stderr.getvalue().strip().splitlines()
        raise StageError(lines[-1] if lines else "the flags are refused") from None
    validate_inputs(args, check_paths=check_paths)


# ---- model FLOPs per phase --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """One rank's denoiser work per rollout of a DMD2 command, as :func:`phase_flops` counts it."""

    args: argparse.Namespace
    samples: int
    micro: int
    steps: int
    student_cfg: int  # forwards per student step (2 under student CFG)
    teacher_cfg: int  # forwards per teacher scoring (2 under teacher CFG)
    critic_rows: int  # samples per pair in the critic's forward (3 with the GAN head: flow matching, fakes, reals)
    gan_gradient: bool  # the scoring computes the student's GAN gradient (a critic forward and a partial backward)
    gan_backward_share: float  # the share of the critic's blocks that backward crosses (to the last tapped block)
    actor_lora: bool
    critic_lora: bool

    @classmethod
    def from_argv(cls, argv: list[str], num_layers: int) -> "Work":
        from miles.backends.fsdp_utils.loss_hub.dmd2_types import dmd2_settings
        from miles.backends.fsdp_utils.loss_hub.gan import feature_blocks
        from miles.driver.arguments import parse_args
        from miles.driver.validators import group_layout
        from miles.methods import get_method

        args = parse_args(argv)
        groups = {group.role: group for group in group_layout(args)}
        critic, settings = groups["critic"], dmd2_settings(args)
        gan = settings.gan_gen_weight > 0
        return cls(
            args=args,
            samples=args.rollout_batch_size * args.n_samples_per_prompt,
            micro=args.micro_batch_size,
            steps=args.diffusion_num_steps,
            student_cfg=2 if args.diffusion_guidance_scale != 1 else 1,
            teacher_cfg=2 if settings.teacher_guidance_scale > 1 else 1,
            critic_rows=get_method(args).train_forward_batch(args, critic) // critic.micro_batch_size,
            gan_gradient=gan,
            gan_backward_share=(max(feature_blocks(args, num_layers)) + 1) / num_layers if gan else 0.0,
            actor_lora=groups["actor"].lora is not None,
            critic_lora=critic.lora is not None,
        )


def phase_flops(fwd: float, work: Work, rollout_id: int) -> dict[str, float]:
    """Model FLOPs of each phase of rollout ``rollout_id`` on the one rank, ``fwd`` being one sample's forward.

    A full-weight backward counts as two forwards (input and weight gradients), the backward through a frozen
    LoRA base as one (input gradients; the adapters' own are negligible); gradient checkpointing's recompute is
    not model work and is not counted (so its MFU reads lower for the same speed). The rollout runs every
    micro-batch to the rollout's largest stop step (the engine's rule at one rank). Scoring: the teacher (both CFG
    halves), the unguided critic, and in phase 2 the GAN gradient, one more critic forward and an input-gradient
    backward to the last tapped block.
    """
    from miles.rollout.step_strategy_hub import stop_at_random_step

    n = work.samples
    chunks = math.ceil(n / work.micro)
    last_step = max(stop_at_random_step(work.args, rollout_id, list(range(n)), work.steps))
    gan = (1 + work.gan_backward_share) if work.gan_gradient else 0.0
    return {
        "rollout (student)": chunks * (last_step + 1) * work.micro * work.student_cfg * fwd,
        "critic steps": n * work.critic_rows * (1 + (1 if work.critic_lora else 2)) * fwd,
        "scoring (teacher CFG + critic)": n * (work.teacher_cfg + 1 + gan) * fwd,
        "student step": n * (1 + (1 if work.actor_lora else 2)) * fwd,
    }


def summarise(records: list[dict], fwd: float, work: Work, peak: float | None) -> tuple[list[list[str]], dict]:
    """One row per phase (median seconds over rollouts ≥ 1, rollout 0 being warm-up; the largest peak device
    memory; TFLOP/s; MFU), then sleep/wake, the weight sync and the rollout, and the medians themselves."""
    measured = sorted({r["rollout_id"] for r in records if "perf/step_time" in r})
    use = [rid for rid in measured if rid >= 1] or measured  # a run stopped after its warm-up shows that one
    values: dict[str, list[float]] = {}
    for record in records:
        rollout_id = record.get("rollout_id", -1)
        if rollout_id not in use:
            continue
        flops = phase_flops(fwd, work, rollout_id)
        for key, value in record.items():
            if isinstance(value, (int, float)) and key.startswith(("perf/", "memory/")):
                values.setdefault(key, []).append(float(value))
        for label, role, phase in PHASES:
            seconds = record.get(f"perf/{role}-{phase}_time")
            if isinstance(seconds, float) and seconds > 0:
                values.setdefault(f"tflops/{label}", []).append(flops[label] / seconds / 1e12)
    median = {key: statistics.median(vals) for key, vals in values.items() if not key.startswith("memory/")}
    median.update({key: max(vals) for key, vals in values.items() if key.startswith("memory/")})
    rows, compute = [], 0.0
    for label, role, phase in PHASES:
        seconds = median.get(f"perf/{role}-{phase}_time")
        peak_bytes = median.get(f"memory/{role}-peak_{phase}_bytes")
        tflops = median.get(f"tflops/{label}")
        compute += seconds or 0.0
        rows.append([
            label,
            f"{seconds:.3f}" if seconds is not None else "–",
            f"{peak_bytes / GIB:.1f}" if peak_bytes is not None else "–",
            f"{tflops:.3g}" if tflops is not None else "–",
            f"{100 * tflops / peak:.1f}%" if tflops is not None and peak else "–",
        ])  # fmt: skip
    step = median.get("perf/step_time")
    rows.append(["sleep / wake (driver)", f"{median.get('perf/sleep_wake_time', 0.0):.3f}", "", "", ""])
    rows.append(["weight sync", "none (colocated)", "", "", ""])
    if step:
        rows.append(["rollout total", f"{step:.3f}", "", "", f"model compute {100 * compute / step:.0f}% of it"])
    return rows, {"rollouts": use, "medians": median}


# ---- the memory plan beside the measured peaks -------------------------------------------------------------------


def memory_rows(argv: list[str], records: list[dict]) -> tuple[list[list[str]], dict]:
    """Per group and phase the planner's bytes (``plan_run`` of the stage's command: the train window's peak for
    ``train_steps``, the resting state plus what an inference phase gathers for the others) beside the largest
    ``memory/<role>-peak_<phase>_bytes`` the run logged; and the planner's exact figures (``parameters``,
    ``gradients``, ``optimizer``, ``frozen``) beside the logged ones, as ``{"<role>-<name>": (planned, logged)}``."""
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import format_bytes, plan_run

    _, plans = plan_run(parse_args(argv))
    rows, peaks = [], {}
    for plan in plans:
        for label, role, phase in PHASES:
            if role != plan.role:
                continue
            planned = plan.train_peak if phase == "train_steps" else plan.resting + plan.gathered_inference
            key = f"memory/{role}-peak_{phase}_bytes"
            measured = max((r[key] for r in records if key in r), default=None)
            peaks[f"{role}-{phase}"] = {"planned": planned, "measured": measured}
            rows.append([
                role, label, format_bytes(planned), format_bytes(measured) if measured else "–",
                f"{measured / planned:.2f}" if measured and planned else "–",
            ])  # fmt: skip
    logged = [r for r in records if any(key.endswith("-parameters_bytes") for key in r)]
    exact = {
        f"{plan.role}-{name}": (value, logged[-1].get(f"memory/{plan.role}-{name}_bytes") if logged else None)
        for plan in plans
        for name, value in plan.logged().items()
    }
    return rows, {"peaks": peaks, "exact": exact, "plan_peak": {plan.role: plan.peak for plan in plans}}


def exact_line(exact: dict) -> str:
    """How many of the planner's exact figures equal the run's logged ones."""
    pairs = [(planned, logged) for planned, logged in exact.values() if logged is not None]
    if not pairs:
        return "exact figures: none logged"
    equal = sum(planned == logged for planned, logged in pairs)
    return f"exact figures (parameters, gradients, optimizer, frozen): {equal} of {len(pairs)} equal to the byte"


# ---- the stages -----------------------------------------------------------------------------------------------------


class Check:
    """One run of the check: options, work directory, the prepared inputs and what the stages found."""

    def __init__(self, opts: argparse.Namespace, work: Path) -> None:
        self.opts, self.work = opts, work
        self.config = TINY if opts.tiny else SD35_MEDIUM
        self.inputs: Inputs | None = None
        self.fwd, self.params = 0.0, 0
        self.device, self.peak = device_peak_tflops(opts.peak_tflops)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        paths = [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
        self.env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        self.commands: dict[str, list[str]] = {}
        self.logs: list[Path] = []

    # -- prepare -------------------------------------------------------------------------------------------------
    def prepare(self, deadline: float) -> dict:
        device = "cuda" if torch.cuda.is_available() and not self.opts.tiny else "cpu"
        pipeline = write_pipeline(self.work / "pipeline", self.config, device, weights=not self.opts.plan_only)
        prompts, negative = write_random_cache(
            self.work / "prompts", sd3_cond_shapes(self.config), self.opts.rollout_batch_size, "sd35"
        )
        latent = (self.config["in_channels"], self.config["sample_size"], self.config["sample_size"])
        self.inputs = Inputs(pipeline, prompts, negative, write_real_latents(prompts, latent, "sd35"))
        self.fwd, self.params = forward_flops(self.config)
        return {"parameters": self.params, "forward_flops_per_sample": self.fwd, "weights": not self.opts.plan_only}

    def _need_inputs(self) -> Inputs:
        if self.inputs is None:
            raise StageError("needs the prepare stage, which failed")
        return self.inputs

    # -- the SD3.5 trainings ---------------------------------------------------------------------------------------
    def sd35_command(self, name: str) -> list[str]:
        lora = (TINY_LORA_RANKS if self.opts.tiny else LORA_RANKS) if name == "lora" else None
        return sd35_argv(self._need_inputs(), self.work / name, self.opts, checkpointing=name == "sd35_gc", lora=lora)

    def training(self, name: str, deadline: float) -> dict:
        argv = self.sd35_command(name)
        self.commands[name] = argv
        work = Work.from_argv(argv, self.config["num_layers"])
        counts = {key: value for key, value in vars(work).items() if key != "args"}
        # What the MFU divides, in forwards of one sample, for rollout 1 (the first one measured).
        counts["forwards_rollout_1"] = phase_flops(1.0, work, 1)
        if self.opts.plan_only:
            check_command(argv, check_paths=False)  # the pipeline has no weights to check
            rows, memory = memory_rows(argv, [])
            return {"command": shlex.join(argv), "memory_rows": rows, "memory": memory, "work": counts}
        cmd = [sys.executable, str(REPO / "train_diffusion.py"), *argv]
        log = self.work / f"{name}.log"
        self.logs.append(log)
        start = time.monotonic()
        code = run_process(cmd, log, deadline, self.env)
        from miles.utils.tracking import read_metrics

        out = self.work / name
        records = read_metrics(out) if (out / "metrics.jsonl").is_file() else []
        data = {
            "command": shlex.join(cmd),
            "wall_seconds": time.monotonic() - start,
            "exit_code": code,
            "work": counts,
        }
        done = sorted({r["rollout_id"] for r in records if "perf/step_time" in r})
        if records:
            data["rows"], data["figures"] = summarise(records, self.fwd, work, self.peak)
            data["memory_rows"], data["memory"] = memory_rows(argv, records)
            data["records"] = records
        if code is None:
            raise StageTimeout(f"stopped at its budget after rollouts {done or 'none'}", data)
        if code != 0:
            data["log_tail"] = log_tail(log)
            raise StageError(f"train_diffusion.py exited {code}: {error_line(log)}", data)
        if len(done) < self.opts.rollouts:
            raise StageError(f"logged rollouts {done} of {self.opts.rollouts}", data)
        return data

    # -- the families --------------------------------------------------------------------------------------------
    def families(self, deadline: float) -> dict:
        names = self.opts.families
        results: dict[str, dict] = {}
        runs = {}
        for name in names:  # the inputs, on the CPU in this process, one family after the other
            if time.monotonic() > deadline:
                results[name] = {"status": "skipped", "reason": "the stage's budget"}
                continue
            root = self.work / "families" / name
            shutil.rmtree(root, ignore_errors=True)
            try:
                inputs = write_family_inputs(name, root)
                argv = family_argv(name, inputs, root / "run", self.opts)
                self.commands[f"families/{name}"] = argv
                check_command(argv, check_paths=True)
                runs[name] = argv
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - one family's inputs must not cost the others
                results[name] = {"status": "failed", "reason": f"inputs: {type(exc).__name__}: {exc}".splitlines()[0],
                                 "traceback": traceback.format_exc()}  # fmt: skip
        if self.opts.plan_only:
            for name, argv in runs.items():
                results[name] = {"status": "ok", "reason": "command checked", "command": shlex.join(argv)}
        else:
            jobs = 1 if self.opts.ray_address else max(1, self.opts.family_jobs)
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {name: pool.submit(self._family_run, name, argv, deadline) for name, argv in runs.items()}
                results.update({name: future.result() for name, future in futures.items()})
        results = {name: results[name] for name in names}
        bad = [f"{name} {r['status']}" for name, r in results.items() if r["status"] != "ok"]
        data = {"families": results}
        if any(r["status"] == "failed" for r in results.values()):
            raise StageError(", ".join(bad), data)
        if bad:
            raise StageTimeout(", ".join(bad), data)
        return data

    def _family_run(self, name: str, argv: list[str], deadline: float) -> dict:
        from miles.utils.tracking import read_metrics

        if deadline - time.monotonic() < MIN_STAGE_SECONDS:
            return {"status": "skipped", "reason": "the stage's budget"}
        out = Path(argv[argv.index("--output-dir") + 1])
        log = out.parent / "train.log"
        self.logs.append(log)
        start = time.monotonic()
        code = run_process([sys.executable, str(REPO / "train_diffusion.py"), *argv], log, deadline, self.env)
        records = read_metrics(out) if (out / "metrics.jsonl").is_file() else []
        result = {"seconds": time.monotonic() - start, "exit_code": code, "command": shlex.join(argv)}
        result.update(family_figures(records))
        if code is None:
            return {**result, "status": "timeout", "reason": f"stopped after rollouts {result['rollouts']}"}
        if code != 0:
            return {**result, "status": "failed", "reason": error_line(log), "log_tail": log_tail(log)}
        problems = family_problems(result, out)
        return {**result, "status": "failed" if problems else "ok", "reason": "; ".join(problems)}

    # -- sleep / wake ----------------------------------------------------------------------------------------------
    def sleep(self, deadline: float) -> dict:
        inputs = self._need_inputs()
        out = self.work / "sleep"
        argv = sleep_argv(inputs, out)
        self.commands["sleep"] = argv
        check_command(argv, check_paths=False)
        if self.opts.plan_only:
            return {"command": shlex.join(argv)}
        result_path = out / "sleep.json"
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "_sleep_probe", str(result_path), *argv]
        log = self.work / "sleep.log"
        self.logs.append(log)
        code = run_process(cmd, log, deadline, self.env)
        data = json.loads(result_path.read_text()) if result_path.is_file() else {}
        if code is None:
            raise StageTimeout(f"stopped at its budget in state {data.get('state', 'loading')}", data)
        if code != 0:
            data["log_tail"] = log_tail(log)
            raise StageError(f"the sleep probe exited {code}: {error_line(log)}", data)
        if data.get("problem"):
            raise StageError(data["problem"], data)
        return data


def family_figures(records: list[dict]) -> dict:
    """A family run's rollouts, last student and critic losses, largest x0 recompute gap and non-finite figures."""
    actor = [r for r in records if "train/loss" in r]
    critic = [r for r in records if "train/critic-loss" in r]
    nonfinite = sorted(
        {key for r in records for key, value in r.items() if key.startswith("train/") and not _finite(value)}
    )
    return {
        "rollouts": sorted({r["rollout_id"] for r in records if "perf/step_time" in r}),
        "student_loss": actor[-1]["train/loss"] if actor else None,
        "critic_loss": critic[-1]["train/critic-loss"] if critic else None,
        "x0_max_abs_diff": max((r.get("train/x0_max_abs_diff", 0.0) for r in actor), default=None),
        "gan_disc_loss": critic[-1].get("train/critic-gan_disc_loss") if critic else None,
        "nonfinite": nonfinite,
    }


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def family_problems(result: dict, out: Path) -> list[str]:
    """What a finished family run lacks: both rollouts, finite figures, the GAN loss, the export."""
    problems = []
    if result["rollouts"] != [0, 1]:
        problems.append(f"logged rollouts {result['rollouts']}, not [0, 1]")
    if result["nonfinite"]:
        problems.append(f"non-finite {result['nonfinite']}")
    if result["gan_disc_loss"] is None:
        problems.append("no GAN loss logged")
    if not (out.parent / "student" / "model_index.json").is_file():
        problems.append("no export")
    return problems


# ---- the sleep probe (a process of its own) -------------------------------------------------------------------------


def sleep_probe(result_path: Path, argv: list[str]) -> int:
    """The sleep/wake check: a one-rank ``GroupTrainer`` of the student (``argv``: :func:`sleep_argv`) on the
    device takes one step, sleeps, wakes and takes another; writes its figures to ``result_path`` after each state
    (so a stopped probe still tells how far it came)."""
    import psutil

    from miles.backends.fsdp_utils.trainer import GroupTrainer
    from miles.driver.arguments import parse_args
    from miles.driver.specs import build_run_spec
    from miles.rollout.conditioning import load_cond_file
    from miles.rollout.data_source import load_latent_file
    from miles.utils.collectives import LocalCollectives
    from miles.utils.types import TrainPair

    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    data: dict = {"device": str(device), "state": "loading"}

    def save() -> None:
        result_path.write_text(json.dumps(data, indent=2, default=str) + "\n")

    def snapshot(state: str, seconds: float | None = None) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        data["state"] = state
        data[state] = {
            "reserved_bytes": torch.cuda.memory_reserved(device) if cuda else None,
            "allocated_bytes": torch.cuda.memory_allocated(device) if cuda else None,
            "host_rss_bytes": psutil.Process().memory_info().rss,
            "seconds": seconds,
        }
        save()

    save()
    real = Path(args.prompt_data)
    records = [json.loads(line) for line in real.read_text().splitlines() if line.strip()][: args.rollout_batch_size]
    pairs = [
        TrainPair(
            sample_index=index,
            x0=load_latent_file(real.parent / record["latent"]),
            pos_cond=load_cond_file(real.parent / record["cond"]),
        )
        for index, record in enumerate(records)
    ]
    run = build_run_spec(args)
    spec = run.group("actor")
    start = time.perf_counter()
    trainer = GroupTrainer(
        spec, run.engine.make_family(spec.init), device=device, collectives=LocalCollectives(), args=args
    )
    data["load_seconds"] = time.perf_counter() - start
    losses = []
    _, metrics, _ = trainer.train(0, pairs, {})
    losses += [record["train/loss"] for record in metrics]
    snapshot("awake")
    for state, move in (("asleep", trainer.sleeper.sleep), ("woken", trainer.sleeper.wake_up)):
        start = time.perf_counter()
        move()
        snapshot(state, time.perf_counter() - start)
    _, metrics, _ = trainer.train(1, pairs, {})
    losses += [record["train/loss"] for record in metrics]
    data["losses"] = losses
    data["state"] = "done"
    if not all(math.isfinite(loss) for loss in losses):
        data["problem"] = f"non-finite losses {losses}"
    elif cuda:
        data.update(sleep_figures(data))
    save()
    return 0


def sleep_figures(data: dict) -> dict:
    """From the probe's CUDA snapshots (``data["awake" | "asleep" | "woken"]``: bytes reserved and allocated on the
    device, seconds of the move into the state): the bytes sleep moved (allocated awake − allocated asleep), the GB/s
    of each move, and ``problem`` when the memory reserved asleep is above :data:`SLEEP_RESERVED_SHARE` of the
    memory reserved awake (what the sleeping group leaves in the caching allocator)."""
    awake, asleep, woken = data["awake"], data["asleep"], data["woken"]
    moved = awake["allocated_bytes"] - asleep["allocated_bytes"]
    figures = {
        "moved_bytes": moved,
        "sleep_gb_per_s": moved / 1e9 / max(asleep["seconds"], 1e-9),
        "wake_gb_per_s": moved / 1e9 / max(woken["seconds"], 1e-9),
    }
    if asleep["reserved_bytes"] > SLEEP_RESERVED_SHARE * awake["reserved_bytes"]:
        figures["problem"] = (
            f"{asleep['reserved_bytes'] / GIB:.2f} GiB reserved asleep, more than {SLEEP_RESERVED_SHARE:.0%} of the "
            f"{awake['reserved_bytes'] / GIB:.2f} GiB awake"
        )
    return figures


# ---- the report -----------------------------------------------------------------------------------------------------


def markdown(header: list[str], rows: list[list]) -> list[str]:
    """A GitHub markdown table (what docs/performance.md takes as it is)."""
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "–"


def _num(value, fmt: str = ".3g") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "–"


def _commit() -> str:
    """The checkout's commit, or "unknown" (the device machine gets the working tree without its history)."""
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else "unknown"


def report(check: Check, results: list[StageResult], total: float) -> list[str]:
    """The report as markdown lines: the stages, each SD3.5 run's phases, the memory plan beside the measured peaks,
    the families, the sleep check."""
    opts = check.opts
    by_name = {result.name: result for result in results}
    mode = "plan only (nothing trained)" if opts.plan_only else ("tiny, CPU" if opts.tiny else "full size")
    lines = [
        f"GPU check ({mode}, commit {_commit()}): device {check.device}, bf16 peak {check.peak or '–'} TFLOP/s; "
        f"transformer {check.params / 1e6:.4g}M parameters, {check.fwd / 1e9:.4g} GFLOP per sample forward at "
        f"{check.config['sample_size']}×{check.config['sample_size']} latents + {TEXT_TOKENS} text tokens; "
        f"batch {opts.micro_batch_size} per forward, {opts.rollout_batch_size} samples per rollout, "
        f"{opts.rollouts} rollouts (medians over rollouts ≥ 1); total {total:.0f} s",
        "",
    ]
    rows = [[r.name, r.status, f"{r.seconds:.0f}", f"{r.budget:.0f}", r.reason.replace("|", "/")] for r in results]
    lines += markdown(["stage", "status", "seconds", "budget", "note"], rows)
    for name, title in SD35_RUNS.items():
        result = by_name.get(name)
        if result is None or "rows" not in result.data:
            continue
        lines += ["", f"{name}: {title} ({result.status}, {result.data.get('wall_seconds', 0):.0f} s)", ""]
        lines += markdown(["phase", "seconds", "peak GiB", "TFLOP/s", "MFU"], result.data["rows"])
    memory = [
        [name, *row]
        for name in SD35_RUNS
        if name in by_name and "memory_rows" in by_name[name].data
        for row in by_name[name].data["memory_rows"]
    ]
    if memory:
        title = "memory plan (miles/driver/memory_plan.py) beside the measured peak per GPU (max_memory_allocated)"
        lines += ["", title, ""]
        lines += markdown(["run", "group", "phase", "planned", "measured", "measured / planned"], memory)
        for name in SD35_RUNS:
            if name in by_name and "memory" in by_name[name].data and not opts.plan_only:
                lines.append(f"{name}: {exact_line(by_name[name].data['memory']['exact'])}")
    families = by_name.get("families")
    if families is not None and families.data.get("families"):
        rows = [
            [name, r["status"], _num(r.get("seconds"), ".0f"), r.get("rollouts", "–"), _num(r.get("student_loss")),
             _num(r.get("critic_loss")), _num(r.get("x0_max_abs_diff")), str(r.get("reason", "")).replace("|", "/")]
            for name, r in families.data["families"].items()
        ]  # fmt: skip
        lines += ["", "families: tiny DMD2 phase 2 in bf16, one rank", ""]
        lines += markdown(["family", "status", "seconds", "rollouts", "student loss", "critic loss", "x0 gap",
                           "note"], rows)  # fmt: skip
    sleep = by_name.get("sleep")
    if sleep is not None and "awake" in sleep.data:
        states = ("awake", "asleep", "woken")
        rows = [
            [state, _gib(sleep.data[state]["reserved_bytes"]), _gib(sleep.data[state]["allocated_bytes"]),
             _gib(sleep.data[state]["host_rss_bytes"]), _num(sleep.data[state]["seconds"])]
            for state in states if state in sleep.data
        ]  # fmt: skip
        moved = sleep.data.get("moved_bytes")
        speed = f", {sleep.data['sleep_gb_per_s']:.3g} / {sleep.data['wake_gb_per_s']:.3g} GB/s" if moved else ""
        lines += ["", f"sleep / wake of the student group ({_gib(moved)} GiB moved{speed})", ""]
        lines += markdown(["state", "reserved GiB", "allocated GiB", "host RSS GiB", "seconds"], rows)
    if opts.plan_only:
        lines += ["", "commands (train_diffusion.py flags; the sleep stage's are parsed in its own process)", ""]
        lines += [f"{name}: {shlex.join(argv)}" for name, argv in check.commands.items()]
    return lines


def write_outputs(check: Check, results: list[StageResult], lines: list[str], out: Path | None, path: Path | None):
    """The report and every figure: ``gpu_check.md``, ``gpu_check.json`` and ``logs.tar.gz`` (the stages' logs, the
    last 256 KiB of each) in ``out``; the JSON also to ``path``."""
    payload = {
        "device": check.device,
        "peak_tflops": check.peak,
        "parameters": check.params,
        "forward_flops_per_sample": check.fwd,
        "options": {key: str(value) for key, value in vars(check.opts).items()},
        "stages": [vars(result) for result in results],
        "commands": {name: shlex.join(argv) for name, argv in check.commands.items()},
    }
    text = json.dumps(payload, indent=2, default=str) + "\n"
    if path is not None:
        path.write_text(text)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(text)
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        for log in check.logs:
            if log.is_file():
                tail = log.read_bytes()[-256 * 1024 :]
                info = tarfile.TarInfo(str(log.relative_to(check.work)))
                info.size = len(tail)
                info.mtime = int(time.time())
                archive.addfile(info, io.BytesIO(tail))


# ---- the command line -----------------------------------------------------------------------------------------------


def _names(value: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown or value!r}; choose from {','.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="Every stage at toy size on the CPU (CI).")
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="Build every stage's command, check it as --dry-run does (the SD3.5 pipeline without weights) and plan "
        "its memory; train nothing.",
    )
    parser.add_argument(
        "--stages",
        type=lambda value: _names(value, STAGES, "stage"),
        default=list(STAGES),
        help=f"Comma-separated stages to run, in the fixed order (default all: {','.join(STAGES)}).",
    )
    parser.add_argument(
        "--families",
        type=lambda value: _names(value, tuple(FAMILIES), "family"),
        default=list(FAMILIES),
        help=f"Comma-separated families of the families stage (default all: {','.join(FAMILIES)}).",
    )
    parser.add_argument(
        "--family-jobs",
        type=int,
        default=None,
        help="Family runs at once (default 4 on a GPU, else 1; 1 with --ray-address).",
    )
    parser.add_argument("--family-cpus", type=int, default=None, help="--num-cpus-per-rank of a family run.")
    parser.add_argument("--deadline", type=float, default=None, help="Seconds for the whole run (default 510).")
    parser.add_argument("--rollouts", type=int, default=None, help="DMD2 rollouts per SD3.5 run (3; --tiny 2).")
    parser.add_argument("--rollout-batch-size", type=int, default=4, help="Samples per rollout (SD3.5 runs).")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="Samples per forward (batch per GPU).")
    parser.add_argument("--peak-tflops", type=float, default=None, help="The device's bf16 peak (default by name).")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="Where to write the pipelines and runs (kept); default a temp dir."
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="Write gpu_check.md, gpu_check.json and logs.tar.gz here (default $OUT when set).",
    )
    parser.add_argument("--json", type=Path, default=None, help="Write every figure here too.")
    parser.add_argument(
        "--ray-address", default=None, help="Run the trainings on this Ray cluster (default: each starts its own)."
    )
    args = parser.parse_args(argv)
    if args.rollouts is None:
        args.rollouts = 2 if args.tiny else 3
    if args.rollouts < 2:
        parser.error("--rollouts must be >= 2 (the first rollout is warm-up)")
    if args.rollout_batch_size % args.micro_batch_size or (args.rollout_batch_size // args.micro_batch_size) % 2:
        parser.error("--rollout-batch-size must be an even number of micro-batches (2 critic steps of whole ones)")
    if args.family_cpus is None:
        args.family_cpus = 1 if args.tiny else 4
    if args.family_jobs is None:
        args.family_jobs = 1 if args.tiny or args.plan_only else 4
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_sleep_probe"]:  # the sleep stage's own process
        return sleep_probe(Path(argv[1]), argv[2:])
    opts = parse_args(argv)
    if not opts.tiny and not opts.plan_only and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --tiny on the CPU", file=sys.stderr)
        return 2
    work = opts.work_dir or Path(tempfile.mkdtemp(prefix="miles_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _check(opts, work)
    finally:
        if opts.work_dir is None:
            # The SD3.5-Medium pipeline alone is 4.5 GB: a temporary work dir goes once the figures are written.
            shutil.rmtree(work, ignore_errors=True)


def _check(opts: argparse.Namespace, work: Path) -> int:
    start = time.monotonic()
    tiny = opts.tiny
    deadline = start + (opts.deadline or (TINY_DEADLINE if tiny else GPU_DEADLINE))
    check = Check(opts, work)

    def budget(name: str) -> float:
        return TINY_BUDGET if tiny else GPU_BUDGETS[name]

    stages = {
        "sd35": lambda d: check.training("sd35", d),
        "families": check.families,
        "sleep": check.sleep,
        "lora": lambda d: check.training("lora", d),
        "sd35_gc": lambda d: check.training("sd35_gc", d),
    }
    # The families bring their own pipelines: a rerun of them alone does not write the SD3.5 one.
    plan = [("prepare", budget("prepare"), check.prepare)] if set(opts.stages) - {"families"} else []
    plan += [(name, budget(name), stages[name]) for name in STAGES if name in opts.stages]

    def write(done: list[StageResult]) -> list[str]:
        lines = report(check, done, time.monotonic() - start)
        write_outputs(check, done, lines, opts.out, opts.json)
        return lines

    results = run_stages(plan, deadline, after=write)
    print("\n".join(write(results)), flush=True)
    return exit_code(results)


def exit_code(results: list[StageResult]) -> int:
    """1 when a stage failed or was stopped at its budget, else 0 (a stage the deadline skipped is not a failure:
    the report says so)."""
    return 1 if any(result.status in ("failed", "timeout") for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
