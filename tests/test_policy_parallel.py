"""Tensor parallel (DeepSpeed AutoTP, with ZeRO-3) and pipeline parallel (DeepSpeed
PipelineModule, with ZeRO 0/1), proven equal to one rank: the step-1 loss and the parameters
after 2 optimizer steps, vLLM co-located, through torchrun. And the layouts that
are refused at start-up, each with its message."""
import json
import os
import sys

import pytest
import torch
from conftest import BIN, PYTHON, free_port, is_vllm_shared_memory, run, tiny_overrides, torchrun
from runs import assert_same_run, series, values
from safetensors.torch import load_file

from megagrpo.config.schema import ConfigError
from megagrpo.validation import load_config

COMMON = ["data.eval_file=null", "grpo.max_steps=2", "grpo.learning_rate=1e-4",
          "logging.sample_steps=0", "checkpoint.save_steps=0"]
# objectives the layouts are also held to one rank with (docs/objectives.md)
OBJECTIVES = {"default": (),
              "gspo": ("grpo.loss_type=grpo", "grpo.importance_sampling_level=sequence", "grpo.epsilon=3e-4",
                       "grpo.epsilon_high=4e-4", "grpo.importance_sampling_correction=sequence_mask"),
              "cispo": ("grpo.loss_type=cispo", "grpo.entropy_coef=0.01")}


def _vllm_shared_memory() -> set[str]:
    """vLLM-CPU's shared-memory segments of tp > 1 engines (a job that leaves one behind makes
    the next job of the same layout fail with EEXIST)."""
    return {name for name in os.listdir("/dev/shm") if is_vllm_shared_memory(name)}


@pytest.fixture(scope="module")
def single_rank(tiny, tmp_path_factory):
    """The one-rank run of a global batch of `completions` with an objective (each run once per
    module)."""
    runs = {}

    def get(completions, objective="default"):
        if (completions, objective) not in runs:
            out = tmp_path_factory.mktemp(f"one_rank_{completions}_{objective}")
            run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                 *tiny_overrides(tiny, out), *COMMON, f"grpo.per_device_train_batch_size={completions}",
                 *OBJECTIVES[objective]])
            runs[completions, objective] = out
        return runs[completions, objective]
    return get


@pytest.mark.multirank
@pytest.mark.alone  # it counts every vLLM shared-memory file in /dev/shm
@pytest.mark.parametrize("ranks,tp,objective", [(2, 2, "default"), (4, 2, "cispo")])
def test_tensor_parallel_equals_one_rank(tiny, tmp_path, single_rank, ranks, tp, objective):
    """cispo: CISPO with an entropy bonus (its gradient through the fused head) under AutoTP."""
    dp = ranks // tp
    reference, parallel = single_rank(16 * dp, objective), tmp_path / f"dp{dp}_tp{tp}"  # 2 prompts x 8 per dp rank
    shared_memory = _vllm_shared_memory()
    proc = run([*torchrun(ranks, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, parallel), *COMMON, "grpo.per_device_train_batch_size=16",
                f"parallel.tensor_parallel_size={tp}", "deepspeed=configs/ds_zero3.json",
                "checkpoint.save_steps=1", *OBJECTIVES[objective]],
               timeout=800)
    assert f"world {ranks} = dp {dp} x tp {tp}" in proc.stdout
    assert "vLLM tp 2" in proc.stdout and _vllm_shared_memory() <= shared_memory  # removed at the ranks' exit
    # the grad norm too: Adam's first step is lr * sign(g), so a doubled gradient would pass the rest
    b = _assert_two_steps_equal(reference, parallel, tiny)
    seen = [json.loads(line)["prompts"] for line in open(parallel / "prompts_seen.jsonl")]
    # offline: the tp shards (each reassembled from its ZeRO-3 partitions) merge into the same weights
    converted = tmp_path / "converted"
    run([f"{BIN}/megagrpo", "convert", "to-hf", str(parallel / "checkpoints" / "step_00000002"), str(converted)])
    c = load_file(str(converted / "model-00001.safetensors"))
    assert sorted(c) == sorted(b) and all(torch.equal(c[k], b[k]) for k in b)
    # re-sharded: its step-1 checkpoint resumed on one rank (DeepSpeed's universal checkpoint)
    # continues the run: the same step-2 loss, prompts and final parameters
    one = tmp_path / "resharded"
    resumed = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                   *tiny_overrides(tiny, one), *COMMON, f"grpo.per_device_train_batch_size={16 * dp}",
                   f"checkpoint.resume={parallel / 'checkpoints' / 'step_00000001'}", *OBJECTIVES[objective]])
    assert f"(re-sharded from dp {dp} x tp {tp} to dp 1 x tp 1)" in resumed.stdout
    assert [json.loads(line)["prompts"] for line in open(one / "prompts_seen.jsonl")] == seen[1:]
    assert_same_run(one, parallel, steps=[2], loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)


