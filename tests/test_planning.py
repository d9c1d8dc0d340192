"""The memory planner (megagrpo/planning.py; `megagrpo plan`, `--dry-run`): the layout and the
bytes of parameters, gradients and optimizer state per rank, counted by hand on the tiny model,
for tp, pp x tp and LoRA, and real shapes refused or accepted by --check-memory."""
import re

import pytest
import torch
from conftest import BIN, PYTHON, run, tiny_overrides

from megagrpo.config.schema import ConfigError
from megagrpo.validation import load_config


def _lora_config(tiny, *overrides):
    return load_config("configs/tiny_lora.yaml", [f"model.name_or_path={tiny['warm']}",
                                                  f"data.train_file={tiny['data']}/train.jsonl",
                                                  f"data.eval_file={tiny['data']}/eval.jsonl", *overrides])


def test_plan_counts_bytes_per_rank(tiny, tmp_path):
    """The tiny model by hand: 2 layers x (q, k, v, o: 128x128; gate, up, down: 384x128) are
    split by tp; embeddings 409x128, q/k/v biases, norms are replicated."""
    sharded = 2 * (4 * 128 * 128 + 3 * 384 * 128)
    replicated = 409 * 128 + 2 * 3 * 128 + 2 * 2 * 128 + 128
    proc = run([f"{BIN}/megagrpo", "plan", "--config", "configs/tiny_arith.yaml", "--world-size", "4",
                *tiny_overrides(tiny, tmp_path), "parallel.tensor_parallel_size=2"])
    assert "world 4 = dp 2 x tp 2 x pp 1, vLLM tp 2; ZeRO stage 3" in proc.stdout
    assert "    3        1       2/2         0" in proc.stdout
    from megagrpo.planning import count_parameters, make_plan
    assert count_parameters(tiny["warm"]) == (sharded + replicated, sharded)
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + ["parallel.tensor_parallel_size=2"])
    per_rank = make_plan(cfg, 4).bytes_per_rank
    local = sharded // 2 + replicated
    assert per_rank["params"] == local * 4 // 2 and per_rank["grads"] == local * 4 // 2
    assert per_rank["optimizer"] == local * 12 // 2
    assert per_rank["rollout_weights"] == (sharded + replicated) * 4 // 2  # vLLM at tp 2 (the trainer's)
    one_engine = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        "parallel.tensor_parallel_size=2", "rollout.tensor_parallel_size=1"])
    assert make_plan(one_engine, 4).bytes_per_rank["rollout_weights"] == (sharded + replicated) * 4
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        "deepspeed=configs/ds_zero1.json", "model.dtype=bfloat16"])
    per_rank = make_plan(cfg, 4).bytes_per_rank  # ZeRO-1: only the optimizer state is split
    total = sharded + replicated
    assert per_rank["params"] == total * 2 and per_rank["grads"] == total * 2
    assert per_rank["optimizer"] == total * 12 // 4


