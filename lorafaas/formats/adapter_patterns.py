"""An adapter's PEFT patterns, each compiled once for that adapter, within a budget.

PEFT reads several `adapter_config.json` fields as regular expressions: `target_modules` as a string,
`exclude_modules` as a string, the keys of `rank_pattern` and `alpha_pattern`, the names of `modules_to_save` and
`layers_pattern` (which PEFT splices into regexes). They run on RE2, whose matching time is linear in the input, and
`AdapterPatterns` bounds what is left, the compile work, so that no config can hold the gateway or a worker:

- at most `MAX_PATTERN_KEYS` patterns a field and `MAX_PATTERN_CHARS` characters a pattern;
- each pattern compiled with `PATTERN_MAX_MEM_BYTES` of RE2 memory (a pattern that needs more is refused; RE2 gives
  up on it within a few milliseconds) and at most `MAX_PROGRAM_SIZE` RE2 instructions for all of an adapter's
  patterns together;
- each pattern compiled once, when the config is checked, and kept with the adapter (`AdapterLayout.patterns`), so
  matching N modules against K keys compiles K patterns, not N x K through a shared cache.

Every refusal is `AdapterUnsupported` (422 `adapter_unsupported`) naming the field and the limit.
"""

from __future__ import annotations

from typing import Any

from lorafaas.errors import AdapterUnsupported

MAX_PATTERN_KEYS = 256  # patterns of one field (rank_pattern keys, modules_to_save names, ...)
MAX_PATTERN_CHARS = 1024  # characters of one pattern
MAX_PROGRAM_SIZE = 65_536  # RE2 instructions of all an adapter's patterns together (a PEFT key compiles to 20-80)
PATTERN_MAX_MEM_BYTES = 256 * 1024  # RE2 memory of one pattern: its program and its matching cache


def unsupported(field_name: str, why: str) -> AdapterUnsupported:
    return AdapterUnsupported(f"adapter_config.json: {field_name}: {why}")


def rank_pattern_regex(key: str) -> str:
    """PEFT's `get_pattern_key`: `re.match(rf"(.*\\.)?({key})$", module)`."""
    return rf"(.*\.)?({key})$"


def saved_module_regex(name: str) -> str:
    """PEFT's check for a `modules_to_save` name: `re.match(rf"(^|.*\\.){name}($|\\..*)", module)`."""
    return rf"(^|.*\.){name}($|\..*)"


def layers_pattern_regex(pattern: str) -> str:
    """PEFT's layer index for `layers_to_transform` with a `layers_pattern`."""
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


DEFAULT_LAYERS_REGEX = r".*?\.[^.]*\.(?P<idx>\d+)\."  # the layer index without a layers_pattern


class AdapterPatterns:
    """One adapter's compiled patterns, keyed by the regex PEFT runs; compiling counts against the budget."""

    def __init__(self) -> None:
        self._compiled: dict[str, Any] = {}
        self.program_size = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def compile(self, field_name: str, pattern: str, shown: str | None = None) -> Any:
        """The compiled RE2 for `pattern`; AdapterUnsupported naming the field (and `shown`, the text the config
        holds, when `pattern` wraps it) if RE2 cannot run it or the adapter's budget is spent."""
        compiled = self._compiled.get(pattern)
        if compiled is not None:
            return compiled
        import re2

        text = pattern if shown is None else shown
        if len(text) > MAX_PATTERN_CHARS:
            raise unsupported(field_name, f"pattern of {len(text):,} characters; the limit is {MAX_PATTERN_CHARS:,}")
        if "{," in pattern:  # Python reads `{,n}` as {0,n}, RE2 as literal text: the two would disagree
            raise unsupported(field_name, f"pattern {text!r} uses '{{,n}}'; write '{{0,n}}'")
        options = re2.Options()
        options.log_errors = False
        options.max_mem = PATTERN_MAX_MEM_BYTES
        try:
            compiled = re2.compile(pattern, options)
        except re2.error as exc:
            reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
            if "too large" in reason:
                raise unsupported(field_name, f"pattern {text[:80]!r} compiles to more than lorafaas's limit of "
                                  f"{PATTERN_MAX_MEM_BYTES // 1024} KiB of RE2 memory a pattern") from exc
            raise unsupported(
                field_name, f"{text!r} is not a regular expression lorafaas can run ({reason}); lookaround and "
                "backreferences are not supported"
            ) from exc
        self.program_size += compiled.programsize
        if self.program_size > MAX_PROGRAM_SIZE:
            raise unsupported(field_name, f"the adapter's patterns compile to more than {MAX_PROGRAM_SIZE:,} RE2 "
                              f"instructions in all (the limit; this one, {text[:80]!r}, to {compiled.programsize:,})")
        self._compiled[pattern] = compiled
        return compiled

    def fullmatch(self, field_name: str, pattern: str, key: str) -> bool:
        return self.compile(field_name, pattern).fullmatch(key) is not None

    def match(self, field_name: str, pattern: str, key: str) -> bool:
        """re.match: anchored at the start only."""
        return self.compile(field_name, pattern).match(key) is not None

    def pattern_key(self, field_name: str, patterns: dict, module: str) -> str | None:
        """The first key of rank_pattern/alpha_pattern that PEFT's `get_pattern_key` picks for `module`."""
        for key in patterns:
            if self.compile(field_name, rank_pattern_regex(key), key).match(module) is not None:
                return key
        return None

    def layer_index(self, pattern: str, key: str) -> int | None:
        found = self.compile("layers_pattern", pattern).match(key)
        return None if found is None else int(found.group("idx"))


def check_count(field_name: str, patterns: dict | list, what: str = "keys") -> None:
    if len(patterns) > MAX_PATTERN_KEYS:
        raise unsupported(field_name, f"{len(patterns):,} {what}; the limit is {MAX_PATTERN_KEYS:,} (each is a "
                          "regular expression matched against every module)")
