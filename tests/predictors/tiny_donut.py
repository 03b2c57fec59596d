"""A tiny Donut-style model built offline: a DonutSwin encoder, an MBart decoder, a DonutProcessor.

No model hub is reachable, so everything is made here: a Unigram (SentencePiece-style, ``▁`` word
boundaries, as XLM-RoBERTa's) tokenizer over a hand-written vocabulary with Donut's task and field
tokens added, a small ``DonutImageProcessor``, and a ``VisionEncoderDecoderModel`` saved with
``save_pretrained`` in the layout a fine-tuned Donut checkpoint has.

The decoder is *constructed* the way the tiny NER model is (see ``tiny_bert``): each token's embedding
is a normalised random vector and the output projection maps a token to the tokens that may follow it
(:data:`FOLLOWS`), so a task prompt runs down Donut's output grammar::

    <s_docvqa><s_question>...</s_question><s_answer>  -> ANSWER  </s_answer></s>
    <s_rvlcdip>                                       -> <s_class> CLASS </s_class></s>
    <s_cord-v2>                                       -> <s_company> NAME </s_company><s_total> TOTAL </s_total></s>

Where several tokens may follow (an answer, a class, a name, a total) they tie but for a random part of
their output rows that is blind to the token itself, so the decoder's context decides: its attention
over the prompt and the page (output projections kept small, random). The page moves every score (in
the third or fourth digit between rendered pages), so a preprocessing or batching difference shows
against the in-process reference, while the output stays Donut JSON that parses.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-RoBERTa's order: pad 1, eos 2
ANSWERS = ["paris", "london", "berlin", "tokyo"]
COMPANIES = ["acme", "globex", "initech", "umbrella"]
TOTALS = ["12.50", "48.00", "7.25", "103.90"]
CLASSES = ["letter", "invoice", "memo", "form"]
QUESTION_WORDS = ["what", "is", "the", "who", "where", "when", "total", "name", "company", "city", "of", "date"]
#: Donut's task start tokens, field tokens and categorical tokens (``<letter/>``), as fine-tuning adds them.
TASK_TOKENS = ["<s_docvqa>", "<s_rvlcdip>", "<s_cord-v2>"]
FIELDS = ["question", "answer", "class", "company", "total"]
FIELD_TOKENS = [token for field in FIELDS for token in (f"<s_{field}>", f"</s_{field}>")]
CLASS_TOKENS = [f"<{name}/>" for name in CLASSES]
ADDED = [*TASK_TOKENS, *FIELD_TOKENS, *CLASS_TOKENS, "<sep/>"]
CHARS = list(string.ascii_lowercase + string.digits + string.punctuation)

#: The output grammar: the tokens each token may be followed by.
FOLLOWS: dict[str, list[str]] = {
    "<s_answer>": [f"▁{word}" for word in ANSWERS],
    **{f"▁{word}": ["</s_answer>"] for word in ANSWERS},
    "</s_answer>": ["</s>"],
    "<s_rvlcdip>": ["<s_class>"],
    "<s_class>": CLASS_TOKENS,
    **{token: ["</s_class>"] for token in CLASS_TOKENS},
    "</s_class>": ["</s>"],
    "<s_cord-v2>": ["<s_company>"],
    "<s_company>": [f"▁{word}" for word in COMPANIES],
    **{f"▁{word}": ["</s_company>"] for word in COMPANIES},
    "</s_company>": ["<s_total>"],
    "<s_total>": [f"▁{word}" for word in TOTALS],
    **{f"▁{word}": ["</s_total>"] for word in TOTALS},
    "</s_total>": ["</s>"],
}

#: The page size the image processor resizes to (height, width): small, so the Swin encoder is fast.
IMAGE_SIZE = (128, 96)
HIDDEN = 128
MAX_POSITIONS = 64


@dataclass(frozen=True)
class Shape:
    """The sizes of a built Donut. :data:`TINY` is the tests' (a page in tens of milliseconds: the serving
    layer's own costs dominate); :data:`SMALL` has the encoder stages and decoder depth of donut-base at a
    smaller width and page (a page in about a second on 2 CPUs), for benchmarks that want a model whose
    compute, not its wrapper, dominates a page."""

    image_size: tuple[int, int] = IMAGE_SIZE
    hidden: int = HIDDEN
    depths: tuple[int, ...] = (1, 1)
    heads: tuple[int, ...] = (2, 4)
    window_size: int = 4
    decoder_layers: int = 2
    decoder_heads: int = 4
    ffn: int = 256


TINY = Shape()
SMALL = Shape(image_size=(640, 480), hidden=256, depths=(2, 2, 6, 2), heads=(1, 2, 4, 8), window_size=10,
              decoder_layers=4, decoder_heads=8, ffn=1024)  # fmt: skip


def pieces() -> list[tuple[str, float]]:
    """The Unigram vocabulary: whole words (likely), then single characters with and without ``▁``."""
    words = [*ANSWERS, *COMPANIES, *TOTALS, *QUESTION_WORDS]
    vocab = [(token, 0.0) for token in SPECIALS]
    vocab += [(f"▁{word}", -2.0) for word in words]
    vocab += [("▁", -6.0)]
    vocab += [(f"▁{char}", -8.0) for char in CHARS] + [(char, -8.0) for char in CHARS]
    return vocab


def build_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.Unigram(pieces(), unk_id=SPECIALS.index("<unk>"), byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in ADDED])
    return tokenizer


def _unit_rows(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Random rows with mean 0 and variance 1 each: a LayerNorm (weight 1, bias 0) leaves them as they are."""
    table = rng.standard_normal((rows, width))
    table -= table.mean(axis=1, keepdims=True)
    table /= table.std(axis=1, keepdims=True)
    return table