@pytest.mark.multirank
def test_ulysses_rows_equal_one_rank_for_every_loss_type(tiny):
    """The tiny model with each packed row split over 2 ranks (Ulysses attention over gloo's
    all-to-all) against the same model on one rank, the same batch: uneven sequences, the
    first longer than either rank's share. Log-probs and entropies (fused head and full
    logits), every loss type's loss and summed gradients, and with gradient checkpointing. A
    control: the split row attended locally (no all-to-all) is far off."""
    proc = run([*torchrun(2, "tests/helpers/sequence_parallel_probe.py"), tiny["warm"]], timeout=300)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["longest"] > out["share"] and sum(out["counts"]) > 0 and min(out["counts"]) > 0, out
    for fused in (True, False):
        assert out[f"logp_difference_fused_{fused}"] < 1e-5 and out[f"entropy_difference_fused_{fused}"] < 1e-5, out
    assert out["without_ulysses_difference"] > 0.1, out
    assert sorted(out["objectives"]) == ["bnpo", "cispo", "dapo+entropy", "dr_grpo", "grpo", "gspo", "sapo"]
    for name, o in out["objectives"].items():
        assert o["grad_norm"] > 1e-3, (name, o)
        assert o["loss_difference"] < 1e-5 and o["grad_difference"] < 1e-5 * max(1.0, o["grad_norm"]), (name, o)
        assert o["sp_grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-4), (name, o)
    assert out["checkpointing_grad_difference"] < 1e-5, out


def test_tiled_mlp_gives_the_plain_gradients(tiny):
    """model.tiled_mlp (DeepSpeed's TiledMLP): a 235-token row through the tiny model (hidden
    128: 2 tiles) gives the same log-probs and gradients as the plain MLP, with gradient
    checkpointing too."""
    from sequence_parallel_probe import batch, losses_and_grads, model

    from megagrpo.policy.tiled_mlp import tile_mlps

    plain = model(tiny["warm"])
    b = batch(plain.config.vocab_size)
    loss, grads = losses_and_grads(plain, b, None, "grpo")
    for checkpointing in (False, True):
        tiled = model(tiny["warm"], checkpointing=checkpointing)
        assert tile_mlps(tiled) == 2
        tiled_loss, tiled_grads = losses_and_grads(tiled, b, None, "grpo")
        assert abs(tiled_loss - loss) < 1e-6 and grads.norm() > 1e-3
        torch.testing.assert_close(tiled_grads, grads, atol=1e-6, rtol=1e-5)


@pytest.mark.multirank
@pytest.mark.parametrize("ranks,sp", [(2, 2), (4, 2)])
def test_sequence_parallel_equals_one_rank(tiny, tmp_path, single_rank, ranks, sp):
    """Ulysses sequence parallelism under ZeRO-3 with vLLM co-located: sp 2 on 2 ranks (with
    model.tiled_mlp, rows of up to 600 tokens: 2-3 tiles a slice) and dp 2 x sp 2 on 4 ranks
    (with gradient checkpointing, micro-batches of at most 40 tokens: about one sequence a row,
    so sequences span both ranks of a group), each against one rank on the same global batch:
    step-1 loss, grad norms, the parameters after 2 steps. The 2-rank run's step-1 checkpoint
    then resumes on one rank (sp 1)."""
    dp = ranks // sp
    reference, parallel = single_rank(16 * dp), tmp_path / f"dp{dp}_sp{sp}"
    layout = (["model.tiled_mlp=true", "grpo.max_tokens_per_microbatch=600"] if ranks == 2 else
              ["grpo.max_tokens_per_microbatch=40", "model.gradient_checkpointing=true"])
    proc = run([*torchrun(ranks, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, parallel), *COMMON, "grpo.per_device_train_batch_size=16",
                f"parallel.sequence_parallel_size={sp}", "deepspeed=configs/ds_zero3.json", *layout,
                "checkpoint.save_steps=1"], timeout=800)
    assert f"world {ranks} = dp {dp} x sp {sp} x tp 1" in proc.stdout
    _assert_two_steps_equal(reference, parallel, tiny)
    # the sp group's first rank sampled; its vLLM engine holds every step's weights
    assert max(values(parallel, "train/sampling/sampling_logp_difference/max")) < 1e-3
    if ranks != 2:
        return
    one = tmp_path / "one_rank"
    resumed = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                   *tiny_overrides(tiny, one), *COMMON, "grpo.per_device_train_batch_size=16",
                   f"checkpoint.resume={parallel / 'checkpoints' / 'step_00000001'}"])
    assert "(re-sharded from dp 1 x sp 2 x tp 1 to dp 1 x tp 1)" in resumed.stdout
    assert [s for s, _ in series(one, "train/loss")] == [2]
    assert_same_run(one, parallel, steps=[2], loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)


