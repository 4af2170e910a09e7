"""The Hydra config tree: every option of every group composes (alone and in pairs with every
option of the other groups), and invalid values or combinations fail before any work starts with
one line naming the key and the fix."""

import itertools
import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megatron_gspo import TORCH_MIN
from megatron_gspo.__main__ import check_group_choices, check_torch, entry
from megatron_gspo.algorithms.behaviour import behaviour_source
from megatron_gspo.config import ConfigError
from megatron_gspo.config.load import job_from_dict, register_configs

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
GROUPS = ["model", "parallel", "algo", "rollout", "replay", "data", "trainer", "logging", "cluster"]
# Options that need values only the user has (servers, files), filled in for checks; the
# checkpoint SGLang serves (and the trainer starts from) is filled in by ``validate``.
FILL = {"rollout=sglang": ["rollout.sglang_urls=[http://127.0.0.1:30000]"],
        "data=files": ["data.files=[prompts.jsonl]"]}


def options(group):
    return sorted(f[:-5] for f in os.listdir(os.path.join(CONF, group)) if f.endswith(".yaml"))


@pytest.fixture(scope="module")
def composer():
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        def make(overrides):
            cfg = compose("config", overrides=[*overrides, "run_dir=."])
            data = OmegaConf.to_container(cfg, resolve=False)
            data.pop("hydra", None)
            return data
        yield make


def fill(overrides):
    out = list(overrides)
    for o in overrides:
        out += FILL.get(o, [])
    return out


SERVED = {}  # model section -> a directory holding its HF config.json (no weights)


def served_checkpoint(model: dict) -> str:
    """A directory with a config.json of ``model``'s shape: what SGLang servers of a job serve."""
    import json
    import tempfile

    from megatron_gspo.config import ModelConfig
    from megatron_gspo.models.hf_config import hf_config_from_model

    key = json.dumps(model, sort_keys=True)
    if key not in SERVED:
        SERVED[key] = tempfile.mkdtemp(prefix="served_")
        with open(os.path.join(SERVED[key], "config.json"), "w") as f:
            json.dump(hf_config_from_model(ModelConfig(**model)), f)
    return SERVED[key]


def validate(data):
    """What the trainer checks before it starts (files are only opened later). A job with
    SGLang servers trains the checkpoint they serve."""
    rollout = data.get("rollout") or {}
    if data["model"].get("name") == "from_checkpoint" and not data["trainer"].get("init_from"):
        data["trainer"]["init_from"] = served_checkpoint({})  # the model's shape comes from it
    if rollout.get("engine") == "sglang" and not rollout.get("sglang_model_path"):
        path = data["trainer"].get("init_from") or served_checkpoint(data["model"])
        data["rollout"]["sglang_model_path"] = path
        data["trainer"]["init_from"] = path
    return job_from_dict(data)


def test_every_group_has_options_and_a_schema():
    for group in GROUPS:
        assert options(group), group


@pytest.mark.parametrize("group", GROUPS)
def test_each_option_composes_and_validates(composer, group):
    for option in options(group):
        data = composer(fill([f"{group}={option}"]))
        job = validate(data)
        assert job is not None


def pairwise_configs():
    """Few configurations that together hold every pair of options of two different groups
    (a greedy covering array): every option of every group meets every option of the others."""
    uncovered = {((g1, o1), (g2, o2)) for g1, g2 in itertools.combinations(GROUPS, 2)
                 for o1 in options(g1) for o2 in options(g2)}
    configs = []
    while uncovered:
        (g1, o1), (g2, o2) = min(uncovered)
        chosen = {g1: o1, g2: o2}
        for g in GROUPS:
            if g in chosen:
                continue
            def gain(o):
                return sum(((a, chosen[a]), (g, o)) in uncovered or ((g, o), (a, chosen[a]))
                           in uncovered for a in chosen)
            chosen[g] = max(options(g), key=gain)
        uncovered -= {((a, chosen[a]), (b, chosen[b])) for a, b in itertools.combinations(GROUPS, 2)}
        configs.append(chosen)
    return configs


