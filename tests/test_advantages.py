import pytest
import torch

from megatron_gspo.algorithms.advantages import group_advantages, informative_groups


def test_matches_formula():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0], dtype=torch.float64)
    adv = group_advantages(r, 3)
    for g in range(2):
        x = r[3 * g:3 * g + 3]
        expected = (x - x.mean()) / (x.std() + 1e-6)
        assert torch.allclose(adv[3 * g:3 * g + 3], expected)
    assert torch.allclose(group_advantages(r, 3, scale=False),
                          r - r.reshape(2, 3).mean(1).repeat_interleave(3))


def test_zero_variance_and_single_member_groups_are_finite_zero():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert torch.equal(group_advantages(r, 3), torch.zeros(6))
    assert torch.equal(group_advantages(r, 1), torch.zeros(6))
    assert torch.isfinite(group_advantages(torch.tensor([3.0]), 1)).all()


def test_informative_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    assert informative_groups(r, 2).tolist() == [False, False, True, True, False, False]


@pytest.mark.parametrize("rewards,group", [(torch.zeros(5), 2), (torch.zeros(2, 2), 2),
                                           (torch.zeros(4), 0)])
def test_wrong_shapes_fail_clearly(rewards, group):
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(rewards, group)


def test_overlong_penalty_is_dapos_linear_ramp():
    from megatron_gspo.algorithms.advantages import overlong_penalty

    # limit 8, buffer 4: free up to 4 tokens, then -1/4 per token, -1 at 8 and beyond
    got = overlong_penalty(torch.tensor([0, 4, 5, 6, 7, 8, 9]), 8, 4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer 9"):
        overlong_penalty(torch.tensor([1]), 8, 9)


def test_select_groups_keeps_informative_groups_in_order():
    from megatron_gspo.algorithms.advantages import informative_groups, select_groups

    rewards = torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 0])  # groups of 2: [1,1] [0,1] [0,0] [1,0]
    keep, drop = select_groups(informative_groups(rewards, 2), 2, wanted=5)
    assert keep == [1, 3] and drop == [0, 2]
    keep, drop = select_groups(informative_groups(rewards, 2), 2, wanted=1)
    assert keep == [1] and drop == [0, 2, 3]
