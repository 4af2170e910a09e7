"""SGLang at cluster scale, against stand-in servers that sample at random (or deterministically
from per-row seeds), have tensor-parallel ranks and take time per request:

- the whole batch in flight: batched requests, several at once, each retried alone on a fault;
- per-row seeds: a group's responses differ, a deterministic server repeats them;
- weight sync in buckets: ``distributed`` from an EP=2 trainer and ``tensor`` from a TP=2 trainer
  to a TP=2 server (full HF tensors per rank, or each rank only its shards in SGLang's layout)
  leave the server generating as after loading the same checkpoint from disk, with the extra
  memory of a sync measured against the bucket size;
- the trainer on TP=2+SP, PP=2, CP=2 and DP=2 layouts: one leader per replica talks to SGLang and
  every rank of a replica trains on the same token ids.
"""

import math

import pytest

from megatron_gspo.rollout.sglang.client import RetryPolicy, SGLangClient, SGLangError
from megatron_gspo.rollout.sglang.engine import SGLangEngine
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import run_ranks
from tests.model_workers import tiny_model_config
from tests.sglang_standin import sglang_param_shapes, start

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52]]
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


def _serve(hf_dir, **kw):
    url, proc = start(hf_dir, **kw)
    yield url
    proc.kill()
    proc.join()


@pytest.fixture(scope="module")
def random_tp2(tiny_hf_checkpoint):
    """Samples from its own RNG (seeds ignored), two TP ranks, 20 ms per request."""
    yield from _serve(tiny_hf_checkpoint, tp=2, latency_s=0.02)


@pytest.fixture(scope="module")
def deterministic(tiny_hf_checkpoint):
    yield from _serve(tiny_hf_checkpoint, deterministic=True)


def engine(url, **kw):
    kw.setdefault("retry", RetryPolicy(attempts=3, backoff_s=0.05, timeout_s=1.5,
                                       generate_timeout_s=1.5, update_timeout_s=30))
    return SGLangEngine([url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3], **kw)


def stats(url, reset=False):
    client = SGLangClient(url)
    if reset:
        client.post("/_reset_stats")
    return client.request("GET", "/_stats")


def responses(samples, group):
    return [[s.response_ids for s in samples[i:i + group]] for i in range(0, len(samples), group)]


def test_the_batch_is_in_flight_at_once(random_tp2):
    stats(random_tp2, reset=True)
    samples = engine(random_tp2, rows_per_request=4, max_in_flight=6).generate(PROMPTS, 4, SAMPLED)
    assert [s.prompt_index for s in samples] == [i for i in range(6) for _ in range(4)]
    assert all(s.prompt_ids == PROMPTS[s.prompt_index] for s in samples)
    seen = stats(random_tp2)
    assert seen["generate_requests"] == 6 and seen["rows"] == 24  # 24 rows in requests of 4
    assert seen["max_in_flight"] >= 2
    # Requests that wait together decode together (the server's continuous batching).
    assert sum(seen["batches"]) == 24 and len(seen["batches"]) < 6, seen["batches"]


def test_a_random_server_gives_every_group_distinct_responses(random_tp2):
    e = engine(random_tp2, rows_per_request=8)
    first = responses(e.generate(PROMPTS, 4, SAMPLED), 4)
    for group in first:
        assert len({tuple(r) for r in group}) > 1, group
    assert first != responses(e.generate(PROMPTS, 4, SAMPLED), 4)  # the seed is not honoured


def test_per_row_seeds_differ_within_a_group_and_repeat(deterministic):
    e = engine(deterministic, rows_per_request=5, max_in_flight=3)
    first = e.generate(PROMPTS, 4, SAMPLED)
    for group in responses(first, 4):
        assert len({tuple(r) for r in group}) > 1, group
    again = e.generate(PROMPTS, 4, SAMPLED)  # other request boundaries, same rows
    assert [s.response_ids for s in again] == [s.response_ids for s in first]
    assert all((a.logprobs_R == b.logprobs_R).all() for a, b in zip(first, again))
    # Rows 8.. of the batch, generated alone from their global row index, repeat too.
    tail = engine(deterministic).generate(PROMPTS[2:], 4, SAMPLED, first_row=8)
    assert [s.response_ids for s in tail] == [s.response_ids for s in first[8:]]
    # One seed for the whole request (SGLang's sampling_seed on every row) gives G copies.
    reply = SGLangClient(deterministic).generate([PROMPTS[0]] * 4, SAMPLED)
    assert len({tuple(item["output_ids"]) for item in reply}) == 1


