"""The memory plan (mas_async.launch.memory_plan, trainer_memory): the fake step's peak against a real CPU step of
a 100M-parameter model, each trainer setting's figure against what it should hold, vLLM servers' shares, and a
plan that does not fit refused by the dry run with its sentence."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.launch.cli import main
from mas_async.launch.memory_plan import GIB, check_memory, kv_bytes_per_token, parameter_count, plan_memory
from mas_async.launch.trainer_memory import plan_samples, trainer_peak
from mas_async.placement import Place

CONFIG = "configs/plan_path_tiny.yaml"
POLICY = "vertical"
QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "vocab_size": 4096, "tie_word_embeddings": False, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}  # fmt: skip
BIG = {**QWEN3, "hidden_size": 384, "num_attention_heads": 6, "head_dim": 64, "intermediate_size": 1024,
       "vocab_size": 151936}  # fmt: skip
"""Qwen3's vocabulary, 2 small layers, untied: 120M parameters, most of them the embedding and the LM head."""


def _config(*overrides: str):
    return load_config(
        CONFIG,
        [f"policies.{POLICY}.dtype=bfloat16", "rollout.max_tokens=512", "trainer.max_tokens_per_micro_batch=1200",
         *overrides],
    )  # fmt: skip


def _samples(config, model_cfg: dict, prompt: int = 64):
    from transformers import AutoConfig

    return plan_samples(config, POLICY, AutoConfig.for_model(**model_cfg), prompt)[0]


def test_the_plans_trainer_peak_is_within_10_percent_of_a_real_cpu_step_of_a_100m_model() -> None:
    """MemTracker on real CPU tensors counts the bytes allocated, as torch.cuda.max_memory_allocated does on a GPU:
    the same two steps (the Adam state made by the first), fake against real. In float32 (bf16 matrix products
    at Qwen3's vocabulary take minutes on a CPU without bf16 units; the next test covers autocast)."""
    assert parameter_count(BIG) >= 100_000_000
    config = _config("rollout.max_tokens=128", f"policies.{POLICY}.dtype=float32")
    samples = _samples(config, BIG)[:2]
    fake = trainer_peak(config, POLICY, BIG, samples=samples)
    real = trainer_peak(config, POLICY, BIG, samples=samples, fake=False)
    print(f"plan {fake.peak / GIB:.3f} GiB, real {real.peak / GIB:.3f} GiB")
    assert abs(fake.peak - real.peak) <= 0.10 * real.peak
    assert real.peak > 16 * parameter_count(BIG)  # the float32 weights, gradients and Adam's two moments


def test_the_plan_agrees_with_a_real_cpu_step_under_bf16_autocast() -> None:
    """The bf16 policy's path: float32 master, autocast's casts, the served bf16 copy."""
    config = _config("rollout.max_tokens=256")
    samples = _samples(config, QWEN3)
    fake = trainer_peak(config, POLICY, QWEN3, samples=samples)
    real = trainer_peak(config, POLICY, QWEN3, samples=samples, fake=False)
    print(f"plan {fake.peak / GIB:.4f} GiB, real {real.peak / GIB:.4f} GiB")
    assert abs(fake.peak - real.peak) <= 0.10 * real.peak


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    """The planned peak of each trainer setting (rank 0; the last rank too where the state is sharded)."""
    settings = {
        "one rank": [],
        "ddp": [f"policies.{POLICY}.trainer_ranks=2"],
        "zero": [f"policies.{POLICY}.trainer_ranks=2", "trainer.zero=true"],
        "distributed": [f"policies.{POLICY}.trainer_ranks=2", "trainer.distributed_optimizer=true"],
        "checkpointing": ["trainer.activation_checkpointing=true"],
    }
    out = {}
    for name, overrides in settings.items():
        config = _config(*overrides)
        samples = _samples(config, QWEN3, prompt=512)
        out[name] = trainer_peak(config, POLICY, QWEN3, samples=samples).peak
        if name in ("zero", "distributed"):
            out[f"{name} last"] = trainer_peak(config, POLICY, QWEN3, rank=1, samples=samples).peak
    return out


def test_ddp_adds_exactly_its_bucket_copy_of_the_float32_gradients(peaks: dict[str, int]) -> None:
    assert peaks["ddp"] - peaks["one rank"] == 4 * parameter_count(QWEN3)


def test_zero_and_the_distributed_optimiser_hold_less_per_rank_than_ddp(peaks: dict[str, int]) -> None:
    assert max(peaks["zero"], peaks["zero last"]) < peaks["ddp"]
    # bf16 weights and gradients, a master and Adam shard: below ZeRO-1's whole float32 master and gradients.
    assert max(peaks["distributed"], peaks["distributed last"]) < min(peaks["zero"], peaks["zero last"])


def test_activation_checkpointing_lowers_a_long_sequences_peak(peaks: dict[str, int]) -> None:
    assert peaks["checkpointing"] < peaks["one rank"]


