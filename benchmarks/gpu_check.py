"""One short, unattended GPU check of DMD2 at SD3.5-Medium scale; ``--tiny`` runs the same path on the CPU (CI).

    python benchmarks/gpu_check.py                 # one GPU: ~2.5B-parameter student, critic and teacher, 1024 px
    python benchmarks/gpu_check.py --tiny          # a tiny SD3 transformer on the CPU, same code path

Nothing is downloaded. The script

1. builds an ``SD3Transformer2DModel`` from SD3.5-Medium's public configuration (stabilityai/stable-diffusion-3.5-
   medium ``transformer/config.json``: 24 layers, 24 heads × 64, dual attention in layers 0–12, RMS QK-norm) with
   random weights and writes it as a pipeline directory without text encoders or VAE;
2. writes a prompt cache (``miles.rollout.conditioning``'s format: one ``.safetensors`` cond per prompt and the
   negative prompt's) of random embeddings of SD3's shapes, 77 CLIP + 256 T5 tokens of width 4096 and pooled 2048,
   so no text encoder sits on the GPU;
3. runs ``train_diffusion.py --loss-type dmd2`` on it with one DP rank for a few rollouts of 1024 px latents
   (16 × 128 × 128), batch 2 per step: K = 2 critic steps, scoring with teacher CFG, one student step, bf16 compute
   with float32 master weights, with and without ``--gradient-checkpointing``;
4. prints per phase the time, the peak device memory, the achieved TFLOP/s and the MFU (model FLOPs from the
   configuration, counted with ``torch.utils.flop_counter`` on the meta device, against the device's bf16 peak),
   and the cost of sleep/wake (critic and actor share the GPU) and of the weight sync (none: the actor ranks
   generate on their own weights).

The CUDA-only branches it exercises (NCCL backend, ``torch.cuda.set_device`` from Ray's GPU ids, moving real
device memory on sleep, bf16 mixed precision, peak-memory accounting) are listed in docs/performance.md.
"""

import argparse
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

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
# Dense bf16 peak TFLOP/s by device name (vendor data sheets).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
PHASES = (
    ("rollout (student)", "actor", "generate"),
    ("critic steps", "critic", "train_steps"),
    ("scoring (teacher CFG + critic)", "critic", "train_output"),
    ("student step", "actor", "train_steps"),
)