@pytest.mark.parametrize("mode", ["500", "hang", "drop", "malformed"])
def test_a_failed_request_is_retried_alone(random_tp2, mode):
    stats(random_tp2, reset=True)
    SGLangClient(random_tp2).post("/_fault", {"mode": mode, "count": 1})
    samples = engine(random_tp2, rows_per_request=4, max_in_flight=4).generate(PROMPTS[:4], 4,
                                                                            SAMPLED)
    assert len(samples) == 16
    seen = stats(random_tp2)
    # Five POSTs reached the server (four requests and one retry); the three that succeeded
    # the first time were not sent again: exactly 16 rows were generated.
    assert seen["generate_posts"] == 5
    assert seen["generate_requests"] == 4 and seen["rows"] == 16


def test_weight_sync_in_buckets(random_tp2, deterministic, tiny_hf_checkpoint,
                                perturbed_checkpoint, tmp_path):
    from tests.sglang_standin import trainer_sync_job

    perturbed = perturbed_checkpoint[0]
    expected = {}
    for url in (random_tp2, deterministic):
        e = engine(url)
        e.update_weights_from_disk(perturbed)
        expected[url] = [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)]
        e.update_weights_from_disk(tiny_hf_checkpoint)
        assert [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)] != expected[url]
    bucket = 160_000
    tp2 = dict(tp=2, sequence_parallel=True)
    cases = [dict(url=deterministic, parallel=dict(ep=2), mode="distributed", bucket_bytes=bucket),
             dict(url=random_tp2, parallel=tp2, mode="tensor", server_tp=2, bucket_bytes=bucket),
             dict(url=random_tp2, parallel=tp2, mode="tensor", server_tp=1, bucket_bytes=bucket),
             dict(url=random_tp2, parallel=tp2, mode="tensor", server_tp=2, bucket_bytes=bucket,
                  direct=True, reset_stats=True)]
    ranks = run_ranks(trainer_sync_job, 2, perturbed, cases, PROMPTS)
    dist_ranks = [r[:1] for r in ranks]
    tensor_ranks = [r[1:3] for r in ranks]
    direct_ranks = [r[3] for r in ranks]

    # EP=2 -> buckets broadcast over the weight-update group -> the server's weights.
    lead = dist_ranks[0][0]
    assert lead["error"] is None and lead["outputs"] == expected[deterministic]
    sent = lead["stats"]
    assert sent.buckets >= 3 and sent.bytes > 2 * bucket
    for rank in dist_ranks:  # the extra memory of a sync: about two buckets, never the model
        assert rank[0]["peak"] <= 2.5 * bucket, (rank[0]["peak"], bucket, sent.bytes)
    assert max(r[0]["peak"] for r in dist_ranks) < sent.bytes / 1.5

    # TP=2 -> one serialized payload per server TP rank -> the server's weights.
    ok, one_payload = tensor_ranks[0]
    assert ok["error"] is None and ok["outputs"] == expected[random_tp2]
    assert ok["stats"].buckets >= 3
    assert set(stats(random_tp2)["tensor_payloads"]) == {2}
    for rank in tensor_ranks:
        assert rank[0]["peak"] <= 2.5 * bucket, (rank[0]["peak"], bucket)
    # A single payload (today's SGLang client before per-rank payloads) fails on TP rank 1.
    assert "HTTP 500" in one_payload["error"] and "tp rank 1" in one_payload["error"]

    # load_format "direct": each TP rank's payload holds only its own shards, in SGLang's names
    # and per-rank shapes; every parameter of the rank arrived exactly once.
    lead = direct_ranks[0]
    assert lead["error"] is None and lead["outputs"] == expected[random_tp2]
    assert lead["stats"].buckets >= 3
    for rank in direct_ranks:
        assert rank["peak"] <= 2.5 * bucket, (rank["peak"], bucket)
    shapes = sglang_param_shapes(tiny_model_config(tiny_hf_checkpoint), 2)
    received = stats(random_tp2)["rank_tensors"]
    assert sorted(received) == ["0", "1"]
    model_bytes = sum(t.numel() * t.element_size() for t in perturbed_checkpoint[1].values())
    for got in received.values():
        assert got == {name: 4 * math.prod(shape) for name, shape in shapes.items()}
        assert sum(got.values()) < 0.6 * model_bytes  # its share, not the model
    assert lead["stats"].bytes == sum(sum(got.values()) for got in received.values())
    assert ok["stats"].bytes == model_bytes  # hf: each bucket once, its payload sent per rank
    for url in (random_tp2, deterministic):
        engine(url).update_weights_from_disk(tiny_hf_checkpoint)


