"""Chat templates `hybridserve init-model --chat-template NAME` writes into tokenizer_config.json.

`granite`: the layout of Granite-4.0's template: `<|start_of_role|>ROLE<|end_of_role|>TEXT` turns ended by
the EOS token, the tools listed in the system turn inside `<tools></tools>`, the assistant's calls as
`<tool_call>{"name", "arguments"}</tool_call>` blocks, and tool results in a user turn as
`<tool_response>` blocks. The gateway reads such calls with its `granite` tool-call parser."""

from __future__ import annotations

import json
from pathlib import Path

GRANITE = r"""
{%- set tools_prefix = 'You are a helpful assistant with access to the following tools. You may call one or more'
  + ' tools to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML'
  + ' tags:\n<tools>' -%}
{%- set tools_suffix = '\n</tools>\n\nFor each tool call, return a json object with function name and arguments'
  + ' within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments":'
  + ' <args-json-object>}\n</tool_call>' -%}
{%- if messages[0].role == 'system' -%}
  {%- set system = messages[0].content -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system = none -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools or system -%}
  {{- '<|start_of_role|>system<|end_of_role|>' -}}
  {%- if tools -%}
    {{- tools_prefix -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- tools_suffix -}}
    {%- if system -%}{{- '\n\n' -}}{%- endif -%}
  {%- endif -%}
  {%- if system -%}{{- system -}}{%- endif -%}
  {{- eos_token + '\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|start_of_role|>user<|end_of_role|>' -}}
    {%- endif -%}
    {{- '<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' -%}
      {{- eos_token + '\n' -}}
    {%- else -%}
      {{- '\n' -}}
    {%- endif -%}
  {%- elif message.role == 'assistant' -%}
    {{- '<|start_of_role|>assistant<|end_of_role|>' -}}
    {%- if message.content -%}{{- message.content -}}{%- endif -%}
    {%- if message.tool_calls -%}
      {%- for call in message.tool_calls -%}
        {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
        {%- set body = {'name': call.function.name, 'arguments': call.function.arguments} -%}
        {{- '<tool_call>\n' + (body | tojson) + '\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- eos_token + '\n' -}}
  {%- else -%}
    {{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + message.content + eos_token + '\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_of_role|>assistant<|end_of_role|>' -}}
{%- endif -%}
""".strip()

TEMPLATES = {"granite": GRANITE}


def add_chat_template(model_dir: Path, name: str) -> None:
    """Writes the template `name` into model_dir/tokenizer_config.json."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = TEMPLATES[name]
    path.write_text(json.dumps(config, indent=2) + "\n")
