"""Config: YAML + overrides, aliases, and the start-up errors (key, value, fix)."""
import json
import os
import sys

import pytest
import yaml
from conftest import ROOT, run, tiny_overrides

from megagrpo.config.schema import ConfigError
from megagrpo.validation import load_config


def test_trl_names_and_overrides(tiny, tmp_path):
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        "num_generations=4", "kl_coef=0.3", "use_vllm=false", "grpo.learning_rate=3e-4",
        "report_to=none", "rollout.stop=['###']"])
    assert cfg.grpo.num_generations == 4 and cfg.grpo.kl_coef == 0.3
    assert cfg.rollout.engine == "hf" and cfg.logging.report_to == []
    assert cfg.grpo.learning_rate == 3e-4 and cfg.rollout.stop == ["###"]


def test_former_names_still_work_and_say_so(tiny, tmp_path, capsys):
    base = tiny_overrides(tiny, tmp_path)
    cfg = load_config("configs/tiny_arith.yaml", base + ["data.reference_field=gold"])
    assert cfg.data.target_field == "gold"
    assert "data.reference_field is now data.target_field" in capsys.readouterr().err
    yaml_file = tmp_path / "old.yaml"
    with open(os.path.join(ROOT, "configs", "tiny_arith.yaml")) as f:
        old = yaml.safe_load(f)
    old["data"]["reference_field"] = "solution"
    yaml_file.write_text(yaml.safe_dump(old))
    assert load_config(str(yaml_file), base).data.target_field == "solution"
    with pytest.raises(ConfigError, match="data.reference_field and data.target_field are both set"):
        load_config(str(yaml_file), base + ["data.target_field=x"])


def test_validation_is_above_the_loader(tiny, tmp_path):
    """config/ only reads and type-checks; the checks of every part run in megagrpo.validation."""
    from megagrpo.config.loading import read_config
    bad = tiny_overrides(tiny, tmp_path) + ["rewards.functions=[{name: no_such_reward}]"]
    assert read_config("configs/tiny_arith.yaml", bad).rewards.functions[0].name == "no_such_reward"
    with pytest.raises(ConfigError, match="rewards.functions\\[0\\].name: reward 'no_such_reward'"):
        load_config("configs/tiny_arith.yaml", bad)


def test_unknown_key_suggests(tiny, tmp_path):
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'grpo.num_generation' \(did you mean 'num_generations'\?\)"):
        load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + ["grpo.num_generation=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rolout' \(did you mean 'rollout'\?\)"):
        load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + ["rolout.temperature=1"])


def test_lists_of_sections_and_their_shorthand(tiny, tmp_path):
    base = tiny_overrides(tiny, tmp_path)
    cfg = load_config("configs/tiny_arith.yaml", base + [
        "rewards.functions=[answer_match, {name: format, weight: 0.5}]"])
    assert [(f.name, f.weight) for f in cfg.rewards.functions] == [("answer_match", 1.0), ("format", 0.5)]
    with pytest.raises(ConfigError, match=r"rewards.functions\[1\].weight: expected a number, got 'x'"):
        load_config("configs/tiny_arith.yaml", base + ["rewards.functions=[answer_match, {name: format, weight: x}]"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rewards.functions\[0\].wieght'"):
        load_config("configs/tiny_arith.yaml", base + ["rewards.functions=[{name: format, wieght: 1}]"])
    # the shorthand is for list entries only: a section given as a bare value is an error
    with pytest.raises(ConfigError, match=r"model: expected a mapping of keys, got 'runs/x'"):
        load_config("configs/tiny_arith.yaml", base + ["model=runs/x"])


def test_batch_not_divisible_by_num_generations(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"= 12 completions per rank per step is not divisible by "
                                          r"grpo.num_generations = 8.*use a multiple of 8"):
        load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
            "grpo.per_device_train_batch_size=12"])


def test_types_and_ranges(tiny, tmp_path):
    base = tiny_overrides(tiny, tmp_path)
    with pytest.raises(ConfigError, match=r"grpo.kl_coef: expected a number, got 'abc'"):
        load_config("configs/tiny_arith.yaml", base + ["grpo.kl_coef=abc"])
    with pytest.raises(ConfigError, match=r"grpo.loss_type: 'dapoo' is not one of .*did you mean 'dapo'"):
        load_config("configs/tiny_arith.yaml", base + ["grpo.loss_type=dapoo"])
    with pytest.raises(ConfigError, match=r"grpo.num_generations: 1 is below the minimum 2"):
        load_config("configs/tiny_arith.yaml", base + ["grpo.num_generations=1", "grpo.per_device_train_batch_size=1"])
    with pytest.raises(ConfigError, match=r"rollout.temperature: 0.0 must be > 0"):
        load_config("configs/tiny_arith.yaml", base + ["rollout.temperature=0"])


