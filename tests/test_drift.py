"""Drift and load metrics on hand-computed examples; routing records; logs and the report."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_workers import SHORT, merge, to_overrides

from moe.drift import (changed_layers, expert_counts, layer_drift_sums, load_metrics,
                       ratio_noise_metrics, ratio_noise_sums, topk_agreement)
from moe.records import (RoutingRecord, RoutingRecordError, index_dtype, local_moe_layers,
                         packed_routes, padded_routes, rank_targets, routes_from_rank)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_topk_agreement_hand_computed():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 5], [6, 7], [6, 7]])  # same set, one shared, none, same
    m = topk_agreement(a, b)
    assert m["exact_match"].item() == pytest.approx(0.5)
    assert m["changed_fraction"].item() == pytest.approx(0.5)
    # Jaccard per row: 1, 1/3, 0, 1
    assert m["jaccard"].item() == pytest.approx((1 + 1 / 3 + 0 + 1) / 4)
    with pytest.raises(ValueError, match="both be"):
        topk_agreement(a, b[:3])


def test_drift_sums_stay_on_the_routes_device():
    """The sums are made where the routes live (on a GPU run, the CUDA device: a host-made tensor
    stacked with device tensors fails there). The meta device stands in for CUDA here: mixing it
    with host tensors raises the same way."""
    a = [torch.tensor([[0, 1], [2, 3]]).to("meta")] * 2
    per_layer, tokens = layer_drift_sums(a, a)
    assert per_layer.device.type == "meta" and per_layer.shape == (2, 3)
    assert tokens.device.type == "meta" and tokens.shape == (2,)
    per_layer, tokens = layer_drift_sums([torch.tensor([[0, 1], [2, 3]])] * 2,
                                         [torch.tensor([[1, 0], [2, 4]])] * 2)
    assert per_layer.tolist() == [[2.0, 1.0, 1 + 1 / 3]] * 2 and tokens.tolist() == [2.0, 1.0]


def test_ratio_noise_hand_computed():
    """4 tokens, 2 MoE layers: token 0 keeps its routes, token 1 changes in layer 0, token 2 in
    both (a reordered top-k set is no change), token 3 keeps them; |log ratio| known."""
    before = [torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]]),
              torch.tensor([[1, 2], [0, 1], [2, 3], [0, 3]])]
    after = [torch.tensor([[1, 0], [2, 0], [0, 1], [3, 1]]),
             torch.tensor([[2, 1], [0, 1], [1, 3], [3, 0]])]
    counts = changed_layers(before, after)
    assert counts.tolist() == [0, 1, 2, 0]
    abs_lr = torch.tensor([0.1, 0.5, 0.9, 0.3])
    sums = ratio_noise_sums(abs_lr, counts, num_layers=2)
    assert sums[0].tolist() == pytest.approx([0.4, 0.5, 0.9]) and sums[1].tolist() == [2, 1, 1]
    m = ratio_noise_metrics(sums)
    assert float(m["changed"]) == pytest.approx((0.5 + 0.9) / 2)
    assert float(m["unchanged"]) == pytest.approx((0.1 + 0.3) / 2)
    assert float(m["quotient"]) == pytest.approx(0.7 / 0.2)
    assert m["by_layers"].tolist() == pytest.approx([0.2, 0.5, 0.9])
    assert float(m["changed_tokens"]) == 0.5
    # two ranks' sums add up to one rank's
    halves = (ratio_noise_sums(abs_lr[:2], counts[:2], 2) + ratio_noise_sums(abs_lr[2:], counts[2:], 2))
    assert torch.equal(halves, sums)
    # nothing changed: the changed mean and the quotient are undefined, not 0
    none = ratio_noise_metrics(ratio_noise_sums(abs_lr, torch.zeros(4, dtype=torch.long), 2))
    assert math.isnan(float(none["changed"])) and math.isnan(float(none["quotient"]))
    assert math.isnan(none["by_layers"][1]) and float(none["changed_tokens"]) == 0


def test_load_metrics_hand_computed_with_idle_experts():
    routes = torch.tensor([[0, 1], [0, 1], [0, 2]])  # experts 3 gets no tokens
    counts = expert_counts(routes, 4)
    assert counts.tolist() == [3, 2, 1, 0]
    m = load_metrics(counts[None])
    share = torch.tensor([3, 2, 1, 0]) / 6
    assert torch.allclose(m["share"][0], share.double())
    expected_entropy = -sum(p * torch.log(p) for p in share[:3].double())
    assert m["entropy"][0].item() == pytest.approx(expected_entropy.item())
    assert m["imbalance"][0].item() == pytest.approx(0.5 / 0.25)
    balanced = load_metrics(torch.full((1, 4), 5.0))
    assert balanced["imbalance"].item() == pytest.approx(1.0)
    assert balanced["entropy"].item() == pytest.approx(torch.log(torch.tensor(4.0)).item())


@pytest.mark.parametrize("experts,dtype", [(8, torch.uint8), (256, torch.uint8),
                                           (257, torch.int16), (512, torch.int16)])
def test_records_are_compact_and_round_trip(experts, dtype):
    g = torch.Generator().manual_seed(experts)
    idx = torch.rand(5, 3, experts, generator=g).argsort(-1)[..., :4]
    idx[0, 0, 0] = experts - 1  # the largest id must survive the compact type
    rec = RoutingRecord.from_indices(idx, experts)
    assert rec.experts_TLK.dtype == dtype == index_dtype(experts)
    back = RoutingRecord.decode(rec.encode())
    assert back.num_experts == experts and torch.equal(back.indices(), idx)
    assert int(back.indices().max()) == experts - 1  # no uint8 overflow above 256 experts


def test_record_errors():
    with pytest.raises(RoutingRecordError, match=r"outside \[0, 3\]"):
        RoutingRecord.from_indices(torch.tensor([[[0, 4]]]), 4)
    with pytest.raises(RoutingRecordError, match="tokens, moe_layers, top_k"):
        RoutingRecord.from_indices(torch.zeros(2, 2, dtype=torch.long), 4)
    rec = RoutingRecord.from_indices(torch.zeros(3, 2, 2, dtype=torch.long), 4)
    with pytest.raises(RoutingRecordError, match="2 MoE layers, the model has 3"):
        rec.check(num_layers=3, top_k=2, num_experts=4)
    with pytest.raises(RoutingRecordError, match="covers 3 tokens, the batch feeds 5"):
        padded_routes([rec], [5], 6)
    with pytest.raises(RoutingRecordError, match="cannot decode"):
        RoutingRecord.decode(b"not a record")


def test_slicing_padding_packing_sequence_parallel_and_stages():
    recs = [RoutingRecord.from_indices(torch.full((n, 2, 1), i), 8) for i, n in enumerate((3, 5))]
    padded = padded_routes(recs, [3, 5], 6)  # [B=2, S=6, L=2, K=1]
    assert padded[0, :3, :, 0].eq(0).all() and padded[1, :5, :, 0].eq(1).all()
    packed = packed_routes(recs, torch.tensor([0, 3, 8, 10]))  # trailing pad segment of 2
    assert packed[0, :3, 0, 0].eq(0).all() and packed[0, 3:8, 0, 0].eq(1).all()
    # Megatron's [s, b] order, then TP rank 1 of 2 keeps the second half of s.
    full = torch.arange(2 * 6).reshape(2, 6)[..., None, None].expand(2, 6, 2, 1)
    (layer0,) = rank_targets(full, layers=[0], tp=2, tp_rank=1, sequence_parallel=True)
    assert layer0[:, 0].tolist() == [3, 9, 4, 10, 5, 11]
    back = routes_from_rank(rank_targets(full, layers=[0, 1]), batch=2)
    assert torch.equal(back, full)
    assert local_moe_layers([0, 1, 1, 1], pp=2, pp_rank=0) == [0]
    assert local_moe_layers([0, 1, 1, 1], pp=2, pp_rank=1) == [1, 2]


SHORT_RUN = to_overrides(merge(SHORT, {"model": {"num_layers": 4}, "trainer": {"save_interval": 0}}))


def test_report_from_a_real_run(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "megatron_gspo", *SHORT_RUN,
                          f"hydra.run.dir={tmp_path / 'run_a'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run_a" / "drift_report.html").is_file()
    rows = [json.loads(x) for x in open(tmp_path / "run_a" / "drift.jsonl")]
    assert {r["kind"] for r in rows} == {"update", "rollout_train", "load", "ratio_noise"}
    noise = [r for r in rows if r["kind"] == "ratio_noise"]
    assert [r["step"] for r in noise] == [1, 2, 3]
    for r in noise:  # 4 MoE layers: tokens counted by 0..4 changed layers
        assert len(r["by_changed_layers"]) == len(r["tokens"]) == 5 and sum(r["tokens"]) > 0
        assert r["unchanged"] >= 0 and 0 <= r["changed_tokens"] <= 1
    metrics = [json.loads(x) for x in open(tmp_path / "run_a" / "metrics.jsonl")]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all("moe/drift/ratio_noise/changed_tokens" in m and "moe/drift/ratio_noise/unchanged"
               in m for m in steps)
    for m, r in zip(steps, noise):  # the step's metrics are the drift log's (undefined: left out)
        assert m["moe/drift/ratio_noise/changed_tokens"] == pytest.approx(r["changed_tokens"])
        assert ("moe/drift/ratio_noise/quotient" in m) == (r["quotient"] == r["quotient"])
    assert sorted({r["layer"] for r in rows if r["kind"] == "update"}, key=str) == \
        [0, 1, 2, 3, "mean"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run_a" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"moe/drift/update/layer_00", "moe/drift/update/mean", "moe/drift/update/tokens_changed",
            "moe/load/entropy/layer_03", "moe/load/max_share", "moe/drift/ratio_noise/unchanged",
            "moe/drift/ratio_noise/changed_tokens", "moe/drift/ratio_noise/by_changed_layers_00"
            } <= tags

    import shutil

    shutil.copytree(tmp_path / "run_a", tmp_path / "run_b")  # a second run to compare with
    out = tmp_path / "report.html"
    report = subprocess.run([sys.executable, "-m", "tools.drift_report", str(tmp_path / "run_a"),
                             str(tmp_path / "run_b"), "-o", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "run_a: mean update drift" in report.stdout
    page = out.read_text()
    assert page.count("data:image/png;base64,") >= 6  # mean curves, ratio noise, 2 x (heatmap + load)
    assert "Ratio noise" in page
    assert "update drift per layer" in page and "expert load" in page


def test_report_rejects_missing_and_corrupt_logs(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "tools.drift_report", str(tmp_path), "-o", str(tmp_path / "r.html")]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no drift.jsonl" in out.stderr
    (tmp_path / "drift.jsonl").write_text('{"step": 1, "kind": "update"}\n{broken\n')
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "drift.jsonl:2: corrupt drift log row" in out.stderr


def _drift_job(a, b, split):
    """Two ranks: ``split='tokens'`` halves the tokens (data/sequence parallel), ``'layers'``
    gives each rank half the layers (pipeline stages)."""
    import torch.distributed as dist

    from moe.instrument import drift_between, expert_load

    dist.init_process_group("gloo", init_method="env://")
    r = dist.get_rank()
    if split == "tokens":
        n = a[0].shape[0] // 2
        fa = [[x[r * n:(r + 1) * n] for x in a]]
        fb = [[x[r * n:(r + 1) * n] for x in b]]
        layers, pp_group = [0, 1, 2, 3], None
    else:
        fa, fb = [a[2 * r:2 * r + 2]], [b[2 * r:2 * r + 2]]
        layers, pp_group = [2 * r, 2 * r + 1], dist.group.WORLD
    drift = drift_between(fa, fb, local_layers=layers, num_moe_layers=4, pp_group=pp_group)
    load = expert_load(fa, local_layers=layers, num_moe_layers=4, num_experts=8)
    return drift, load


@pytest.mark.parametrize("split", ["tokens", "layers"])
def test_drift_reduction_over_ranks_equals_one_rank(split):
    from moe.instrument import drift_between, expert_load
    from tests.distributed import run_ranks

    g = torch.Generator().manual_seed(2)
    a = [torch.rand(10, 8, generator=g).argsort(-1)[:, :2] for _ in range(4)]
    b = [x.clone() for x in a]
    for layer, rows in enumerate(([1, 2], [], [2, 7], [9])):
        for row in rows:
            b[layer][row] = (b[layer][row] + 1) % 8
    ref = drift_between([a], [b], local_layers=[0, 1, 2, 3], num_moe_layers=4)
    assert ref["tokens_changed"].item() == pytest.approx(4 / 10)  # rows 1, 2, 7, 9
    assert ref["changed_fraction"].item() == pytest.approx(5 / 40)
    ref_load = expert_load([a], local_layers=[0, 1, 2, 3], num_moe_layers=4, num_experts=8)
    for drift, load in run_ranks(_drift_job, 2, a, b, split):
        for key in ("layers", "changed_fraction", "jaccard", "tokens_changed"):
            assert torch.allclose(drift[key], ref[key]), key
        assert torch.allclose(load["share"], ref_load["share"])


def test_rollout_train_mismatch_is_logged_and_reported(tmp_path):
    from moe.instrument import DriftLog, drift_between, expert_load, read_drift_log
    from moe.report import build_report, summarize

    g = torch.Generator().manual_seed(4)
    engine = [torch.rand(12, 8, generator=g).argsort(-1)[:, :2] for _ in range(2)]
    trainer = [e.clone() for e in engine]
    trainer[1][:3] = (trainer[1][:3] + 1) % 8  # 3 of 12 tokens routed differently in layer 1
    log = DriftLog(str(tmp_path))
    for step in (1, 2):
        log.drift(step, "rollout_train", drift_between([engine], [trainer], local_layers=[0, 1],
                                                       num_moe_layers=2))
        log.load(step, expert_load([trainer], local_layers=[0, 1], num_moe_layers=2,
                                   num_experts=8))
    rows = read_drift_log(str(tmp_path))
    mean = [r for r in rows if r["kind"] == "rollout_train" and r["layer"] == "mean"]
    assert mean[0]["changed_fraction"] == pytest.approx(3 / 24)
    assert mean[0]["tokens_changed"] == pytest.approx(3 / 12)
    assert summarize("r", rows)["rollout_train"] == pytest.approx(3 / 24)
    page, _ = build_report({"r": rows})
    assert "<td>0.1250</td>" in page  # the mismatch column of the summary table
    with pytest.raises(ValueError, match="drift kind"):
        log.drift(3, "sideways", {})
