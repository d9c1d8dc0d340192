"""Generation by an external `vllm serve` (rollout.servers; megagrpo/rollout/servers.py): a real
server of the tiny model started here, 2 trainer ranks (ZeRO-3) through torchrun sending it
their prompts and, from rank 0, their weights after every step (vLLM's weight-transfer API, the
gloo backend). At staleness 0 the run equals the co-located 2-rank run on the same seeds: the
same completions, so the same losses, held-out scores and parameters. A server that dies
mid-run stops the job, naming its URL, with the last checkpoint intact."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
import torch
from conftest import BIN, ROOT, free_port, run, signal_job, tiny_overrides, torchrun
from runs import assert_same_run, values
from safetensors.torch import load_file

from megagrpo.checkpoints import rollouts_ahead
from megagrpo.checkpoints.rollouts_ahead import load_rollouts_ahead
from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.config.schema import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import daemons  # noqa: E402

COMMON = ["grpo.max_steps=3", "grpo.per_device_train_batch_size=16", "logging.sample_steps=0",
          "checkpoint.save_steps=0"]
# as the co-located engine samples: the trainer's log-probs (processed), prompts prefilled whole
SERVER_ARGS = ("--weight-transfer-config", '{"backend": "gloo"}', "--logprobs-mode", "processed_logprobs",
               "--no-enable-chunked-prefill", "--enable-scale-out")  # (the token route: partial rollouts)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """One `vllm serve` of the tiny model for the module's runs (each job puts its own weights in
    at start-up)."""
    with daemons.vllm_server(tiny["warm"], tmp_path_factory.mktemp("server"), *SERVER_ARGS) as url:
        yield url


@pytest.fixture(scope="module")
def colocated(tiny, tmp_path_factory):
    """The co-located 2-rank run both placements of generation apart are held equal to."""
    out = tmp_path_factory.mktemp("colocated")
    _train(tiny, out)
    return out


def _assert_equal_runs(expected, got):
    """The same completions, token for token (runs.assert_same_run): the same losses, gradient
    norms, prompts, rewards and lengths, held-out scores and parameters."""
    assert len(values(got, "train/loss")) == 3
    assert_same_run(got, expected, loss_atol=1e-6, grad_norm_rtol=1e-4, param_atol=1e-6)
    assert json.load(open(got / "eval_results.json")) == json.load(open(expected / "eval_results.json"))


def _train(tiny, out, *overrides):
    return run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), *COMMON, *overrides], timeout=600)


def _kill_after_first_checkpoint(tiny, dying, ranks, overrides, kill, warm=True):
    """Start a 40-step job, call kill(job) once its step-1 checkpoint exists, and wait for the
    job to end: (its output, the seconds from the kill to its end, its exit code). warm=False:
    its ranks are torchrun's children (conftest.torchrun)."""
    job = subprocess.Popen(
        [*torchrun(ranks, "-m", "megagrpo.train", warm=warm), "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, dying), "grpo.max_steps=40", "checkpoint.save_steps=1", "data.eval_file=null",
         *overrides],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (dying / "checkpoints" / "step_00000001").exists():
            assert job.poll() is None and time.time() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.5)
        kill(job)
        killed = time.time()
        out, _ = job.communicate(timeout=120)
        return out, time.time() - killed, job.returncode
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


