"""`tools` and `tool_choice`: rendered by a chat template that reads them (tool_choice "none"), otherwise refused by
name, with the reason read from the backbone's chat template."""

import json

import pytest

from lorafaas.platform.gateway.tools import ToolsRefused, chat_template_text, tools_to_render

TOOLS = [{"type": "function", "function": {"name": "weather"}}]


def test_a_template_that_renders_no_tools_refuses_them(tmp_path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    for choice in (None, "none", "auto"):
        with pytest.raises(ToolsRefused, match="does not render tools") as refused:
            tools_to_render(TOOLS, choice, "plain", tmp_path)
        assert refused.value.param == "tools"


def test_a_tool_aware_template_renders_tools_with_tool_choice_none_only(tmp_path) -> None:
    named = [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "{{ tools }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert "tools" in chat_template_text(tmp_path)
    assert json.loads(tools_to_render(TOOLS, "none", "tooly", tmp_path)) == TOOLS
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "weather"}}):
        with pytest.raises(ToolsRefused, match="tool_choice") as refused:
            tools_to_render(TOOLS, choice, "tooly", tmp_path)
        assert refused.value.param == "tool_choice"


def test_no_tools_accepts_tool_choice_none_only(tmp_path) -> None:
    assert tools_to_render(None, None, "b", tmp_path) is None
    assert tools_to_render([], "none", "b", tmp_path) is None
    with pytest.raises(ToolsRefused) as refused:
        tools_to_render(None, {"type": "function", "function": {"name": "weather"}}, "b", tmp_path)
    assert refused.value.param == "tool_choice"
