"""Run ``train_diffusion.py`` as a command many times, fast: one warmed-up interpreter forks a child per command.

Each child is a separate process that runs the script exactly as ``python train_diffusion.py ARGS`` would
(``runpy`` with ``__name__ == "__main__"``, its own argv, cwd, stdout and stderr, its exit code), but skips the
2–3 s of importing torch and diffusers that every fresh interpreter pays. The parent imports the modules the
parse and preflight paths load and nothing starts threads there, so a fork is safe. Commands that start Ray do
not belong here (a test session's cluster is not the child's); use a plain subprocess for them.

    results = run_commands([{"argv": [...], "cwd": "/tmp/x"}, ...])   # [{"returncode", "stdout", "stderr"}]

``python -m tests.support.cli`` is the server: JSON cases on stdin, JSON results on stdout.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "train_diffusion.py"


def _run_child(case: dict, out_path: str, err_path: str) -> None:
    """In the forked child: run the script as ``__main__`` and exit with its code (never returns)."""
    import runpy
    import traceback

    code = 0
    try:
        out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(case.get("cwd") or os.getcwd())
        os.environ.update(case.get("env") or {})
        sys.argv = [str(SCRIPT), *case["argv"]]
        try:
            runpy.run_path(str(SCRIPT), run_name="__main__")
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - report it as the interpreter would
            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _warm_up() -> None:
    """Run the parse path once in this process (a command that every check up to the numbers accepts), so that
    what it initialises on first use is initialised before the forks, not in every child."""
    import contextlib
    import io

    import torch

    from miles.driver.arguments import parse_args

    argv = ["--hf-checkpoint", "/nonexistent", "--prompt-data", "/nonexistent.jsonl", "--rollout-batch-size", "8",
            "--num-rollout", "1", "--lr", "nan"]  # fmt: skip
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        parse_args(argv)
    torch.isfinite(torch.zeros(1)).all()


def serve(cases: list[dict]) -> list[dict]:
    """Fork one child per case, in order; return each one's exit code, stdout and stderr."""
    # What the parse and preflight paths import, loaded once before the forks.
    sys.path.insert(0, str(REPO))
    import safetensors.torch  # noqa: F401
    from diffusers.utils import logging as _diffusers_logging  # noqa: F401 - setup_logging's imports
    from transformers.utils import logging as _transformers_logging  # noqa: F401

    import miles.driver.arguments  # noqa: F401
    import miles.driver.preflight  # noqa: F401
    import miles.driver.preflight_data  # noqa: F401
    import miles.driver.preflight_outputs  # noqa: F401
    import miles.models.digits  # noqa: F401
    import miles.rollout.data_source  # noqa: F401
    import miles.utils.log  # noqa: F401

    _warm_up()
    results = []
    with tempfile.TemporaryDirectory(prefix="miles_cli_") as tmp:
        for i, case in enumerate(cases):
            out_path, err_path = f"{tmp}/{i}.out", f"{tmp}/{i}.err"
            pid = os.fork()
            if pid == 0:
                _run_child(case, out_path, err_path)
            _, status = os.waitpid(pid, 0)
            results.append(
                {
                    "returncode": os.waitstatus_to_exitcode(status),
                    "stdout": Path(out_path).read_text(errors="replace"),
                    "stderr": Path(err_path).read_text(errors="replace"),
                }
            )
    return results


def run_commands(cases: list[dict], timeout: float = 600) -> list[dict]:
    """Run every case (``{"argv": [...], "cwd": ..., "env": {...}}``) in a fresh server process."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.cli"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the command server failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    results = serve(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(results))
