"""SFT samples: chat rows rendered with the tokenizer's chat template, and loss masks over the assistant replies.

The reply markers are discovered from the template itself by rendering probe chats (Molt inventory §4.14), never
hard-coded: `reply_open` = what the generation prompt appends (e.g. `<|im_start|>assistant\\n`,
`<start_of_turn>model\\n`), `reply_close` = the first token the template writes after a reply's content (e.g.
`<|im_end|>`), supervised too when it is a special (stop) token so the model learns to stop. A template without a
terminator ends a reply at the next special token, unsupervised. Masks are token-aligned (mask[t] = 1 iff token t
is trained on), the trainer's convention. Packing happens in the trainer's micro-batching (parallel/batching.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import TemplateError

from molt_hydra.data.prompts import (BUILTIN, IMAGE_PART_FIX, JSON_TYPES, builtin_rows, check_json_rows,
                                     own_image_part, usable_image_rows)
from molt_hydra.models.vlm import NOT_GENERATED, image_parts

log = logging.getLogger(__name__)

_PROBE_USER, _PROBE_REPLY = "Zq probe question 17", "Zq probe reply 42"
ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render (one of another role: dropped)


@dataclass(frozen=True)
class ReplyMarkers:
    reply_open: tuple[int, ...]
    reply_close: int | None  # a special (stop) token, supervised; None: a reply ends at the next special token


def _render(tokenizer, messages, chat_template, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)


def _special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def discover_reply_markers(tokenizer, chat_template: str | None = None) -> ReplyMarkers:
    user = [{"role": "user", "content": _PROBE_USER}]
    bare = _render(tokenizer, user, chat_template, False)
    prompt = _render(tokenizer, user, chat_template, True)
    if not prompt.startswith(bare) or prompt == bare:
        raise ValueError("chat template: add_generation_prompt=True must append the assistant header to the "
                         "rendered prompt; cannot locate assistant replies")
    full = _render(tokenizer, user + [{"role": "assistant", "content": _PROBE_REPLY}], chat_template, False)
    at = full.find(_PROBE_REPLY, len(bare))
    if at < 0:
        raise ValueError("chat template does not render the assistant message content")
    open_ids = tokenizer(prompt[len(bare):], add_special_tokens=False)["input_ids"]
    after = tokenizer(full[at + len(_PROBE_REPLY):], add_special_tokens=False)["input_ids"]
    # plain text after the reply (e.g. a newline) is no terminator token
    close = after[0] if after and after[0] in _special_ids(tokenizer) else None
    return ReplyMarkers(tuple(open_ids), close)


def reply_loss_mask(ids: list[int], markers: ReplyMarkers, special_ids: set[int],
                    last_turn_only: bool = False) -> list[int]:
    """1 on every token after each reply_open up to reply_close (inclusive; a reply without one ends before the
    next special token)."""
    n, k, op = len(ids), len(markers.reply_open), list(markers.reply_open)
    mask, runs, i = [0] * n, [], 0
    while i < n:
        if ids[i:i + k] != op:
            i += 1
            continue
        j = start = i + k
        while j < n and ids[j] != markers.reply_close and not (markers.reply_close is None and ids[j] in special_ids):
            j += 1
        end = j + 1 if (j < n and markers.reply_close is not None) else j
        runs.append((start, end))
        i = max(j, start)
    for start, end in runs[-1:] if last_turn_only else runs:
        mask[start:end] = [1] * (end - start)
    return mask


def _check_row(row, index: int, input_key: str, output_key: str | None) -> None:
    """A row that is no object, or whose prompt / reply is missing or of another shape, is an error naming the row and
    the key (was: a bare KeyError / TypeError from the trainer rank)."""
    if not isinstance(row, dict):
        raise ValueError(f"SFT row {index} is {row!r:.60}, not an object with data.input_key={input_key!r}. Fix: "
                         "make every row a JSON object")
    for key, column, types in (("input_key", input_key, (str, list)), ("output_key", output_key, (str, dict, list))):
        if column is not None and not isinstance(row.get(column), types):
            got = f"is {row[column]!r:.60}" if column in row else f"is missing (keys {sorted(row)})"
            raise ValueError(f"SFT row {index}: data.{key}={column!r} {got}; it must be a string or a list of chat "
                             f"messages{' (or one message)' if key == 'output_key' else ''}. Fix: set data.{key} to "
                             "that column, and give every row one")
        value = row.get(column) if column is not None else None
        for message in [value] if isinstance(value, dict) else value if isinstance(value, list) else []:
            content = message.get("content") if isinstance(message, dict) else None
            # (was: another role rendered as the template pleased; a number for content a TypeError from the template)
            if not (isinstance(message, dict) and message.get("role") in ROLES and (content is None or isinstance(
                    content, str) or isinstance(content, list) and all(isinstance(p, dict) for p in content))):
                raise ValueError(f"SFT row {index}: data.{key}={column!r} holds {message!r:.60}, not a chat message. "
                                 f"Fix: make each message an object with a 'role' (one of {', '.join(ROLES)}) and "
                                 "its 'content' (a string or a list of parts, each an object)")
        # images come from data.image_key alone (was: trained without the image; a VLM's template placed it)
        if own := own_image_part([value] if isinstance(value, dict) else value, ("image", "image_url")):
            raise ValueError(f"SFT row {index}: data.{key}={column!r}: {own[0]}. Fix: {IMAGE_PART_FIX}")


def check_sft_rows(path: str, input_key: str, output_key: str | None) -> list:
    """`load_rows` and each row's check, naming the file: data/rules.py runs them, so a dry run finds a bad SFT file
    or row (was: found by the trainer ranks, once the run had started). Returns the rows."""
    rows = load_rows(path)
    _check_rows(rows, path, input_key, output_key)
    return rows


def _check_rows(rows: list, source: str | None, input_key: str, output_key: str | None) -> None:
    """Each row's check; an error names `source` (the file: train or eval data), where given."""
    try:
        for index, row in enumerate(rows):
            _check_row(row, index, input_key, output_key)
    except ValueError as e:
        raise ValueError(f"{source}: {e}" if source else str(e)) from None