@pytest.mark.daemons
@pytest.mark.multirank
def test_sampled_ahead_with_staleness_bounded_and_resumed_exactly(tiny, tmp_path, server):
    """rollout.max_staleness=1: the batch of step t+1 is sampled while step t trains. Every batch
    after the first is one step old (never more), and the run SIGKILLed after its step-2
    checkpoint (which holds the batch sampled for step 3) and started again trains on the same
    tokens as the run that was not killed, its logs holding each step once."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    ahead = ["rollout.max_staleness=1", f"rollout.servers=[{server}]", "grpo.max_steps=6", "data.eval_file=null",
             "grpo.importance_sampling_correction=token_truncate", "checkpoint.save_steps=2"]
    _train(tiny, whole, *ahead)
    assert values(whole, "train/rollout/staleness") == [0, 1, 1, 1, 1, 1]
    assert max(values(whole, "train/rollout/staleness_max")) == 1

    command = [*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
               *tiny_overrides(tiny, killed), *COMMON, *ahead]
    job = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    latest, seen = killed / "checkpoints" / "latest", killed / "prompts_seen.jsonl"
    deadline = time.time() + 300
    while not (latest.is_file() and latest.read_text() == "step_00000002" and seen.is_file()
               and '"step": 3' in seen.read_text()):
        assert job.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.1)
    signal_job(job.pid, signal.SIGKILL)  # the launcher and both ranks
    job.wait()
    checkpoint = killed / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in checkpoint.glob("rollouts_ahead_rank*")) == [
        "rollouts_ahead_rank0.json", "rollouts_ahead_rank1.json"]
    resumed = run(command, timeout=600)
    assert "at step 2" in resumed.stdout
    assert_same_run(killed, whole)  # each step once, the same values, prompts and parameters, bit for bit
    assert values(killed, "train/rollout/staleness") == [0, 1, 1, 1, 1, 1]
    # a checkpoint with a batch ahead resumed without sampling ahead is refused (its sampler is past
    # the saved batch); step 2's was pruned (checkpoint.keep_last), step 4's holds step 5's batch
    checkpoint = str(killed / "checkpoints" / "step_00000004")
    with pytest.raises(ConfigError, match="resume it with rollout.max_staleness > 0"):
        load_rollouts_ahead({"path": checkpoint, "dp_size": 2}, rank=0, max_staleness=0)
    assert len(load_rollouts_ahead({"path": checkpoint, "dp_size": 2}, rank=1, max_staleness=1)) == 1


def _server_metric(url: str, name: str) -> float:
    """One of the server's Prometheus metrics, summed over its labels."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def _sample_through_an_update(generator, server, prompts, new_weights):
    """Sample 8 completions of each prompt, sending `new_weights` (as step 7) once the server has
    sampled the first tokens of them; starts with the server idle."""
    from concurrent.futures import ThreadPoolExecutor

    deadline = time.time() + 60
    while _server_metric(server, "vllm:num_requests_running") + _server_metric(server, "vllm:num_requests_waiting"):
        assert time.time() < deadline, "the server is still busy with an earlier test's requests"
        time.sleep(0.05)
    with ThreadPoolExecutor(max_workers=1) as side:
        sampled_before = _server_metric(server, "vllm:generation_tokens_total")
        sampling = side.submit(generator.generate, prompts, 8, [11, 12])
        while _server_metric(server, "vllm:generation_tokens_total") == sampled_before:
            assert time.time() < deadline and not sampling.done()
            time.sleep(0.01)
        generator.load_weights(iter(new_weights.items()), step=7)
        return sampling.result(timeout=120)


