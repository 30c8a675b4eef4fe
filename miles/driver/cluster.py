"""The driver's checks of the Ray cluster a run joins or starts, so that neither a dead address nor a cluster too
small for the command becomes a hang.

* :func:`check_ray_address` (before ``ray.init``): ``--ray-address host:port`` answers a TCP connect within
  :data:`CONNECT_TIMEOUT_S`; ``ray.init`` on a dead address retries for minutes and does not react to SIGTERM.
* :func:`check_cluster_fits` (right after ``ray.init`` of a cluster the run started itself): the placement the
  command asks for fits the cluster's CPUs and GPUs; a local cluster never grows, so the placement group would
  otherwise wait :data:`miles.ray.placement_group.PLACEMENT_TIMEOUT_S` seconds and fail. A cluster the run joined
  may still grow (an autoscaler), so there the wait stays and its timeout is one line too.
"""

import argparse
import socket

from miles.utils.validation import reject, trainer_ranks

__all__ = ["CONNECT_TIMEOUT_S", "check_cluster_fits", "check_ray_address", "required_resources"]

CONNECT_TIMEOUT_S = 5.0


def check_ray_address(address: str | None, flag: str = "--ray-address", connect: bool = True) -> None:
    """Refuse an address that is not ``host:port`` (a port in 1–65535; an IPv6 host in brackets), or (``connect``)
    where nothing accepts a TCP connection; ``auto``, ``local`` and ``ray://`` client addresses are left to Ray.
    ``parse_args`` checks the form only (a dry run plans for a cluster it often cannot reach); the driver connects
    before ``ray.init``.

    Raises:
        ArgumentValidationError: naming the address and how to start a cluster there.
    """
    if not address or address in ("auto", "local") or address.startswith("ray://"):
        return
    host, sep, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not sep or not host or bare_ipv6 or not port.isdigit() or not 0 < int(port) < 65536:
        reject(
            f"{flag} {address} is not host:port with a port in 1-65535 (e.g. 10.0.0.1:6379, the address `ray start "
            "--head` prints; [::1]:6379 for IPv6), auto, local or ray://host:port"
        )
    if not connect:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        reject(
            f"{flag} {address}: no Ray cluster answers there ({reason}); start one with `ray start --head "
            f"--port {port}` on {host or 'that node'}, or fix the address"
        )


def required_resources(args: argparse.Namespace, cpus_per_rank: int, use_gpu: bool) -> dict[str, float]:
    """What the run's placement groups reserve in all: one bundle per trainer rank and per engine replica, each
    ``cpus_per_rank`` CPUs (and one GPU on a GPU cluster)."""
    bundles = trainer_ranks(args) + (args.rollout_num_gpus or 0)
    needs = {"CPU": float(bundles * cpus_per_rank)}
    if use_gpu:
        needs["GPU"] = float(bundles)
    return needs


def check_cluster_fits(args: argparse.Namespace) -> None:
    """Refuse a command whose bundles cannot all be placed on the cluster this run started (needs ``ray.init``).

    Raises:
        ArgumentValidationError: naming the flags, what they ask for and what the cluster has.
    """
    import ray

    from miles.ray.placement_group import bundle_cpus, use_gpu_bundles

    have = ray.cluster_resources()
    cpus = bundle_cpus(args)
    needs = required_resources(args, cpus, use_gpu_bundles())
    short = {name: need for name, need in needs.items() if need > have.get(name, 0.0)}
    if not short:
        return
    bundles = trainer_ranks(args) + (args.rollout_num_gpus or 0)
    asked = ", ".join(f"{need:g} {name}" for name, need in needs.items())
    held = ", ".join(f"{have.get(name, 0.0):g} {name}" for name in needs)
    reject(
        f"the command needs {bundles} bundles of {cpus} CPU{'s' if cpus > 1 else ''}"
        f"{' and 1 GPU' if 'GPU' in needs else ''} ({asked}: --actor-num-nodes x --actor-num-gpus-per-node + "
        f"--rollout-num-gpus, --num-cpus-per-rank) but this machine's Ray cluster has {held}; lower them, or join "
        "a larger cluster with --ray-address"
    )
