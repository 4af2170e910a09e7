"""Context parallelism on real gloo ranks: the zigzag split of padded and packed rows, log-probs,
one RL update of every algorithm (and R2 / R3) and one supervised update equal to one rank, and the
GSPO reduction's traffic over the CP group independent of the sequence length."""

import pytest
import torch

from megatron_gspo.batch.micro_batch import MicroBatch
from megatron_gspo.distributed.seqshard import pack_sequences, zigzag_index
from tests.cp_workers import cp_job
from tests.distributed import run_ranks


def test_zigzag_split_of_a_micro_batch():
    tokens = torch.arange(16)[None].repeat(2, 1)
    mb = MicroBatch(tokens, tokens + 100, old_logp_BS=tokens.float(), loss_mask_BS=tokens.float(),
                    advantages_B=torch.tensor([1.0, -1.0]))
    r0, r1 = mb.for_cp_rank(2, 0), mb.for_cp_rank(2, 1)
    assert r0.tokens_BS[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # chunks 0 and 3 of 4
    assert r1.tokens_BS[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2
    assert r1.targets_BS[0].tolist() == [104, 105, 106, 107, 108, 109, 110, 111]
    assert r0.position_ids_BS[0].tolist() == r0.tokens_BS[0].tolist()  # global positions
    assert torch.equal(r0.advantages_B, mb.advantages_B)
    assert mb.for_cp_rank(1, 0) is mb
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        MicroBatch(tokens[:, :14], tokens[:, :14]).for_cp_rank(4, 0)


def test_packed_zigzag_takes_each_sequence_in_chunks():
    packed = pack_sequences([torch.arange(9), torch.arange(5)], seq_multiple_of=4)
    assert packed.cu_seqlens.tolist() == [0, 8, 12]
    mb = MicroBatch(packed.tokens_1N, packed.targets_1N, packed.position_ids_1N,
                    cu_seqlens=packed.cu_seqlens)
    assert mb.cp_index(2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert mb.cp_index(2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert packed.valid_N.tolist() == [True] * 8 + [True] * 4 and packed.seq_N.tolist()[8:] == [1] * 4
    assert zigzag_index(6, 1, 0).tolist() == list(range(6))


def _logprob_inputs():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 128, (4, 17), generator=g)
    sequences = [torch.randint(0, 128, (n,), generator=g) for n in (9, 14, 6)]
    return tokens, sequences


def _update_inputs(width=17):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (4, width), generator=g)
    mask = torch.zeros(4, width - 1)
    mask[:, 5:] = 1.0
    mask[1, width - 5:] = 0.0  # a shorter response
    # Rows 0 and 2 stay inside GSPO's clip range, rows 1 and 3 leave it.
    scale = torch.tensor([1e-5, 0.05, 2e-5, 0.05])[:, None]
    delta = scale * torch.randn(4, width - 1, generator=g) * mask
    adv = torch.tensor([1.0, -0.5, -0.7, 1.2])
    return tokens, delta, adv, mask


ARMS = [("gspo", "none"), ("gspo_token", "none"), ("grpo", "none"), ("grpo", "r2"),
        ("grpo", "r3")]


@pytest.fixture(scope="module")
def runs(tiny_hf_checkpoint):
    """Log-probs, every arm's update at width 17 and GSPO's at width 33: 1 rank and CP=2."""
    cases = [(*_update_inputs(), algo, replay) for algo, replay in ARMS]
    cases.append((*_update_inputs(33), "gspo", "none"))
    one = run_ranks(cp_job, 1, tiny_hf_checkpoint, {}, _logprob_inputs(), cases)[0]
    two = run_ranks(cp_job, 2, tiny_hf_checkpoint, {"cp": 2}, _logprob_inputs(), cases)
    return one, two


def test_logprobs_with_cp2_equal_one_rank(runs):
    one, two = runs
    sequences = _logprob_inputs()[1]
    for rank in two:
        padded, packed = rank["logprobs"]
        assert padded.shape == one["logprobs"][0].shape == (4, 16)
        torch.testing.assert_close(padded, one["logprobs"][0], rtol=0, atol=1e-5)
        assert packed.shape == one["logprobs"][1].shape == (sum(len(s) - 1 for s in sequences),)
        torch.testing.assert_close(packed, one["logprobs"][1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arm", range(len(ARMS)), ids=[f"{a}-{r}" for a, r in ARMS])
def test_one_update_with_cp2_equals_one_rank(runs, arm):
    one, two = runs[0]["updates"][arm], [rank["updates"][arm] for rank in runs[1]]
    assert one["grad_norm"] > 0 and abs(one["metrics"]["policy_loss"]) > 0
    for rank in two:
        for key in ("loss", "policy_loss", "aux_loss", "clip_fraction", "ratio_mean", "entropy"):
            assert rank["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
        assert rank["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        torch.testing.assert_close(rank["after"], one["after"], rtol=1e-5, atol=1e-5)


def test_supervised_update_with_cp2_equals_one_rank(runs):
    one = runs[0]["sft"]
    assert one["loss"] > 0
    for rank in runs[1]:
        assert rank["sft"]["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert rank["sft"]["accuracy"] == one["accuracy"]
        torch.testing.assert_close(rank["sft"]["after"], one["after"], rtol=1e-5, atol=1e-5)


def test_gspo_reduction_sends_per_sequence_values_only(runs):
    updates = runs[1][0]["updates"]
    short, long = updates[0], updates[-1]  # GSPO at 16 and 32 tokens per row
    assert long["after"].shape[1] == 2 * short["after"].shape[1]
    # Two micro-batches of 2 sequences, 4 statistics each: 16 values, whatever the length.
    assert short["values_sent"] == long["values_sent"] == 16
