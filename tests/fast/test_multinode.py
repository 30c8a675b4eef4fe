"""DMD2 on a local two-node Ray cluster (``ray.cluster_utils.Cluster``, one CPU bundle per node): 2 DP ranks on
different nodes for each group, two rollouts with a save, then a resume that repeats the uninterrupted run.

The driver runs as a subprocess joining the cluster with ``--ray-address``, as a user's driver would; the cluster's
processes (head and two worker raylets) are ended by ``Cluster.shutdown`` whatever the test's outcome.
"""

import json
import os
import subprocess
import sys

import pytest

from miles.driver.run_dir import complete_rollouts, read_latest
from miles.utils.tracking import read_metrics
from tests.support.ray import REPO, export_test_environment
from tests.support.trainer import make_pipeline

PROMPTS = [f"a handwritten digit {digit}" for digit in range(4)]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    export_test_environment()
    # The head holds no CPU: the trainer bundles must land on the two worker nodes, one each.
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _run(cluster, pipeline, data, out, *extra):
    argv = [
        sys.executable, str(REPO / "train_diffusion.py"), "--ray-address", cluster.address,
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(data), "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "4", "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2",
        "--lr", "1e-3", "--critic-lr", "1e-3", "--output-dir", str(out), *extra,
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return {r["rollout_id"]: r for r in read_metrics(out) if "train/loss" in r}


def test_two_nodes_train_save_and_resume_exactly(cluster, tmp_path):
    from ray.util.state import list_nodes

    nodes = [node for node in list_nodes(address=cluster.address) if node.resources_total.get("CPU")]
    assert len(nodes) == 2
    pipeline = make_pipeline(tmp_path / "digits")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    save = tmp_path / "ckpt"
    full = _run(
        cluster, pipeline, data, tmp_path / "full", "--num-rollout", "3", "--save", str(save), "--save-interval", "2"
    )
    # One commit for both groups (the actor's `latest`); every saved rollout is complete in each group's directory.
    assert sorted(full) == [0, 1, 2] and read_latest(save) == 2
    assert complete_rollouts(save) == complete_rollouts(f"{save}_critic") == [1, 2]
    # The save after rollout 1 (interval 2) is complete on both groups: resume from it and repeat rollout 2.
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("1\n")
    resumed = _run(cluster, pipeline, data, tmp_path / "resumed", "--num-rollout", "3", "--load", str(save))
    assert sorted(resumed) == [2]
    assert resumed[2]["train/loss"] == full[2]["train/loss"]
    assert resumed[2]["train/dmd2_grad_abs_mean"] == full[2]["train/dmd2_grad_abs_mean"]
