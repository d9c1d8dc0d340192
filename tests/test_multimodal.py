"""Multimodal GRPO (docs/multimodal.md), on a random tiny Idefics3 (SmolVLM's architecture)
built by tools/make_tiny_model.py and the shapes task of tools/make_demo_data.py:
- every form a row may give an image in renders the same tokens and pixels, and each bad image
  is one line naming the file, the row and the image, or a counted drop;
- the trainer's log-probs of image rows: packed = padded = fused = naive = each row alone
  through transformers, and the image changes them;
- dp=2 under ZeRO-3 equals one rank (loss, grad norm, every parameter after 2 steps), and a
  resume on one rank from its checkpoint; vLLM's sampler log-probs equal the trainer's at every
  step (the sync with a frozen tower); the export and the offline conversion hold the same
  weights and load back with the processor;
- a LoRA VLM (adapters on the language model only): dp=2 under ZeRO-3 equals one rank;
- the weight sync of a trained vision tower: vLLM scores an image prompt as the trainer does
  after a step, and differently from before it.
The VLM quickstart's learning is held in test_train_quickstart.py."""
import base64
import json
import os
import shutil
import sys

import pytest
import torch
from conftest import BIN, run, torchrun, write_jsonl
from runs import assert_same_run, series
from safetensors.torch import load_file

from megagrpo.config.schema import ConfigError, ImagesConfig
from megagrpo.data import DataError, load_prompts
from megagrpo.multimodal.models import auto_model_class
from megagrpo.multimodal.processor import join_image_tensors, load_processor
from megagrpo.planning import make_plan
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import completion_logprobs, install_logprob_head
from megagrpo.policy.models import load_tokenizer
from megagrpo.validation import load_config


@pytest.fixture(scope="module")
def vlm(tiny_vlm):
    return {**tiny_vlm, "processor": load_processor(tiny_vlm["model"]), "tokenizer": load_tokenizer(tiny_vlm["model"])}


def _load(path, vlm, **images):
    return load_prompts(str(path), vlm["tokenizer"], 128, processor=vlm["processor"],
                        images_cfg=ImagesConfig(**images))


def _image_file(vlm, index=0) -> str:
    return os.path.join(vlm["data"], "images", f"{index:05d}.png")


def test_image_forms_render_the_same_tokens_and_pixels(vlm, tmp_path):
    shutil.copy(_image_file(vlm), tmp_path / "a.png")
    encoded = base64.b64encode(open(tmp_path / "a.png", "rb").read()).decode()
    question = "What colour is the largest shape?"

    def chat(part):
        return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": question}]}]}
    rows = [{"prompt": question, "images": ["a.png"]},
            {"prompt": question, "images": [str(tmp_path / "a.png")]},  # absolute
            {"prompt": question, "images": [encoded]},
            {"prompt": question, "images": [f"data:image/png;base64,{encoded}"]},
            chat({"type": "image", "image": "a.png"}), chat({"type": "image", "path": "a.png"}),
            chat({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}})]
    prompts, dropped = _load(write_jsonl(tmp_path / "forms.jsonl", rows), vlm)
    assert dropped == 0 and len(prompts) == len(rows)
    first = prompts[0]
    image_token = vlm["tokenizer"].convert_tokens_to_ids("<image>")
    assert first.token_ids.count(image_token) == 9  # (96 px / 16 px / 2)^2: the connector's tokens
    assert first.vision.template_ids.count(image_token) == 1  # the placeholder vLLM expands
    for prompt in prompts[1:]:
        assert prompt.token_ids == first.token_ids and prompt.vision.template_ids == first.vision.template_ids
        assert sorted(prompt.vision.tensors) == ["pixel_attention_mask", "pixel_values"]
        for key, value in first.vision.tensors.items():
            assert torch.equal(prompt.vision.tensors[key], value), key
    assert "images" not in first.fields  # the images are the prompt's, not a reward's field


def _png_bytes(vlm) -> bytes:
    return open(_image_file(vlm), "rb").read()