def build_donut(directory: Path, *, seed: int = 0, attention_gain: float = 0.5, tie_spread: float = 1.0,
                shape: Shape = TINY) -> Path:  # fmt: skip
    """Build and ``save_pretrained`` the model and its processor into ``directory`` (returned)."""
    import torch
    from transformers import (
        DonutImageProcessor,
        DonutProcessor,
        DonutSwinConfig,
        DonutSwinModel,
        GenerationConfig,
        MBartConfig,
        MBartForCausalLM,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
    )

    tokenizer = build_tokenizer()
    vocab_size = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(seed)
    hidden = shape.hidden
    # Swin doubles its width per stage; the last stage's width is the decoder's (cross-attention) input.
    encoder_config = DonutSwinConfig(
        image_size=list(shape.image_size), patch_size=4, num_channels=3,
        embed_dim=hidden // 2 ** (len(shape.depths) - 1), depths=list(shape.depths), num_heads=list(shape.heads),
        window_size=shape.window_size, mlp_ratio=2.0 if shape == TINY else 4.0,
    )  # fmt: skip
    decoder_config = MBartConfig(
        vocab_size=vocab_size, d_model=hidden, decoder_layers=shape.decoder_layers,
        decoder_attention_heads=shape.decoder_heads, decoder_ffn_dim=shape.ffn,
        # MBart's num_hidden_layers (what generate sizes its cache by) reads encoder_layers: the decoder's depth.
        encoder_layers=shape.decoder_layers, encoder_attention_heads=shape.decoder_heads, encoder_ffn_dim=shape.ffn,
        max_position_embeddings=MAX_POSITIONS,
        scale_embedding=False, tie_word_embeddings=False, is_decoder=True, add_cross_attention=True,
        pad_token_id=ids("<pad>"), bos_token_id=ids("<s>"), eos_token_id=ids("</s>"),
        decoder_start_token_id=ids("<s>"), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder_config, decoder_config)
    config.pad_token_id = ids("<pad>")
    config.eos_token_id = ids("</s>")
    config.decoder_start_token_id = ids("<s>")
    model = VisionEncoderDecoderModel(
        config=config, encoder=DonutSwinModel(encoder_config), decoder=MBartForCausalLM(decoder_config)
    ).eval()

    rng = np.random.default_rng(seed)
    embeddings = _unit_rows(rng, vocab_size, hidden)
    spread = _unit_rows(rng, vocab_size, hidden)
    head = np.zeros((vocab_size, hidden))
    for token, followers in FOLLOWS.items():
        for follower in followers:
            head[ids(follower)] += embeddings[ids(token)]
            if len(followers) > 1:  # a tie: the page decides, through the small random part
                source = embeddings[ids(token)]
                row = spread[ids(follower)]
                row = row - (row @ source) / (source @ source) * source  # blind to the token itself: context only
                head[ids(follower)] += tie_spread * row
    decoder = model.decoder.model.decoder
    with torch.no_grad():
        decoder.embed_tokens.weight.copy_(torch.from_numpy(embeddings).float())
        for layer in decoder.layers:
            for projection in (layer.self_attn.out_proj, layer.encoder_attn.out_proj, layer.fc2):
                projection.weight.mul_(attention_gain)
                projection.bias.zero_()
        # Logits about 0.2 per unit of match: a designed successor is ~25 nats ahead, a tie a few tenths apart.
        model.decoder.lm_head.weight.copy_(torch.from_numpy(head * 0.2).float())

    image_processor = DonutImageProcessor(
        size={"height": shape.image_size[0], "width": shape.image_size[1]}, do_align_long_axis=False, do_thumbnail=True,
        do_pad=True, do_resize=True, do_normalize=True,
    )  # fmt: skip
    processor = DonutProcessor(image_processor=image_processor, tokenizer=tokenizer)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    processor.save_pretrained(directory)
    GenerationConfig(
        decoder_start_token_id=ids("<s>"), pad_token_id=ids("<pad>"), eos_token_id=ids("</s>"),
        bos_token_id=ids("<s>"), max_length=MAX_POSITIONS,
    ).save_pretrained(directory)  # fmt: skip
    return directory