def test_every_pair_of_group_options_composes(composer):
    configs = pairwise_configs()
    assert len(configs) < 60
    for chosen in configs:
        data = composer(fill([f"{g}={o}" for g, o in chosen.items()]))
        for g, o in chosen.items():  # each group's file was applied
            if g in ("algo", "replay", "rollout", "cluster"):
                assert data[g].get("name", data[g].get("engine", data[g].get("mode"))) == o, (g, o)
        validate(data)  # every pair of shipped options is a valid job


def test_arms_and_experiments_compose(composer):
    for arm in options("arm"):
        job = validate(composer([f"+arm={arm}"]))
        assert (job.algo.name, job.replay.mode) == {"gspo": ("gspo", "none"), "grpo": ("grpo", "none"),
                                                    "grpo_r2": ("grpo", "r2"),
                                                    "grpo_r3": ("grpo", "r3")}[arm]
    tiny = validate(composer(["+experiment=paper_tiny", "+arm=grpo_r2"]))
    assert tiny.model.name == "tiny_moe" and tiny.replay.mode == "r2"
    for experiment in ("paper_tiny", "paper_small"):  # every arm the same behaviour log-probs
        for arm in options("arm"):
            job = validate(composer([f"+experiment={experiment}", f"+arm={arm}"]))
            assert behaviour_source(job, "cpu") == "recompute", (experiment, arm)
    big = validate(composer(fill(["+experiment=qwen3_30b_a3b", "+arm=gspo", "data=files",
                                  "rollout=sglang"])))
    assert big.model.name == "qwen3_30b_a3b" and big.rollout.engine == "sglang"
    assert (big.parallel.tp, big.parallel.ep, big.algo.minibatches) == (2, 8, 4)
    assert (big.algo.clip_low, big.algo.clip_high) == (3e-4, 4e-4)
    assert big.parallel.device == "cuda" and big.model.activation_recompute == "full"
    assert big.parallel.validate(32, big.model, device_type="cuda", have_te=True) == 16


