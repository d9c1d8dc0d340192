"""Generators (rollout engines): sample G completions per prompt and take new weights in place.

Both have the same interface:
    generate(prompt_ids, n, seeds, greedy=False, max_tokens=None, vision=None) -> per prompt, n Completions
    logprobs(requests) -> per (token_ids, prompt_len[, vision]), the log-probs of token_ids[prompt_len:]
    load_weights(named_tensors, partial=False, step=0)   # (HF name, tensor) stream; no restart, no disk
    sleep() / wake_up(tags)       # free accelerator memory while the trainer runs

`VLLMGenerator` runs vLLM inside this training process (external_launcher executor, created
after the job's process group), sharded over rollout.tensor_parallel_size consecutive ranks
(rollout/generator_group.py: how those ranks call it; rollout/vllm_settings.py: its
settings). `HFGenerator` runs transformers' generate on its own copy of the model: the
fallback, and the correctness reference for the vLLM path.
Sampler logprobs are log-softmax(logits / temperature) of the sampled token, as the trainer
computes them (vLLM's processed_logprobs).
A prompt with images comes with its multimodal.processor.VisionPrompt (`vision`, per prompt):
vLLM gets the images as multi_modal_data beside the template's tokens and expands the image
placeholders itself, which is checked against the processor's expansion that the trainer
scores; transformers gets the processor's image tensors.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable

import torch

from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.config.schema import Config
from megagrpo.console import on_terminal
from megagrpo.multimodal.processor import join_image_tensors
from megagrpo.policy.batch import Completion
from megagrpo.policy.moe import attach_routing, checkpoint_slots
from megagrpo.rollout.vllm_models import refresh_after_reload, skip_input_embedding_prepack
from megagrpo.rollout.vllm_settings import vllm_settings


def sampling_seed(seed: int, step: int, prompt_index: int, sampling_round: int = 0) -> int:
    """The sampling seed of one prompt's group: a pure function of (seed, step, prompt, round),
    so a prompt's samples are the same whatever the layout and after a resume. Held-out
    evaluation uses step EVAL_STEP at every evaluation, so its samples are comparable over
    training; rounds after the first of dynamic sampling (grpo.dynamic_sampling) get steps of
    their own, below EVAL_STEP."""
    if sampling_round:
        step = EVAL_STEP - 1 - (step * 1000 + sampling_round)
    return ((seed * 1_000_003 + step) * 1_000_033 + prompt_index) % 2**31


EVAL_STEP = -1
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vllm 0.32
INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


def _on_gpu() -> bool:
    return torch.cuda.is_available()


class VLLMGenerator:
    def __init__(self, cfg: Config, model_path: str, seed: int):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        r = cfg.rollout
        self.cfg = r
        self.asleep: set[str] = set()  # what vLLM has released: "weights", "kv_cache"
        self.can_sleep = r.sleep and _on_gpu()
        if not _on_gpu():
            # The engine runs eager on CPU (vllm_settings), but vLLM torch.compiles one helper
            # on every platform, the sampled tokens' ranks (batched_count_greater_than, with
            # Inductor on CPU): 4 s at the first rollout of every process and 1 s again at each
            # new batch size, for what runs eagerly in 2 ms. So nothing in this process is
            # compiled (torch's own switch; megagrpo compiles nothing; docs/upstream-issues.md).
            torch._dynamo.config.disable = True
        settings = vllm_settings(cfg, model_path, seed, generator_layout(cfg).generator_tp, _on_gpu())
        self.llm = LLM(**settings, distributed_executor_backend="external_launcher", enable_sleep_mode=self.can_sleep,
                       use_tqdm_on_load=on_terminal())  # its loading bar, on a terminal only
        if not _on_gpu():
            self.llm.collective_rpc(_input_embeddings_skip_gemm_prepack)
        tied = bool(getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False))
        self.reload_warnings = _ExpectedReloadWarnings(tied)
        for name in (RELOAD_LOGGER, INPLACE_LOGGER):
            logging.getLogger(name).addFilter(self.reload_warnings)

    def generate(self, prompt_ids: list[list[int]], n: int, seeds: list[int], greedy: bool = False,
                 max_tokens: list[int] | None = None, vision: list | None = None) -> list[list[Completion]]:
        """n samples per prompt; prompt i's samples depend only on seeds[i] and the weights.
        max_tokens: per prompt, the most tokens to sample (default rollout.max_new_tokens);
        vision: per prompt, its VisionPrompt or None."""
        from vllm import SamplingParams

        self.wake_up()
        r = self.cfg
        params = [SamplingParams(
            n=n, temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_tokens=max_tokens[i] if max_tokens else r.max_new_tokens, stop=list(r.stop) or None,
            logprobs=0, seed=seed) for i, seed in enumerate(seeds)]
        visions = vision or [None] * len(prompt_ids)
        outputs = self.llm.generate([_engine_prompt(ids, v) for ids, v in zip(prompt_ids, visions)], params,
                                    use_tqdm=False)
        for ids, out in zip(prompt_ids, outputs):
            _check_expansion(ids, out.prompt_token_ids)
        return [[Completion(token_ids=list(c.token_ids),
                            logprobs=[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                            truncated=c.finish_reason == "length",
                            routes=c.routed_experts)  # (routing replay r3 on GPU) [tokens - 1, layers, k]
                 for c in out.outputs] for out in outputs]

    def logprobs(self, requests: list[tuple]) -> list[list[float]]:
        """Per (token_ids, prompt_len[, vision]): the log-probs of token_ids[prompt_len:] given
        what precedes them (prompt_logprobs), all in one engine call."""
        from vllm import SamplingParams

        self.wake_up()
        prompts = []
        for ids, start, *vision in requests:
            vision = vision[0] if vision else None
            prompt = _engine_prompt(ids[:start], vision)
            prompts.append({**prompt, "prompt_token_ids": prompt["prompt_token_ids"] + ids[start:]})
        outputs = self.llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        for (ids, *_), out in zip(requests, outputs):
            _check_expansion(ids, out.prompt_token_ids)
        return [[out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))]
                for out, (ids, start, *_) in zip(outputs, requests)]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     step: int = 0) -> None:
        """partial: the stream holds some layers only (a LoRA policy's adapted ones); vLLM
        keeps the others as they are, and its warnings about them are expected. step: the
        training steps in these weights (a server names them by it)."""
        self.reload_warnings.partial = partial
        loaded = []
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _recorded(named_tensors, loaded)})
        finally:
            self.reload_warnings.partial = False
        self.llm.collective_rpc(_refresh_after_reload, args=(loaded,))
        self.llm.reset_prefix_cache()
        if self.llm.model_config.is_multimodal_model:
            # Image features from the old weights must go; and the worker's reload clears its
            # encoder cache but not the scheduler's record of it, which then asks for features
            # that are gone ("Encoder cache miss", vllm 0.32): reset both (docs/upstream-issues.md).
            self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        # Level 1 keeps a CPU copy of the weights; level 2 would drop them and a wake-up
        # reload from disk would overwrite the synced weights (TRL #5312).
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take back what sleep released, in this order. The weight sync wakes the weights
        only; the KV cache comes back before sampling, after the sync's buffers are gone (the
        out-of-memory at wake-up that waking both at once invites)."""
        for tag in tags:
            if tag in self.asleep:
                self.llm.wake_up(tags=[tag])
                self.asleep.discard(tag)


def _engine_prompt(token_ids: list[int], vision) -> dict:
    """vLLM's input for one prompt: its token ids, or with images the template's tokens (one
    placeholder per image, which vLLM expands) and the images."""
    if vision is None:
        return {"prompt_token_ids": token_ids}
    return {"prompt_token_ids": list(vision.template_ids), "multi_modal_data": {"image": vision.images}}


def _check_expansion(expected: list[int], ran: list[int]) -> None:
    """vLLM's image-token expansion must be the processor's, or the trainer would score other
    tokens than were sampled."""
    if list(ran) != list(expected):
        first = next((i for i, (a, b) in enumerate(zip(ran, expected)) if a != b), min(len(ran), len(expected)))
        raise RuntimeError(f"vLLM expanded an image prompt into {len(ran)} tokens where the model's processor "
                           f"gives {len(expected)} (first difference at token {first}); the processor's settings "
                           "(images.longest_edge, its preprocessor_config) and vLLM's must agree")


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's in-place reload warns "<Layer>: Failed to load weights" for every layer that has
    loadable tensors but received none, and then puts that layer's previous tensors back.
    Two such layers are expected on every sync, so their lines are dropped here (any other
    layer's still shows, since it would mean a weight missing from the stream):
    - RotaryEmbedding: its cos/sin cache is computed from the model config; HF checkpoints,
      and so our stream, never hold it, and the restored cache is the right one.
    - ParallelLMHead of a model with tied embeddings: the stream sends the shared weight once,
      as the embedding (vLLM skips lm_head.weight of tied models anyway); the head is then
      re-derived from the new embedding by _refresh_after_reload. tests/test_rollout_weight_sync.py shows the
      engine's log-probs after a sync equal the trainer's. (docs/upstream-issues.md)
    While a partial stream loads (`partial`), every layer it leaves out warns so, and vLLM
    lists the weights it did not receive: both are dropped then."""

    def __init__(self, tied_embeddings: bool):
        super().__init__()
        self.expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_embeddings else set())
        self.partial = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.partial and message.startswith("Following weights were not loaded"):
            return False
        layer, _, rest = message.partition(": ")
        return not (rest == "Failed to load weights" and (self.partial or layer in self.expected))


def _recorded(named_tensors, names: list):
    """The (name, tensor) stream, each name added to `names` as it passes."""
    for name, tensor in named_tensors:
        names.append(name)
        yield name, tensor


def _refresh_after_reload(worker, loaded: list) -> None:
    refresh_after_reload(worker.model_runner.get_model(), loaded)


def _input_embeddings_skip_gemm_prepack(worker) -> None:
    skip_input_embedding_prepack(worker.model_runner.get_model())


class HFGenerator:
    def __init__(self, cfg: Config, model_path: str, seed: int):
        from megagrpo.dtypes import DTYPES
        from megagrpo.multimodal.models import auto_model_class
        from megagrpo.policy.models import load_tokenizer

        self.cfg = cfg.rollout
        device = f"cuda:{torch.cuda.current_device()}" if _on_gpu() else "cpu"
        self.model = auto_model_class(model_path).from_pretrained(
            model_path, dtype=DTYPES[cfg.model.dtype]).to(device).eval()
        tokenizer = load_tokenizer(model_path)
        self.pad_id, self.eos_id, self.tokenizer = tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer
        self.device = device
        # an MoE model's routes, recorded for routing replay r3 (policy/moe.py)
        self.routing = attach_routing(self.model) if self.cfg.routing_replay == "r3" else None
        self.expert_slots = None  # checkpoint name -> where in which parameter (an MoE model's experts)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, seeds: list[int], greedy: bool = False,
                 max_tokens: list[int] | None = None, vision: list | None = None) -> list[list[Completion]]:
        """n samples per prompt from one batched generate; the samples depend on all the seeds
        and on the batch (transformers samples a batch from one generator). With max_tokens
        (per prompt), the batch samples the largest and each row is cut to its own; vision:
        per prompt, its VisionPrompt or None."""
        r = self.cfg
        rows = [ids for ids in prompt_ids for _ in range(n)]
        images = self._images([v for v in (vision or [None] * len(prompt_ids)) for _ in range(n)])
        caps = [cap for cap in (max_tokens or [r.max_new_tokens] * len(prompt_ids)) for _ in range(n)]
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in rows],
                                 device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :] >=
                torch.tensor([width - len(ids) for ids in rows], device=self.device)[:, None]).long()
        if self.routing is not None:
            self.routing.trace = []
        with torch.random.fork_rng(devices=[self.device] if _on_gpu() else []):
            torch.manual_seed(hash(tuple(seeds)) % 2**63)
            out = self.model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=not greedy,
                temperature=r.temperature if not greedy else None,
                top_p=r.top_p if not greedy else None, top_k=(r.top_k if r.top_k > 0 else None) if not greedy else None,
                max_new_tokens=max(caps), eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                stop_strings=list(r.stop) or None, tokenizer=self.tokenizer if r.stop else None,
                return_dict_in_generate=True, output_logits=True, **images)
        generated = out.sequences[:, width:]
        temperature = 1.0 if greedy else r.temperature
        logprobs = torch.stack(out.logits, dim=1).float().div(temperature).log_softmax(-1)
        token_logprobs = logprobs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        routes = self._traced_routes(len(rows), width)
        completions = []
        for row in range(len(rows)):
            ids = generated[row, :caps[row]].tolist()
            if self.eos_id in ids:
                end = ids.index(self.eos_id) + 1
            else:  # a row that met a stop string is padded after it; padding was never sampled
                end = len(ids)
                while end > 0 and ids[end - 1] == self.pad_id:
                    end -= 1
            completions.append(Completion(
                token_ids=ids[:end], logprobs=token_logprobs[row, :end].tolist(),
                truncated=self.eos_id not in ids[:end] and end == caps[row],
                routes=None if routes is None else routes[row, width - len(rows[row]):width + end - 1].numpy()))
        return [completions[i * n:(i + 1) * n] for i in range(len(prompt_ids))]

    def _traced_routes(self, batch: int, width: int):
        """(routing replay r3) the routes of the generate just run, (batch, columns, layers, k):
        its first forward fed the `width` prompt columns, each later one a sampled token."""
        if self.routing is None:
            return None
        trace, self.routing.trace = self.routing.trace, None
        return torch.cat([step.view(batch, -1, *step.shape[1:]) for step in trace], dim=1)

    def _images(self, visions: list) -> dict:
        return join_image_tensors(visions, self.model.config.model_type, self.model.dtype, self.device)

    @torch.no_grad()
    def logprobs(self, requests: list[tuple]) -> list[list[float]]:
        """Per (token_ids, prompt_len[, vision]): the log-probs of token_ids[prompt_len:] given what precedes them."""
        scores = []
        for token_ids, prompt_len, *vision in requests:
            ids = torch.tensor([token_ids], device=self.device)
            logp = self.model(input_ids=ids, **self._images(vision)).logits[0, :-1].float().log_softmax(-1)
            scores.append(logp[torch.arange(len(token_ids) - 1), ids[0, 1:]][prompt_len - 1:].tolist())
        return scores

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False,
                     step: int = 0) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name in params:
                params[name].data.copy_(tensor)
                continue
            if self.expert_slots is None:  # the stream names an MoE model's experts one by one
                self.expert_slots = checkpoint_slots(self.model)
            param, index = self.expert_slots[name]
            params[param].data.view(-1)[index.reshape(-1)] = tensor.reshape(-1).to(params[param].dtype)

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: tuple[str, ...] = ()) -> None:
        pass


def build_generator(cfg: Config, seed: int):
    """The generator of rollout.engine, or the servers of rollout.servers (rollout/servers.py)
    or of the generating ranks (rollout/serving.py)."""
    if cfg.rollout.placement == "disaggregated":
        from megagrpo.rollout.serving import generator_ranks_client
        return generator_ranks_client(cfg)
    if cfg.rollout.servers:
        from megagrpo.rollout.servers import ServerGenerator
        return ServerGenerator(cfg, cfg.rollout.servers)
    generator_class = {"vllm": VLLMGenerator, "hf": HFGenerator}[cfg.rollout.engine]
    return generator_class(cfg, cfg.model.name_or_path, seed)
