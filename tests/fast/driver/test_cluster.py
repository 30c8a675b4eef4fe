"""The driver's checks of the Ray cluster (``miles.driver.cluster``): a dead ``--ray-address`` and a placement the
cluster cannot hold are one line before anything waits, and SIGTERM while Ray starts is the clean path (143)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from miles.driver.arguments import parse_args
from miles.driver.cluster import check_cluster_fits, check_ray_address, required_resources
from miles.utils.validation import ArgumentValidationError
from tests.support.ray import REPO

BASE = ["--hf-checkpoint", "/models/student", "--prompt-data", "/data/prompts.jsonl", "--num-rollout", "2"]


def test_an_address_where_nothing_listens_is_refused_at_once():
    with socket.socket() as probe:  # bound, then closed: nothing listens on the port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ArgumentValidationError, match=rf"--ray-address 127.0.0.1:{port}: no Ray cluster answers"):
        check_ray_address(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 5
    with pytest.raises(ArgumentValidationError, match="RAY_ADDRESS head is not host:port"):
        check_ray_address("head", "RAY_ADDRESS")
    for left_to_ray in (None, "auto", "local", "ray://head:10001"):
        check_ray_address(left_to_ray)
    check_ray_address(f"127.0.0.1:{port}", connect=False)  # the form alone: what parse_args checks


def test_a_dry_run_refuses_an_address_that_is_not_host_port(capsys):
    # A dry run plans for a cluster it often cannot reach: it checks the address's form, not that anything answers.
    base = [*BASE, "--rollout-batch-size", "4", "--dry-run"]
    for good in ("10.0.0.1:6379", "[::1]:6379", "head-node:6379", "auto", "local", "ray://head:10001"):
        assert parse_args([*base, "--ray-address", good]).ray_address == good
    for bad in ("head-node", ":6379", "::1", "10.0.0.1:0", "10.0.0.1:99999", "10.0.0.1:abc", "http://head:8265"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*base, "--ray-address", bad])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"train_diffusion.py: error: --ray-address {bad} is not host:port with a port in 1-65535 (e.g. "
            "10.0.0.1:6379, the address `ray start --head` prints; [::1]:6379 for IPv6), auto, local or "
            "ray://host:port"
        )


def test_a_placement_larger_than_the_cluster_is_refused_before_it_waits(ray_cluster):
    cpus = ray_cluster.cluster_resources()["CPU"]  # the session's cluster: 4 CPUs, no GPU
    fits = parse_args(
        [*BASE, "--rollout-batch-size", "4", "--actor-num-gpus-per-node", "2", "--num-cpus-per-rank", "1"]
    )
    check_cluster_fits(fits)
    ranks = int(cpus) + 2
    too_many = parse_args([*BASE, "--rollout-batch-size", str(ranks), "--actor-num-gpus-per-node", str(ranks),
                           "--num-cpus-per-rank", "1"])  # fmt: skip
    with pytest.raises(ArgumentValidationError) as exc_info:
        check_cluster_fits(too_many)
    assert str(exc_info.value).startswith(
        f"the command needs {ranks} bundles of 1 CPU ({ranks:g} CPU: --actor-num-nodes x --actor-num-gpus-per-node"
    )
    assert f"but this machine's Ray cluster has {cpus:g} CPU" in str(exc_info.value)
    # Engine replicas take bundles too.
    assert required_resources(
        parse_args([*BASE, "--rollout-batch-size", "4", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"]),
        3,
        use_gpu=True,
    ) == {"CPU": 9.0, "GPU": 3.0}


def test_sigterm_while_ray_starts_is_the_clean_path_with_exit_code_143(tmp_path):
    """A driver that starts its own local cluster gets SIGTERM as soon as Ray's first process appears (ray.init
    still runs then: it installs a handler of its own that would exit 15 with nothing printed)."""
    from miles.driver.watchdog import descendants
    from tests.support.trainer import make_pipeline

    pipeline = make_pipeline(tmp_path / "digits")
    data = tmp_path / "train.jsonl"
    from tests.support.inputs import write_digit_records

    write_digit_records(data, 8)
    argv = ["--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(pipeline), "--prompt-data", str(data),
            "--rollout-batch-size", "8", "--micro-batch-size", "4", "--num-rollout", "2",
            "--output-dir", str(tmp_path / "out")]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    ray_tmp = f"/tmp/ray_sigterm_{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "train_diffusion.py", *argv], cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env={**env, "RAY_TMPDIR": ray_tmp}, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(b"gcs_server" in _cmdline(pid) for pid in descendants({proc.pid})):
            assert proc.poll() is None and time.monotonic() < deadline, "Ray never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["rm", "-rf", ray_tmp], check=False)
    assert proc.returncode == 143, stderr[-3000:]
    assert "interrupted by SIGTERM; shutting down Ray" in stderr and "Traceback" not in stderr, stderr[-3000:]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class _RayStartingNoNode:
    """Stands in for the ``ray`` module whose local node never registers: Ray raises this bare Exception after 30 s
    of an overloaded machine or a full /tmp/ray (``ray._private.node``), which cannot be produced here on demand."""

    def __init__(self, message: str) -> None:
        self.message, self.shut_down = message, False

    def init(self, **kwargs) -> None:
        raise Exception(self.message)

    def shutdown(self) -> None:
        self.shut_down = True


def test_a_ray_node_that_times_out_during_startup_is_one_line_naming_what_to_do():
    # Issue 34 item 7: Ray's own words ended the run with a traceback.
    import train_diffusion
    from miles.utils.validation import RunError

    ray = _RayStartingNoNode(
        "The current node timed out during startup. This could happen because some of the raylet failed to startup "
        "or the GCS has become overloaded."
    )
    with pytest.raises(RunError) as info:
        train_diffusion._init_ray(ray, "local")
    message = str(info.value)
    assert "\n" not in message and message.startswith("Ray's local node did not start within 30 s")
    assert "`ray stop`" in message and "--ray-address HOST:PORT" in message
    assert ray.shut_down  # the processes that did start are ended
    other = _RayStartingNoNode("something else")
    with pytest.raises(Exception, match="^something else$"):
        train_diffusion._init_ray(other, "local")
    assert not other.shut_down