BAD_IMAGES = [  # (row, images config, what the message says)
    ({"images": ["pics/missing.png"]}, {}, "no such image file 'pics/missing.png'"),
    ({"images": ["junk.png"]}, {}, "not an image PIL can read"),
    ({"images": ["truncated.png"]}, {}, "damaged or truncated"),
    ({"images": ["good.png"]}, {"max_source_pixels": 1000}, "96x96 pixels is over images.max_source_pixels=1000"),
    ({"images": ["%%%not-base64%%%"]}, {}, "neither an existing file nor valid base64"),
    ({"images": [base64.b64encode(b"plain text, no image at all").decode()]}, {}, "not an image PIL can read"),
    ({"images": ["data:image/png,abc"]}, {}, "a data URI must be data:image/...;base64,<data>"),
    ({"images": [42]}, {}, "expected a file path, a data URI or base64 text, got int"),
    ({"images": {"a": "good.png"}}, {}, "'images' must be a list"),
    ({"images": ["good.png"] * 3}, {"max_per_prompt": 2}, "3 images, over images.max_per_prompt=2"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]}, {},
     "message 1 part 1 is an image with no source"),
]


def _bad_image_folder(vlm, tmp_path):
    (tmp_path / "junk.png").write_bytes(b"this is not a png")
    (tmp_path / "truncated.png").write_bytes(_png_bytes(vlm)[:120])
    shutil.copy(_image_file(vlm), tmp_path / "good.png")


@pytest.mark.parametrize("case", range(len(BAD_IMAGES)))
def test_a_bad_image_is_one_line_naming_file_row_and_image(vlm, tmp_path, case):
    _bad_image_folder(vlm, tmp_path)
    row, config, expected = BAD_IMAGES[case]
    rows = [{"prompt": "A row without an image", "answer": "red"}, {"prompt": "What colour?", **row}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as error:
        _load(path, vlm, **config)
    message = str(error.value)
    assert message.startswith(f"{path}:2: ") and expected in message and "\n" not in message, message
    assert "image" in message


def test_bad_images_are_dropped_and_counted_when_asked(vlm, tmp_path, capsys):
    _bad_image_folder(vlm, tmp_path)
    rows = [{"prompt": "What colour?", **row} for row, config, _ in BAD_IMAGES if not config]
    rows.insert(2, {"prompt": "What colour?", "images": ["good.png"], "answer": "red"})
    prompts, dropped = _load(write_jsonl(tmp_path / "bad.jsonl", rows), vlm, on_bad_image="drop")
    assert len(prompts) == 1 and prompts[0].fields == {"answer": "red"}
    assert dropped == len(rows) - 1
    out = capsys.readouterr().out
    assert f"{len(rows) - 1} rows dropped for a bad image (images.on_bad_image=drop); the first: " in out
    assert "bad.jsonl:1: image images[0]: no such image file 'pics/missing.png'" in out


def test_images_for_a_text_model_are_refused(tiny, vlm, tmp_path):
    shutil.copy(_image_file(vlm), tmp_path / "a.png")
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "q", "images": ["a.png"]}])
    with pytest.raises(DataError, match=r"rows.jsonl:1: the row has images, but the model takes none"):
        load_prompts(path, load_tokenizer(tiny["warm"]), 128, processor=None, images_cfg=ImagesConfig())