@pytest.mark.multirank
def test_sequence_parallel_under_zero_2_equals_one_rank(tiny, tmp_path, single_rank):
    """sp 2 with ZeRO-2, whose reduction (unlike ZeRO-3's reduce-scatter) DeepSpeed divides by
    dp and not by the sp group: step-1 loss, grad norms and parameters after 2 steps as one
    rank's. (Measured once: ZeRO 0 and 1 equal one rank the same way, within 6e-7.)"""
    reference, parallel = single_rank(16), tmp_path / "sp2_zero2"
    run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, parallel),
         *COMMON, "grpo.per_device_train_batch_size=16", "parallel.sequence_parallel_size=2",
         "deepspeed=configs/ds_zero2.json", "grpo.max_tokens_per_microbatch=600"], timeout=800)
    _assert_two_steps_equal(reference, parallel, tiny)


def _assert_two_steps_equal(reference, parallel, tiny):
    """The 2-step runs agree (runs.assert_same_run): losses within 1e-5, grad norms within 1e-4,
    every exported parameter within 1e-5, the same prompts and completions; and training moved
    the parameters. Returns the parallel run's exported tensors."""
    b = assert_same_run(parallel, reference, loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
    start = load_file(os.path.join(tiny["warm"], "model.safetensors"))
    assert max((b[k] - start[k]).abs().max().item() for k in b) > 1e-4  # training moved them
    return b


def test_hf_to_pipeline_refusals(tiny, tmp_path, capsys):
    """Bad inputs of `convert hf-to-pipeline` end with exit 2 and a message naming the problem;
    nothing is written (the writer would clear the model's own shards if pointed at them)."""
    from megagrpo.checkpoints.convert import main as convert

    cases = [([tiny["warm"], tiny["warm"], "--pipeline-parallel-size", "2"], "the output folder is the model folder"),
             ([tiny["warm"], str(tmp_path / "a"), "--pipeline-parallel-size", "6"],
              "--pipeline-parallel-size 6: the model has 5 pipeline layers"),
             ([tiny["data"], str(tmp_path / "b"), "--pipeline-parallel-size", "2"], "not an HF model folder")]
    for args, message in cases:
        assert convert(["hf-to-pipeline", *args]) == 2
        assert message in capsys.readouterr().err, args
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert os.path.isfile(os.path.join(tiny["warm"], "model.safetensors"))


def test_refused_layouts(tiny, tmp_path, monkeypatch):
    base = tiny_overrides(tiny, tmp_path)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 with ZeRO stage 3: DeepSpeed "
                                          r"runs pipelines with ZeRO stage 0 or 1 only"):
        load_config("configs/tiny_arith.yaml", base + ["parallel.pipeline_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the model's 2 "
                                          r"attention heads"):
        load_config("configs/tiny_arith.yaml", base + ["parallel.tensor_parallel_size=4"])
    pipeline = base + ["parallel.pipeline_parallel_size=2", "deepspeed=configs/ds_zero1.json"]
    assert load_config("configs/tiny_arith.yaml", pipeline + ["parallel.tensor_parallel_size=2"])  # 3D
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 needs grpo.packing=true"):
        load_config("configs/tiny_arith.yaml", pipeline + ["grpo.packing=false"])
    checkpointed = load_config("configs/tiny_arith.yaml", pipeline + ["model.gradient_checkpointing=true"])
    assert checkpointed.model.gradient_checkpointing  # DeepSpeed's pipeline activation checkpointing
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 exceeds the model's 2 layers"):
        load_config("configs/tiny_arith.yaml", base + ["parallel.pipeline_parallel_size=3",
                                                       "deepspeed=configs/ds_zero0.json"])
    assert load_config("configs/tiny_arith.yaml", pipeline).parallel.pipeline_parallel_size == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by tensor_parallel_size x "
                                          r"pipeline_parallel_size x sequence_parallel_size = 2 x 1 x 1"):
        load_config("configs/tiny_arith.yaml", base + ["parallel.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"= 1 x 1 x 2; launch a multiple of 2 ranks"):
        load_config("configs/tiny_arith.yaml", base + ["parallel.sequence_parallel_size=2"])
    monkeypatch.delenv("WORLD_SIZE")
    # sequence parallelism: what it composes with in this version, and the model's heads
    sequence = base + ["parallel.sequence_parallel_size=2"]
    assert load_config("configs/tiny_arith.yaml", sequence).parallel.sequence_parallel_size == 2
    for extra, message in [(["parallel.tensor_parallel_size=2"], r"sequence_parallel_size=2 with tensor_paral"),
                           (pipeline[len(base):], r"composes with data parallelism and ZeRO 0-3 only"),
                           (["grpo.packing=false"], r"sequence_parallel_size=2 needs grpo.packing=true"),
                           (["parallel.sequence_parallel_size=4"], r"does not divide the model's 2 attention heads")]:
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny_arith.yaml", sequence + extra)
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_attention_heads": 2,
                                                   "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match=r"no pipeline layer map for model_type 'gpt2'"):
        load_config("configs/tiny_arith.yaml", base + [f"model.name_or_path={other}",
                                                       "parallel.pipeline_parallel_size=2",
                                                       "deepspeed=configs/ds_zero1.json"])


def test_pipeline_activation_checkpointing_recomputes_every_decoder_layer(tiny):
    """model.gradient_checkpointing under pipelines: DeepSpeed's activation checkpoint runs once
    per decoder layer (and on nothing else), and forward and gradients are exactly the same."""
    proc = run([PYTHON, "tests/helpers/pipeline_checkpointing_probe.py", tiny["warm"],
                os.path.join(tiny["data"], "train.jsonl")], env={"MASTER_PORT": str(free_port())})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    decoder_layers = result["layers"].count("DecoderLayer")
    assert decoder_layers == 2 and result["calls"] == decoder_layers
    assert result["checkpointed"] == ["DecoderLayer"] * decoder_layers
    assert result["gradient_norm"] > 0
    assert result["output_difference"] == 0.0 and result["gradient_difference"] == 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("ranks,tp,pp,ds,checkpointing,objective", [
    (2, 1, 2, "ds_zero0", False, "default"), (4, 1, 2, "ds_zero1", False, "default"),
    (2, 1, 2, "ds_zero0", True, "default"), (4, 2, 2, "ds_zero0", False, "gspo"),
    (4, 2, 2, "ds_zero1", False, "default")])
def test_pipeline_parallel_equals_one_rank(tiny, tmp_path, single_rank, ranks, tp, pp, ds, checkpointing,
                                           objective):
    """DeepSpeed PipelineModule stages (each loading only its layers from safetensors), the
    GRPO loss at the last stage, tied embedding/head across the first and last stage; the
    gradient norm (which DeepSpeed gets wrong under a fp32 ZeRO-0 pipeline) too. With
    activation checkpointing (DeepSpeed's pipeline form) the same numbers. With tp 2 each
    stage's decoder layers are split over two ranks (dp 1 x tp 2 x pp 2); the ZeRO-1 case also
    resumes its step-1 checkpoint on the same layout. gspo: GSPO's sequence-level ratios with
    the sequence-mask sampler correction, under tp 2 x pp 2."""
    dp = ranks // (tp * pp)
    reference, parallel = single_rank(16 * dp, objective), tmp_path / f"dp{dp}_pp{pp}"
    # the run starts from the model rewritten as one file per stage (hf-to-pipeline)
    staged = tmp_path / "staged"
    run([f"{BIN}/megagrpo", "convert", "hf-to-pipeline", tiny["warm"], str(staged),
         "--pipeline-parallel-size", str(pp)])
    stage_files = json.load(open(staged / "model.safetensors.index.json"))["weight_map"]
    first = sorted(n for n, f in stage_files.items() if f == "model-stage001-of-002.safetensors")
    assert first and all(n == "model.embed_tokens.weight" or n.startswith("model.layers.0.") for n in first)
    original = load_file(os.path.join(tiny["warm"], "model.safetensors"))
    assert sorted(stage_files) == sorted(original)
    proc = run([*torchrun(ranks, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, parallel), *COMMON, "grpo.per_device_train_batch_size=16",
                f"parallel.pipeline_parallel_size={pp}", f"parallel.tensor_parallel_size={tp}",
                f"deepspeed=configs/{ds}.json", f"model.name_or_path={staged}",
                f"model.gradient_checkpointing={str(checkpointing).lower()}", "checkpoint.save_steps=1",
                *OBJECTIVES[objective]],
               timeout=800)
    assert f"world {ranks} = dp {dp} x tp {tp} x pp {pp}" in proc.stdout
    assert "stage=0 layers=2" in proc.stdout and "stage=1 layers=3" in proc.stdout  # by parameters
    # the HF export streams every stage's tensors to rank 0: the same names as one rank's
    b = _assert_two_steps_equal(reference, parallel, tiny)
    # offline: the pipeline checkpoint's layer files convert to the same HF weights
    converted = tmp_path / "converted"
    run([f"{BIN}/megagrpo", "convert", "to-hf", str(parallel / "checkpoints" / "step_00000002"), str(converted)])
    c = load_file(str(converted / "model-00001.safetensors"))
    assert sorted(c) == sorted(b) and all(torch.equal(c[k], b[k]) for k in b)
    # the first stage's vLLM engine samples with the weights streamed from every stage
    assert max(values(parallel, "train/sampling/sampling_logp_difference/max")) < 1e-3
    if tp == 1 or ds != "ds_zero1":
        return
    # exact resume on the same layout: step 2 again from the step-1 checkpoint
    again = tmp_path / "resumed"
    run([*torchrun(ranks, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, again), *COMMON, "grpo.per_device_train_batch_size=16",
         f"parallel.pipeline_parallel_size={pp}", f"parallel.tensor_parallel_size={tp}",
         f"deepspeed=configs/{ds}.json", f"model.name_or_path={staged}",
         f"checkpoint.resume={parallel / 'checkpoints' / 'step_00000001'}"], timeout=800)
    assert [s for s, _ in series(again, "train/loss")] == [2]
    assert_same_run(again, parallel, steps=[2], loss_atol=1e-6, grad_norm_rtol=1e-6)  # parameters bit for bit
