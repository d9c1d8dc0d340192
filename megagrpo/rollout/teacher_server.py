"""A distillation teacher behind a URL (teacher.url): any `vllm serve` of the teacher model.

Each rank asks for its own rows at once, one request per row, as OpenAI completions with the
row's token ids as the prompt and `prompt_logprobs: 0`: vLLM returns log p(token | what
precedes it) for every prompt token, at temperature 1, and the completion's tokens are read
from there (the one generated token is thrown away). Requests that fail are tried again
(teacher.retries); a server still failing stops the run naming it, since a step without its
teacher has no distillation signal.

At start the server must serve the policy's vocabulary: the ids of a probe of the policy's
tokenizer must come back as the same text from the server's /detokenize, and its context must
hold the longest sequence the run can make.

    teacher = TeacherServer(cfg, tokenizer)       # waits for /health, checks vocabulary and context
    batch.teacher_logp = teacher.logprobs(batch)  # (B, C), zeros past each completion
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from megagrpo.config.schema import Config, max_sequence_length
from megagrpo.policy.batch import RolloutBatch
from megagrpo.rollout.servers import Server, ServerError

PROBE_TOKENS = 256  # how many of the policy's token ids the vocabulary check sends


class TeacherServer:
    def __init__(self, cfg: Config, tokenizer, log=print, concurrency: int = 16):
        t = cfg.teacher
        self.server = Server(t.url, t.timeout_s, t.retries, settings="teacher.")
        self.server.wait_until_ready(log, takes_weights=False)
        longest = max_sequence_length(cfg)
        if self.server.max_model_len and self.server.max_model_len < longest:
            raise ServerError(f"teacher.url {t.url} serves a context of {self.server.max_model_len} tokens, shorter "
                              f"than the {longest} of the run's longest sequence: restart it with --max-model-len "
                              f"{longest} or more")
        self._check_vocabulary(tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="teacher")

    def _check_vocabulary(self, tokenizer) -> None:
        """The server decodes a spread of the policy's token ids to the text the policy's
        tokenizer does; else it serves another vocabulary, and its log-probs would be of
        other tokens."""
        size, special = len(tokenizer), set(tokenizer.all_special_ids)  # (a server may leave special tokens out)
        ids = [i for i in range(0, size, max(1, size // PROBE_TOKENS)) if i not in special][:PROBE_TOKENS]
        theirs = self.server.post("detokenize", {"model": self.server.model, "tokens": ids})["prompt"]
        ours = tokenizer.decode(ids)
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ServerError(f"teacher.url {self.server.url} ({self.server.model}) decodes the policy's token ids to "
                              f"other text (from character {at}: {theirs[at:at + 40]!r}, the policy's tokenizer: "
                              f"{ours[at:at + 40]!r}): it serves another vocabulary. The teacher scores the policy's "
                              "token ids, so both must share one: serve a teacher of the policy's family")

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, C) the teacher's log-probs of each row's completion tokens, on the batch's device."""
        prompts, completions = batch.sequences()
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)

        def score(i: int) -> None:
            if not completions[i]:
                return
            logp = self.server.prompt_logprobs(prompts[i] + completions[i], len(prompts[i]), temperature=1.0)
            out[i, :len(completions[i])] = torch.tensor(logp)

        list(self.pool.map(score, range(len(batch))))
        return out.to(batch.completion_ids.device)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