def _messages(row: dict, input_key: str, output_key: str | None) -> list[dict]:
    prompt = row[input_key]
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    reply = row[output_key] if output_key is not None else []  # a string, one message or a list of them
    if isinstance(reply, str):
        reply = {"role": "assistant", "content": reply}
    return msgs + ([reply] if isinstance(reply, dict) else list(reply))


def load_rows(data: str | list[dict]) -> list[dict]:
    """A list of dicts, a .jsonl / .json file of them, or `builtin://NAME` (a generated task, e.g. colors_warm)."""
    if not isinstance(data, (str, Path)):
        return list(data)
    if str(data).startswith(BUILTIN):
        return builtin_rows(str(data))
    path = Path(os.path.expanduser(data))  # as validation reads it (config/validate.py check_location)
    if path.suffix not in JSON_TYPES:
        raise ValueError(f"SFT data {str(path)!r}: expected a .jsonl or .json file (or a list of rows)")
    # read as prompt files are: a list, one object or JSON Lines in a .json, each row an object, an error naming the
    # line (was: a BOM, a U+2028 in a string failed; JSON Lines in a .json was json's 'Extra data')
    return check_json_rows(path)


def data_identity(data) -> str | None:
    """What a job=sft checkpoint records of its training data, so that a resume on data changed since (a file written
    again at the same path) is told: a file's size and the sha256 of its bytes; a builtin task's name (its rows are
    made from it); None for rows handed over as a list."""
    if not isinstance(data, (str, Path)):
        return None
    if str(data).startswith(BUILTIN):
        return str(data)
    path = Path(os.path.expanduser(data))
    with path.open("rb") as f:  # in chunks: a training file may be gigabytes
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{path.stat().st_size} bytes, sha256 {digest[:16]}"


def build_sft_samples(rows: list[dict], tokenizer, *, input_key: str = "input", output_key: str | None = None,
                      max_len: int = 2048, chat_template: str | None = None, train_on_last_turn_only: bool = False,
                      max_samples: int | None = None, image_key: str | None = None, max_images_per_prompt: int = 0,
                      images=None, source: str | None = None) -> list[dict]:
    """[{"input_ids", "loss_mask"}] per row with at least one assistant message and one supervised token.
    VLM rows (`image_key`): `<image>` markers in user strings become image parts, each placeholder is expanded and
    the processor outputs ride along (`images`: the model's `models.vlm.TrajectoryImages`); a row longer than
    max_len once expanded is skipped, as a cut would orphan image features; a row with an image that cannot be read or
    that the model's processor refuses, or more than `max_images_per_prompt` images, is dropped, logged with its row
    id and counted (`usable_image_rows`).
    Every row skipped (no reply, no supervised token, too long) or cut to max_len is counted and logged with its id
    (was: skipped or cut without a word). `source`: the rows' file, named by each error and log line (was: a trainer
    rank's "SFT row 3: ..." left train and eval data apart only by guess)."""
    markers = discover_reply_markers(tokenizer, chat_template)
    special = _special_ids(tokenizer)
    dropped, rows, named = [], rows[:max_samples], f"{source}: " if source else ""
    _check_rows(rows, source, input_key, output_key)
    usable = rows
    if image_key:  # a row with an unreadable image, or too many, costs its row (logged, counted), never the run
        with_images = next((i for i, row in enumerate(rows) if row.get(image_key)), None)
        if with_images is not None and images is None:
            raise ValueError(f"{named}SFT row {with_images} has images but the model has no vision tower. Fix: use a "
                             "VLM or set data.image_key=null")
        # `fits`: an image the processor refuses (Qwen-VL: aspect ratio > 200) drops its row, named, as in RL
        # prompt loading (was: the processor's ValueError out of a trainer rank, naming no row)
        usable = usable_image_rows(rows, f"{named}SFT", image_key, max_images_per_prompt, False, image_key, dropped,
                                   fits=images and images.added_tokens)
    out, notes, kept, gone = [], {}, iter(usable), {i for i, _ in dropped}  # notes: why -> row ids skipped or cut
    for index in (i for i in range(len(rows)) if i not in gone):
        try:
            sample, note = _sample(next(kept), tokenizer, markers, special, input_key=input_key,
                                   output_key=output_key, max_len=max_len, chat_template=chat_template,
                                   last_only=train_on_last_turn_only, image_key=image_key, images=images)
        except ValueError as e:
            raise ValueError(f"{named}SFT row {index}: {e}") from None
        if note:
            notes.setdefault(note, []).append(index)
        if sample is not None:
            out.append(sample)
    report = "; ".join(f"{len(ids)} {why} (row ids {ids[:20]})" for why, ids in notes.items())
    if report:
        log.warning("%sSFT data: of %d rows, %s", named, len(rows), report)
    if not out:
        raise ValueError(f"{named}no SFT samples with supervised tokens among {len(rows)} rows "
                         f"(input_key={input_key!r}, output_key={output_key!r})" + (f": {report}" if report else "")
                         + (f"; {len(dropped)} dropped for their images, the first: {dropped[0][1]}"
                            if dropped else ""))
    return out


