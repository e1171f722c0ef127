"""Instance log text cut to `tail`/`since` and read back, as the gateway and `lorafaas logs --follow` do."""

import time

from lorafaas.platform import log_lines

LOG = """2026-11-24 06:52:47,482 INFO [f/a] worker: listening
2026-11-24 06:52:48,100 ERROR [f/a] worker: failed
Traceback (most recent call last):
  ValueError: boom
2026-11-24 06:52:49,000 INFO [f/a] worker: ready
"""


def test_a_traceback_line_belongs_to_the_stamped_line_before_it() -> None:
    lines = log_lines.stamped("a", LOG)
    failed_at = time.mktime(time.strptime("2026-11-24 06:52:48", "%Y-%m-%d %H:%M:%S")) + 0.1
    assert [line.logged_at for line in lines][1:4] == [failed_at] * 3
    since = log_lines.cut(lines, since=failed_at)
    assert [line.text for line in since][:3] == LOG.splitlines()[1:4]
    assert [line.text for line in log_lines.cut(lines, tail=2)] == LOG.splitlines()[-2:]
    assert log_lines.cut(lines, tail=0) == []


def test_rendered_sections_parse_back_to_the_same_lines() -> None:
    sections = [log_lines.stamped("a", LOG), [], log_lines.stamped("b", "plain\n2026-11-24 06:53:00,000 INFO x\n")]
    text = log_lines.render(sections)
    assert text.count("==> ") == 2  # an empty section has no header
    assert log_lines.parse(text) == [*sections[0], *sections[2]]
