"""The chat format: special tokens, the template, conversation checks, and rendering to token ids
with a loss mask.

A conversation is a list of messages `[{"role": ..., "content": ...}, ...]` (the SmolTalk /
UltraChat `messages` layout): an optional system message first, then user and assistant turns
alternating, starting with the user and ending with the assistant. It is rendered as

    <|bos|> [<|system_start|> SYSTEM <|system_end|>]
            <|user_start|> USER <|user_end|> <|assistant_start|> ASSISTANT <|assistant_end|>  (repeated)
    <|endoftext|>

where each text is the tokenizer's ordinary encoding of the content (a "<|user_start|>" typed inside
a message is text, never a special token) and <|endoftext|> is the tokenizer's end-of-text (an hf:
tokenizer's may have another name, e.g. </s>). The loss mask is 1 on every assistant content token and
its <|assistant_end|> (the model learns to answer and to stop), 0 everywhere else; the trainer counts
a target when the mask of the token it predicts is 1. The closing <|endoftext|> is the document
separator every prepared document ends with, so packing and document masking treat a conversation
like any other document.

The special tokens are appended after the tokenizer's end-of-text (data/tokenizers/bpe.py), so a base
model's ids keep their meaning and its vocabulary grows by len(CHAT_TOKENS) at `init.from`.
An hf: tokenizer (data/tokenizers/hf.py) keeps those of the chat tokens its tokenizer.json has and gets
the others appended after its vocabulary; its own BOS, if any, is not used here (<|bos|> is).
"""

from __future__ import annotations

import json

import numpy as np

from pretrainer.data.tokenizers.base import Tokenizer

BOS = "<|bos|>"
ROLE_TOKENS = {role: (f"<|{role}_start|>", f"<|{role}_end|>") for role in ("system", "user", "assistant")}
CHAT_TOKENS = (BOS, *[token for pair in ROLE_TOKENS.values() for token in pair])
ASSISTANT_START, ASSISTANT_END = ROLE_TOKENS["assistant"]
USER_START, USER_END = ROLE_TOKENS["user"]

TEMPLATE = (
    "<|bos|>[<|system_start|>SYSTEM<|system_end|>]"
    "(<|user_start|>USER<|user_end|><|assistant_start|>ASSISTANT<|assistant_end|>)+<|endoftext|>"
)

# The same template for transformers' `apply_chat_template` (written into an exported tokenizer_config.json).
HF_CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '_start|>' + message['content'] + '<|' + message['role'] + '_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant_start|>' }}{% endif %}"
)


def is_chat_tokenizer(tokenizer: Tokenizer) -> bool:
    return all(name in tokenizer.special_tokens for name in CHAT_TOKENS)


def chat_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with the chat tokens appended (those it has keep their ids)."""
    return tokenizer.with_special(CHAT_TOKENS)


def conversation_problem(messages) -> str:
    """ "" for a well-formed conversation, else what is wrong with it, in a few words."""
    if not isinstance(messages, list) or not messages:
        return '\'messages\' must be a non-empty list of {"role", "content"} objects'
    expected = "user"
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or "content" not in message
        ):
            return f"message {i + 1} is not an object with 'role' and 'content'"
        role, content = message["role"], message["content"]
        if role not in ROLE_TOKENS:
            return f"message {i + 1} has unknown role '{role}' (roles: system, user, assistant)"
        if not isinstance(content, str) or not content.strip():
            return f"message {i + 1} ({role}) has empty content"
        if role == "system":
            if i != 0:
                return f"message {i + 1}: a system message may only come first"
            continue
        if role != expected:
            return (
                f"message {i + 1} is '{role}' where '{expected}' was expected "
                f"(turns alternate, starting with the user)"
            )
        expected = "assistant" if role == "user" else "user"
    if messages[-1]["role"] != "assistant":
        return "the conversation does not end with an assistant message"
    return ""


def canonical(messages: list[dict]) -> str:
    """The conversation as one JSON string (role and content only): the document prepare keys,
    deduplicates, splits and hands to its workers."""
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False)


def render(messages: list[dict], tokenizer: Tokenizer, close: bool = True) -> tuple[list[int], list[int]]:
    """-> (token ids, loss mask) of a conversation in the template; `close`: end with <|endoftext|>
    (a training document) or not (a chat prompt, continued by the model)."""
    special = tokenizer.special_tokens
    ids, mask = [special[BOS]], [0]
    contents = tokenizer.encode_batch([m["content"] for m in messages])
    for message, content in zip(messages, contents):
        start, end = ROLE_TOKENS[message["role"]]
        trained = int(message["role"] == "assistant")
        ids += [special[start], *content, special[end]]
        mask += [0, *[trained] * len(content), trained]
    if close:
        ids.append(tokenizer.eot_id)
        mask.append(0)
    return ids, mask


def prompt_ids(messages: list[dict], tokenizer: Tokenizer) -> list[int]:
    """A conversation so far (ending with the user) followed by <|assistant_start|>:
    what the model continues."""
    ids, _ = render(messages, tokenizer, close=False)
    return ids + [tokenizer.special_tokens[ASSISTANT_START]]


def render_batch(documents: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """prepare's worker for --format chat: canonical conversations
    -> (all ids, all mask bytes, per-item lengths)."""
    rendered = [render(json.loads(document), tokenizer) for document in documents]
    lengths = np.array([len(ids) for ids, _ in rendered], dtype=np.int64)
    flat_ids = np.fromiter((i for ids, _ in rendered for i in ids), dtype=np.int64, count=int(lengths.sum()))
    flat_mask = np.fromiter(
        (m for _, mask in rendered for m in mask), dtype=np.uint8, count=int(lengths.sum())
    )
    return flat_ids, flat_mask, lengths