def test_plan_counts_a_3d_stage_and_refuses_what_does_not_fit(tiny, tmp_path):
    """tp x pp: a rank holds its stage with the decoder layers split by tp. Real shapes (config
    only, no weights): 2 ranks of Qwen2.5-1.5B in bf16 with ZeRO-3 do not fit a 24 GiB node,
    and --check-memory says so (exit 3) with the switches that would help; one rank of 0.5B
    fits a 32 GiB node (its plan, 22.0 GiB, is above 90% of 24 GiB: the run peaked at 20.2)."""
    from megagrpo.planning import make_plan
    from megagrpo.policy.pipeline_module import ModelParts
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2", "deepspeed=configs/ds_zero1.json"])
    plan = make_plan(cfg, 8)
    per_layer_split = 4 * 128 * 128 + 3 * 384 * 128 + 3 * 128  # q/k/v biases split too
    stages = ModelParts(tiny["warm"], torch.float32, "sdpa").stage_parameters(2, 2)
    whole = ModelParts(tiny["warm"], torch.float32, "sdpa").stage_parameters(2)
    assert [w - s for w, s in zip(whole, stages)] == [per_layer_split // 2, per_layer_split // 2]
    assert plan.bytes_per_rank["params"] == max(stages) * 4
    assert plan.bytes_per_rank["optimizer"] == max(stages) * 12 // 2
    for shape, ranks, node_gib, code in (("qwen2.5-1.5b", 2, 24, 3), ("qwen2.5-0.5b", 1, 32, 0)):
        model = tmp_path / shape
        run([PYTHON, "tools/make_tiny_model.py", "--shape", shape, "--config-only", "--out", str(model)])
        proc = run([f"{BIN}/megagrpo", "plan", "--check-memory", "--node-memory-gib", str(node_gib),
                    "--world-size", str(ranks),
                    "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, tmp_path),
                    f"model.name_or_path={model}", "model.dtype=bfloat16", "deepspeed=configs/ds_zero3_bf16.json",
                    "model.gradient_checkpointing=true", "rollout.max_new_tokens=128"], check=False)
        assert proc.returncode == code, (shape, proc.stdout[-2000:], proc.stderr[-2000:])
        for part in ("runtime", "trainer_state", "gradient_buckets", "optimizer_step", "reference", "rollout",
                     "activations", "logprob_head"):
            assert f"\n  {part} " in proc.stdout, part
        if code:
            assert f"does not fit: {ranks} rank(s) x " in proc.stderr and "RAM of this node" in proc.stderr
            assert "grpo.kl_coef=0 (no reference model" in proc.stderr
        else:
            assert "memory: fits" in proc.stdout


def test_the_plan_counts_adapter_state_only(tiny, monkeypatch):
    """r x (in + out) per adapted layer: q_proj and v_proj (hidden 128 -> 128, 2 layers) at r 8,
    plus every norm (5 x 128) as modules to save; gradients and Adam for those only, no reference."""
    from megagrpo.planning import make_plan
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _lora_config(tiny, "model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj]",
                  "model.lora.modules_to_save=[norm]")
    plan = make_plan(cfg, 2)
    trained = 2 * 2 * 8 * (128 + 128) + 5 * 128
    assert plan.params_trained == trained and plan.lora
    assert plan.bytes_per_rank["grads"] == trained * 4 // 2 and plan.bytes_per_rank["optimizer"] == trained * 12 // 2
    assert plan.bytes_per_rank["reference"] == 0
    assert plan.bytes_per_rank["params"] == (plan.params_total + trained) * 4 // 2


def test_a_rank_near_the_nodes_memory_says_so_once_per_phase(tmp_path):
    """The memory watch (every trainer rank runs one): a line naming the phase, the rank's RSS
    and the plan's figure once the node has under 5% free and the rank holds more than its plan;
    nothing while the node has room or the rank is within its plan; once per phase."""
    from megagrpo.monitoring import MemoryWatch, PhaseClock, StartupTimeline

    meminfo = tmp_path / "meminfo"

    def node(total_gib, free_gib):
        meminfo.write_text(f"MemTotal: {int(total_gib * 2**20)} kB\nMemFree: 1 kB\n"
                           f"MemAvailable: {int(free_gib * 2**20)} kB\n")

    watch = MemoryWatch(rank=1, planned_gib=0.01, meminfo=str(meminfo))
    StartupTimeline(watch).lap("model")
    assert watch.phase == "model"
    PhaseClock(watch).lap("reference")
    node(100, 10)
    assert watch.check() is None  # 10% free
    node(100, 4)
    line = watch.check()
    assert line.startswith("[megagrpo] rank 1: the node has 4.00 of 100.00 GiB free and this rank holds ")
    assert "above the plan's 0.01 GiB per rank, after the 'reference' phase" in line
    assert watch.check() is None  # said once for this phase
    PhaseClock(watch).lap("train")
    assert "after the 'train' phase" in watch.check()
    PhaseClock().lap("rollout")  # a clock without the watch does not move its phase
    assert watch.phase == "train" and watch.check() is None
    assert MemoryWatch(rank=0, planned_gib=1e6, meminfo=str(meminfo)).check() is None  # within its plan
    assert "(no plan of host memory" in MemoryWatch(rank=0, planned_gib=None, meminfo=str(meminfo)).check()
    assert MemoryWatch(rank=0, planned_gib=None, meminfo=str(tmp_path / "absent")).check() is None


def test_sequence_parallel_plan_splits_activations_and_refuses_a_trajectory_the_kv_cache_cannot_hold(
        tiny, tmp_path, monkeypatch, capsys):
    """sp 2 on 4 ranks: ZeRO partitions over dp x sp (4), each rank's activations are half a
    row, the all-to-all's buffers counted; `plan` prints the sp slices and the longest sequence
    that trains, which sp lengthens. A co-located CPU engine whose KV cache cannot hold one
    trajectory is refused before launch with the numbers that would fit."""
    from megagrpo.cli import main as cli
    from megagrpo.planning import make_plan

    base = tiny_overrides(tiny, tmp_path) + ["rollout.max_new_tokens=2048"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    one = make_plan(load_config("configs/tiny_arith.yaml", base), 4)
    two = make_plan(load_config("configs/tiny_arith.yaml", base + ["parallel.sequence_parallel_size=2"]), 4)
    assert (two.dp, two.sp, two.zero_partitions) == (2, 2, 4)
    assert two.bytes_per_rank == one.bytes_per_rank  # ZeRO-3 over 4 ranks either way
    assert two.peak["activations"] * 2 == pytest.approx(one.peak["activations"], rel=1e-3)
    assert two.peak["sequence_parallel"] > 0 == one.peak["sequence_parallel"]
    longest = {}
    for sp in (1, 2):
        assert cli(["plan", "--config", "configs/tiny_arith.yaml", "--world-size", "4", "--node-memory-gib", "12",
                    *base, f"parallel.sequence_parallel_size={sp}"]) == 0
        out = capsys.readouterr().out
        longest[sp] = int(re.search(r"longest sequence that trains in this memory: (\d+) tokens", out).group(1))
    assert "world 4 = dp 2 x sp 2 x tp 1 x pp 1" in out and "    3        1       1/1         0             2/2" in out
    assert longest[2] > 1.5 * longest[1] > 0, longest
    per_token = 2 * 2 * 2 * 64 * 4  # K and V x 2 layers x 2 kv heads x 64 x float32
    with pytest.raises(ConfigError, match=rf"rollout.cpu_kv_cache_gb=0.001 holds {2**30 // 1000 // per_token} tokens "
                                          r"of this model's KV cache \(2048 bytes each\), fewer than one "
                                          r"trajectory's 2\d\d\d .* raise rollout.cpu_kv_cache_gb to 0.00"):
        load_config("configs/tiny_arith.yaml", base + ["rollout.cpu_kv_cache_gb=0.001"])


def test_the_peak_counts_the_pass_or_the_optimizer_step_whichever_is_larger(tiny, tmp_path):
    """The forward and backward's transients are freed before the optimizer step allocates its
    own (bench/long_context.py measures the two phases' peaks apart): Qwen2.5-0.5B's shape in
    bf16 on 2 ranks, ZeRO-3. With short micro-batches the step sets the peak, so a longer
    micro-batch adds nothing until the pass outgrows the step; then it adds its activations."""
    from megagrpo.planning import PASS_PARTS, STEP_PARTS, format_plan, make_plan, peak_total
    model = tmp_path / "qwen2.5-0.5b"
    run([PYTHON, "tools/make_tiny_model.py", "--shape", "qwen2.5-0.5b", "--config-only", "--out", str(model)])

    def plan(tokens):
        return make_plan(load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
            f"model.name_or_path={model}", "model.dtype=bfloat16", "deepspeed=configs/ds_zero3_bf16.json",
            "model.gradient_checkpointing=false", "grpo.logprob_chunk_size=64",
            f"grpo.max_tokens_per_microbatch={tokens}"]), 2)

    def phases(p):
        held = sum(v for k, v in p.peak.items() if k not in PASS_PARTS + STEP_PARTS)
        return held, sum(p.peak.get(k, 0) for k in PASS_PARTS), sum(p.peak.get(k, 0) for k in STEP_PARTS)

    short, middle, long = plan(128), plan(512), plan(8192)
    held, pass_bytes, step_bytes = phases(short)
    assert pass_bytes < step_bytes and peak_total(short.peak) == held + step_bytes
    assert peak_total(middle.peak) == peak_total(short.peak)  # more activations, the same peak
    held_long, pass_long, _ = phases(long)
    assert pass_long > step_bytes and held_long == held
    assert peak_total(long.peak) == held + pass_long < sum(long.peak.values())
    total = re.search(r"\n  total +([\d.]+) GiB", format_plan(long)).group(1)
    assert float(total) == pytest.approx(peak_total(long.peak) / 2**30, abs=1e-3)