def _sample(row: dict, tokenizer, markers: ReplyMarkers, special: set[int], *, input_key: str,
            output_key: str | None, max_len: int, chat_template: str | None, last_only: bool, image_key: str | None,
            images) -> tuple[dict | None, str | None]:
    """(the row's sample, or None when it is skipped; why it was skipped or cut to max_len, or None)."""
    msgs = _messages(row, input_key, output_key)
    if not any(m["role"] == "assistant" for m in msgs):
        return None, "skipped: no assistant message"
    replies = ["".join(str(p.get("text") or "") for p in c) if isinstance(c := m.get("content"), list) else c or ""
               for m in msgs if m["role"] == "assistant" and not m.get("tool_calls")]  # (_check_row: their shapes)
    if not all(text.strip() for text in replies):
        # (was: trained on, its mask the terminator alone: the model taught to stop at once, without a word)
        return None, "skipped: a blank assistant reply (no text, no tool call)"
    row_images = (row.get(image_key) or []) if image_key else []
    if row_images:
        msgs = image_parts(msgs)
    try:
        text = _render(tokenizer, msgs, chat_template, False)
    except (TemplateError, TypeError) as e:  # its raise_exception (Gemma's "System role not supported"), or content
        # it cannot join (was: the template's traceback out of every trainer rank, naming no row)
        raise ValueError(f"the chat template refuses its messages ({type(e).__name__}: {e}). Fix: give the row the "
                         "roles and order the template takes, or set data.chat_template to one that renders them") \
            from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    op, k = list(markers.reply_open), len(markers.reply_open)
    if sum(ids[i:i + k] == op for i in range(len(ids))) > sum(m["role"] == "assistant" for m in msgs):
        # a message's text holds the reply header: the mask would train what follows it as a reply (was: a user's
        # text after a literal "<|im_start|>assistant\n" trained on, without a word)
        return None, (f"skipped: a message's text holds the chat template's reply header "
                      f"{tokenizer.decode(op)!r}, so no mask could tell its tokens from a reply's")
    cut = f"cut to data.max_len={max_len} tokens" if len(ids) > max_len and not row_images else None
    ids = ids if row_images else ids[:max_len]  # an image row is skipped when too long, never cut (see above)
    mask = reply_loss_mask(ids, markers, special, last_only)
    multimodal = {}
    if row_images and (places := ids.count(images.placeholder_id)) != len(row_images):
        # (was: "fewer image placeholders in the trajectory than its 2 images", naming no row)
        raise ValueError(f"it has {len(row_images)} image(s) in data.image_key={image_key!r} but {places} place(s) for "
                         "one in its messages. Fix: write one <image> in the user text where each image goes (or a "
                         "{'type': 'image'} content part)")
    if row_images:  # the mask rides through the expansion as per-token values; image tokens get 0 (context only)
        ids, mask, _, _, multimodal = images.expand(ids, mask, [NOT_GENERATED] * len(ids), [], row_images)
        if len(ids) > max_len:
            return None, f"skipped: longer than data.max_len={max_len} tokens once its images are expanded"
    if not sum(mask):
        return None, "skipped: no reply token" + (f" within data.max_len={max_len} tokens" if cut else "")
    return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask, dtype=torch.float32), **multimodal}, cut
