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
        return held, sum(p.peak[k] for k in PASS_PARTS), sum(p.peak[k] for k in STEP_PARTS)

    short, middle, long = plan(128), plan(512), plan(8192)
    held, pass_bytes, step_bytes = phases(short)
    assert pass_bytes < step_bytes and peak_total(short.peak) == held + step_bytes
    assert peak_total(middle.peak) == peak_total(short.peak)  # more activations, the same peak
    held_long, pass_long, _ = phases(long)
    assert pass_long > step_bytes and held_long == held
    assert peak_total(long.peak) == held + pass_long < sum(long.peak.values())
    total = re.search(r"\n  total +([\d.]+) GiB", format_plan(long)).group(1)
    assert float(total) == pytest.approx(peak_total(long.peak) / 2**30, abs=1e-3)
