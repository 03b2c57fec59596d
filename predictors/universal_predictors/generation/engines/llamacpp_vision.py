"""Images for the llama.cpp engine: a GGUF model's multimodal projector (mmproj) through llama.cpp's ``mtmd``.

``mtmd`` (llama-cpp-python's ``mtmd_cpp`` bindings) reads the projector next to the text model, turns a
prompt whose images stand as its media marker into chunks (text tokens, and image chunks: the model's own
preprocessing, slices included, done here), and evaluates an image chunk into one sequence's KV cache (the
vision encoder, then the image embeddings decoded at that sequence's positions, causal or not and with
M-RoPE positions as the model wants: ``mtmd_helper_eval_chunk_single``). The engine's slot scheduler keeps
text in its shared batches and evaluates each image chunk on its own, between two steps.

Prefix reuse across requests compares keys, one per KV cell: a text token's key is its id, an image token's
key is a negative number derived from the image's pixels and the slice, so two prompts share a cached
prefix through an image only when it is the same image.

How a chat template places images: each image part is given to the template as a text part holding
``mtmd``'s marker, as llama-cpp-python's own ``MTMDChatHandler`` does; ``mtmd`` replaces each marker by the
family's image tokens (``<fake_token_around_image><global-img>`` ... for Idefics3, ``<start_of_image>`` ...
for Gemma 3, and so on).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import mtmd_cpp

#: llama-cpp-python's ``mtmd`` bindings (untyped: typed as Any here).
mtmd: Any = mtmd_cpp

logger = logging.getLogger(__name__)


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _mtmd_log(level: int, text: bytes, user_data: Any) -> None:
    """mtmd's log (a line per image slice at INFO) into Python's logging: warnings and errors only."""
    if level in (2, 3):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        logger.warning("mtmd: %s", text.decode("utf-8", "replace").rstrip())


#: The pixels one image may hand to llama.cpp (an RGB buffer of 48 MiB): larger images are downscaled to
#: this first; llama.cpp then resizes to the family's own processing size.
MAX_IMAGE_PIXELS = 4096 * 4096


def find_projector(source: str | Path, pattern: str) -> Path:
    """The one file ``pattern`` names in the source folder (or in the folder holding a source file).
    ValueError naming the pattern and the GGUF files found."""
    path = Path(source)
    folder = path.parent if path.is_file() else path
    if not folder.is_dir():
        raise ValueError(f"the source {str(path)!r} is neither a GGUF file nor a folder")
    matches = sorted(p for p in folder.glob(pattern) if p.is_file() and p != path)
    if len(matches) == 1:
        return matches[0]
    found = ", ".join(sorted(str(p.relative_to(folder)) for p in folder.rglob("*.gguf"))[:20]) or "no .gguf files"
    if not matches:
        raise ValueError(f"--source-projector-file {pattern!r} matches no file in {folder} (found: {found})")
    names = ", ".join(str(p.relative_to(folder)) for p in matches[:20])
    raise ValueError(f"--source-projector-file {pattern!r} matches {len(matches)} files in {folder} ({names}); "
                     "make the pattern pick exactly one")  # fmt: skip


@dataclass(frozen=True)
class ImageChunk:
    """One image chunk of a prompt (an image, or one slice of it): ``n_tokens`` KV cells at ``n_pos`` positions."""

    chunk: Any  # const mtmd_input_chunk *, owned by the prompt's chunk list
    n_tokens: int
    n_pos: int
    key: int  # the key of each of its cells (negative: never a token id)


#: A prompt, in order: text token ids and image chunks.
Segment = list[int] | ImageChunk


class MtmdPrompt:
    """A prompt tokenized by ``mtmd``: its segments, and the chunk list they point into (freed with it)."""

    def __init__(self, chunks: Any, segments: list[Segment]) -> None:
        self._chunks = chunks
        self.segments = segments
        self.keys: list[int] = [k for s in segments for k in (s if isinstance(s, list) else [s.key] * s.n_tokens)]
        self.image_tokens = sum(s.n_tokens for s in segments if isinstance(s, ImageChunk))

    def __del__(self) -> None:
        if self._chunks is not None:
            mtmd.mtmd_input_chunks_free(self._chunks)
            self._chunks = None


class Projector:
    """A loaded projector bound to one llama.cpp model and context."""

    def __init__(self, path: Path, model: Any, n_threads: int, use_gpu: bool, flash_attn: bool | None) -> None:
        mtmd.mtmd_log_set(_mtmd_log, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(_mtmd_log, ctypes.c_void_p(0))
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        params.warmup = False
        params.flash_attn_type = (  # None: llama.cpp's own choice per device, as the text context's
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
            if flash_attn is None
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self.path = path
        self.ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp cannot load {path.name} as a multimodal projector for this model "
                             "(see the log above: a projector made for another model, or a family this "
                             "llama.cpp does not know)")  # fmt: skip
        if not mtmd.mtmd_support_vision(self.ctx):
            self.close()
            raise ValueError(f"{path.name} has no vision encoder (an audio-only projector): images need one")
        self.marker = mtmd.mtmd_default_marker().decode("utf-8")

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def template_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Messages whose image parts are text parts holding the media marker (llama-cpp-python's way)."""
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = [{"type": "text", "text": self.marker} if p.get("type") == "image" else p for p in content]
            out.append({**message, "content": content})
        return out

    def tokenize(self, text: str, images: Sequence[Any]) -> MtmdPrompt:
        """``text`` (its markers standing for ``images``, PIL RGB, in order) as ``mtmd`` chunks. Blocking, on a
        worker thread while the engine thread evaluates: ``mtmd_tokenize`` reads the context only (it takes it
        ``const``; llama-server calls it from its HTTP threads the same way)."""
        if text.count(self.marker) != len(images):
            raise ValueError(f"the chat template placed {text.count(self.marker)} of the {len(images)} images "
                             "(it must render every content part of a message)")  # fmt: skip
        bitmaps, digests = [], []
        try:
            for image in images:
                rgb = image.convert("RGB").tobytes()
                digest = hashlib.blake2b(rgb, digest_size=16, person=b"mtmd-image")
                digest.update(f"{image.width}x{image.height}".encode())
                pixels = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
                bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
                if not bitmap:
                    raise ValueError(f"llama.cpp could not take a {image.width}x{image.height} image")
                mtmd.mtmd_bitmap_set_id(bitmap, digest.hexdigest().encode())
                bitmaps.append(bitmap)
                digests.append(digest.hexdigest())
            data = text.encode("utf-8")
            inp = mtmd.mtmd_input_text()
            inp.text, inp.text_len = data, len(data)
            # The template writes BOS itself (the chat path tokenizes without special tokens too).
            inp.add_special, inp.parse_special = False, True
            chunks = mtmd.mtmd_input_chunks_init()
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            code = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), array, len(bitmaps))
            if code != 0:
                mtmd.mtmd_input_chunks_free(chunks)
                why = {1: "the number of images and markers differ", 2: "an image failed preprocessing"}
                raise ValueError(f"llama.cpp could not prepare the prompt's images ({why.get(code, f'error {code}')})")
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
        return MtmdPrompt(chunks, self._segments(chunks))

    @staticmethod
    def _segments(chunks: Any) -> list[Segment]:
        segments: list[Segment] = []
        slices: dict[bytes, int] = {}
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                ids = [int(ptr[j]) for j in range(n.value)]
                if segments and isinstance(segments[-1], list):
                    segments[-1].extend(ids)
                elif ids:
                    segments.append(ids)
                continue
            if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                raise ValueError("the prompt holds a non-image media chunk, which this engine does not take")
            image_id = mtmd.mtmd_input_chunk_get_id(chunk) or b""
            ordinal = slices.get(image_id, 0)
            slices[image_id] = ordinal + 1
            # The key: the image's pixels and the slice's place in it, never a token id (negative).
            key = -1 - int.from_bytes(hashlib.blake2b(image_id + ordinal.to_bytes(4), digest_size=7).digest())
            segments.append(ImageChunk(chunk, int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)),
                                       int(mtmd.mtmd_input_chunk_get_n_pos(chunk)), key))  # fmt: skip
        return segments

    def evaluate(self, lctx: Any, image: ImageChunk, n_past: int, seq_id: int, n_batch: int, n_ubatch: int) -> int:
        """Encode ``image`` and decode its embeddings into ``seq_id``'s cache at ``n_past``; the next position."""
        # Image tokens that attend to each other both ways (Gemma 3) must be decoded in one micro-batch.
        if image.n_tokens > n_ubatch and mtmd.mtmd_decode_use_non_causal(self.ctx, image.chunk):
            raise RuntimeError(f"an image of {image.n_tokens} tokens attends non-causally and must fit one batch: "
                               f"raise the engine arg n_batch to at least {image.n_tokens}")  # fmt: skip
        new_n_past = llama_cpp.llama_pos(0)
        code = mtmd.mtmd_helper_eval_chunk_single(
            self.ctx, lctx, image.chunk, n_past, seq_id, n_batch, False, ctypes.byref(new_n_past)
        )
        if code != 0:
            raise RuntimeError(f"llama.cpp could not evaluate an image (mtmd_helper_eval_chunk_single returned {code})")
        return int(new_n_past.value)