def test_missing_files(tiny, tmp_path):
    base = tiny_overrides(tiny, tmp_path)
    with pytest.raises(ConfigError, match=r"model.name_or_path: '/nonexistent/model' has no config.json"):
        load_config("configs/tiny_arith.yaml", base + ["model.name_or_path=/nonexistent/model"])
    with pytest.raises(ConfigError, match=r"data.train_file: file '/nope.jsonl' does not exist"):
        load_config("configs/tiny_arith.yaml", base + ["data.train_file=/nope.jsonl"])
    with pytest.raises(ConfigError, match=r"deepspeed: file 'configs/none.json' does not exist"):
        load_config("configs/tiny_arith.yaml", base + ["deepspeed=configs/none.json"])
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' does not exist"):
        load_config("nope.yaml", [])


@pytest.mark.parametrize("model_type,key,overrides,refusal", [
    ("deepseek_v3", "n_routed_experts", [], r"is a mixture-of-experts model \(deepseek_v3, n_routed_experts=8\); "
     "megagrpo trains qwen3_moe, mixtral so far"),
    ("qwen3_moe", "num_experts", ["parallel.tensor_parallel_size=2"],
     r"parallel.tensor_parallel_size: 2 with .* \(qwen3_moe, num_experts=8\): not supported \(AutoTP has no split"),
    ("mixtral", "num_local_experts", ["rollout.routing_replay=r3", "rollout.servers=[http://localhost:1]"],
     r"rollout.routing_replay: r3 with .* and rollout.servers: not available: `vllm serve` 0.32 does not return"),
    ("mixtral", "num_local_experts", ["model.lora.r=8", "parallel.expert_parallel_size=2"],
     r"model.lora.r: 8 with parallel.expert_parallel_size 2 and .*: not supported \(AutoEP's expert layers"),
    ("qwen3_moe", "num_experts", ["parallel.expert_parallel_size=3"],
     r"parallel.expert_parallel_size: 3 must be >= 1 and divide the 8 experts"),
    ("qwen3_moe", "num_experts", ["model.router_aux_loss_coef=-1"], r"model.router_aux_loss_coef: -1.0 must be >= 0"),
    ("qwen2", None, ["parallel.expert_parallel_size=2"], r"parallel.expert_parallel_size: 2 with a dense model"),
])
def test_mixture_of_experts_layouts_that_are_not_built_are_refused(tiny, tmp_path, model_type, key, overrides,
                                                                    refusal):
    model = tmp_path / model_type
    model.mkdir()
    config = json.load(open(os.path.join(tiny["warm"], "config.json")))
    (model / "config.json").write_text(json.dumps({**config, "model_type": model_type, **({key: 8} if key else {})}))
    with pytest.raises(ConfigError, match=refusal):
        load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [f"model.name_or_path={model}",
                                                                                 *overrides])


def test_cli_reports_config_error_before_building_anything(tiny, tmp_path):
    """Through the real entry point: exit code 2, the message, and no output folder made."""
    out = tmp_path / "never"
    proc = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), "model.name_or_path=/missing/model"], check=False)
    assert proc.returncode == 2
    assert "config error: model.name_or_path: '/missing/model' has no config.json" in proc.stderr
    assert not out.exists()


def test_every_shipped_config_validates(tiny, tmp_path):
    """On the tiny model (2 attention heads): a config's vLLM tp 8 is set back to the trainer's,
    and its expert parallelism to none (the tiny model is dense; the MoE configs are validated on
    the tiny MoE model by test_moe.py); the real shapes with their vLLM tp are validated by
    test_cluster_launch.py's dry runs."""
    import glob
    for path in glob.glob(f"{ROOT}/configs/*.yaml"):
        cfg = load_config(path, tiny_overrides(tiny, tmp_path, **{"rollout.tensor_parallel_size": "null",
                                                                  "parallel.expert_parallel_size": "1"}))
        assert cfg.grpo.num_generations >= 2


def test_validation_does_not_write_into_the_config(tiny, tmp_path):
    """Validation checks, and returns what it resolves (the generator's layout): the config it
    is given stays as it was loaded, whatever the layout."""
    import copy

    from megagrpo.config.loading import read_config
    from megagrpo.validation import validate

    base = tiny_overrides(tiny, tmp_path)
    cases = [([], 1, 1), (["parallel.tensor_parallel_size=2"], 2, 2),  # the trainer's tp, by default
             (["parallel.tensor_parallel_size=2", "rollout.engine=hf"], 1, 1),
             (["rollout.servers=[http://node7:8000]"], 1, 1),
             (["rollout.placement=disaggregated", "rollout.ranks=2", "rollout.tensor_parallel_size=2"], 2, 1),
             (["grpo.importance_sampling_correction=true", "report_to=none"], 1, 1)]
    for overrides, generator_tp, ranks_per_group in cases:
        cfg = read_config("configs/tiny_arith.yaml", base + overrides)
        loaded = copy.deepcopy(cfg)
        layout = validate(cfg)
        assert cfg == loaded, overrides
        assert (layout.generator_tp, layout.ranks_per_group) == (generator_tp, ranks_per_group), overrides
        assert cfg.rollout.tensor_parallel_size == loaded.rollout.tensor_parallel_size
    # the shorthands are written out while the config is read, not by validation
    assert (cfg.grpo.importance_sampling_correction, cfg.logging.report_to) == ("token_truncate", [])
