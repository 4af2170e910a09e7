"""Loss and gradients do not depend on how sequences are sharded: context-parallel zigzag chunks
(CP = 1, 2, 4) and vocab-parallel logits (TP = 2), on real gloo ranks; CP sends O(sequences)."""

import pytest
import torch

from megatron_gspo.algorithms.losses import policy_loss
from tests.distributed import run_ranks
from tests.shard_workers import cp_loss_job, tp_loss_job
from tests.test_losses import batch, value_and_grad

ALGOS = ["gspo", "gspo_token", "grpo"]


@pytest.fixture(scope="module")
def data():
    return batch(11, b=6, t=16, spread=0.001, lengths=[16, 1, 0, 9, 5, 12])


@pytest.fixture(scope="module")
def cp_results(data):
    return {cp: run_ranks(cp_loss_job, cp, ALGOS, [data], cp, {}) for cp in (2, 4)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("algo", ALGOS)
def test_context_parallel_zigzag(data, cp_results, algo, cp):
    logp, old, adv, mask = data
    full_loss, full_grad = value_and_grad(lambda x: policy_loss(algo, x, old, adv, mask)[0], logp)
    _, full_metrics = policy_loss(algo, logp, old, adv, mask)
    ranks = [r[algo][0] for r in cp_results[cp]]
    covered = torch.zeros(logp.numel(), dtype=torch.bool)
    for r in ranks:
        assert abs(r["loss"].item() - full_loss.item()) <= 1e-12
        grad = r["grad"].reshape(-1)
        assert torch.allclose(grad[r["index"]], full_grad.reshape(-1)[r["index"]], atol=1e-12)
        others = torch.ones_like(covered)
        others[r["index"]] = False
        assert (grad[others] == 0).all()
        covered[r["index"]] = True
        for key in ("clip_fraction", "ratio_mean", "ratio_min", "ratio_max"):
            assert abs(r["metrics"][key].item() - full_metrics[key].item()) <= 1e-12, key
    assert covered.all()


def test_context_parallel_fp32(data):
    logp, old, adv, mask = (x.float() for x in data)
    full_loss, full_grad = value_and_grad(lambda x: policy_loss("gspo", x, old, adv, mask)[0], logp)
    for r in (x["gspo"][0] for x in run_ranks(cp_loss_job, 2, ["gspo"], [(logp, old, adv, mask)],
                                                2, {})):
        assert abs(r["loss"].item() - full_loss.item()) <= 1e-5
        assert (r["grad"].reshape(-1)[r["index"]] - full_grad.reshape(-1)[r["index"]]).abs().max() \
            <= 1e-5


def test_reduction_sends_values_per_sequence_not_per_token():
    batches = [batch(3, b=6, t=t, spread=0.001, lengths=[t, 1, 0, t // 2, 5, t]) for t in (16, 256)]
    results = run_ranks(cp_loss_job, 2, ALGOS, batches, 2, {})[0]
    for algo in ALGOS:
        short, long = (r["values_sent"] for r in results[algo])
        assert short == long, algo
        assert short <= 8 * 6 + 2  # K <= 8 statistics per sequence (+ 2 for the ratio min/max)


@pytest.mark.parametrize("algo", ALGOS)
def test_tensor_parallel_vocab_shards(algo):
    g = torch.Generator().manual_seed(4)
    b, t, v = 4, 6, 10
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (b, t), generator=g)
    _, old, adv, mask = batch(4, b=b, t=t, lengths=[6, 1, 0, 3])
    full = logits.clone().requires_grad_()
    ref = torch.log_softmax(full, -1).gather(-1, target[..., None])[..., 0]
    old = ref.detach() + 0.001 * torch.randn(b, t, generator=g, dtype=torch.float64)
    loss, _ = policy_loss(algo, ref, old, adv, mask)
    loss.backward()
    for rank, (tp_loss, grad) in enumerate(run_ranks(tp_loss_job, 2, algo, logits, target, old,
                                                     adv, mask)):
        assert abs(tp_loss.item() - loss.item()) <= 1e-12
        assert torch.allclose(grad, full.grad.chunk(2, -1)[rank], atol=1e-12)