def test_trainer_layouts_with_sglang(random_tp2, deterministic, tiny_hf_checkpoint, tmp_path):
    """TP=2+SP (distributed sync, R3 routes from the server), PP=2 (distributed sync), CP=2
    (disk sync): 2 RL steps each; then the same DP=2 run twice against a deterministic
    server."""
    from tests.sglang_workers import job, sglang_jobs

    hf = tiny_hf_checkpoint
    jobs = [
        job(hf, random_tp2, str(tmp_path / "tp2"), parallel={"tp": 2, "sequence_parallel": True},
            rollout={"weight_sync": "distributed", "sglang_gpus_per_server": 1,
                     "weight_sync_port": 0, "return_routes": True},
            replay={"mode": "r3"}),
        job(hf, deterministic, str(tmp_path / "pp2"), parallel={"pp": 2},
            rollout={"weight_sync": "distributed", "sglang_gpus_per_server": 1,
                     "weight_sync_port": 0}),
        job(hf, random_tp2, str(tmp_path / "cp2"), parallel={"cp": 2},
            rollout={"weight_sync": "disk"}),
        job(hf, deterministic, str(tmp_path / "dp2_a"), rollout={"weight_sync": "disk"}),
        job(hf, deterministic, str(tmp_path / "dp2_b"), rollout={"weight_sync": "disk"}),
    ]
    ranks = run_ranks(sglang_jobs, 2, jobs, timeout=600)
    names = ["tp2", "pp2", "cp2", "dp2_a", "dp2_b"]
    for j, name in enumerate(names):
        per_rank = [r[j]["steps"] for r in ranks]
        assert [len(s) for s in per_rank] == [2, 2], name
        rows = [r for r in ranks[0][j]["rows"] if "train/loss" in r]
        assert [r["step"] for r in rows] == [1, 2], name
        for r in rows:
            assert r["minibatch/ratio_mean"][0] == 1.0 and r["minibatch/clip_fraction"][0] == 0.0
            # the server generates with the weights the trainer pushed: the same log-probs and
            # (R3 / drift) routes
            assert r["rollout/logprob_mismatch"] < 1e-4, name
            if name == "tp2":
                assert r["moe/drift/rollout_train/mean"] < 0.05
        if name.startswith("dp2"):
            continue
        # One replica: both ranks trained on bitwise-identical token ids, every step.
        for a, b in zip(*per_rank):
            assert a["tokens"] == b["tokens"], name
            assert a["responses"] == b["responses"], name
        for step in per_rank[0]:
            for group in [step["responses"][i:i + 4] for i in range(0, 16, 4)]:
                assert len({tuple(r) for r in group}) > 1, (name, group)
    # DP=2: two replicas, each with its own leader and its own half of the prompts.
    a, b = ([r[j]["steps"] for r in ranks] for j in (3, 4))
    for step in range(2):
        assert a[0][step]["prompts"] != a[1][step]["prompts"]
        # The deterministic server repeats the run exactly (per-row seeds, same weights).
        assert [r[step]["responses"] for r in a] == [r[step]["responses"] for r in b]
    assert ([r["rollout/reward_mean"] for r in ranks[0][3]["rows"] if "train/loss" in r]
            == [r["rollout/reward_mean"] for r in ranks[0][4]["rows"] if "train/loss" in r])


def test_sampling_params_are_checked_before_any_request():
    e = SGLangEngine(["http://127.0.0.1:1"], num_hidden_layers=4, top_k=2, moe_layers=[1])
    with pytest.raises(ValueError, match="top_p"):
        e.generate(PROMPTS, 2, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="rows_per_request=0"):
        SGLangEngine(["http://x"], num_hidden_layers=4, top_k=2, moe_layers=[1],
                     rows_per_request=0)


def test_a_wrong_reply_count_is_an_error(deterministic):
    client = SGLangClient(deterministic)
    with pytest.raises(ValueError, match="2 seeds for 1 rows"):
        client.generate([PROMPTS[0]], SAMPLED, seeds=[1, 2])
    with pytest.raises(SGLangError, match="HTTP 400"):
        client.post("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]})


def test_replica_leaders_spread_requests_over_every_server(random_tp2, deterministic):
    """Each replica's leader starts at its own server (``first_server`` = its data-parallel
    rank) and goes round the servers across calls, not from server 0 in every call."""
    urls = [random_tp2, deterministic]

    def counts():
        return [stats(u)["generate_requests"] for u in urls]

    def leader(dp_rank):
        return SGLangEngine(urls, num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                            rows_per_request=4, first_server=dp_rank)

    one_request = (PROMPTS[:1], 4, SAMPLED)  # 4 rows: one request
    for dp_rank, expected in ((0, [1, 0]), (1, [0, 1]), (2, [1, 0]), (3, [0, 1])):
        before = counts()
        leader(dp_rank).generate(*one_request)
        assert [a - b for a, b in zip(counts(), before)] == expected, dp_rank
    e = leader(1)
    before = counts()
    for _ in range(4):  # across calls: 1, 0, 1, 0
        e.generate(*one_request)
    assert [a - b for a, b in zip(counts(), before)] == [2, 2]
    before = counts()
    e.generate(PROMPTS[:3], 4, SAMPLED)  # 12 rows: three requests in one call, next at server 1
    assert [a - b for a, b in zip(counts(), before)] == [1, 2]
