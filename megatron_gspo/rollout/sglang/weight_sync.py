"""SGLang's weight-update group, and what a weight sync sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_gspo.rollout.sglang.client import SGLangError


@dataclass(frozen=True)
class SyncStats:
    """One weight sync: what was sent and how long it took."""

    mode: str
    tensors: int  # HF tensors
    # Bytes the trainer sent: the HF tensors for disk, distributed (one broadcast reaches every
    # server rank) and tensor with hf payloads (one payload repeated per TP rank); for tensor with
    # direct payloads, the shards of all TP ranks of one server.
    bytes: int
    buckets: int
    seconds: float

    def describe(self) -> str:
        return (f"weight sync ({self.mode}): {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB "
                f"in {self.buckets} buckets, {self.seconds:.2f} s")


def count_sent(sent: list, bucket: Sequence[tuple], nbytes: Optional[int]) -> None:
    """Add a bucket to ``sent`` (tensors, bytes, buckets): ``nbytes`` sent for it, or (None)
    the bytes of its HF tensors."""
    sent[0] += len(bucket)
    sent[1] += sum(t.numel() * t.element_size() for _, t in bucket) if nbytes is None else nbytes
    sent[2] += 1


def init_weights_update_group(engine, *, master_address: str, master_port: int,
                              engine_gpus: Sequence[int], group_name: str = "weight_update_group",
                              backend: str = "nccl", timeout_s: float = 600.0):
    """The trainer's side of SGLang's weight-update group: rank 0 is the trainer, server i joins
    at rank 1 + sum of the GPUs of servers before it. The trainer group is built the way SGLang
    builds its side (TCP store under a PrefixStore named ``group_name``); a plain
    ``init_process_group`` uses other store keys and hangs. ``master_port`` 0: the store listens
    on a port the system picks, which the servers are told."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    world = 1 + sum(engine_gpus)
    errors = []
    for client in engine.clients:  # a group left by an earlier run under this name refuses joins
        try:
            client.post("/destroy_weights_update_group", {"group_name": group_name})
        except SGLangError:
            pass  # none there
    try:  # (listening before any server is asked to join: they connect to a port that is open)
        store = dist.TCPStore(master_address, master_port, world, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except RuntimeError as e:
        cause = str(e).splitlines()[0]
        if "EADDRINUSE" in cause:
            raise SGLangError(f"weight-update group {group_name!r}: trainer rank 0 cannot listen "
                              f"on port {master_port} ({cause}); set rollout.weight_sync_port to "
                              "a free port, or 0 for any") from None
        raise SGLangError(f"weight-update group {group_name!r}: trainer rank 0 cannot open its "
                          f"store at {master_address}:{master_port} ({cause}); check "
                          "rollout.weight_sync_address and rollout.weight_sync_port") from None

    def join(client, offset):
        try:
            client.post("/init_weights_update_group",
                        {"master_address": master_address, "master_port": store.port,
                         "rank_offset": offset, "world_size": world, "group_name": group_name,
                         "backend": backend})
        except Exception as e:
            errors.append(e)

    built = {}

    def build():
        try:
            group, _ = _new_process_group_helper(
                world, 0, [], backend, dist.PrefixStore(group_name, store), group_name=group_name,
                timeout=timedelta(seconds=timeout_s))
            # The group is outside the trainer's world: its ranks are its own (as SGLang
            # registers them), which collectives need to translate group ranks.
            _world.pg_group_ranks[group] = {i: i for i in range(world)}
            built["group"] = group
        except Exception as e:
            built["error"] = e

    # Every server joins (its request returns once it is in the group) and rank 0 builds its
    # side (gloo waits for every server there; NCCL connects at the first broadcast). The first
    # failure on either side ends the wait; threads left waiting are daemons.
    offsets = [1 + sum(engine_gpus[:i]) for i in range(len(engine_gpus))]
    threads = [threading.Thread(target=join, args=(c, o), daemon=True)
               for c, o in zip(engine.clients, offsets)]
    threads.append(threading.Thread(target=build, daemon=True))
    for t in threads:
        t.start()
    while not errors and "error" not in built and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    if errors or "error" in built:
        if built.get("group") is not None:  # (built before a server failed: leave no group)
            dist.destroy_process_group(built["group"])
        if errors:
            raise SGLangError(f"weight-update group {group_name!r}: a server did not join: "
                              f"{errors[0]}")
        raise built["error"]
    return built["group"]


def destroy_weights_update_group(engine, group,
                                 group_name: str = "weight_update_group") -> None:
    """Leave the weight-update group on both sides (the servers refuse a new group under a name
    they hold, and so does this process): at the end of a run, best effort."""
    import torch.distributed as dist

    for client in engine.clients:
        try:
            client.post("/destroy_weights_update_group", {"group_name": group_name})
        except SGLangError:
            pass  # a server that is gone holds no group
    dist.destroy_process_group(group)
