"""The vision-language parts of tools/make_tiny_model.py (--arch idefics3): SmolVLM's
architecture (Idefics3: a SigLIP image encoder, a pixel-shuffle connector, a Llama language
model) at tiny sizes, with the image tokens in the tokenizer, a chat template that renders
image parts, and the processor files beside the weights.

An image is resized to --image-size pixels on its longer side and cut into patches of
--patch-size; the connector merges scale_factor^2 neighbouring patches into one token, so each
image becomes (image_size / patch_size / 2)^2 tokens between its markers (9 at the defaults).
"""
from transformers import Idefics3Config, Idefics3Processor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]  # Idefics3's, as SmolVLM has them
SCALE_FACTOR = 2


def chat_template_with_images(template: str) -> str:
    """The text chat template, where a message's content may also be a list of parts:
    {"type": "image"} renders as <image> (the processor expands it), {"type": "text"} as its text."""
    parts = ("{% if message['content'] is string %}{{ message['content'] }}{% else %}"
             "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
             "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}")
    return template.replace("{{ message['content'] }}<|im_end|>", parts + "<|im_end|>")


def add_image_tokens(tokenizer) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"] + IMAGE_TOKENS})
    tokenizer.chat_template = chat_template_with_images(tokenizer.chat_template)


def idefics3_config(args, text_config, tokenizer) -> Idefics3Config:
    """Idefics3 around the tiny text model's config (a Llama one) and a SigLIP tower."""
    patches = args.image_size // args.patch_size
    if args.image_size % args.patch_size or patches % SCALE_FACTOR:
        raise SystemExit(f"--image-size {args.image_size} must be a multiple of --patch-size {args.patch_size} "
                         f"giving an even number of patches per side")
    vision = dict(hidden_size=args.vision_hidden_size, intermediate_size=2 * args.vision_hidden_size,
                  num_hidden_layers=args.vision_layers, num_attention_heads=args.vision_hidden_size // 64,
                  image_size=args.image_size, patch_size=args.patch_size)
    return Idefics3Config(text_config=text_config.to_dict(), vision_config=vision,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=SCALE_FACTOR,
                          tie_word_embeddings=text_config.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id)


def save_processor(args, tokenizer, out: str) -> None:
    patches = args.image_size // args.patch_size
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": args.image_size},
                                       max_image_size={"longest_edge": args.image_size})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                      image_seq_len=(patches // SCALE_FACTOR) ** 2).save_pretrained(out)