def _gpu_places(config, names: list[str], share: float | None = None) -> dict[str, Place]:
    return {name: Place("n0", "127.0.0.1", "cuda:0", "g", (i,), "", share) for i, name in enumerate(names)}


def test_a_trainer_that_fits_its_gpu_and_one_refused_with_the_figure_and_what_to_change() -> None:
    config = _config()
    places = _gpu_places(config, [f"trainer/{POLICY}"])
    fits = plan_memory(config, places, 8 * GIB, 64, model_config_of=lambda spec: QWEN3)
    check_memory(fits, "GPUs of 8 GiB")
    need = fits[f"trainer/{POLICY}"].need
    assert 2 * GIB < need < 3 * GIB  # the step's peak + 5% + the 2 GiB margin
    small = plan_memory(config, places, 2 * GIB, 64, model_config_of=lambda spec: QWEN3)
    with pytest.raises(ConfigError) as refused:
        check_memory(small, "GPUs of 2 GiB")
    words = str(refused.value)
    assert f"trainer/{POLICY} needs {round(need / GIB, 2)} GiB" in words and "2.0 GiB it has" in words
    assert "trainer.activation_checkpointing=true" in words and "trainer.distributed_optimizer=true" in words


def test_a_trainer_share_of_its_gpu_is_its_room() -> None:
    """`cluster.gpu_shares` caps a trainer: the documented 0.4 of an 80 GiB GPU is 32 GiB."""
    config = _config()
    places = _gpu_places(config, [f"trainer/{POLICY}"], share=0.4)
    plan = plan_memory(config, places, 80 * GIB, 64, model_config_of=lambda spec: QWEN3)
    assert plan[f"trainer/{POLICY}"].room == int(0.4 * 80 * GIB)
    tight = plan_memory(config, places, 5 * GIB, 64, model_config_of=lambda spec: QWEN3)
    with pytest.raises(ConfigError, match="share 0.4 of a 5.0 GiB GPU.*cluster.gpu_shares"):
        check_memory(tight, "GPUs of 5 GiB")


def test_a_vllm_servers_weights_receive_buffers_and_kv_cache_under_the_engine_arguments_it_gets() -> None:
    from mas_async.model_source import model_config

    qwen = model_config("Qwen/Qwen3-1.7B")
    config = load_config(
        "configs/plan_path_qwen3_1.7b.yaml",
        ["policies.tool.model=Qwen/Qwen3-1.7B", "policies.plan.model=Qwen/Qwen3-1.7B"],
    )
    name = "inference/tool/0"
    plan = plan_memory(
        config, _gpu_places(config, [name]), 80 * GIB, 1024, model_config_of=lambda s: qwen, training=False
    )
    server = plan[name]
    params = parameter_count(qwen)
    assert server.parts["weights"] == 2 * params and server.parts["receive buffers"] >= 2 * params
    assert kv_bytes_per_token(qwen, 2) == 2 * 28 * 8 * 128 * 2
    assert server.parts["KV of one 40960-token sequence"] == 40960 * kv_bytes_per_token(qwen, 2)
    # vLLM is given 0.92 less the receive buffers' share of the GPU (vllm_compat.engine_arguments).
    args = server.engine_args
    assert args["gpu_memory_utilization"] == pytest.approx(0.92 - server.parts["receive buffers"] / (80 * GIB))
    assert args["max_num_seqs"] == config.policies["tool"].max_batch_sequences and args["dtype"] == "bfloat16"
    assert server.fits and server.room == int(0.92 * 80 * GIB)
    small = load_config(
        "configs/plan_path_qwen3_1.7b.yaml",
        ["policies.tool.model=Qwen/Qwen3-1.7B", "policies.tool.vllm.gpu_memory_utilization=0.15"],
    )
    refused = plan_memory(small, _gpu_places(small, [name]), 80 * GIB, 1024, model_config_of=lambda s: qwen,
                          training=False)  # fmt: skip
    with pytest.raises(ConfigError, match="inference/tool/0 needs .*max_model_len"):
        check_memory(refused, "GPUs of 80 GiB")


def test_the_dry_run_prints_each_gpu_processs_memory_and_refuses_one_that_does_not_fit(capsys) -> None:
    args = ["train", "configs/plan_path_tiny_gpu.yaml", "--dry-run", "--prompt-tokens", "64"]
    assert main([*args, "--gpu-memory-gib", "40"]) == 0
    out = capsys.readouterr().out
    assert "memory: GPUs of 40 GiB (--gpu-memory-gib)" in out
    assert "trainer/vertical:" in out and "of 8.0 GiB (share 0.2 of a 40.0 GiB GPU): fits" in out
    assert main([*args, "--gpu-memory-gib", "8"]) == 2
    err = capsys.readouterr().err
    assert "trainer/vertical needs" in err and "1.6 GiB it has (share 0.2 of a 8.0 GiB GPU" in err
    assert "cluster.gpu_shares" in err
