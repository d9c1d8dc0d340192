"""Images in data rows: where a row keeps them, reading them, and refusing bad ones by name.

A row carries images in one of two forms:
  {"prompt": "...", "images": ["shapes/0001.png", "data:image/png;base64,...", ...]}
      file paths (relative to the data file, or absolute), data URIs or bare base64; the user
      turn becomes the images, in order, then the prompt text (TRL's layout);
  {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                              {"type": "text", "text": "..."}]}]}
      HF/TRL chat parts; the source may also be under "path" or "url", or OpenAI's
      {"type": "image_url", "image_url": {"url": ...}}.
Either way the messages the chat template sees hold bare {"type": "image"} parts, and the images
come back as RGB PIL images in the order of those parts.

Every image is checked before it is decoded: a missing file, bytes that are no image, an image
over images.max_source_pixels (a decompression bomb is refused before it is unpacked), a
truncated file, or more than images.max_per_prompt images raise ImageError naming the row, the
image's place in it and its source. data.py drops and counts the row or refuses the run
(images.on_bad_image).
"""
from __future__ import annotations

import base64
import binascii
import io
import os

from PIL import Image


class ImageError(ValueError):
    """A row's image cannot be used; the message names the row, the image and the cause
    (data.py raises it as a DataError, or drops the row)."""


def _short(ref: str) -> str:
    return ref if len(ref) <= 60 else ref[:40] + f"... ({len(ref)} characters)"


def _source_bytes(ref, base_dir: str, where: str) -> bytes:
    """The encoded bytes of one image reference: a data URI, a file path, or bare base64."""
    if not isinstance(ref, str) or not ref:
        raise ImageError(f"{where}: expected a file path, a data URI or base64 text, got {type(ref).__name__} "
                         f"{ref!r:.60}")
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if ";base64" not in header or not payload:
            raise ImageError(f"{where}: a data URI must be data:image/...;base64,<data> (got {_short(ref)!r})")
        return _decode_base64(payload, where)
    path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    looks_like_path = len(ref) < 256 and ("/" in ref or "." in ref[-6:])
    if looks_like_path:
        raise ImageError(f"{where}: no such image file {ref!r} (looked for {os.path.abspath(path)})")
    return _decode_base64(ref, where)


def _decode_base64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: neither an existing file nor valid base64 ({e}): {_short(text)!r}") from None


def open_image(ref, base_dir: str, where: str, max_source_pixels: int, longest_edge) -> Image.Image:
    """One image as RGB, at most `longest_edge` pixels on its longer side (aspect kept; None:
    as stored)."""
    data = _source_bytes(ref, base_dir, where)
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        raise ImageError(f"{where}: not an image PIL can read ({type(e).__name__}: {e}); source "
                         f"{_short(str(ref))!r}") from None
    width, height = image.size
    if width * height > max_source_pixels:
        raise ImageError(f"{where}: {width}x{height} pixels is over images.max_source_pixels="
                         f"{max_source_pixels}; shrink the image or raise the bound (source {_short(str(ref))!r})")
    try:
        image.load()
        image = image.convert("RGB")
    except Exception as e:
        raise ImageError(f"{where}: the image is damaged or truncated ({type(e).__name__}: {e}); source "
                         f"{_short(str(ref))!r}") from None
    if longest_edge and max(width, height) > longest_edge:
        scale = longest_edge / max(width, height)
        image = image.resize((max(1, round(width * scale)), max(1, round(height * scale))), Image.BICUBIC)
    return image


_SOURCE_KEYS = ("image", "path", "url")


def _part_source(part: dict):
    if part.get("type") == "image_url":
        inner = part.get("image_url")
        return inner.get("url") if isinstance(inner, dict) else inner
    return next((part[k] for k in _SOURCE_KEYS if part.get(k) is not None), None)


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def row_has_images(row: dict, field: str) -> bool:
    messages = row.get("messages")
    in_messages = isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(_is_image_part(p) for p in m["content"])
        for m in messages)
    return bool(row.get(field)) or in_messages


def row_images(row: dict, messages: list, where: str, base_dir: str, images_cfg) -> tuple[list, list]:
    """(messages with bare image parts, the images in their order) for one row; `messages` is the
    row's chat as data.py built it (the prompt text alone in its user turn for `prompt` rows)."""
    refs, places = [], []
    if row.get(images_cfg.field) is not None:
        listed = row[images_cfg.field]
        listed = [listed] if isinstance(listed, str) else listed
        if not isinstance(listed, list) or not listed:
            raise ImageError(f"{where}: '{images_cfg.field}' must be a list of image paths or base64 strings")
        refs += listed
        places += [f"{images_cfg.field}[{i}]" for i in range(len(listed))]
        user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if user is None:
            raise ImageError(f"{where}: the row has images but no user turn to show them in")
        text = messages[user]["content"]
        text_parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        messages = [dict(m) for m in messages]
        messages[user]["content"] = [{"type": "image"} for _ in listed] + text_parts
    else:
        new = []
        for i, m in enumerate(messages):
            content = m["content"]
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if _is_image_part(part):
                        source = _part_source(part)
                        if source is None:
                            raise ImageError(f"{where}: message {i + 1} part {j + 1} is an image with no source; "
                                             f"give it under one of {', '.join(_SOURCE_KEYS)}")
                        refs.append(source)
                        places.append(f"message {i + 1} part {j + 1}")
                        part = {"type": "image"}
                    parts.append(part)
                m = {**m, "content": parts}
            new.append(m)
        messages = new
    if len(refs) > images_cfg.max_per_prompt:
        raise ImageError(f"{where}: {len(refs)} images, over images.max_per_prompt={images_cfg.max_per_prompt}")
    images = [open_image(ref, base_dir, f"{where}: image {place}", images_cfg.max_source_pixels,
                         images_cfg.longest_edge) for ref, place in zip(refs, places)]
    return messages, images


def thumbnail_data_uri(image: Image.Image, side: int = 128) -> str:
    """A PNG data URI of the image, at most `side` pixels on its longer side (eval samples and
    `megagrpo report` show what the model saw)."""
    small = image.copy()
    small.thumbnail((side, side))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
