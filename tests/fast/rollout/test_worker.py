"""The ``--rollout-num-gpus`` engine replica (``RolloutEngineWorker``) in a bf16 run (issue 30, item 6), without Ray:
it samples what the actor ranks sample, before and after a weight update, and loads the update in place.

The actor side is two real ``GroupTrainer`` ranks in bf16 (two spawned processes over gloo, as NCCL ranks on two
GPUs: FSDP2 with a bf16 ``MixedPrecisionPolicy``), each generating its DP shard with the actor's own
``RolloutGenerator``; the replica is the plain class the Ray actor wraps, in rank 0's process. The digits pipeline and
its MiniLM text encoder are real.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from miles.backends.fsdp_utils.trainer import GroupTrainer
from miles.eval.digits.data import write_digits_jsonl
from miles.ray.rollout import RolloutManager
from miles.rollout.generator import RolloutGenerator
from miles.rollout.worker import RolloutEngineWorker
from miles.utils.collectives import ProcessGroupCollectives
from tests.support.trainer import free_port, make_args, make_pipeline, run_spec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("digits"))


def _args(pipeline, tmp_path):
    prompts = write_digits_jsonl(tmp_path / "data", prompt_repeats=1)["prompts"]
    # SFT on the student's own samples: one optimizer step per rollout changes the weights the replica must follow.
    return make_args(
        pipeline,
        tmp_path,
        train_only=False,
        prompt_data=prompts,
        rollout_num_gpus=1,
        rollout_batch_size=2,
        micro_batch_size=1,
        train_dtype="bfloat16",
        num_steps_per_rollout=1,
        lr=1e-2,
    )


def _x0(pairs) -> torch.Tensor:
    return torch.stack([pair.x0 for pair in pairs])


def _actor_rank(rank: int, port: int, run, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        family = run.engine.make_family()
        collectives = ProcessGroupCollectives(CPU)
        trainer = GroupTrainer(
            run.group("actor"), family, device=CPU, collectives=collectives, mesh=mesh, args=run.args
        )
        actor = RolloutGenerator(
            run.engine,
            family,
            trainer.models.denoiser,
            args=run.args,
            device=CPU,
            collectives=collectives,
            inference=trainer.inference,
        )
        shards = RolloutManager(run.engine.data, dp_size=2).shards(0)
        before = actor.generate(shards[rank])
        trainer.train(0, before, {})
        after = actor.generate(shards[rank])
        # What FSDPTrainRayActor.update_weights ships: the unsharded float32 state dict on the CPU, at rank 0.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(trainer.models.denoiser, options=options)
        results[rank] = {"before": _x0(before), "after": _x0(after), "weights": weights if rank == 0 else None}
    finally:
        dist.destroy_process_group()


def test_a_replica_samples_what_the_actor_ranks_sample_in_bf16_before_and_after_an_update(pipeline, tmp_path):
    """A float32 replica without autocast once drew other samples than the bf16 actor ranks (and ran its matmuls in
    float32, about 10× slower on an H100 than bf16)."""
    run = run_spec(_args(pipeline, tmp_path))
    results = mp.Manager().dict()
    mp.spawn(_actor_rank, args=(free_port(), run, results), nprocs=2)
    ranks = [results[0], results[1]]
    shards = RolloutManager(run.engine.data, dp_size=2).shards(0)
    replica = RolloutEngineWorker()
    replica.init(run)
    for shard, rank in zip(shards, ranks):
        assert torch.equal(_x0(replica.generator.generate(shard)), rank["before"])
    replica.load_weights(ranks[0]["weights"])
    for shard, rank in zip(shards, ranks):
        assert not torch.equal(rank["after"], rank["before"])  # the step moved the weights
        assert torch.equal(_x0(replica.generator.generate(shard)), rank["after"])


def test_load_weights_copies_into_the_replicas_own_tensors(pipeline, tmp_path):
    """A weight update builds no second model: every tensor is copied into the replica's own parameters and buffers
    (their storage stays where it was) and holds the update's values in the replica's dtype.

    It stands in for a GPU replica, where every CPU tensor of the update must be moved to the device on its way in
    (the replica once converted the whole state dict there before loading it: a second full copy in GPU memory):
    here the update arrives in float64, a dtype the replica does not hold, so every tensor must be converted; the
    bytes allocated during the load are counted with the CPU profiler."""
    replica = RolloutEngineWorker()
    replica.init(run_spec(_args(pipeline, tmp_path)))
    denoiser = replica.generator.denoiser
    targets = denoiser.state_dict(keep_vars=True)
    pointers = {key: tensor.data_ptr() for key, tensor in targets.items()}
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in targets.values())
    gen = torch.Generator().manual_seed(0)
    update = {key: torch.randn(tensor.shape, generator=gen, dtype=torch.float64) for key, tensor in targets.items()}

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        replica.load_weights(update)
    allocated = sum(max(event.self_cpu_memory_usage, 0) for event in prof.key_averages())
    assert allocated < 0.05 * model_bytes, f"{allocated} bytes allocated to load a {model_bytes}-byte model"

    after = denoiser.state_dict(keep_vars=True)
    assert {key: tensor.data_ptr() for key, tensor in after.items()} == pointers
    for key, tensor in after.items():
        assert tensor.dtype == targets[key].dtype
        assert torch.equal(tensor, update[key].to(tensor.dtype)), key
    with pytest.raises(RuntimeError, match="does not match the engine's denoiser"):
        replica.load_weights({"nope": torch.zeros(1)})
