"""Prompts for online RL, and the row-reading and chat-template helpers that `common.data.rows` shares.

Errors are `UserError`s naming the file and the 1-based row ("data.jsonl, row 7: ..."). Nothing
heavy is imported here: the tokenizer arrives as an argument.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import UserError, one_line


@dataclass(frozen=True)
class PromptExample:
    prompt_ids: list[int]
    prompt_text: str  # the rendered prompt, what the reward function sees
    label: str | None


def build_prompts(rows: list[dict], source: str, tokenizer, *, input_key: str = "prompt",
                  label_key: str | None = "label", apply_chat_template: bool = False,
                  prompt_max_len: int = 1024, input_template: str | None = None) -> tuple[list[PromptExample], int]:
    """Tokenized prompts and the number dropped for being longer than `prompt_max_len` tokens.

    The input is a string or (with `apply_chat_template`) a message list; with the template a
    string becomes one user message; without it `input_template` ("Q: {}\nA: ") wraps the string.
    A missing or null label gives None; a non-string label (a number, say) is kept as its JSON
    text, so reward functions always compare strings.
    """
    examples, dropped, longest = [], 0, 0
    for i, row in enumerate(rows, start=1):
        where = f"{source}, row {i}"
        prompt = as_text_or_messages(field(row, input_key, "--input_key", where), input_key, where)
        if apply_chat_template:
            text = render_chat(tokenizer, user_turn(prompt), True, where)
        elif isinstance(prompt, str):
            text = fill_template(input_template, prompt)
        else:
            raise needs_template(input_key, where)
        ids = encode(tokenizer, text)
        if len(ids) > prompt_max_len:
            dropped, longest = dropped + 1, max(longest, len(ids))
            continue
        label = row.get(label_key) if label_key is not None else None
        if label is not None and not isinstance(label, str):
            label = json.dumps(label, ensure_ascii=False)
        examples.append(PromptExample(ids, text, label))
    if not examples and dropped:
        raise UserError(f"{source}: all {dropped} prompts are longer than --prompt_max_len "
                        f"{prompt_max_len} tokens (the longest has {longest}); raise "
                        "--prompt_max_len")
    return examples, dropped


# ---- reading fields of a row -------------------------------------------------------------------

def field(row: dict, key: str, flag: str, where: str) -> Any:
    """`row[key]`, or a UserError listing the row's keys and the flag that names the column."""
    value = row.get(key)
    if value is None:
        state = "is null" if key in row else "is missing"
        raise UserError(f"{where}: '{key}' {state} (the row has keys {keys_of(row)}); "
                        f"set {flag} to the key that holds it")
    return value


def as_text_or_messages(value: Any, key: str, where: str) -> str | list[dict]:
    """Check that `value` is a non-empty string or a list of {role, content} messages."""
    if isinstance(value, str):
        _check_text(value, f"'{key}'", where)
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for j, m in enumerate(value, start=1):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise UserError(f"{where}: message {j} of '{key}' needs string 'role' and "
                                f"'content' fields, got {keys_of(m)}")
            _check_text(m["content"], f"message {j} of '{key}'", where, allow_empty=True)
        return value
    raise UserError(f"{where}: '{key}' must be a string or a non-empty list of "
                    f"{{role, content}} messages, got {type_name(value)}")


def _check_text(text: str, what: str, where: str, allow_empty: bool = False) -> None:
    if not allow_empty and not text.strip():
        raise UserError(f"{where}: {what} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a "\ud800" escape: tokenizers reject it
        raise UserError(f"{where}: {what} holds invalid Unicode (a lone surrogate)") from None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    """The tokenizer's chat template applied to `messages`, as text."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # the template is the model's own code; its errors are about the data
        raise UserError(f"{where}: the tokenizer's chat template failed ({one_line(e)}); "
                        "check the messages, or drop --apply_chat_template") from None


def render_response(tokenizer, prompt_msgs: list[dict], prompt_text: str,
                    response_msgs: list[dict], key: str, where: str) -> str:
    """The text the template puts after `prompt_text` for `response_msgs`, ending at eos."""
    if not any(m["content"].strip() for m in response_msgs):
        raise UserError(f"{where}: the response in '{key}' is empty")
    # Rendering the whole conversation and cutting off the prompt gives the response exactly as
    # the template ends a turn, whatever its end-of-turn marker is.
    full = render_chat(tokenizer, prompt_msgs + response_msgs, False, where)
    if not full.startswith(prompt_text):
        raise UserError(f"{where}: the chat template renders the prompt differently alone and "
                        "inside the conversation, so the response cannot be split off; use a "
                        "template whose generation prompt is a prefix of the full conversation")
    text = full[len(prompt_text):]
    eos = tokenizer.eos_token
    if eos and text.rstrip().endswith(eos):  # "<|im_end|>\n": stop at eos, not after the newline
        text = text.rstrip()
    return text


def fill_template(template: str | None, prompt: str) -> str:
    """OpenRLHF's `--input_template`: `template.format(prompt)` ('{{' and '}}' are literal braces)."""
    return prompt if template is None else template.format(prompt)


def set_chat_template(tokenizer, template: str | None) -> None:
    """--tokenizer_chat_template: the Jinja template replaces the tokenizer's (and is saved with it)."""
    if template is None:
        return
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"--tokenizer_chat_template: not a valid Jinja template ({e.message}, line {e.lineno})") from None
    tokenizer.chat_template = template


def encode(tokenizer, text: str) -> list[int]:
    # Special tokens come from the template text; adding BOS/EOS here would double them.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_tail(tokenizer, ids: list[int], max_chars: int = 60) -> str:
    """The end of a prompt for a log line, as a repr: its last whole tokens whose text fits `max_chars`
    (at least the last token), with `…` in front when that is not all of it. Cut on the text instead, a
    line would show half a token (`'tart|>user\\n...'` of `<|im_start|>`), or half a UTF-8 character."""
    shown, k = "", 0
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[-n:])
        if text.startswith("\ufffd"):  # a byte-level token in the middle of a character: take one more
            continue
        if shown and len(text) > max_chars:
            break
        shown, k = text, n
    return ("…" if k < len(ids) else "") + repr(shown)


def user_turn(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def needs_template(key: str, where: str) -> UserError:
    return UserError(f"{where}: '{key}' is a list of chat messages; add --apply_chat_template so "
                     "the tokenizer's chat template turns it into text")


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def keys_of(row: dict) -> str:
    keys = [str(k) for k in row][:12]
    return "[" + ", ".join(keys) + (", ..." if len(row) > 12 else "") + "]"

