"""OpenAI's `tools` and `tool_choice` on chat completions: refused by name rather than ignored.

Tool definitions reach a model only through its chat template; a template that never reads `tools` would drop them
silently, so a request with tools on such a backbone is a 400 naming `tools`. Rendering them through a template that
does read them is not implemented yet (no backbone lorafaas ships has one): refused too, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def check_tools(tools: list | None, tool_choice: str | dict | None, backbone: str, model_dir: Path) -> None:
    """Accept a request that asks for no tool use (no tools; tool_choice absent or "none"); refuse anything else by
    name."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolsRefused("tool_choice", f"tool_choice is {json.dumps(tool_choice)} but no tools are given; "
                               "leave tool_choice out or send \"none\"")
        return
    if "tools" not in chat_template_text(model_dir):
        raise ToolsRefused("tools", f"tools are given, but the chat template of backbone {backbone} does not render "
                           "tools; leave tools out")
    raise ToolsRefused("tools", f"tools are given; rendering them through the chat template of backbone {backbone} "
                       "is not implemented yet; leave tools out")
