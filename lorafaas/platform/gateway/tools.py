"""OpenAI's `tools` and `tool_choice` on chat completions: rendered through the chat template, or refused by name.

Tool definitions reach a model only through its chat template; a template that never reads `tools` would drop them
silently, so a request with tools on such a backbone (smollm2-135m's) is a 400 naming `tools`. On a template that
reads them, `tool_choice: "none"` renders them and the reply is the model's text, as in vLLM; `auto` (OpenAI's
default with tools) needs a tool-call parser, which lorafaas does not have (vLLM refuses it too unless started with
one), and a named function or `required` are not implemented: 400s naming `tool_choice`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafaas.errors import InvalidInput


class ToolsRefused(InvalidInput):
    code = "tools_unsupported"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param  # OpenAI's error body names the parameter


def chat_template_text(model_dir: Path) -> str:
    """The backbone's chat template as stored: chat_template.jinja, else tokenizer_config.json's (one or named)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config_path = model_dir / "tokenizer_config.json"
    template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template") if config_path.is_file() \
        else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        return "\n".join(str(entry.get("template", "")) for entry in template if isinstance(entry, dict))
    return template or ""


def tools_to_render(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None, backbone: str,
                    model_dir: Path) -> str | None:
    """The tool definitions to give the chat template (JSON text), or None; refuses what it cannot honour by name."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolsRefused("tool_choice", f"tool_choice is {json.dumps(tool_choice)} but no tools are given; "
                               "leave tool_choice out or send \"none\"")
        return None
    if "tools" not in chat_template_text(model_dir):
        raise ToolsRefused("tools", f"tools are given, but the chat template of backbone {backbone} does not render "
                           "tools; leave tools out")
    if tool_choice != "none":
        shown = "absent (auto)" if tool_choice is None else json.dumps(tool_choice)
        raise ToolsRefused("tool_choice", f"tool_choice is {shown}; lorafaas parses no tool calls, so it renders "
                           "tools only with tool_choice \"none\" (the reply is the model's text)")
    return json.dumps(tools)
