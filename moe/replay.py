"""Routing Replay on megatron-core's own ``RouterReplay`` switch.

Each ``TopKRouter`` of a model built with ``moe_enable_routing_replay=True`` owns a
``RouterReplay``; its action decides whether top-k is computed (and recorded) or taken from given
indices. ``RoutingReplay`` owns the instances of one model: it removes them from Megatron's
class-level list (so that nothing global drives them and the list does not grow with every model),
and drives them through two context managers that the trainer holds:

- ``record()``: every router records its top-k; the routes of each forward are collected.
- ``replay(targets)``: every forward takes the next micro-batch's routes; activation recomputation
  in the backward replays them again. Missing routes, routes left unconsumed and routes consumed
  twice are errors.

R2 records in the old-policy pass and replays in every training forward of that batch; R3 replays
routes supplied by the rollout engine (sliced with ``moe.records``).

Legend: ``N`` tokens a router sees (Megatron's [s, b] order), ``K`` top-k, ``L`` local MoE layers.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moe.records import RoutingRecordError


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation recomputation calls forwards there)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class RecordedRoutes:
    """Routes collected by ``RoutingReplay.record``: one entry per forward, each a list over
    local MoE layers of [N, K] int64."""

    forwards: list = field(default_factory=list)


class RoutingReplay:
    """Drives the ``RouterReplay`` instances of one model (R2 / R3 and drift recording)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError("the model has no MoE routers")
        if any(r.router_replay is None for r in self.routers):
            raise ValueError("the model was built without moe_enable_routing_replay=True; build it "
                             "with build_model(..., moe_enable_routing_replay=True)")
        self.recompute = getattr(self.routers[0].config, "recompute_granularity", None) is not None
        mine = {id(r.router_replay) for r in self.routers}
        RouterReplay.global_router_replay_instances[:] = [
            x for x in RouterReplay.global_router_replay_instances if id(x) not in mine]
        self._mode: Optional[str] = None
        self._pending: list[deque] = []
        self._recorded: Optional[RecordedRoutes] = None
        self._current: list = []
        for layer, router in enumerate(self.routers):
            router.register_forward_pre_hook(self._pre_hook(layer))
            router.register_forward_hook(self._post_hook(layer))

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    # -- hooks -----------------------------------------------------------------------------------
    def _pre_hook(self, layer: int):
        def hook(module, args):
            replay = module.router_replay
            if self._mode == "replay":
                if _in_backward():  # activation recomputation: the routes set in the forward
                    if not replay.replay_backward_list:
                        raise RoutingRecordError(f"MoE layer {layer}: recompute found no routes "
                                                 "to replay (consumed twice?)")
                    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                    return
                queue = self._pending[layer]
                if not queue:
                    raise RoutingRecordError(f"MoE layer {layer}: no routes left to replay for this "
                                             "forward (missing, or a forward consumed them twice)")
                target = queue.popleft()
                tokens = args[0].shape[0] * (args[0].shape[1] if args[0].dim() == 3 else 1)
                if target.shape[0] != tokens:
                    raise RoutingRecordError(f"MoE layer {layer}: {target.shape[0]} routes for "
                                             f"{tokens} tokens")
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                replay.set_target_indices(target.to(args[0].device))
        return hook

    def _post_hook(self, layer: int):
        def hook(module, args, output):
            if self._mode == "record" and not _in_backward():
                self._current[layer] = module.router_replay.get_recorded_indices().detach().clone()
                if layer == self.num_layers - 1:
                    self._recorded.forwards.append(self._current)
                    self._current = [None] * self.num_layers
            if self._mode == "replay":
                module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return hook

    # -- context managers ------------------------------------------------------------------------
    def _set(self, action: Optional[RouterReplayAction]) -> None:
        for router in self.routers:
            replay = router.router_replay
            replay.clear_indices()
            if action is None:
                replay.clear_router_replay_action()
            else:
                replay.set_router_replay_action(action)

    @contextlib.contextmanager
    def record(self) -> Iterator[RecordedRoutes]:
        """Record the top-k of every router in every forward inside the block."""
        if self._mode is not None:
            raise RuntimeError(f"routing replay is already in {self._mode} mode")
        self._mode, self._recorded = "record", RecordedRoutes()
        self._current = [None] * self.num_layers
        self._set(RouterReplayAction.RECORD)
        try:
            yield self._recorded
        finally:
            self._mode = None
            self._set(None)

    @contextlib.contextmanager
    def replay(self, targets: Sequence[Sequence[torch.Tensor]]) -> Iterator[None]:
        """Replay ``targets`` (per forward, per local MoE layer, [N, K] expert ids) in order."""
        if self._mode is not None:
            raise RuntimeError(f"routing replay is already in {self._mode} mode")
        checks = []  # (forward, layer, in range) for every target: one host sync for all
        for i, forward in enumerate(targets):
            if len(forward) != self.num_layers:
                raise RoutingRecordError(f"routes for forward {i} cover {len(forward)} MoE layers, "
                                         f"this model stage has {self.num_layers}")
            for layer, t in enumerate(forward):
                num_experts = self.routers[layer].config.num_moe_experts
                top_k = self.routers[layer].topk
                if t.dim() != 2 or t.shape[1] != top_k:
                    raise RoutingRecordError(f"routes for forward {i}, MoE layer {layer}: shape "
                                             f"{tuple(t.shape)}, expected [tokens, {top_k}]")
                if t.numel():
                    checks.append((i, layer, ((t >= 0) & (t < num_experts)).all()))
        if checks:
            ok_each = torch.stack([c[2] for c in checks]).cpu()
            if not bool(ok_each.all()):
                i, layer, _ = checks[int((~ok_each).nonzero()[0, 0])]
                num_experts = self.routers[layer].config.num_moe_experts
                raise RoutingRecordError(f"routes for forward {i}, MoE layer {layer}: expert "
                                         f"ids outside [0, {num_experts - 1}]")
        self._pending = [deque(t[layer].long() for t in targets) for layer in range(self.num_layers)]
        self._mode = "replay"
        self._set(RouterReplayAction.REPLAY_FORWARD)
        ok = False
        try:
            yield
            ok = True
        finally:
            left = sum(len(q) for q in self._pending)
            left_backward = sum(len(r.router_replay.replay_backward_list) for r in self.routers)
            self._mode, self._pending = None, []
            self._set(None)
        if ok and left:
            raise RoutingRecordError(f"{left} replay routes were never consumed (more routes "
                                     "than forwards)")
        if ok and self.recompute and left_backward:
            raise RoutingRecordError(f"{left_backward} routes were replayed in the forward but not "
                                     "in the backward recomputation")
