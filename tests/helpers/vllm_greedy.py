"""Greedy tokens from vLLM (CPU, in-process) for a model folder: `python vllm_greedy.py DIR`.
Prints one JSON line: {"prompt": [...], "tokens": [...]}."""
import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from transformers import AutoTokenizer  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", help="a Hugging Face model folder")
path = parser.parse_args().model
tokenizer = AutoTokenizer.from_pretrained(path)
text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                     tokenize=False, add_generation_prompt=True)
prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=128,
          enforce_eager=True)
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12),
                   use_tqdm=False)
print(json.dumps({"prompt": prompt, "tokens": list(out[0].outputs[0].token_ids)}))