INVALID = [  # (overrides, key the message must name)
    (["algo.minibatch_split=shuffled"], "algo.minibatch_split"),
    (["algo.name=ppo"], "algo.name"),
    (["algo.minibatches=0"], "algo.minibatches"),
    (["algo.minibatches=3"], "algo.minibatches"),  # does not divide 16 x 8 responses
    (["algo.aggregation=token_mean"], "algo.aggregation"),  # changes GSPO's objective
    (["algo.aggregation=sum"], "algo.aggregation"),
    (["algo.clip_low=1.5"], "algo.clip_low"),
    (["algo.dual_clip=3.0"], "algo.dual_clip"),  # GRPO only
    (["algo=grpo", "algo.dual_clip=0.5"], "algo.dual_clip"),
    (["algo.old_logprobs=cached"], "algo.old_logprobs"),
    (["algo.kl_coef=-0.1"], "algo.kl_coef"),
    (["replay.mode=r4"], "replay.mode"),
    (["replay=r3", "rollout=sglang", "rollout.return_routes=false",
      "rollout.sglang_urls=[http://h:1]"], "replay.mode"),  # engine without routes
    (["replay=r2", "algo.old_logprobs=engine"], "algo.old_logprobs"),
    (["algo.rollout_correction=seq_tis", "algo.old_logprobs=engine"],
     "algo.rollout_correction"),  # every weight 1
    (["replay=r2", "model.num_experts=0"], "replay.mode"),  # replay on a dense model
    (["rollout.engine=vllm"], "rollout.engine"),
    (["rollout.group_size=1"], "rollout.group_size"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout=sglang"], "rollout.sglang_urls"),  # no servers
    (["rollout.weight_sync=nfs"], "rollout.weight_sync"),
    (["rollout.weight_sync_port=70000"], "rollout.weight_sync_port"),
    (["rollout.tensor_sync_format=npz"], "rollout.tensor_sync_format"),
    (["rollout.sglang_ep_per_server=3"], "rollout.sglang_ep_per_server"),  # 8 GPUs per server
    (["rollout=sglang", "rollout.sglang_urls=[http://h:1]", "rollout.weight_sync=tensor"],
     "rollout.weight_sync"),  # CUDA IPC handles: colocated servers only (refused)
    (["rollout=sglang", "rollout.sglang_urls=[http://h:1]", "rollout.sglang_generate_timeout_s=0"],
     "rollout.sglang_generate_timeout_s"),
    (["trainer.checkpoint_format=zip"], "trainer.checkpoint_format"),
    (["model.activation_recompute=selective"], "model.activation_recompute"),
    (["data.task=multiply"], "data.task"),
    (["data=files"], "data.files"),
    (["data.reward=bleu"], "data.reward"),
    (["trainer.steps=0"], "trainer.steps"),
    (["trainer.lr=0"], "trainer.lr"),
    (["trainer.lr_schedule=linear"], "trainer.lr_schedule"),
    (["trainer.init_from=/no/such/dir"], "trainer.init_from"),
    (["trainer.clip_grad=-1"], "trainer.clip_grad"),
    (["model.top_k=9"], "model.top_k"),
    (["model.vocab_size=64"], "model.vocab_size"),  # smaller than the built-in tokenizer
    (["model.params_dtype=float16"], "model.params_dtype"),
    (["cluster=slurm", "cluster.signal_s=999999"], "cluster.signal_s"),
    (["rollout.mode=eager"], "rollout.mode"),
    (["rollout.mode=async", "algo.rollout_correction=decoupled"], "rollout.mode"),  # local engine
    (["rollout.mode=one_step_off"], "rollout.mode"),  # off-policy samples, no correction
    (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["rollout.partial=true", "rollout.mode=one_step_off", "algo.rollout_correction=decoupled"],
     "rollout.partial"),  # one_step_off generates no segments across syncs
    (["rollout=sglang", "rollout.sglang_urls=[http://h:1]", "rollout.mode=async",
      "rollout.pause_mode=in_place", "algo.rollout_correction=decoupled"], "rollout.pause_mode"),
    (["rollout=sglang", "rollout.sglang_urls=[http://h:1]", "rollout.mode=async",
      "rollout.pause_mode=retract", "algo.rollout_correction=decoupled"], "rollout.pause_mode"),
    (["rollout.mode=one_step_off", "rollout.dynamic_sampling=true",
      "algo.rollout_correction=decoupled"], "rollout.dynamic_sampling"),
    (["rollout.partial_segment_tokens=-1"], "rollout.partial_segment_tokens"),
    (["backend.compile_experts=true"], "backend.compile_experts"),  # on the CPU backend
    (["backend.compile_experts=true", "backend.grouped_experts=false", "parallel.device=cuda"],
     "backend.compile_experts"),  # nothing to compile
]


@pytest.mark.parametrize("overrides,key", INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_invalid_config_names_the_key_in_one_line(composer, overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(composer(overrides))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(key + "="), msg
    assert "; fix: " in msg


LAYOUT_INVALID = [  # (overrides, world size, key)
    (["parallel.tp=2", "parallel.ep=2"], 4, "parallel.sequence_parallel"),  # TP with MoE, no SP
    (["parallel.tp=2"], 1, "parallel.tp*pp*cp"),
    (["parallel.ep=3"], 3, "parallel.ep"),
    (["parallel.pp=3"], 3, "parallel.pp"),
    (["rollout.prompts_per_step=3"], 2, "rollout.prompts_per_step"),
    (["trainer.micro_batch_size=24"], 2, "trainer.micro_batch_size"),
    # 16 prompts on 8 ranks: 2 each, not 4 mini-batches of whole groups
    (["algo.minibatch_split=groups", "trainer.micro_batch_size=4"], 8, "algo.minibatch_split"),
    (["parallel.timeout_s=0"], 1, "parallel.timeout_s"),
    # the other ranks of a replica wait longer than that for their leader's /generate
    (["rollout=sglang", "rollout.sglang_urls=[http://h:1]", "parallel.timeout_s=600"], 1,
     "parallel.timeout_s"),
]


@pytest.mark.parametrize("overrides,world,key", LAYOUT_INVALID,
                         ids=[" ".join(o) for o, _, _ in LAYOUT_INVALID])
def test_invalid_layouts_name_the_key(composer, overrides, world, key):
    job = validate(composer(overrides))
    with pytest.raises(ConfigError) as e:
        dp = job.parallel.validate(world, job.model, device_type="cpu")
        job.check_layout(dp)
    assert str(e.value).startswith(key + "="), str(e.value)


def test_unknown_group_option_lists_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        check_group_choices(["algo=gspo,ppo"])
    assert str(e.value) == ("algo='ppo': no such option in conf/algo/; fix: use one of grpo, "
                            "gspo, gspo_token")
    check_group_choices(["algo=gspo,grpo", "replay=none,r2", "trainer.steps=3", "+arm=gspo"])
    with pytest.raises(ConfigError):
        check_group_choices(["+experiment=paper_huge"])


def test_a_torch_older_than_the_floor_is_one_line_at_start(monkeypatch, capsys):
    check_torch(torch.__version__)  # what the tests run on
    check_torch("2.10.0a0+nv25.11")  # NGC PyTorch 25.11's build, the GPU image's base
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    monkeypatch.setattr("sys.argv", ["megatron_gspo", "trainer.steps=1"])
    with pytest.raises(SystemExit) as e:
        entry()
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"config error: torch 2.6.0+cu124 is older than the {TORCH_MIN} megatron-gspo needs "
        f"(torch.nn.functional.grouped_mm); fix: pip install 'torch>={TORCH_MIN}'\n")


REFUSED_OVERRIDES = [  # (command line, the one line), each refused before Hydra runs
    (["trainer.stpes=2"], "trainer.stpes=2: no such key; fix: did you mean trainer.steps?"),
    (["-m", "trainer.lr=1e-5,1e-6", "trainer.max_tokens_per_microbatch=8"],
     "trainer.max_tokens_per_microbatch=8: no such key; fix: did you mean "
     "trainer.max_tokens_per_micro_batch?"),
    (["stepz=3"], "stepz=3: no such key; fix: the config has algo, backend, cluster, data, "
                  "logging, model, parallel, replay, rollout, run_dir, seed, trainer"),
    (["algo=grpo", "algo.clip_low=abc"],
     "algo.clip_low=abc: Value 'abc' of type 'str' could not be converted to Float; fix: "
     "python -m megatron_gspo --cfg job shows every key and its value"),
    (["trainer.steps=[1"], "trainer.steps=[1: Hydra cannot parse this override (no viable "
                           "alternative at input '[1'); fix: see "
                           "https://hydra.cc/docs/advanced/override_grammar/basic/"),
    (["trainer.resume=/a,b"], "trainer.resume=/a,b: several values without --multirun; fix: "
                              "add --multirun (-m) to sweep them, or quote one string "
                              "(trainer.resume='...') or write a list ([...])"),
    (["trainer.steps=1", "trainer.steps=x"],  # the override that failed, not the first
     "trainer.steps=x: Value 'x' of type 'str' could not be converted to Integer; fix: "
     "python -m megatron_gspo --cfg job shows every key and its value"),
    (["experiment=paper_tiny"],  # Hydra's own advice kept
     "experiment=paper_tiny: Could not override 'experiment'. No match in the defaults list.; "
     "fix: To append to your default list use +experiment=paper_tiny"),
    (["-m", "seed=range(1,5,0)"], "seed=range(1,5,0): this sweep has no values Hydra can list "
                                  "(range() arg 3 must not be zero); fix: see "
                                  "https://hydra.cc/docs/advanced/override_grammar/extended/"),
    (["-m", "seed=range(0,300)", "trainer.lr=1e-5,1e-6,abc"],  # a key's values, set as Hydra does
     "trainer.lr=abc: Value 'abc' of type 'str' could not be converted to Float; fix: "
     "python -m megatron_gspo --cfg job shows every key and its value"),
    (["--multirun", "algo=gspo,grpo", "model.num_experts=4,x"],  # each value of a sweep
     "model.num_experts=x: Value 'x' of type 'str' could not be converted to Integer; fix: "
     "python -m megatron_gspo --cfg job shows every key and its value"),
    (["-m", "algo=gspo", "--cfg", "job"],
     "--multirun and --cfg: Hydra takes one of these at a time; fix: drop all but one"),
    (["algo=gspo,grpo", "hydra.mode=MULTIRUN", "--cfg", "job"],
     "hydra.mode=MULTIRUN and --cfg: Hydra takes one of these at a time; fix: drop all but one"),
]


@pytest.mark.parametrize("argv,line", REFUSED_OVERRIDES, ids=[a[-1] for a, _ in REFUSED_OVERRIDES])
def test_an_override_hydra_refuses_is_one_line_with_exit_code_2(monkeypatch, capsys, argv, line):
    """Where Hydra would write several lines (and exit 1), the entry writes one (exit 2)."""
    monkeypatch.setattr("sys.argv", ["megatron_gspo", *argv])
    with pytest.raises(SystemExit) as e:
        entry()
    assert e.value.code == 2
    assert capsys.readouterr().err == f"config error: {line}\n"


def test_the_overrides_check_passes_what_hydra_composes():
    from megatron_gspo.config.load import check_overrides

    check_overrides(["-m", "algo=gspo,grpo", "replay=none,r2", "trainer.lr=1e-5,1e-6",
                     "trainer.steps=range(1,4)", "+arm=gspo", "hydra.sweep.dir=sweeps",
                     "rollout.sglang_urls=[http://h:1,http://h:2]"])
    check_overrides(["+experiment=paper_tiny", "hydra.run.dir=runs/x", "data=files",
                     "data.files=[a.jsonl]"])
    check_overrides(["--cfg", "job", "model.num_experts=4"])
    check_overrides(["algo=gspo,grpo", "seed=range(0,3)", "hydra.mode=MULTIRUN"])  # (Hydra 1.2+)
    check_overrides(["-m", "algo=glob(*)", "++trainer.steps=3,4", "+trainer.extra=1,2"])
    check_overrides(["--config-name", "other", "anything.goes=1"])  # (Hydra's to report)


def test_unknown_key_names_the_section():
    with pytest.raises(ConfigError) as e:
        job_from_dict({"algo": {"nam": "gspo"}})
    assert str(e.value).startswith("algo.nam=")


AUTO_SOURCES = [  # (overrides, device, where ``algo.old_logprobs=auto`` takes them from)
    ([], "cpu", "engine"),  # the local engine is the trainer's own fp32 model
    (["model.params_dtype=bfloat16"], "cpu", "recompute"),
    ([], "cuda", "recompute"),  # GPU kernels: decoding and the full forward round differently
    (["rollout=sglang", "rollout.sglang_urls=[http://h:1]"], "cpu", "recompute"),
    (["replay=r2"], "cpu", "recompute"),  # R2 records the pass's routes
    (["replay=r3"], "cpu", "recompute"),  # R3 replays the engine's routes in the pass
    (["algo=grpo", "algo.rollout_correction=token_tis"], "cpu", "recompute"),
    (["algo.old_logprobs=recompute"], "cpu", "recompute"),
    (["algo.old_logprobs=engine", "model.params_dtype=bfloat16"], "cuda", "engine"),
]


@pytest.mark.parametrize("overrides,device,source", AUTO_SOURCES,
                         ids=[" ".join(o) + " " + d for o, d, _ in AUTO_SOURCES])
def test_behaviour_logprobs_source(composer, overrides, device, source):
    assert behaviour_source(validate(composer(overrides)), device) == source


def test_model_from_checkpoint_reads_the_shape_from_its_config(composer, qwen3_30b_dir):
    job = validate(composer(["model=from_checkpoint", f"trainer.init_from={qwen3_30b_dir}",
                             "model.activation_recompute=full"]))
    m = job.model
    assert (m.num_layers, m.num_experts, m.top_k, m.vocab_size, m.hidden_size) == (
        48, 128, 8, 151936, 2048)
    assert m.params_dtype == "bfloat16" and m.activation_recompute == "full"  # the job's own
    with pytest.raises(ConfigError, match=r"^model='from_checkpoint': reads the model's shape "):
        job_from_dict(composer(["model=from_checkpoint"]))

