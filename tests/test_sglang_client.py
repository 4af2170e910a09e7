"""The SGLang client against a stand-in server on loopback that implements SGLang's endpoints and
payloads over the local engine: generation with log-probs and routed experts, weight sync from
disk and over a process group, memory release / resume, and faults (hang, HTTP 500, dropped
connection, malformed JSON) with bounded retries."""

import os
import socket
import time

import pytest

from megatron_gspo.rollout.sglang.engine import SGLangEngine
from megatron_gspo.rollout.sglang.facade import HAVE_SGLANG
from megatron_gspo.rollout.sglang.client import (RetryPolicy, SGLangClient, SGLangError,
                                                 decode_routes)
from megatron_gspo.rollout.sglang.weight_sync import (destroy_weights_update_group,
                                                       init_weights_update_group)
from megatron_gspo.rollout.sglang.facade import launch_server
from megatron_gspo.rollout.types import SamplingParams
from tests.sglang_standin import start

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def server(tiny_hf_checkpoint):
    url, proc = start(tiny_hf_checkpoint)
    yield url
    proc.kill()
    proc.join()


def engine(url, **kw):
    # tiny HF model: 4 layers, the first dense; top-2
    return SGLangEngine([url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                        retry=RetryPolicy(attempts=3, backoff_s=0.05, timeout_s=1.5,
                                          generate_timeout_s=1.5, update_timeout_s=30), **kw)


def test_generate_with_logprobs_and_routes(server):
    e = engine(server, return_routes=True)
    assert e.health()
    samples = e.generate(PROMPTS, 2, GREEDY)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    for s in samples:
        assert len(s.response_ids) == 5 and s.finish_reason == "length"
        assert (s.logprobs_R <= 0).all()
        assert s.routes_TLK.shape == (len(s.prompt_ids) + 4, 3, 2)
        assert int(s.routes_TLK.min()) >= 0 and int(s.routes_TLK.max()) < 4
    assert samples[0].response_ids == samples[1].response_ids  # greedy


def test_weight_sync_from_disk(server, tiny_hf_checkpoint, perturbed_checkpoint):
    e = engine(server)
    before = [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)]
    e.update_weights_from_disk(perturbed_checkpoint[0])
    after = [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)]
    assert after != before
    info = SGLangClient(server).request("GET", "/model_info")
    assert info["weight_version"] == "1"
    e.update_weights_from_disk(tiny_hf_checkpoint)
    assert [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)] == before
    with pytest.raises(SGLangError, match="HTTP 400"):
        e.update_weights_from_disk("/nonexistent/checkpoint")
    assert [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)] == before  # old weights kept


@pytest.fixture
def closed_port():
    """A port nothing listens on, held (bound, not listening) for the test: connections to it
    are refused and no other process can take it meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_weight_sync_over_a_process_group(server, tiny_hf_checkpoint, perturbed_checkpoint):
    e = engine(server)
    e.update_weights_from_disk(perturbed_checkpoint[0])
    expected = [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)]
    e.update_weights_from_disk(tiny_hf_checkpoint)
    group = init_weights_update_group(e, master_address="127.0.0.1", master_port=0,
                                      engine_gpus=[1], backend="gloo", timeout_s=60)
    e.update_weights_from_distributed(sorted(perturbed_checkpoint[1].items()), group)
    assert [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)] == expected
    destroy_weights_update_group(e, group)
    e.update_weights_from_disk(tiny_hf_checkpoint)


def test_a_server_that_cannot_join_the_group_fails_it_at_once(server):
    """The refusal ends rank 0's wait in the rendezvous (600 s here) at once, and no group is
    left under the name: the next one builds."""
    client = SGLangClient(server)
    client.post("/_fault", {"mode": "500", "count": 100})
    try:
        start = time.monotonic()
        with pytest.raises(SGLangError, match="a server did not join: .*HTTP 500"):
            init_weights_update_group(engine(server), master_address="127.0.0.1",
                                      master_port=0, engine_gpus=[1], backend="gloo",
                                      timeout_s=600)
        assert time.monotonic() - start < 60  # (not a speed check: the wait would be 600 s)
    finally:
        client.post("/_fault", {"mode": "500", "count": 0})
    e = engine(server)
    group = init_weights_update_group(e, master_address="127.0.0.1", master_port=0,
                                      engine_gpus=[1], backend="gloo", timeout_s=60)
    destroy_weights_update_group(e, group)


def test_a_weight_sync_port_in_use_is_named(server):
    """The trainer listens before any server is asked to join: a port held by another process
    is a one-line error that names the setting."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SGLangError, match=rf"cannot listen on port {port} \(.*EADDRINUSE.*"
                           r"set rollout.weight_sync_port to a free port, or 0 for any"):
            init_weights_update_group(engine(server), master_address="127.0.0.1",
                                      master_port=port, engine_gpus=[1], backend="gloo",
                                      timeout_s=60)


def test_memory_release_and_resume(server):
    e = engine(server)
    e.release_memory()
    e.resume_memory(["weights"])
    e.resume_memory(["kv_cache", "cuda_graph"])
    assert e.health()


@pytest.mark.parametrize("mode", ["500", "hang", "drop", "malformed"])
def test_faults_are_retried_then_reported(server, mode):
    client = SGLangClient(server)
    client.post("/_fault", {"mode": mode, "count": 1})
    e = engine(server)
    assert len(e.generate(PROMPTS[:1], 1, GREEDY)) == 1  # one failure: the retry succeeds
    client.post("/_fault", {"mode": mode, "count": 3})
    with pytest.raises(SGLangError) as info:
        e.generate(PROMPTS[:1], 1, GREEDY)
    message = str(info.value)
    assert "/generate failed after 3 attempts" in message
    expected = {"500": "HTTP 500", "hang": "timed out", "drop": "",
                "malformed": "malformed JSON"}[mode]
    assert expected in message
    assert len(e.generate(PROMPTS[:1], 1, GREEDY)) == 1  # healthy again