def _moe_plan(tiny, tmp_path, model, world, *overrides):
    from megagrpo.planning import make_plan
    return make_plan(load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        f"model.name_or_path={model}", "model.dtype=bfloat16", "grpo.kl_coef=0.02", *overrides]), world)


def test_the_plan_splits_a_mixture_of_experts_per_rank(tiny, tmp_path, monkeypatch):
    """The tiny Qwen3-MoE by hand (tools/make_tiny_model.py --arch qwen3_moe --config-only: 2
    layers of 8 experts of width 128, top 2, hidden 128, vocabulary 512, a tied head), on 4
    ranks in bf16 (2 + 2 + 12 bytes). AutoEP (ep e) leaves E/e experts per layer on a rank, and
    ZeRO partitions them over the dp/e ranks holding the same ones: under ZeRO-3 a rank's
    bytes are the same for any e, under ZeRO-1 its weights and gradients shrink by e and its
    optimizer state does not. The reference and vLLM hold every expert (built without AutoEP)."""
    from megagrpo.planning import activation_bytes_per_token, format_plan, microbatch_tokens, model_config
    model = tmp_path / "qwen3_moe"
    run([PYTHON, "tools/make_tiny_model.py", "--arch", "qwen3_moe", "--config-only", "--out", str(model)])
    experts = 2 * 8 * (2 * 128 * 128 + 128 * 128)  # gate_up [8, 256, 128] and down [8, 128, 128] per layer
    # the embedding (the head tied to it), per layer q/k/v/o, q and k norms, the router [8, 128]
    # and two norms, the final norm
    dense = 512 * 128 + 2 * (4 * 128 * 128 + 2 * 64 + 8 * 128 + 2 * 128) + 128
    monkeypatch.setenv("WORLD_SIZE", "4")
    cases = {  # (ZeRO stage, e) -> (params, grads, optimizer), each (all, experts') bytes per rank
        (1, 1): ((dense + experts) * 2, experts * 2), (1, 2): ((dense + experts // 2) * 2, experts // 2 * 2),
        (1, 4): ((dense + experts // 4) * 2, experts // 4 * 2),
        (3, 1): ((dense + experts) * 2 // 4, experts * 2 // 4), (3, 2): ((dense + experts) * 2 // 4, experts * 2 // 4),
        (3, 4): ((dense + experts) * 2 // 4, experts * 2 // 4)}
    for (stage, ep), weights in cases.items():
        plan = _moe_plan(tiny, tmp_path, model, 4, f"deepspeed=configs/ds_zero{stage}.json",
                         f"parallel.expert_parallel_size={ep}")
        assert (plan.ep, plan.params_total, plan.params_experts) == (ep, dense + experts, experts)
        assert plan.params_trained == dense + experts // ep  # this rank's, before ZeRO
        got = {k: (plan.bytes_per_rank[k], plan.expert_bytes[k]) for k in plan.bytes_per_rank}
        assert got["params"] == weights and got["grads"] == weights, (stage, ep, got)
        # Adam over the dp/e ranks holding the same experts: 1/4 of every expert either way
        assert got["optimizer"] == (dense * 12 // 4 + experts * 12 // 4, experts * 12 // 4), (stage, ep)
        whole = ((dense + experts) * 2, experts * 2)
        assert got["reference"] == (whole if stage == 1 else (whole[0] // 4, whole[1] // 4)), (stage, ep)
        assert got["rollout_weights"] == whole  # vLLM at tp 1: the whole model
        if stage == 3:  # ZeRO-3 gathers this rank's share: its own experts only
            assert plan.peak["gathered_params"] == (dense + experts // ep) * 2
    # e 2 on ZeRO-3: the pass adds AutoEP's exchange (tokens x top 2 x 128, sent and received,
    # dispatch and combine), the weight sync one layer's 8 experts gathered (4/3 of them)
    tokens = microbatch_tokens(load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path)))
    plan = _moe_plan(tiny, tmp_path, model, 4, "parallel.expert_parallel_size=2")  # ZeRO-3
    assert plan.peak["expert_parallel"] == 4 * tokens * 2 * 128 * 2
    assert plan.peak["expert_gather"] == 4 * (experts // 2) * 2 // 3
    assert "expert_parallel" not in _moe_plan(tiny, tmp_path, model, 4).peak  # ep 1: no exchange
    text = format_plan(plan)
    assert "world 4 = dp 4 (ep 2: each layer's experts split over 2 of them) x tp 1 x pp 1" in text
    assert ("experts: 0.79M parameters in 2 MoE layers of 8 experts (top 2), 4 per rank (ep 2); dense "
            "(attention, routers, embeddings, norms): 0.20M") in text
    assert "  params                0.47 MiB  (experts 0.38 MiB, dense 0.10 MiB)" in text
    assert "expert_gather" in text and "(the weight sync)" in text
    # activations per token, one MoE layer: 14 h + 2 x (2 h + 6 x 128) values in bf16, the norms'
    # float32 inputs (4 h bytes), the router's 8 float32 probabilities and 64 bytes per routed copy
    layer = 2 * (14 * 128 + 2 * (2 * 128 + 6 * 128)) + 4 * 128 + 4 * 8 + 64 * 2
    config = model_config(str(model))
    assert activation_bytes_per_token(config, 2, "bfloat16", checkpointing=False) == 2 * layer
    assert activation_bytes_per_token(config, 2, "bfloat16", checkpointing=True) == 2 * 2 * 128 + layer


MOE_SHAPES = {  # the published config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B
    "configs/qwen3_30b_a3b_1x8.yaml": (8, dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                               num_attention_heads=32, num_hidden_layers=48)),
    "configs/qwen3_235b_a22b_4x8.yaml": (32, dict(hidden_size=4096, intermediate_size=12288,
                                                  moe_intermediate_size=1536, num_attention_heads=64,
                                                  num_hidden_layers=94))}


def test_the_shipped_moe_configs_fit_80_gib_gpus_as_their_headers_say(tiny, tmp_path, monkeypatch):
    """Qwen3-30B-A3B on 1 x 8 and Qwen3-235B-A22B on 4 x 8 as shipped, their architecture from a
    local config.json (nothing downloaded), planned as on 80 GiB GPUs: the header's parameters,
    trainer weights per GPU and planned peak are the plan's, and the peak is under the 90% that
    `megagrpo plan --check-memory` allows. The optimizer state is offloaded to host memory."""
    from transformers import Qwen3MoeConfig

    import megagrpo.planning as planning
    gpu = 80 * 2**30
    monkeypatch.setattr(planning, "_device", lambda: "cuda")
    monkeypatch.setattr(planning, "engine_bytes", lambda cfg, weights: int(cfg.rollout.gpu_memory_utilization * gpu))
    data = [f"data.train_file={tiny['data']}/train.jsonl", f"data.eval_file={tiny['data']}/eval.jsonl"]
    for config, (world, shape) in MOE_SHAPES.items():
        model = tmp_path / config.split("/")[1].removesuffix(".yaml")
        Qwen3MoeConfig(**shape, num_experts=128, num_experts_per_tok=8, num_key_value_heads=4, head_dim=128,
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936,
                       tie_word_embeddings=False).save_pretrained(model)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        cfg = load_config(config, data)  # as shipped: a hub name
        assert cfg.model.name_or_path.startswith("Qwen/Qwen3-") and cfg.parallel.expert_parallel_size == 8
        plan = planning.make_plan(load_config(config, data + [f"model.name_or_path={model}"]), world)
        header = open(config).read().split("\nmodel:")[0]
        assert (plan.dp, plan.ep, plan.zero_stage, list(plan.offloaded)) == (world, 8, 3, ["optimizer"])
        assert f"{plan.params_total / 1e9:.1f}B parameters, {plan.params_experts / 1e9:.1f}B of them experts" in header
        gib = {k: f"{v / 2**30:.1f}" for k, v in plan.bytes_per_rank.items()}
        assert f"weights {gib['params']} + gradients {gib['grads']}" in header
        assert f"Adam moments ({gib['optimizer']} GiB per rank" in header
        peak = planning.peak_total(plan.peak)
        assert f"Planned peak (megagrpo plan, 80 GiB GPU): {peak / 2**30:.1f} GiB per GPU" in header
        assert peak <= 0.9 * gpu and plan.peak["optimizer_step"] == 0 and plan.peak["reference"] == 0
