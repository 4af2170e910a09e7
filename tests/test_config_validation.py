"""Bad layouts fail with one line naming the setting and the fix, before any process group exists."""

import pytest
import torch.distributed as dist

from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig

MOE = ModelConfig()  # 4 layers, 8 experts, 4 heads, 2 query groups
DENSE = ModelConfig(num_experts=0)

BAD = [
    # (layout, world size, model, key the message must name, words of the fix)
    (ParallelConfig(tp=2, sequence_parallel=True), 3, MOE, "parallel.tp*pp*cp", "multiple"),
    (ParallelConfig(ep=3), 3, MOE, "parallel.ep", "dividing"),
    (ParallelConfig(tp=2), 2, MOE, "parallel.sequence_parallel", "sequence_parallel=true"),
    (ParallelConfig(pp=3), 3, MOE, "parallel.pp", "dividing"),
    (ParallelConfig(tp=8, sequence_parallel=True), 8, MOE, "parallel.tp", "dividing"),
    (ParallelConfig(ep=2), 2, DENSE, "parallel.ep", "ep=1"),
    (ParallelConfig(sequence_parallel=True), 1, DENSE, "parallel.sequence_parallel", "tp >= 2"),
    (ParallelConfig(cp=3), 2, MOE, "parallel.tp*pp*cp", "multiple"),
    (ParallelConfig(ep=4), 2, MOE, "parallel.ep*etp*pp", "multiple"),
    (ParallelConfig(tp=0), 1, MOE, "parallel.tp", ">= 1"),
    (ParallelConfig(backend="mpi"), 1, MOE, "parallel.backend", "gloo"),
    (ParallelConfig(tp=2, etp=1, sequence_parallel=True), 2, MOE, "parallel.etp", "ep > 1"),
    (ParallelConfig(tp=2, etp=3, sequence_parallel=True), 6, MOE, "parallel.etp", "dividing"),
]


@pytest.mark.parametrize("layout,world,model,key,fix", BAD)
def test_bad_layout_names_key_and_fix(layout, world, model, key, fix):
    with pytest.raises(ConfigError) as info:
        layout.validate(world, model)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(key + "="), message
    assert "fix:" in message and fix in message


@pytest.mark.parametrize("layout,world", [
    (ParallelConfig(), 1), (ParallelConfig(tp=2, sequence_parallel=True), 2),
    (ParallelConfig(ep=2), 2), (ParallelConfig(pp=2), 2),
    (ParallelConfig(tp=2, ep=2, sequence_parallel=True), 4), (ParallelConfig(pp=2, ep=2), 4),
    (ParallelConfig(cp=2), 2), (ParallelConfig(cp=2, ep=2), 4),
])
def test_good_layouts_give_data_parallel_size(layout, world):
    dp = layout.validate(world, MOE)
    assert dp == world // (layout.tp * layout.pp * layout.cp)


@pytest.mark.parametrize("field,value,key", [
    ("num_query_groups", 3, "model.num_query_groups"),
    ("top_k", 9, "model.top_k"),
    ("first_k_dense", 4, "model.first_k_dense"),
    ("params_dtype", "float16", "model.params_dtype"),
    ("hidden_size", 0, "model.hidden_size"),
])
def test_bad_model_config(field, value, key):
    import dataclasses

    with pytest.raises(ConfigError, match=r"^" + key.replace(".", r"\.") + "="):
        dataclasses.replace(MOE, **{field: value}).validate()


def test_init_parallel_fails_before_creating_any_group(monkeypatch):
    from megatron_gspo.distributed.parallel import init_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        init_parallel(ParallelConfig(tp=2), MOE)
    assert not dist.is_initialized()


def test_unknown_key_is_named():
    from megatron_gspo.config.load import to_dataclass

    with pytest.raises(ConfigError, match=r"^tensor_parallel=2: .*fix: use one of tp, pp"):
        to_dataclass(ParallelConfig, {"tensor_parallel": 2})


def test_context_parallel_on_gpus_needs_transformer_engine():
    """Without TE the SDPA fallback would build a dense mask over the whole packed row; on CPU it
    stays (the tests run it), on a GPU it is refused."""
    layout = ParallelConfig(cp=2)
    assert layout.validate(2, MOE, device_type="cpu") == 1
    assert layout.validate(2, MOE, device_type="cuda", have_te=True) == 1
    with pytest.raises(ConfigError, match=r"^parallel\.cp=2: context parallelism on GPUs needs "
                                          r"Transformer Engine.*fix: install Transformer Engine"):
        layout.validate(2, MOE, device_type="cuda", have_te=False)

