"""Generation: the engine, the batch of prompts and responses, sampling, SGLang."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config.errors import invalid


@dataclass
class RolloutConfig:
    """Generation: prompts per step, responses per prompt (the group), sampling."""

    engine: str = "local"  # local (in-process Megatron) | sglang (HTTP servers)
    prompts_per_step: int = 16  # global, split over data-parallel ranks
    group_size: int = 8  # responses per prompt (the group of the advantages)
    max_new_tokens: int = 8  # response length limit
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = -1  # top-k sampling (-1: off)
    sglang_urls: list = field(default_factory=list)  # servers (engine=sglang)
    # an sglang-router balancing /generate over the servers (optional)
    sglang_router_url: Optional[str] = None
    # The Hugging Face checkpoint the servers were started from (launch/submit.sh --model-path
    # sets it): the trainer must start from the same weights (trainer.init_from) and tokenizer
    # (data.tokenizer), and every server must report it (/model_info) before the first step.
    sglang_model_path: str = ""
    # Seconds: servers' start-up (loading a large checkpoint), one batched /generate request,
    # one weight-update call (never retried: a repeated distributed update would wait for a
    # broadcast that never comes), other calls (health, pause, flush; retried).
    sglang_startup_timeout_s: float = 1800.0
    sglang_generate_timeout_s: float = 3600.0  # one batched /generate request (retried)
    sglang_update_timeout_s: float = 1800.0  # one weight-update call (never retried)
    sglang_control_timeout_s: float = 60.0  # health, pause, flush and other calls (retried)
    # sglang: disk | distributed (NCCL broadcast from trainer rank 0 to every server rank) |
    # tensor (CUDA IPC handles: colocated servers only, which this release refuses)
    weight_sync: str = "disk"
    # Each server's GPUs (its tensor-parallel size): ranks it adds to the weight_sync=distributed
    # group, payloads of weight_sync=tensor.
    sglang_gpus_per_server: int = 8
    sglang_ep_per_server: int = 1  # each server's --ep-size (its expert layout, for direct sync)
    # weight_sync=tensor: hf (every server TP rank gets the bucket's full HF tensors and cuts its
    # slice) | direct (each rank gets only its own shards, in SGLang's parameter layout of the
    # default MoE runner on Hopper GPUs: sglang_layout.py).
    tensor_sync_format: str = "hf"
    sglang_rows_per_request: int = 64  # rows of one batched /generate request
    sglang_max_in_flight: int = 32  # requests in flight at once (per replica leader)
    weight_sync_bucket_mb: float = 512.0  # weights go out in buckets of about this size
    # weight_sync=distributed: the port of the trainer's (rank 0) store; 0: one the system picks
    weight_sync_port: int = 29600
    # weight_sync=distributed: the address servers reach trainer rank 0 at; empty: the address
    # of rank 0's interface that routes to the first server
    weight_sync_address: str = ""
    return_routes: bool = False  # sglang: ask the servers for routed experts (R3, drift)
    # DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts
    # until the step's batch is full, at most max_sampling_rounds rounds (then groups of equal
    # rewards fill the rest: they carry no advantage).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # dynamic_sampling: rounds of fresh prompts at most
    # Responses cut at max_new_tokens: keep (trained as finished ones) | mask (no loss) |
    # soft_penalty (DAPO: reward ramps down by up to 1 over the last overlong_buffer tokens).
    overlong: str = "keep"
    # soft_penalty: the tokens before the limit over which the penalty ramps
    overlong_buffer: int = 4
    # Asynchronous RL: sync (generate, train, sync weights: every sample on-policy) |
    # one_step_off (step k+1's batch generated while step k trains, by the weights before step k:
    # staleness 1; the local engine generates it before step k trains, no overlap on one device) |
    # async (sglang: each replica leader's producer keeps generating, up to max_staleness + 1
    # steps' batches admitted ahead). Off-policy modes need algo.rollout_correction.
    mode: str = "sync"
    # async: policy versions a sample may lag the policy that trains on it (eta): a group is
    # admitted for step t once the servers hold version t - 1 - max_staleness or later, so every
    # token of it is at most max_staleness versions older than the policy of step t
    max_staleness: int = 1
    # async: responses generated in segments across weight syncs, each resumed under the new
    # weights (re-prefill), every token recorded with the version that sampled it
    partial: bool = False
    # partial: new tokens per response per round; a weight sync waits for the round to end, so
    # the versions of every token follow the schedule, not the clock (reproducible) | 0: no
    # segments, a sync aborts the requests in flight (their tokens kept; more overlap, versions
    # depend on timing)
    partial_segment_tokens: int = 64
    # The in-process engine on a GPU decodes without host synchronisations
    # (rollout/static_decode.py): it reads the rows' finished flags every this many steps.
    decode_readback_steps: int = 8
    compile_decode: bool = False  # the GPU decoding step under torch.compile (one graph)
    # the GPU decoding step captured as a CUDA graph per batch bucket and replayed
    cuda_graphs: bool = False
    # How the servers pause for a weight sync: abort (requests in flight end and return their
    # tokens). retract and in_place are refused: both carry a request across the update under
    # one version label, and in_place keeps the KV cache of the old weights.
    pause_mode: str = "abort"

    def validate(self) -> "RolloutConfig":
        if self.engine not in ("local", "sglang"):
            raise invalid("rollout.engine", self.engine, "is unknown", "use local or sglang")
        for key in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise invalid(f"rollout.{key}", getattr(self, key), "must be >= 1",
                              "set a value >= 1")
        if self.group_size < 2:
            raise invalid("rollout.group_size", self.group_size, "a group of one has no baseline "
                          "(advantage 0 for every response)", "use group_size >= 2")
        if self.temperature <= 0:
            raise invalid("rollout.temperature", self.temperature, "RL needs sampled responses",
                          "use a temperature > 0")
        if not 0 < self.top_p <= 1:
            raise invalid("rollout.top_p", self.top_p, "must be in (0, 1]", "use 1.0 to disable")
        if self.engine == "sglang" and not self.sglang_urls:
            raise invalid("rollout.sglang_urls", self.sglang_urls,
                          "engine=sglang needs the servers' "
                          "URLs (weight updates and pauses go to every server; a router does not "
                          "relay them)", "list them, e.g. rollout.sglang_urls=[http://node1:30000]")
        for key in ("sglang_gpus_per_server", "sglang_ep_per_server", "sglang_rows_per_request",
                    "sglang_max_in_flight"):
            if getattr(self, key) < 1:
                raise invalid(f"rollout.{key}", getattr(self, key), "must be >= 1",
                              "set a value >= 1")
        if not 0 <= self.weight_sync_port <= 65535:
            raise invalid("rollout.weight_sync_port", self.weight_sync_port,
                          "is not a TCP port", "give one in 1..65535, or 0 for any free port")
        if not self.weight_sync_bucket_mb > 0:
            raise invalid("rollout.weight_sync_bucket_mb", self.weight_sync_bucket_mb,
                          "must be > 0",
                          "e.g. 512")
        if self.max_sampling_rounds < 1:
            raise invalid("rollout.max_sampling_rounds", self.max_sampling_rounds, "must be >= 1",
                          "e.g. 4")
        if self.overlong not in ("keep", "mask", "soft_penalty"):
            raise invalid("rollout.overlong", self.overlong, "is unknown",
                          "use keep, mask or soft_penalty")
        if self.overlong == "soft_penalty" and not 1 <= self.overlong_buffer <= self.max_new_tokens:
            raise invalid("rollout.overlong_buffer", self.overlong_buffer,
                          f"must be in [1, max_new_tokens={self.max_new_tokens}]", "e.g. 4")
        if self.weight_sync not in ("disk", "distributed", "tensor"):
            raise invalid("rollout.weight_sync", self.weight_sync, "is unknown",
                          "use disk, distributed or tensor")
        if self.engine == "sglang" and self.weight_sync == "tensor":
            raise invalid("rollout.weight_sync", "tensor", "hands the servers CUDA IPC handles of "
                          "trainer rank 0's GPU, which only servers on that node (colocated) can "
                          "open, and colocated servers are not supported (they would share GPUs "
                          "with the trainer without releasing their memory)",
                          "run the servers on their own nodes (launch/submit.sh --sglang separate) "
                          "and use rollout.weight_sync=distributed")
        for key in ("sglang_startup_timeout_s", "sglang_generate_timeout_s",
                    "sglang_update_timeout_s", "sglang_control_timeout_s"):
            if not getattr(self, key) > 0:
                raise invalid(f"rollout.{key}", getattr(self, key), "must be > 0",
                           "give seconds (see conf/rollout/sglang.yaml)")
        if self.tensor_sync_format not in ("direct", "hf"):
            raise invalid("rollout.tensor_sync_format", self.tensor_sync_format, "is unknown",
                          "use direct or hf")
        self.validate_async()
        self.validate_decode()
        if self.sglang_gpus_per_server % self.sglang_ep_per_server:
            raise invalid("rollout.sglang_ep_per_server", self.sglang_ep_per_server,
                          f"does not divide sglang_gpus_per_server={self.sglang_gpus_per_server}",
                          "SGLang's --ep-size divides its --tp-size")
        return self

    def validate_decode(self) -> None:
        if self.decode_readback_steps < 1:
            raise invalid("rollout.decode_readback_steps", self.decode_readback_steps,
                          "must be >= 1", "e.g. 8")

    def validate_async(self) -> None:
        if self.mode not in ("sync", "one_step_off", "async"):
            raise invalid("rollout.mode", self.mode, "is unknown", "use sync, one_step_off or async")
        if self.mode == "async" and self.engine != "sglang":
            raise invalid("rollout.mode", "async", "needs SGLang servers beside the trainer (the "
                          "local engine shares the trainer's device: nothing to overlap)",
                          "use rollout=sglang, or rollout.mode=one_step_off with the local engine")
        if self.max_staleness < 0:
            raise invalid("rollout.max_staleness", self.max_staleness, "must be >= 0",
                          "0 (on-policy batches) or more")
        if self.partial and self.mode != "async":
            raise invalid("rollout.partial", True, f"splits responses across weight syncs, which "
                          f"rollout.mode={self.mode} does not run during generation",
                          "use rollout.mode=async")
        if self.partial_segment_tokens < 0:
            raise invalid("rollout.partial_segment_tokens", self.partial_segment_tokens,
                          "must be >= 0", "e.g. 64, or 0 to abort at each sync")
        if self.pause_mode != "abort":
            why = ("keeps the KV cache computed by the old weights" if self.pause_mode == "in_place"
                   else "carries requests across the update under one version label")
            raise invalid("rollout.pause_mode", self.pause_mode,
                          why if self.pause_mode in ("in_place", "retract") else "is unknown",
                          "use abort (requests end and are resumed under the new weights)")
        if self.dynamic_sampling and self.mode != "sync":
            raise invalid("rollout.dynamic_sampling", True, "redraws prompts until a batch is "
                          f"full, which rollout.mode={self.mode}'s admission schedule does not",
                          "use rollout.mode=sync with dynamic sampling")

    @property
    def staleness_bound(self) -> int:
        """How many policy versions a trained sample's oldest token may lag (eta)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    @property
    def engine_returns_routes(self) -> bool:
        return self.engine == "local" or self.return_routes