def test_bad_requests_are_not_retried(server):
    client = SGLangClient(server, RetryPolicy(attempts=3, backoff_s=0.05, timeout_s=5))
    with pytest.raises(SGLangError, match="HTTP 400"):
        client.post("/generate", {"text": "no ids"})


def test_unreachable_server(closed_port):
    e = SGLangEngine([f"http://127.0.0.1:{closed_port}"], num_hidden_layers=4, top_k=2,
                     moe_layers=[1, 2, 3], retry=RetryPolicy(attempts=2, backoff_s=0.01,
                                                             timeout_s=0.5))
    assert not e.health()
    with pytest.raises(SGLangError, match=r"failed after 2 attempts: .*(Connection refused|Errno)"):
        e.generate(PROMPTS, 1, GREEDY)


def test_routes_decoding_checks_sizes():
    import base64

    import numpy as np

    blob = base64.b64encode(np.arange(2 * 4 * 2, dtype=np.int32).tobytes()).decode()
    routes = decode_routes(blob, 2, 4, 2, [1, 3])
    assert routes.tolist() == [[[2, 3], [6, 7]], [[10, 11], [14, 15]]]
    with pytest.raises(SGLangError, match="expected 3 x 4 x 2"):
        decode_routes(blob, 3, 4, 2, [1])


@pytest.mark.skipif(HAVE_SGLANG, reason="sglang is installed")
def test_missing_sglang_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install -e \.\[rollout\]"):
        launch_server("/models/x", port=30000)


def test_router_registration_and_generation(server):
    from tests.sglang_standin import start_router

    router_url, proc = start_router()
    try:
        e = engine(server, router_url=router_url)
        workers = SGLangClient(router_url).request("GET", "/workers")["workers"]
        assert [w["url"] for w in workers] == [server]
        engine(server, router_url=router_url)  # registering again adds nothing
        assert len(SGLangClient(router_url).request("GET", "/workers")["workers"]) == 1
        via_router = [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)]
        direct = [s.response_ids for s in engine(server).generate(PROMPTS, 1, GREEDY)]
        assert via_router == direct
    finally:
        proc.kill()
        proc.join()


def test_sync_from_a_megatron_layout(server, tiny_hf_checkpoint, perturbed_checkpoint, tmp_path):
    from tests.distributed import run_ranks
    from tests.sglang_standin import trainer_sync_job

    e = engine(server)
    e.update_weights_from_disk(perturbed_checkpoint[0])
    expected = [s.response_ids for s in e.generate(PROMPTS, 1, GREEDY)]
    e.update_weights_from_disk(tiny_hf_checkpoint)
    cases = [dict(url=server, parallel=dict(ep=2), mode="disk", disk_dir=str(tmp_path / "sync"),
                  bucket_bytes=100_000)]
    [result], [other] = run_ranks(trainer_sync_job, 2, perturbed_checkpoint[0], cases, PROMPTS)
    assert result["error"] is None and other["error"] is None
    assert result["outputs"] == expected  # EP=2 trainer -> HF names -> shards on disk -> server
    assert result["stats"].buckets > 1 and len(os.listdir(tmp_path / "sync")) == \
        result["stats"].buckets + 2  # one shard per bucket, the index, config.json
    e.update_weights_from_disk(tiny_hf_checkpoint)


def test_weight_updates_are_sent_once_and_generation_is_retried(server):
    """A failed weight-update call is not repeated (a second /update_weights_from_distributed
    would wait for a broadcast that never comes); /generate and control calls are retried; each
    kind of call has its own timeout."""
    client = SGLangClient(server)
    before = client.request("GET", "/_stats")["posts"].get("/update_weights_from_disk", 0)
    client.post("/_fault", {"mode": "500", "count": 1})
    e = engine(server)
    with pytest.raises(SGLangError, match=r"update_weights_from_disk failed \(a weight update is "
                                          r"sent once, never retried\): HTTP 500"):
        e.clients[0].post("/update_weights_from_disk", {"model_path": "/x"})
    posts = client.request("GET", "/_stats")["posts"]
    assert posts["/update_weights_from_disk"] == before + 1
    policy = RetryPolicy(timeout_s=7, generate_timeout_s=3600, update_timeout_s=900)
    c = SGLangClient(server, policy)
    assert c._policy("/generate") == (4, 3600)
    assert c._policy("/update_weights_from_distributed") == (1, 900)
    assert c._policy("/init_weights_update_group") == (1, 900)
    assert c._policy("/pause_generation") == (4, 7)
    client.post("/_fault", {"mode": "500", "count": 1})  # the generation's retry succeeds
    assert len(e.generate(PROMPTS[:1], 1, GREEDY)) == 1


def test_wait_ready_gives_up_with_the_server_named(closed_port):
    e = SGLangEngine([f"http://127.0.0.1:{closed_port}"], num_hidden_layers=4, top_k=2,
                     moe_layers=[1, 2, 3], retry=RetryPolicy(timeout_s=0.2))
    with pytest.raises(SGLangError, match=r"127\.0\.0\.1:\d+: not ready after 0\.3 s"):
        e.wait_ready(0.3)


def test_the_server_reports_its_checkpoint(server, tiny_hf_checkpoint):
    assert engine(server).model_paths() == {server: tiny_hf_checkpoint}