@pytest.mark.daemons
def test_a_request_paused_through_an_update_goes_on_with_the_new_weights(tiny, tmp_path, server):
    """rollout.partial_rollouts, in this process: a batch of requests is sampling when new
    weights are sent (the update starts once the server has sampled its first tokens of them);
    the requests pause (pause mode keep), take the weights and go on. The server tags each token
    with the weights that sampled it, named by their training step: a completion's versions are
    in order, and a token's sampler log-prob is that of its weights, before the update those the
    batch started with (within 1e-4, as the co-located sync's test holds the engine to the
    trainer), after it not (what a token after the update saw: the new weights, and the keys and
    values that the older ones computed; no single model reproduces it)."""
    from transformers import AutoModelForCausalLM

    from megagrpo.rollout.servers import ServerGenerator
    from megagrpo.stack import build_rollout_stack
    from megagrpo.validation import load_config

    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        f"rollout.servers=[{server}]", "rollout.max_staleness=1", "rollout.partial_rollouts=true",
        "rollout.max_new_tokens=448"])
    prompts = [p.token_ids for p in build_rollout_stack(cfg).prompts[:2]]
    # the random tiny model: it seldom stops before max_new_tokens, so its requests outlast an update
    start = AutoModelForCausalLM.from_pretrained(tiny["model"], torch_dtype=torch.float32).eval()
    moved = {name: p.detach() + 0.05 * torch.randn_like(p) for name, p in start.named_parameters()}
    generator = ServerGenerator(cfg, [server])
    try:
        # whether the update lands before the last request ends is a race (CI once lost it): at
        # most 3 tries, each checked in full below
        tries, completions = [], lambda: [c for groups in tries for group in groups for c in group]
        while len(tries) < 3 and not any(len(set(c.versions)) == 2 for c in completions()):
            generator.load_weights(start.named_parameters(), step=6)
            tries.append(_sample_through_an_update(generator, server, prompts, moved))
    finally:
        generator.close()
    gaps = {6: [], 7: []}  # |sampler log-prob - the starting weights'| by version
    for prompt, group in ((p, g) for groups in tries for p, g in zip(prompts, groups)):
        for c in group:
            assert len(c.versions) == len(c.token_ids) == len(c.logprobs)
            assert c.versions == sorted(c.versions) and set(c.versions) <= {6, 7}, c.versions
            with torch.no_grad():  # temperature 1: the processed log-probs are log_softmax(logits)
                logits = start(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
            scored = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            for version, sampled, started in zip(c.versions, c.logprobs, scored.tolist()):
                gaps[version].append(abs(sampled - started))
    assert any(len(set(c.versions)) == 2 for c in completions()), [sorted(set(c.versions)) for c in completions()]
    before, after = gaps[6], gaps[7]
    assert before and after
    assert max(before) < 1e-4, max(before)  # sampled with the starting weights: theirs
    assert sum(after) / len(after) > 1e-3, sum(after) / len(after)  # sampled with the new ones


@pytest.mark.daemons
def test_an_outside_agent_generates_through_the_server_one_step_ahead(tiny, tmp_path, server):
    """rollout.agent with rollout.servers and max_staleness 1: an `openai`-SDK agent's episodes
    (3 model calls each, the earlier turns sent back reworded) reach the server batched, the
    trainer's log-probs equal the server's, and each step's agent metrics are its own batch's,
    though that batch was sampled a step before it is scored."""
    from test_outside_agents import AGENT, HELPERS

    out = tmp_path / "agent"
    run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, out),
         *AGENT, "rollout.agent=openai_tool_agent:solve_streaming_rerendering", f"rollout.servers=[{server}]",
         "rollout.max_staleness=1", "grpo.max_steps=3", "checkpoint.save_steps=0"], env=HELPERS, timeout=600)
    assert values(out, "train/rollout/staleness") == [0.0, 1.0, 1.0]
    assert values(out, "train/agent/episodes") == [16.0] * 3
    assert values(out, "train/agent/model_calls_per_episode") == [3.0] * 3
    assert values(out, "train/agent/prefix_mismatches_per_episode") == [2.0] * 3
    # every step's batch went to the server in batched calls (read from the batch itself: the
    # next one is in flight when a step logs)
    assert all(v > 1 for v in values(out, "train/agent/requests_per_generator_call_max"))
    assert max(values(out, "train/sampling/sampling_logp_difference/max")) < 1e-4


