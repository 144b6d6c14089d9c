"""The tiny models' tokenizer: a byte-level BPE trained here on a small synthetic corpus (no download), with a ChatML
chat template that renders tools and Hermes-style `<tool_call>` blocks (models/tiny.py, models/tiny_vlm.py); and the
random-init save every tiny model shares."""

from __future__ import annotations

import random
from pathlib import Path
# imported where used: tokenizers and transformers (heavy; only to build once)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
VOCAB_SIZE = 512

# ChatML as Qwen renders it: tools go into the system turn, assistant tool calls are `<tool_call>{json}</tool_call>`,
# tool results are wrapped as user-side `<tool_response>` blocks. Text-only content, or a list of parts.
CHAT_TEMPLATE = r"""{%- macro content_text(c) -%}
{%- if c is string -%}{{ c }}{%- elif c is none -%}{%- else -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{ p.text }}{%- elif p.type in ['image', 'image_url'] -%}<|image|>{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ content_text(messages[0].content) }}

{% endif %}# Tools
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ content_text(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ content_text(m.content) }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{{ content_text(m.content) }}{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}{%- set f = tc.function if tc.function is defined else tc -%}
<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else (f.arguments | tojson) }}}</tool_call>{%- endfor -%}{%- endif -%}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ content_text(m.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""  # noqa: E501 (the template is data: its lines are the chat format)


def _corpus(rng: random.Random):
    words = "the quick brown fox jumps over lazy dog answer is yes no python print tool result call sum".split()
    for _ in range(4000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        yield (f"<|im_start|>user\nWhat is {a}+{b}?<|im_end|>\n"
               f"<|im_start|>assistant\nThe answer is \\boxed{{{a + b}}}.<|im_end|>")
        yield '<tool_call>{"name": "python", "arguments": {"code": "print(%d*%d)"}}</tool_call>' % (a, b)
        yield " ".join(rng.choice(words) for _ in range(12))


def build_tokenizer(extra_specials: tuple[str, ...] | list[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS + list(extra_specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_corpus(random.Random(0)), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None, model_max_length=4096,
                                  additional_special_tokens=SPECIALS[1:] + list(extra_specials))
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) <= VOCAB_SIZE, len(tok)
    return tok


def special_ids(tok) -> dict:
    """The token ids every tiny model's config carries: pad as bos, `<|im_end|>` as eos."""
    pad = tok.pad_token_id
    return dict(bos_token_id=pad, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=pad)


def save_random_init(out_dir: Path, seed: int, model_cls, config, special: dict, large: bool = False) -> None:
    """A tiny model of `config`, random-init from `seed`, saved to `out_dir`. `large` (a GPU recipe's full-width
    shape): built in bf16 (half the disk), on the GPU when there is one (minutes on a CPU)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    with torch.device("cuda" if large and torch.cuda.is_available() else "cpu"):
        model = model_cls(config)
    model = model.to(torch.bfloat16) if large else model.float()
    model.generation_config = GenerationConfig(eos_token_id=special["eos_token_id"],
                                               pad_token_id=special["pad_token_id"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
