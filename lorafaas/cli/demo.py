"""`lorafaas demo`: the demo adapters answering one prompt, straight from the model store.

Until the platform serves functions (gateway, node agent), this is the main job: import the default backbone if
absent, then run the base model and each demo adapter on the same prompt with plain transformers + PEFT.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from lorafaas.cli.output import RichProgress, err_console, print_json, print_table
from lorafaas.config import LorafaasConfig
from lorafaas.errors import SourceUnavailable
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.demo_functions import DEMO_ADAPTERS_DIR, demo_adapter_dirs

DEMO_PROMPT = "Tell me about the ocean."


def demo(
    ctx: typer.Context,
    prompt: str = typer.Option(DEMO_PROMPT, "--prompt", help="What to ask every demo function."),
    max_tokens: int = typer.Option(48, "--max-tokens", min=1, max=512),
    adapters_dir: Path = typer.Option(DEMO_ADAPTERS_DIR, "--adapters", help="Directory of demo adapters."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Import smollm2-135m if absent and show each demo adapter's answer beside the base model's."""
    from lorafaas.models.reference import greedy_generate, load_backbone, with_adapter
    from lorafaas.platform.builtin_backbones import DEFAULT_BACKBONE, import_builtin

    config: LorafaasConfig = ctx.obj
    store = ModelStore(config.models_dir)
    adapters = demo_adapter_dirs(adapters_dir)
    if not adapters:
        raise SourceUnavailable(f"no demo adapters under {adapters_dir}; run from a clone of the repository")
    answers: dict[str, str] = {}
    with RichProgress() as progress:
        import_builtin(store, DEFAULT_BACKBONE, progress)
        progress.stage(f"loading {DEFAULT_BACKBONE}")
        model, tokenizer = load_backbone(store.path(DEFAULT_BACKBONE))
        progress.stage("generating", len(adapters) + 1)
        answers["(base model)"] = greedy_generate(model, tokenizer, prompt, max_tokens).text
        progress.advance()
        peft_model = None
        for adapter_dir in adapters:
            if peft_model is None:
                peft_model = with_adapter(model, adapter_dir, adapter_dir.name)
            else:
                peft_model.load_adapter(str(adapter_dir), adapter_name=adapter_dir.name)
            peft_model.set_adapter(adapter_dir.name)
            answers[adapter_dir.name] = greedy_generate(peft_model, tokenizer, prompt, max_tokens).text
            progress.advance()
    if as_json:
        print_json({"backbone": DEFAULT_BACKBONE, "prompt": prompt, "answers": answers})
        return
    table = Table("function", "answer", title=f"{prompt!r} on {DEFAULT_BACKBONE}", show_lines=True)
    for name, text in answers.items():
        table.add_row(name, text)
    print_table(table)
    err_console.print(f"demo adapters: {adapters_dir}; try `lorafaas adapter inspect {adapters[0]}`")