def write_pipeline(out: Path, config: dict, device: str) -> Path:
    """A ``StableDiffusion3Pipeline`` directory holding only a random transformer (bf16) and a scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers.utils import logging as diffusers_logging

    torch.manual_seed(0)
    with torch.device(device):
        transformer = SD3Transformer2DModel(**config)
    diffusers_logging.set_verbosity_error()  # the bf16 cast's note about float32 modules (SD3 keeps none)
    transformer.to(torch.bfloat16).save_pretrained(out / "transformer")
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
    del transformer
    return out


def write_prompt_cache(out: Path, config: dict, count: int = 8) -> tuple[Path, Path]:
    """``prompts.jsonl`` whose records name random cond files of SD3's shapes, and the negative prompt's file."""
    from safetensors.torch import save_file

    (out / "cond").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)

    def cond() -> dict[str, torch.Tensor]:
        return {
            "encoder_hidden_states": torch.randn(TEXT_TOKENS, config["joint_attention_dim"], generator=gen),
            "pooled_projections": torch.randn(config["pooled_projection_dim"], generator=gen),
        }

    records = []
    for index in range(count):
        save_file(cond(), str(out / "cond" / f"{index}.safetensors"))
        records.append({"prompt": f"random prompt {index}", "cond": f"cond/{index}.safetensors"})
    (out / "prompts.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    save_file(cond(), str(out / "negative.safetensors"))
    return out / "prompts.jsonl", out / "negative.safetensors"


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


def phase_flops(fwd: float, args: argparse.Namespace, rollout_id: int) -> dict[str, float]:
    """Model FLOPs of each phase of rollout ``rollout_id`` on the one rank (a backward counts as two forwards)."""
    from miles.rollout.step_strategy_hub import stop_at_random_step

    samples = args.rollout_batch_size
    chunks = math.ceil(samples / args.micro_batch_size)
    # Every micro-batch runs to the rollout's largest stop step (the recipe's seed 42, the engine's 4 steps).
    max_step = max(stop_at_random_step(argparse.Namespace(rollout_seed=42), rollout_id, list(range(samples)), 4))
    return {
        "rollout (student)": chunks * (max_step + 1) * args.micro_batch_size * fwd,
        "critic steps": samples * 3 * fwd,
        # the teacher's CFG forward has both halves, the critic's is unguided
        "scoring (teacher CFG + critic)": samples * (2 + 1) * fwd,
        "student step": samples * 3 * fwd,
    }


def device_peak_tflops(override: float | None) -> tuple[str, float | None]:
    if not torch.cuda.is_available():
        return "cpu", override
    name = torch.cuda.get_device_name(0)
    if override:
        return name, override
    return name, next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def run_trainer(work: Path, pipeline: Path, prompts: Path, negative: Path, args, checkpointing: bool) -> dict:
    out = work / ("run_checkpointing" if checkpointing else "run")
    cmd = [
        sys.executable, str(REPO / "train_diffusion.py"), "--loss-type", "dmd2",
        "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline), "--prompt-data", str(prompts),
        "--negative-cond", str(negative), "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", str(args.rollout_batch_size), "--micro-batch-size", str(args.micro_batch_size),
        "--dmd2-critic-steps-per-rollout", "2", "--dmd2-teacher-guidance-scale", "4.5",
        "--diffusion-num-steps", "4", "--num-rollout", str(args.rollouts), "--train-dtype", "bfloat16",
        "--lr", "1e-6", "--critic-lr", "4e-6", "--output-dir", str(out),
        *(["--gradient-checkpointing"] if checkpointing else []),
        *(["--ray-address", args.ray_address] if args.ray_address else []),
    ]  # fmt: skip
    log = work / f"{out.name}.log"
    print(f"$ {shlex.join(cmd)}\n  (log {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.run(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if code != 0:
        tail = log.read_text().splitlines()[-30:]
        raise RuntimeError(f"train_diffusion.py failed with exit code {code}:\n" + "\n".join(tail))
    from miles.utils.tracking import read_metrics

    records = read_metrics(out)
    return {"records": records, "wall_seconds": time.perf_counter() - start, "command": shlex.join(cmd)}


def summarise(run: dict, fwd: float, args: argparse.Namespace, peak: float | None) -> list[list[str]]:
    """One row per phase: median seconds over rollouts ≥ 1 (0 is warm-up), peak memory, TFLOP/s, MFU."""
    perf: dict[str, list[float]] = {}
    for record in run["records"]:
        rollout_id = record.get("rollout_id", -1)
        if rollout_id < 1:
            continue
        flops = phase_flops(fwd, args, rollout_id)
        for key, value in record.items():
            if isinstance(value, (int, float)) and (key.startswith("perf/") or key.startswith("memory/")):
                perf.setdefault(key, []).append(float(value))
        for label, role, phase in PHASES:
            seconds = record.get(f"perf/{role}-{phase}_time")
            if isinstance(seconds, float) and seconds > 0:
                perf.setdefault(f"tflops/{label}", []).append(flops[label] / seconds / 1e12)
    median = {key: statistics.median(values) for key, values in perf.items()}
    rows, compute = [], 0.0
    for label, role, phase in PHASES:
        seconds = median.get(f"perf/{role}-{phase}_time")
        peak_bytes = median.get(f"memory/{role}-peak_{phase}_bytes")
        tflops = median.get(f"tflops/{label}")
        compute += seconds or 0.0
        rows.append([
            label,
            f"{seconds:.3f}" if seconds is not None else "–",
            f"{peak_bytes / 2**30:.1f}" if peak_bytes is not None else "–",
            f"{tflops:.3g}" if tflops is not None else "–",
            f"{100 * tflops / peak:.1f}%" if tflops is not None and peak else "–",
        ])  # fmt: skip
    step = median.get("perf/step_time")
    rows.append(["sleep / wake (driver)", f"{median.get('perf/sleep_wake_time', 0.0):.3f}", "", "", ""])
    rows.append(["weight sync", "none (colocated)", "", "", ""])
    if step:
        rows.append(["rollout total", f"{step:.3f}", "", "", f"model compute {100 * compute / step:.0f}% of it"])
    return rows


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line("-" * width for width in widths), *map(line, rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny SD3 transformer on the CPU (CI).")
    parser.add_argument("--rollouts", type=int, default=3, help="DMD2 rollouts per run (the first is warm-up).")
    parser.add_argument("--rollout-batch-size", type=int, default=4, help="Prompts per rollout.")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="Samples per forward (batch per GPU).")
    parser.add_argument("--peak-tflops", type=float, default=None, help="The device's bf16 peak (default by name).")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="Where to write the pipeline and runs (kept); default a temp dir."
    )
    parser.add_argument("--no-checkpointing-run", action="store_true", help="Skip the --gradient-checkpointing run.")
    parser.add_argument("--json", type=Path, default=None, help="Write every figure here.")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds per training run.")
    parser.add_argument(
        "--ray-address", default=None, help="Run the trainings on this Ray cluster (default: each starts its own)."
    )
    args = parser.parse_args(argv)
    if args.rollouts < 2:
        parser.error("--rollouts must be >= 2 (the first rollout is warm-up)")
    if args.rollout_batch_size % args.micro_batch_size or (args.rollout_batch_size // args.micro_batch_size) % 2:
        parser.error("--rollout-batch-size must be an even number of micro-batches (2 critic steps of whole ones)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = TINY if args.tiny else SD35_MEDIUM
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --tiny on the CPU", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="miles_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _check(args, config, work)
    finally:
        if args.work_dir is None:
            # The SD3.5-Medium pipeline alone is 5 GB: a temporary work dir goes once the figures are printed.
            shutil.rmtree(work, ignore_errors=True)


def _check(args: argparse.Namespace, config: dict, work: Path) -> int:
    start = time.perf_counter()
    pipeline = write_pipeline(work / "pipeline", config, "cpu" if args.tiny else "cuda")
    prompts, negative = write_prompt_cache(work / "prompts", config)
    fwd, params = forward_flops(config)
    name, peak = device_peak_tflops(args.peak_tflops)
    report = {"device": name, "peak_tflops": peak, "parameters": params, "forward_flops_per_sample": fwd, "runs": {}}
    out = [
        f"device {name}, bf16 peak {peak or '?'} TFLOP/s; transformer {params / 1e6:.4g}M parameters, "
        f"{fwd / 1e9:.4g} GFLOP per sample forward at {config['sample_size']}×{config['sample_size']} latents + "
        f"{TEXT_TOKENS} text tokens; batch {args.micro_batch_size} per step, {args.rollout_batch_size} samples per "
        f"rollout, medians over rollouts 1..{args.rollouts - 1}"
    ]
    for checkpointing in (False, True) if not args.no_checkpointing_run else (False,):
        run = run_trainer(work, pipeline, prompts, negative, args, checkpointing)
        rows = summarise(run, fwd, args, peak)
        title = "with --gradient-checkpointing" if checkpointing else "without gradient checkpointing"
        out += ["", f"{title} ({run['wall_seconds']:.0f} s):",
                format_table(["phase", "seconds", "peak GiB", "TFLOP/s", "MFU"], rows)]  # fmt: skip
        report["runs"][title] = {"rows": rows, "command": run["command"], "wall_seconds": run["wall_seconds"]}
    out.append(f"\ntotal {time.perf_counter() - start:.0f} s")
    print("\n".join(out), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
