"""GSPO through the Megatron model on every foundation layout: the same loss, gradient norm and
updated policy on 1 rank and on N ranks (real gloo ranks, fp32)."""

import pytest

from tests.conftest import LAYOUTS


@pytest.fixture(scope="module")
def results(layout_runs):
    return {name: layout_runs[name]["gspo"] for name in LAYOUTS}


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_gspo_step_is_layout_invariant(results, name):
    ref = results["single"][0]
    assert 0 < ref["metrics"]["clip_fraction"] < 1  # both clipped and unclipped sequences
    for r in results[name]:
        assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-6
        assert r["metrics"]["clip_fraction"] == ref["metrics"]["clip_fraction"]
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"]
        if r["after"] is not None:
            assert (r["after"] - ref["after"]).abs().max().item() <= 1e-5


def test_step_changes_the_policy(results):
    ref = results["single"][0]
    assert ref["grad_norm"] > 0
    assert ref["after"].shape == ref["before"].shape == (4, 16)
    assert (ref["after"] - ref["before"]).abs().max().item() > 1e-3
