"""Tiny tokenizers trained offline with the ``tokenizers`` library and wrapped in the transformers class each stock
pipeline loads (nothing is downloaded).

Each builder starts from the transformers class's own empty tokenizer, so the normalizer and pre-tokenizer are the
ones the real checkpoint uses (Qwen2's regex split + byte-level, CLIP's lower-casing split + byte-level with ``</w>``,
T5's Metaspace), trains that backend on :data:`CORPUS`, and builds the class again from the trained vocabulary.
Every word of the corpus becomes one token; any other text still tokenizes (byte-level alphabets for Qwen and CLIP,
single characters for T5).
"""

import json
import math
import string

from tokenizers import pre_tokenizers, trainers

__all__ = [
    "CORPUS",
    "QWEN_IMAGE_TEMPLATE_PREFIX",
    "QWEN3_CHAT_TEMPLATE",
    "clip_tokenizer",
    "qwen_tokenizer",
    "t5_tokenizer",
]

# The system and user header of QwenImagePipeline.prompt_template_encode (diffusers 0.42.1,
# pipelines/qwenimage/pipeline_qwenimage.py). The pipeline drops the first 34 hidden states
# (prompt_template_encode_start_idx): with every word of it in the vocabulary it is 34 tokens here too.
QWEN_IMAGE_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)

# CLIP's end-of-word mark while training (outside the byte-level alphabet); see clip_tokenizer
_WORD_END = "\u2581"
_ALPHABET_LINE = " ".join(string.ascii_letters + string.digits + string.punctuation)

CORPUS = [
    QWEN_IMAGE_TEMPLATE_PREFIX + "a red square<|im_end|>\n<|im_start|>assistant\n",
    "a red square on a blue field",
    "two green dots and a yellow line",
    "a cat and a dog baking a cake together in a kitchen",
    "a photo of a mountain lake at sunrise, highly detailed",
    "blurry, low quality, worst quality, static, overexposed",
    _ALPHABET_LINE,
]

# A Qwen3-style chat template written for the tiny tokenizer: one turn per message, and the empty thinking block
# Qwen3 emits when Flux2KleinPipeline calls apply_chat_template(..., enable_thinking=False).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _trained_model(tokenizer, trainer) -> dict:
    """Train ``tokenizer``'s backend on :data:`CORPUS` in place and return its model as JSON (vocab, merges)."""
    backend = tokenizer.backend_tokenizer
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return json.loads(backend.to_str())["model"]


def qwen_tokenizer(special_tokens: tuple[str, ...] = (), chat_template: str | None = None):
    """A byte-level BPE ``Qwen2Tokenizer`` (the class of Qwen2.5-VL's and Qwen3's tokenizers).

    Args:
        special_tokens: added special tokens besides ``<|endoftext|>`` (id 0, also pad and eos), ``<|im_start|>``
            and ``<|im_end|>``.
        chat_template: a Jinja chat template to attach (``QWEN3_CHAT_TEMPLATE`` for FLUX.2-klein).

    Returns:
        the tokenizer; ``len(tokenizer)`` is the vocabulary size the text encoder needs.
    """
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *special_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model = _trained_model(Qwen2Tokenizer(), trainer)
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(merge) for merge in model["merges"]],
        additional_special_tokens=specials[1:],
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def clip_tokenizer(model_max_length: int = 77):
    """A byte-level BPE ``CLIPTokenizer`` with ``<|startoftext|>`` = 0 and ``<|endoftext|>`` = 1 (also pad).

    CLIP's BPE marks a word's last symbol with ``</w>``. ``BpeTrainer(end_of_word_suffix=...)`` numbers those marked
    symbols in hash-map order, so its merges (and the ids) change from run to run. The corpus is instead split with
    CLIP's own normalizer and pre-tokenizer, every word ends in :data:`_WORD_END` (a character of the initial
    alphabet, so every symbol id is fixed and ties break the same way each run), and the trained merges are turned
    into CLIP's form: ``x + _WORD_END`` becomes the symbol ``x</w>``.

    Args:
        model_max_length: the padding length FluxPipeline reads from ``tokenizer.model_max_length`` (77 as in CLIP).
    """
    from tokenizers import Tokenizer, models
    from transformers import CLIPTokenizer

    backend = CLIPTokenizer().backend_tokenizer
    words = [
        word + _WORD_END
        for line in CORPUS
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line))
    ]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=[*alphabet, _WORD_END], show_progress=False)
    learner.train_from_iterator([" ".join(words)], trainer=trainer)

    def clip_form(symbol: str) -> str:
        return symbol[: -len(_WORD_END)] + "</w>" if symbol.endswith(_WORD_END) else symbol

    merges = [
        (clip_form(left), clip_form(right))
        for left, right in json.loads(learner.to_str())["model"]["merges"]
        if right != _WORD_END  # x + end-of-word is CLIP's starting symbol x</w>, not a merge
    ]
    tokens = ["<|startoftext|>", "<|endoftext|>", *alphabet, *(char + "</w>" for char in alphabet)]
    tokens += [left + right for left, right in merges]
    vocab = {token: index for index, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 512):
    """A Unigram ``T5Tokenizer`` (transformers 5's ``T5TokenizerFast``) with T5's ids: ``<pad>`` = 0, ``</s>`` = 1,
    ``<unk>`` = 2, and no sentinel tokens. Used for T5 (FLUX.1) and UMT5 (Wan), whose real tokenizers share them."""
    from transformers import T5Tokenizer

    trainer = trainers.UnigramTrainer(
        vocab_size=200,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    model = _trained_model(T5Tokenizer(extra_ids=0), trainer)
    # Two things in the trained vocabulary change from run to run: the log-probabilities in their last bits
    # (parallel sums), and the order, hence the scores, of the single characters the trainer appends after the
    # learned pieces. Rounding the learned scores, giving every single character one score below them all, and
    # sorting the pieces after the three special ones makes the saved tokenizer a function of the corpus alone.
    specials, learned = model["vocab"][:3], model["vocab"][3:]
    floor = math.floor(min(score for _, score in learned)) - 1.0
    pieces = sorted(
        ((piece, floor if len(piece) == 1 else round(score, 6)) for piece, score in learned),
        key=lambda item: (-item[1], item[0]),
    )
    return T5Tokenizer(vocab=[*map(tuple, specials), *pieces], extra_ids=0, model_max_length=model_max_length)
