"""Running the driver (``train_diffusion.main``) inside the test session's Ray cluster."""

import signal
import time

import train_diffusion


def run_main(argv: list[str]) -> None:
    """``train_diffusion.main(argv)`` in this process. It joins the session's Ray cluster (the caller's test uses the
    ``ray_cluster`` fixture) and ends only what it started; the SIGINT/SIGTERM handlers it installs are put back
    afterwards so that pytest keeps its own."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        train_diffusion.main(argv)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def wait_for_free_cpus(expected: float, timeout_s: float = 30.0) -> float:
    """The cluster's free CPUs once they reach ``expected`` (Ray frees killed actors and removed placement groups
    asynchronously), or what is free after ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)