def test_image_rows_logprobs_packed_padded_fused_naive_and_alone_agree(vlm):
    model = auto_model_class(vlm["model"]).from_pretrained(vlm["model"], dtype=torch.float32).eval()
    install_logprob_head(model, chunk_size=7)
    prompts, _ = _load(os.path.join(vlm["data"], "train.jsonl"), vlm)
    tokenizer = vlm["tokenizer"]
    texts = ["Answer: red", "Answer: blue", "Answer: a green one", "yellow"]
    rows = [prompts[0], prompts[0], prompts[1], prompts[2]]  # two completions share an image
    completions = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    batch = make_batch([p.token_ids for p in rows], [Completion(c, [0.0] * len(c), False) for c in completions],
                       torch.zeros(len(rows)), tokenizer.pad_token_id, [p.vision for p in rows])
    with torch.no_grad():
        results = {(packing, fused): completion_logprobs(model, batch, 0.7, packing=packing, fused=fused)[0]
                   for packing in (True, False) for fused in (True, False)}
        for result in results.values():
            torch.testing.assert_close(result, results[True, True], atol=2e-5, rtol=0)
        for i, (prompt, completion) in enumerate(zip(rows, completions)):
            ids = torch.tensor([prompt.token_ids + completion])
            images = join_image_tensors([prompt.vision], "idefics3", torch.float32, "cpu")
            logits = model(input_ids=ids, **images).logits
            alone = (logits[0, len(prompt.token_ids) - 1:-1] / 0.7).log_softmax(-1)
            alone = alone.gather(-1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(results[True, True][i, :len(completion)], alone, atol=2e-5, rtol=0)
        swapped = make_batch([p.token_ids for p in rows], [Completion(c, [0.0] * len(c), False) for c in completions],
                             torch.zeros(len(rows)), tokenizer.pad_token_id, [rows[2].vision] * len(rows))
        other = completion_logprobs(model, swapped, 0.7)[0]
    assert (other[0] - results[True, True][0]).abs().max() > 1e-3, "the image does not reach the model"


REFUSED_WITH_IMAGES = [
    ("parallel.tensor_parallel_size=2", "AutoTP has no split plan for the vision tower"),
    ("parallel.pipeline_parallel_size=2", "the pipeline's layer map holds decoder layers only"),
    ("parallel.sequence_parallel_size=2", "a row's image features would span sp ranks"),
    ("rollout.max_turns=2", "no multi-turn loop carries images yet"),
    ("rollout.placement=disaggregated", "the servers' requests carry token ids, not images"),
]


@pytest.mark.parametrize("override,reason", REFUSED_WITH_IMAGES)
def test_layouts_a_vlm_does_not_take_are_refused_with_the_reason(vlm, tmp_path, override, reason):
    with pytest.raises(ConfigError, match="is a vision-language model \\(idefics3\\)") as error:
        load_config("configs/tiny_vlm.yaml", _vlm_overrides(vlm, tmp_path)[2:] + [override])
    assert reason in str(error.value)


def test_the_planner_counts_a_vlm(vlm, tmp_path):
    """All parameters (encoder and connector too); trained: all but the frozen encoder, or a LoRA
    policy's adapters on the language model's linear layers."""
    model = auto_model_class(vlm["model"]).from_pretrained(vlm["model"])
    params = dict(model.named_parameters())
    tower = sum(p.numel() for name, p in params.items() if ".vision_model." in f".{name}")
    plan = make_plan(load_config("configs/tiny_vlm.yaml", _vlm_overrides(vlm, tmp_path)[2:]), world_size=2)
    assert plan.params_total == sum(p.numel() for p in params.values()) and tower > 0
    assert plan.params_trained == plan.params_total - tower
    lora = load_config("configs/tiny_vlm.yaml", _vlm_overrides(vlm, tmp_path)[2:] + ["model.lora.r=8"])
    assert make_plan(lora, world_size=2).params_trained == sum(
        8 * (m.in_features + m.out_features) for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.text_model."))


def _vlm_overrides(vlm, out, **extra):
    """configs/tiny_vlm.yaml on the random model; its completions are random tokens, so the
    reward is their length's distance from 12 characters (answer_match would give all zeros)."""
    values = {"rewards.functions": "[{name: length_penalty, args: {target: 12}}]",
              "model.name_or_path": vlm["model"], "data.train_file": os.path.join(vlm["data"], "train.jsonl"),
              "data.eval_file": "null", "output_dir": str(out), "logging.progress_bar": "false",
              "logging.sample_steps": 0, "checkpoint.save_steps": 0, "grpo.learning_rate": 1e-3, **extra}
    return ["--config", "configs/tiny_vlm.yaml", *[f"{k}={v}" for k, v in values.items()]]


@pytest.mark.multirank
def test_dp2_zero3_equals_one_rank_and_vllm_samples_what_the_trainer_scores(vlm, tmp_path):
    two, one = tmp_path / "dp2", tmp_path / "dp1"
    run([*torchrun(2, "-m", "megagrpo.train"), *_vlm_overrides(vlm, two, **{
        "grpo.max_steps": 2, "grpo.per_device_train_batch_size": 16, "checkpoint.save_steps": 1})])
    run([sys.executable, "-m", "megagrpo.train", *_vlm_overrides(vlm, one, **{
        "grpo.max_steps": 2, "grpo.per_device_train_batch_size": 32})])
    assert_same_run(two, one, loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
    # resumed on one rank from the dp=2 checkpoint of step 1 (frozen tower included), step 2 is the same
    resumed = tmp_path / "resumed"
    run([sys.executable, "-m", "megagrpo.train", *_vlm_overrides(vlm, resumed, **{
        "grpo.max_steps": 2, "grpo.per_device_train_batch_size": 32,
        "checkpoint.resume": two / "checkpoints" / "step_00000001"})])
    assert_same_run(resumed, two, steps=[2], loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
    for out in (one, two):
        # step 2 samples with the weights synced after step 1 (the language model and the
        # connector; the frozen tower is not sent)
        gaps = series(out, "train/sampling/sampling_logp_difference/max")
        assert [s for s, _ in gaps] == [1, 2] and all(gap < 1e-4 for _, gap in gaps), gaps
    # the export and the offline conversion of the dp=2 checkpoint: the same weights, with the
    # processor's files, loading back in transformers
    run([f"{BIN}/megagrpo", "convert", "to-hf", str(two / "checkpoints" / "step_00000002"), str(tmp_path / "hf")])
    converted = load_file(str(tmp_path / "hf" / "model-00001.safetensors"))
    live = load_file(str(two / "hf" / "model.safetensors"))
    assert sorted(converted) == sorted(live) and all(torch.equal(converted[k], live[k]) for k in live)
    for folder in (two / "hf", tmp_path / "hf"):
        model = auto_model_class(str(folder)).from_pretrained(str(folder))
        assert type(model).__name__ == "Idefics3ForConditionalGeneration"
        assert load_processor(str(folder)).image_seq_len == 9


@pytest.mark.multirank
def test_lora_vlm_dp2_zero3_equals_one_rank(vlm, tmp_path):
    """Adapters on the language model only (the encoder and the connector stay as loaded): dp=2
    under ZeRO-3 equals one rank, and vLLM samples with the merged weights what the trainer scores."""
    lora = {"model.lora.r": 8, "grpo.max_steps": 2}
    two, one = tmp_path / "dp2", tmp_path / "dp1"
    run([*torchrun(2, "-m", "megagrpo.train"), *_vlm_overrides(vlm, two, **lora,
                                                              **{"grpo.per_device_train_batch_size": 16})])
    run([sys.executable, "-m", "megagrpo.train", *_vlm_overrides(vlm, one, **lora,
                                                               **{"grpo.per_device_train_batch_size": 32})])
    assert_same_run(two, one, loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
    targets = json.load(open(one / "adapter" / "adapter_config.json"))["target_modules"]
    assert targets and all(t.startswith("model.text_model.layers.") for t in targets), targets
    for out in (one, two):
        gaps = series(out, "train/sampling/sampling_logp_difference/max")
        assert [s for s, _ in gaps] == [1, 2] and all(gap < 1e-4 for _, gap in gaps), gaps


@pytest.mark.multirank
def test_weight_sync_of_a_trained_vision_tower(vlm, tmp_path):
    out = tmp_path / "swap"
    run([*torchrun(2, "tests/helpers/swap_probe.py"), *_vlm_overrides(vlm, out, **{
        "grpo.max_steps": 1, "grpo.per_device_train_batch_size": 16, "model.freeze_vision_tower": "false"})])
    probes = [json.load(open(os.path.join(out, f"swap_rank{rank}.json"))) for rank in (0, 1)]
    assert max(r["tower_moved"] for r in probes) > 0, "the vision tower did not train"
    for rank, r in enumerate(probes):
        assert r["images"] == 1 and r["grad_norm"] > 0
        for key in ("before", "after"):
            engine, trainer = r[f"engine_{key}"], r[f"trainer_{key}"]
            assert len(engine) == len(trainer) == len(r["completion"]) > 1
            assert max(abs(a - b) for a, b in zip(engine, trainer)) < 1e-4, (rank, key, r)
        assert max(abs(a - b) for a, b in zip(r["engine_after"], r["engine_before"])) > 1e-3, r