@pytest.mark.daemons
@pytest.mark.multirank
def test_partial_rollouts_in_a_run_resumed(tiny, tmp_path, server):
    """rollout.partial_rollouts in a 2-rank run (the requests in flight at an update go on):
    each saved batch's completions carry versions in order, within the step it was started at
    and the next; staleness, counted from a batch's oldest token, stays within 1; and the run
    resumed from its step-1 checkpoint (the servers now name the weights by their training step,
    as the batches do) goes on within the bound."""
    out = tmp_path / "partial"
    partial = [f"model.name_or_path={tiny['model']}", "rollout.max_new_tokens=448", "data.eval_file=null",
               f"rollout.servers=[{server}]", "rollout.max_staleness=1", "rollout.partial_rollouts=true",
               "grpo.per_device_train_batch_size=8", "grpo.learning_rate=1e-3", "checkpoint.save_steps=1",
               "checkpoint.keep_last=3", "checkpoint.save_hf_at_end=false"]
    _train(tiny, out, *partial)
    assert values(out, "train/rollout/staleness") == [0, 1, 1]
    assert len(values(out, "train/rollout/partial_token_share")) == 3
    # checkpoint n holds step n+1's batch, started with the weights after n-1 steps
    for n in (1, 2, 3):
        for batch in rollouts_ahead.read(out / "checkpoints" / f"step_{n:08d}" / "rollouts_ahead_rank0.json"):
            assert batch.version == n - 1
            for c in (c for group in batch.groups for c in group):
                assert len(c.versions) == len(c.token_ids) == len(c.logprobs)
                assert c.versions == sorted(c.versions) and set(c.versions) <= {n - 1, n}
    again = tmp_path / "resumed"
    resumed = _train(tiny, again, *partial, f"checkpoint.resume={out / 'checkpoints' / 'step_00000001'}")
    assert "at step 1" in resumed.stdout
    assert values(again, "train/rollout/staleness") == [1, 1]


