"""Routing Replay (R2 and R3) on megatron's RouterReplay, on every CPU layout (real gloo ranks)."""

import pytest
import torch

from tests.distributed import run_layouts
from tests.replay_workers import replay_job

CASES = {
    "single": (1, {}, False, None),
    "recompute": (1, {}, True, None),
    "packed": (1, {}, False, [9, 5, 12, 3]),
    "ep2": (2, dict(ep=2), False, None),
    "pp2": (2, dict(pp=2), False, None),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True), False, None),
    "tp2_sp_packed": (2, dict(tp=2, sequence_parallel=True), False, [9, 5, 12, 3]),
}


def engine_routes(b, s, layers=3, experts=4, k=2, seed=0):
    """Distinct top-k expert ids per token and layer, as a rollout engine would return them."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, s, layers, experts, generator=g).argsort(-1)[..., :k]


@pytest.fixture(scope="module")
def results():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (4, 13), generator=g)
    out = {}
    for world in (1, 2):  # every case of a world size in one spawn
        names = [n for n, case in CASES.items() if case[0] == world]
        cases = [(replay_job, (CASES[n][1], tokens, engine_routes(4, 12), *CASES[n][2:]))
                 for n in names]
        out.update(zip(names, run_layouts(world, cases)))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_r2_replays_recorded_routes_exactly(results, name):
    for r in results[name]:
        assert r["replay_exact"], "replayed forward used other experts than recorded"
        assert max(r["drift_off"]) > 0, "without replay the perturbed routers must drift"
        if r["forced_diff"] is not None:
            assert r["forced_diff"] == 0.0


@pytest.mark.parametrize("name", list(CASES))
def test_r3_reproduces_supplied_routes(results, name):
    for r in results[name]:
        assert r["r3_exact"]


def test_recompute_replays_the_same_routes(results):
    (r,) = results["recompute"]
    assert r["used_after"] == 2 * r["num_routers"]  # the forward, then the recomputation
    assert r["recompute_exact"]


def test_pipeline_stages_hold_their_own_layers(results):
    assert [r["layers"] for r in results["pp2"]] == [[0], [1, 2]]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_records_fail_clearly(results, name):
    errors = results[name][0]["errors"]
    assert "expected [tokens, 2]" in errors["top_k"]
    assert "MoE layers" in errors["layers"]
    assert "expert ids outside [0, 3]" in errors["range"]
    if "tokens" in errors:
        assert "routes for" in errors["tokens"] and "tokens" in errors["tokens"]
    assert "never consumed" in errors["unconsumed"]


def test_megatron_class_level_list_is_cleared_of_the_model(results):
    assert all(r["left_in_global_list"] == 0 for rs in results.values() for r in rs)


def test_replay_needs_the_megatron_switch():
    from moe.replay import RoutingReplay

    with pytest.raises(ValueError, match="no MoE routers"):
        RoutingReplay(torch.nn.Linear(2, 2))
