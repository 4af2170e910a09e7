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
    weight_sync_port: int = 29600  # weight_sync=distributed: the trainer's (rank 0) store port
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
        if self.sglang_gpus_per_server % self.sglang_ep_per_server:
            raise invalid("rollout.sglang_ep_per_server", self.sglang_ep_per_server,
                          f"does not divide sglang_gpus_per_server={self.sglang_gpus_per_server}",
                          "SGLang's --ep-size divides its --tp-size")
        return self

    @property
    def engine_returns_routes(self) -> bool:
        return self.engine == "local" or self.return_routes
