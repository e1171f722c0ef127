"""`tools` and `tool_choice`: refused by name, with the reason read from the backbone's chat template."""

import json

import pytest

from lorafaas.platform.gateway.tools import ToolsRefused, chat_template_text, check_tools

TOOLS = [{"type": "function", "function": {"name": "weather"}}]


def test_smollm2_template_renders_no_tools_so_tools_are_refused(tmp_path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ToolsRefused, match="does not render tools") as refused:
        check_tools(TOOLS, None, "plain", tmp_path)
    assert refused.value.param == "tools"


def test_a_tool_aware_template_is_read_from_tokenizer_config_and_still_refused_as_not_implemented(tmp_path) -> None:
    named = [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "{{ tools }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert "tools" in chat_template_text(tmp_path)
    with pytest.raises(ToolsRefused, match="not implemented"):
        check_tools(TOOLS, "auto", "tooly", tmp_path)


def test_no_tools_accepts_tool_choice_none_only(tmp_path) -> None:
    check_tools(None, None, "b", tmp_path)
    check_tools([], "none", "b", tmp_path)
    with pytest.raises(ToolsRefused) as refused:
        check_tools(None, {"type": "function", "function": {"name": "weather"}}, "b", tmp_path)
    assert refused.value.param == "tool_choice"
