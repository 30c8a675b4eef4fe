"""Whose turn on the GPU: colocated trainer groups share each GPU and take turns on it, the driver handing it to one
group at a time for every phase in which a group computes (generate, train, the critic's scoring, save, evaluation,
the DMD2 debug grid, the export), as the memory plan assumes.

On the CPU the groups do not take turns (``miles.driver.schedule.needs_sleep`` is off without GPUs). The run below
turns them on: it stands in for the DMD2 critic and actor groups sharing one 80 GB GPU that holds only one of them
at a time. A sleep on the CPU flips each rank's state and moves nothing, so the log of states the recording trainer
(``tests.support.turns``) writes is what the GPU would hold at each moment. One DP rank per group keeps it cheap.
"""

import json

import pytest

from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.sd3 import tiny_sd3_pipeline
from tests.support.turns import awake_when_computing, read_turns

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("turns")
    _, pipeline = tiny_sd3_pipeline(root / "sd3")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    out = root / "out"
    argv = [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(data), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "2",
        "--micro-batch-size", "2", "--dmd2-critic-steps-per-rollout", "1", "--num-rollout", "2", "--lr", "1e-3",
        "--save", str(root / "ckpt"), "--save-interval", "1", "--eval-interval", "1", "--eval-n-samples-per-prompt",
        "1", "--save-hf", str(root / "student"), "--output-dir", str(out),
        "--custom-trainer-path", "tests.support.turns.RecordingTrainer",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        # Groups sharing GPUs: what needs_sleep answers when Ray reports GPUs.
        patch.setattr("miles.driver.schedule.needs_sleep", lambda num_groups, use_gpu: num_groups > 1)
        run_main(argv)
    return {"out": out, "events": read_turns(out)}


def test_one_group_is_awake_whenever_a_group_computes(run):
    seen = awake_when_computing(run["events"])
    for event, awake in seen:
        where = f"{event['role']} {event['event']} ({event['rollout_id']})"
        assert awake == [event["role"]], f"{where} while {awake} awake"
    phases = {(event["role"], event["event"]) for event, _ in seen}
    # Rollouts (generate, train, scoring), saves, evaluation and export (eval_weights) of both groups.
    assert phases == {
        ("actor", "sample"),
        ("actor", "train"),
        ("actor", "save"),
        ("actor", "eval_weights"),
        ("critic", "train"),
        ("critic", "train_output"),
        ("critic", "save"),
    }
    # The DMD2 debug grid of each evaluation: the critic scores the actor's "debug" samples.
    scored = [
        event["rollout_id"] for event, _ in seen if (event["role"], event["event"]) == ("critic", "train_output")
    ]
    assert scored.count("debug") == 2
    # The export (after the last evaluation) reads the actor's weights on the actor's turn.
    assert (seen[-1][0]["role"], seen[-1][0]["event"]) == ("actor", "eval_weights")
    # The hand-overs are timed into each rollout's perf record.
    perf = [record for record in read_metrics(run["out"]) if "perf/step_time" in record]
    assert [record["rollout_id"] for record in perf] == [0, 1]
    assert all(record["perf/sleep_wake_time"] >= 0 and "perf/critic-wake_time" in record for record in perf)


def test_the_actor_group_sleeps_with_the_text_encoders_it_loaded(run):
    """No prompt cache: the actor ranks load the tiny SD3's two CLIP encoders at their first rollout, and the group's
    sleep controller moves them with its own state from then on (issue 30 item 9); the critic encodes nothing."""
    actor = [event for event in run["events"] if event["role"] == "actor"]
    critic = [event for event in run["events"] if event["role"] == "critic"]
    assert actor[0]["event"] == "init" and actor[0]["modules"] == 1  # the student
    sleeps = [event["modules"] for event in actor if event["event"] == "sleep"]
    assert len(sleeps) >= 2 and set(sleeps) == {3}
    assert {event["modules"] for event in critic} == {2}  # the critic and the teacher
