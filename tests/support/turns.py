"""A trainer that writes down whose turn on the device it is: every sleep/wake of its group and every phase in which
the group computes, in the order they happen, to ``<output-dir>/turns.jsonl`` (one JSON line per event, appended by
every rank of every group).

Name it with ``--custom-trainer-path tests.support.turns.RecordingTrainer``; :func:`read_turns` reads the log back
and :func:`awake_when_computing` replays it. The driver waits for one group's sleep before it wakes another, so
the file's order is the order the device saw.
"""

import contextlib
import json
import os
from pathlib import Path

from miles.backends.fsdp_utils.trainer import GroupTrainer

__all__ = ["RecordingTrainer", "awake_when_computing", "read_turns"]

LOG_NAME = "turns.jsonl"


class RecordingTrainer(GroupTrainer):
    """A ``GroupTrainer`` that logs its sleep/wake transitions and its compute phases (``generate`` and
    ``evaluate`` sampling, ``train``, ``train_output``, ``save``, ``eval_weights``: evaluation and export)."""

    def __init__(self, spec, family, **kwargs) -> None:
        super().__init__(spec, family, **kwargs)
        self._log = Path(self.args.output_dir) / LOG_NAME
        self._log.parent.mkdir(parents=True, exist_ok=True)
        # Wrapped on the instance, so that the actor's remote sleep/wake and any wake from inside the trainer (the
        # group waking itself) are all written down.
        for name in ("sleep", "wake_up"):
            setattr(self.sleeper, name, self._transition(name, getattr(self.sleeper, name)))
        self._record("init", None)

    def _record(self, event: str, rollout_id) -> None:
        line = {
            "role": self.role,
            "rank": self.rank,
            "event": event,
            "rollout_id": rollout_id,
            "state": self.sleeper.state,
            # The text encoders join the sleeper's modules when the actor first encodes a prompt (miles issue 30).
            "modules": len(self.sleeper.models),
        }
        # One short write per line on a file opened for appending: lines of concurrent ranks never interleave.
        with open(self._log, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _transition(self, name: str, move):
        def recorded() -> None:
            move()
            self._record(name, None)

        return recorded

    def train(self, rollout_id, pairs, external):
        self._record("train", rollout_id)
        return super().train(rollout_id, pairs, external)

    def train_output(self, rollout_id, external, pairs):
        self._record("train_output", rollout_id)
        return super().train_output(rollout_id, external, pairs)

    def check_finite_weights(self, what: str) -> None:
        # Called by save (and load) right before the checkpoint is written.
        self._record("save", what)
        super().check_finite_weights(what)

    @contextlib.contextmanager
    def inference(self):
        # Every sampling pass on the student: generate (rollouts, the debug grid) and evaluate.
        self._record("sample", None)
        with super().inference():
            yield

    @contextlib.contextmanager
    def eval_weights(self):
        # Evaluation and the export read the evaluation weights.
        self._record("eval_weights", None)
        with super().eval_weights():
            yield


def read_turns(output_dir: str | Path) -> list[dict]:
    """The events of ``<output_dir>/turns.jsonl`` in the order they were written."""
    with open(Path(output_dir) / LOG_NAME) as f:
        return [json.loads(line) for line in f if line.strip()]


def awake_when_computing(events: list[dict]) -> list[tuple[dict, list[str]]]:
    """Replay ``events``: for each compute event, the event and the sorted roles of the groups awake at that moment
    (every group starts awake; a sleep or wake event sets its rank's state)."""
    state: dict[tuple[str, int], str] = {}
    seen = []
    for event in events:
        key = (event["role"], event["rank"])
        if event["event"] in ("init", "sleep", "wake_up"):
            state[key] = event["state"]
            continue
        awake = sorted({role for (role, _), value in state.items() if value == "awake"})
        seen.append((event, awake))
    return seen
