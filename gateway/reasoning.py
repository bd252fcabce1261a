"""Reasoning split from content: the text a model writes between `<think>` and `</think>` becomes
`reasoning_content`, the rest `content` (vLLM's `deepseek_r1` reasoning parser, by name and by rule).

The reasoning starts at the output's first character when the prompt leaves a `<think>` open (templates
that open the block themselves, as DeepSeek-R1's and Nemotron-H's do), or when the output begins with
`<think>`; otherwise the output is content throughout. It ends at `</think>`; output that never closes the
block is all reasoning. Incremental, as the tool-call parsers (gateway/tool_parsers.py). Pure."""

from __future__ import annotations

from gateway.tool_parsers import Piece, partial_suffix

OPEN, CLOSE = "<think>", "</think>"
PARSER_NAMES = ("deepseek_r1",)


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside a `<think>` block (the template opened it for the model)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def pick_reasoning_parser(name: str, template_source: str | None) -> str:
    """ "" (off), or a parser's name: `name`, or with "auto" deepseek_r1 when the template writes `<think>`."""
    if name in ("", "none"):
        return ""
    if name == "auto":
        return "deepseek_r1" if template_source and OPEN in template_source else ""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}: use auto, none or one of {', '.join(PARSER_NAMES)}")
    return name


class ReasoningSplitter:
    """`feed` each new piece of output, then `finish`: "reasoning" and "content" pieces."""

    def __init__(self, starts_inside: bool) -> None:
        self.state = "inside" if starts_inside else "start"  # start -> inside -> after, or start -> after
        self.buffer = ""
        self.strip_newlines = False  # just after </think>: the newlines templates put there belong to neither

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if not head or (len(head) < len(OPEN) and OPEN.startswith(head)):
                return []  # may still become <think>
            if head.startswith(OPEN):
                self.state, self.buffer = "inside", head[len(OPEN) :]
            else:
                self.state = "after"
        if self.state == "after":
            text, self.buffer = self.buffer, ""
            if self.strip_newlines:
                text = text.lstrip("\n")
                self.strip_newlines = not text
            return [Piece("content", text)] if text else []
        pieces = []
        at = self.buffer.find(CLOSE)
        if at >= 0:
            if at:
                pieces.append(Piece("reasoning", self.buffer[:at]))
            rest, self.buffer, self.state = self.buffer[at + len(CLOSE) :], "", "after"
            self.strip_newlines = True
            return pieces + self.feed(rest)
        keep = partial_suffix(self.buffer, CLOSE)
        ready, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return [Piece("reasoning", ready)] if ready else []

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        return [Piece("reasoning" if self.state == "inside" else "content", text)]
