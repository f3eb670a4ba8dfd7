"""`pretrainer chat RUN_DIR`: talk to a model trained on the chat format (data/tokenizers/chat_format.py).

    session = ChatSession(model, tokenizer, temperature=0.6, top_k=50, max_new_tokens=256, seed=0)
    for piece in session.reply("What is 2+3?"):   # text as it is generated (streamed)
        print(piece, end="")

The conversation is kept as token ids, exactly as generated (a reply is never re-encoded from its
text), and the KV cache holds them: each turn feeds only the new user turn, so a long chat costs one
token per forward pass. When the next turn would not fit the model's context (seq_len), the oldest
turns are dropped and the rest is prefilled again. On a terminal: `/reset`, `/temp T`, `/quit`. With
piped stdin each line is a conversation of its own (a prompt to score), answered on one line, and the
command exits at the end; `--conversation` makes the lines the turns of one conversation instead.

    pretrainer chat runs/sft --temperature 0 < prompts.txt > answers.txt   # line N answers line N
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from pretrainer.core.errors import UserError
from pretrainer.data.tokenizers.base import Tokenizer
from pretrainer.data.tokenizers.chat_format import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    ROLE_TOKENS,
    USER_END,
    USER_START,
    is_chat_tokenizer,
)
from pretrainer.model.generate import stream

HELP = "commands: /reset (new conversation), /temp T (sampling temperature; 0 = greedy), /quit"


class ChatSession:
    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        *,
        temperature: float,
        top_k: int,
        max_new_tokens: int,
        seed: int,
        system: str = "",
    ):
        if not is_chat_tokenizer(tokenizer):
            raise UserError(
                f"tokenizer {tokenizer.name} has no chat tokens: this is a base model. Fine-tune it on "
                f"conversations first (prepare --format chat --tokenizer-from RUN, then train "
                f"--init.from=RUN)"
            )
        self.model, self.tokenizer, self.special = model, tokenizer, tokenizer.special_tokens
        self.temperature, self.top_k, self.max_new_tokens, self.system = (
            temperature,
            top_k,
            max_new_tokens,
            system,
        )
        self.generator = torch.Generator(device=model.wte.weight.device).manual_seed(seed)
        self.context = model.cfg.seq_len
        if max_new_tokens > self.context // 2:  # leave the question room
            print(
                f"note: replies cut at {self.context // 2} tokens, half the model's context ({self.context})",
                file=sys.stderr,
            )
            self.max_new_tokens = self.context // 2
        # a turn ends at <|assistant_end|>; a weakly tuned model may instead start another turn or document
        self.stops = (*[self.special[name] for name in (ASSISTANT_END, USER_START, BOS)], tokenizer.eot_id)
        self.reset()

    def reset(self) -> None:
        self.head = [self.special[BOS]]  # <|bos|> and the system message: kept when old turns are dropped
        if self.system:
            start, end = ROLE_TOKENS["system"]
            self.head += [self.special[start], *self.tokenizer.encode(self.system), self.special[end]]
        self.turns: list[list[int]] = []  # each: a user turn and the reply, as ids
        self.cache, self.fed = None, 0  # the KV cache holds the first `fed` ids of the conversation

    def _ids(self) -> list[int]:
        return [*self.head, *[i for turn in self.turns for i in turn]]

    def reply(self, text: str) -> Iterator[str]:
        """The assistant's answer to `text`, streamed as text pieces; the turn joins the conversation."""
        s = self.special
        turn = [s[USER_START], *self.tokenizer.encode(text), s[USER_END], s[ASSISTANT_START]]
        self.turns.append(turn)
        while len(self._ids()) + self.max_new_tokens > self.context and len(self.turns) > 1:
            self.turns.pop(0)  # the oldest turn goes; the conversation is prefilled again below
            self.cache = None
        ids = self._ids()
        cut = len(ids) + self.max_new_tokens > self.context
        if cut:  # one turn alone is too long: the model sees its end
            ids = ids[-(self.context - self.max_new_tokens) :]
            self.cache = None
        if self.cache is None:
            self.cache, self.fed = self.model.new_kv_cache(1), 0
        answer: list[int] = []
        printed = ""
        for token in stream(
            self.model,
            ids[self.fed :],
            self.cache,
            self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            generator=self.generator,
            stop_ids=self.stops,
            vocab_in_use=self.tokenizer.vocab_size,
        ):
            if token in self.stops:
                break
            answer.append(token)
            text_so_far = self.tokenizer.decode(answer)
            if not text_so_far.endswith("\ufffd"):  # hold back a character whose bytes are not all out yet
                yield text_so_far[len(printed) :]
                printed = text_so_far
        rest = self.tokenizer.decode(answer)[len(printed) :]
        if rest:
            yield rest
        # the reply ends with <|assistant_end|> (also when cut at max_new_tokens); the cache holds the
        # conversation up to cache.pos, and the next turn feeds the rest
        turn += [*answer, s[ASSISTANT_END]]
        self.fed = self.cache.pos
        if cut:  # the cache holds a cut conversation: start it again next turn
            self.cache = None


def run_chat(session: ChatSession, lines=None, out=sys.stdout, conversation: bool = False) -> None:
    """The terminal loop: a prompt and streamed replies on a terminal; with piped input (`lines`, or
    stdin that is not a terminal) one answer line per input line, each line a new conversation unless
    `conversation` (then the lines are its turns), then return at the end."""
    interactive = lines is None and sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 (line editing and history for input())
        except ImportError:
            pass
        print(f"chat with {session.tokenizer.name} model; {HELP}", file=out)
    source = lines if lines is not None else sys.stdin
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                print(file=out)
                return
        else:
            line = next(source, None)
            if line is None:
                return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, argument = line.partition(" ")
            if command == "/quit":
                return
            if command == "/reset":
                session.reset()
                print("(new conversation)", file=out)
            elif command == "/temp":
                try:
                    session.temperature = float(argument)
                    print(f"(temperature {session.temperature})", file=out)
                except ValueError:
                    print("usage: /temp 0.7", file=out)
            else:
                print(HELP, file=out)
            continue
        if interactive:
            print("assistant> ", end="", file=out, flush=True)
            for piece in session.reply(line):
                print(piece, end="", file=out, flush=True)
            print(file=out, flush=True)
            continue
        if not conversation:  # a script's prompts: each one alone, as it would be scored
            session.reset()
        reply = "".join(session.reply(line))
        print(" ".join(reply.splitlines()), file=out, flush=True)  # line N answers line N