@pytest.mark.daemons
@pytest.mark.multirank
def test_server_run_equals_colocated_and_a_dead_server_stops_the_job(tiny, tmp_path, server, colocated):
    served = tmp_path / "served"
    url = server
    proc = _train(tiny, served, f"rollout.servers=[{url}]")
    # each update named by the training steps in its weights
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == "3"
    _assert_equal_runs(colocated, served)
    a = load_file(str(colocated / "hf" / "model.safetensors"))
    start = load_file(os.path.join(tiny["warm"], "model.safetensors"))
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # training moved them
    assert "vLLM server" not in proc.stderr

    # the server dies mid-run: the job stops naming it; the checkpoint before is intact
    def kill_the_server(job):
        server = daemons.server_process(url)
        for process in [server, *server.children(recursive=True)]:
            process.send_signal(signal.SIGKILL)

    dying = tmp_path / "dying"
    out, seconds, code = _kill_after_first_checkpoint(
        tiny, dying, 2, [f"rollout.servers=[{url}]", "rollout.server_timeout_s=5", "rollout.server_retries=1"],
        kill_the_server)
    assert code != 0 and seconds < 60, out[-3000:]
    assert f"vLLM server {url}" in out, out[-3000:]
    saved = sorted(p.name for p in (dying / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved and (dying / "checkpoints" / saved[-1] / "COMPLETE").exists(), saved


def test_server_settings_refused_with_the_fix(tiny, tmp_path):
    from megagrpo.planning import format_plan, make_plan
    from megagrpo.validation import load_config

    base = tiny_overrides(tiny, tmp_path)
    cfg = load_config("configs/tiny_arith.yaml", base + ["rollout.servers=[http://node7:8000]"])
    assert cfg.rollout.servers == ["http://node7:8000"] and generator_layout(cfg).ranks_per_group == 1
    plan = make_plan(cfg, 2)
    assert plan.bytes_per_rank["rollout_weights"] == 0 and plan.peak["rollout"] == 0  # the servers' memory
    assert "generation on 1 vLLM server(s) apart from the job, max staleness 0" in format_plan(plan)
    for bad, message in [
            ("rollout.servers=[node7:8000]", r"rollout.servers\[0\]: 'node7:8000' is not a server URL; write "
                                             r"http://HOST:PORT"),
            ("rollout.engine=hf", r"rollout.servers are vLLM servers: remove rollout.engine=hf"),
            ("rollout.tensor_parallel_size=2", r"shard a server with its own --tensor-parallel-size"),
            ("rollout.server_retries=-1", r"rollout.server_retries=-1 must be >= 0"),
            ("rollout.max_staleness=1", r"rollout.max_staleness=1 samples ahead on servers"),
            ("grpo.dynamic_sampling=true", r"with grpo.dynamic_sampling: the rounds of a step depend on its rewards")]:
        extra = {"rollout.servers=[node7:8000]": [bad], "rollout.max_staleness=1": [bad],
                 "grpo.dynamic_sampling=true": ["rollout.servers=[http://node7:8000]", "rollout.max_staleness=1", bad]
                 }.get(bad, ["rollout.servers=[http://node7:8000]", bad])
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny_arith.yaml", base + extra)


@pytest.mark.multirank
def test_an_outside_agent_generates_on_the_jobs_generating_rank(tiny, tmp_path):
    """rollout.placement=disaggregated with rollout.agent: 2 training ranks, each with its own
    endpoint, and 1 generating rank running the job's vLLM server. The `openai`-SDK agent's
    episodes (3 model calls each) reach the server batched, and the trainer's log-probs equal
    the server's."""
    from test_outside_agents import AGENT, HELPERS

    out = tmp_path / "agent"
    run([f"{BIN}/deepspeed", "--num_gpus", "3", "--master_port", str(free_port()), "--module", "megagrpo.train",
         "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, out), *AGENT,
         "rollout.agent=openai_tool_agent:solve_streaming", "rollout.placement=disaggregated", "rollout.ranks=1",
         "grpo.max_steps=2", "checkpoint.save_steps=0"], env=HELPERS, timeout=600)
    assert values(out, "train/agent/episodes") == [32.0] * 2  # 16 on each training rank
    assert values(out, "train/agent/model_calls_per_episode") == [3.0] * 2
    assert values(out, "train/agent/failed_crash") == values(out, "train/agent/failed_timeout") == [0.0] * 2
    assert all(v > 1 for v in values(out, "train/agent/requests_per_generator_call_max"))
    assert max(values(out, "train/sampling/sampling_logp_difference/max")) < 1e-4
    assert len(values(out, "train/loss")) == 2


@pytest.mark.multirank
def test_generating_ranks_in_the_job_equal_colocated(tiny, tmp_path, colocated):
    """rollout.placement=disaggregated: 3 ranks through the deepspeed launcher, ranks 0-1 train
    (ZeRO-3) in a world of their own and rank 2 runs the job's vLLM server, meeting them in the
    rendezvous store that trainer rank 0's process holds; the run equals the co-located one, and
    the server is gone with the job. A generating rank SIGKILLed mid-run (torchrun, whose agent
    holds the store) ends the job non-zero within 60 s, naming the rank, and its server goes
    with it."""
    out = tmp_path / "disaggregated"
    proc = run([f"{BIN}/deepspeed", "--num_gpus", "3", "--master_port", str(free_port()), "--module",
                "megagrpo.train", "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, out), *COMMON,
                "rollout.placement=disaggregated", "rollout.ranks=1"], timeout=600)
    _assert_equal_runs(colocated, out)
    assert "world 2 = dp 2 x tp 1 x pp 1" in proc.stdout  # the trainers' world
    url = proc.stdout.split("generator server 0 serving at ", 1)[1].split()[0]
    assert (out / "vllm_server_0.log").exists()
    with pytest.raises(StopIteration):  # the server ended with the job
        daemons.server_process(url)


    # the generating rank SIGKILLed after the first checkpoint (a lost process, not a clean exit)
    server = []

    def kill_the_generating_rank(job):
        generating = next(p for p in psutil.Process(job.pid).children(recursive=True)
                          if "megagrpo.train" in " ".join(p.cmdline()) and p.environ().get("RANK") == "2")
        server.extend(generating.children(recursive=True))
        assert server and "api_server" in " ".join(server[0].cmdline())
        generating.send_signal(signal.SIGKILL)

    out, seconds, code = _kill_after_first_checkpoint(tiny, tmp_path / "dying", 3,
                                                      ["rollout.placement=disaggregated", "rollout.ranks=1"],
                                                      kill_the_generating_rank, warm=False)
    assert code != 0 and seconds < 60, out[-3000:]
    assert re.search(r"rank\s*: 2 \(local_rank: 2\)\s+exitcode\s*: -9", out), out[-3000:]
    psutil.wait_procs(server, timeout=60)
    left = [p for p in server if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"the server outlived its rank: {left}"


def test_a_server_that_cannot_start_stops_its_generating_rank_naming_its_log(tiny, tmp_path, monkeypatch):
    """A generating rank's whole job (serving.serve), in this process against a rendezvous store
    of its own: its server cannot start (a KV cache too small for one sequence), and the rank
    stops with an error naming the server and its log, whose cause (vLLM's error further up) and
    tail it shows."""
    from torch.distributed import TCPStore

    from megagrpo.cluster.placement import Placement
    from megagrpo.rollout.serving import ServingError, serve
    from megagrpo.validation import load_config

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the launch's, as rank 0 holds it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config("configs/tiny_arith.yaml", tiny_overrides(tiny, tmp_path) + [
        "rollout.placement=disaggregated", "rollout.ranks=1", "rollout.cpu_kv_cache_gb=0.00001",
        "rollout.server_timeout_s=300"])
    with pytest.raises(ServingError, match=r"generator server 0 \(http://[\d.]+:\d+\) exited with 1; its log: "
                                           rf"{tmp_path}/vllm_server_0.log:\n\.\.\. .*ValueError: No available memory "
                                           r"for the cache blocks(.|\n)*Engine core initialization failed"):
        serve(cfg, Placement(rank=2, world_size=3, generating_ranks=1, generator_tp=1))


def test_disaggregated_settings_refused_with_the_fix(tiny, tmp_path, monkeypatch):
    from megagrpo.planning import format_plan, make_plan
    from megagrpo.validation import load_config

    base = tiny_overrides(tiny, tmp_path) + ["rollout.placement=disaggregated"]
    monkeypatch.setenv("WORLD_SIZE", "6")
    cfg = load_config("configs/tiny_arith.yaml", base + ["rollout.ranks=2", "rollout.tensor_parallel_size=2",
                                                         "rollout.max_staleness=1"])
    plan = make_plan(cfg, 6)
    assert (plan.dp, plan.generating_ranks, len(plan.ranks)) == (4, 2, 4)
    assert plan.peak["rollout"] == 0 and plan.generating_peak > 0
    text = format_plan(plan)
    assert "world 6 = 4 training (dp 4 x tp 1 x pp 1) + 2 generating, generation on ranks 4-5: 1 vLLM server(s) " \
           "of tp 2, max staleness 1" in text and "peak memory per generating rank" in text
    # the job's servers get the co-located engine's settings, and the token route with partial rollouts
    from megagrpo.cluster.placement import Placement
    from megagrpo.rollout.serving import server_command
    command = server_command(cfg, Placement(4, 6, 2, 2), "10.0.0.5", 8000)
    assert "--tensor-parallel-size 2" in " ".join(command) and "--enable-scale-out" not in command
    partial = load_config("configs/tiny_arith.yaml", base + ["rollout.ranks=2", "rollout.max_staleness=1",
                                                             "rollout.partial_rollouts=true"])
    assert "--enable-scale-out" in server_command(partial, Placement(4, 6, 2, 1), "10.0.0.5", 8000)
    for bad, message in [
            ("rollout.ranks=0", r"needs rollout.ranks >= 1 \(now 0\)"),
            ("rollout.ranks=3", r"rollout.ranks=3 is not a whole number of servers of rollout.tensor_parallel_size=2"),
            ("rollout.ranks=6", r"rollout.ranks=6 leaves no rank to train in a launch of 6"),
            ("rollout.servers=[http://node7:8000]", r"remove rollout.servers"),
            ("parallel.tensor_parallel_size=3", r"world size 4 is not divisible by tensor_parallel_size x "
                                                r"pipeline_parallel_size x sequence_parallel_size = 3 x 1 x 1"),
            ("rollout.partial_rollouts=true", r"rollout.partial_rollouts continues the batches sampled ahead across "
                                              r"a weight update: set rollout.max_staleness >= 1")]:
        extra = ["rollout.ranks=2"] if bad.startswith(("rollout.servers", "parallel", "rollout.partial")) else []
        with pytest.raises(ConfigError, match=message):
            load_config("configs/tiny_arith.yaml", base + ["rollout.tensor_parallel_size=2", *extra, bad])
