"""Loading and saving models: safetensors only, local directories unless asked otherwise.

- `load_causal_lm` / `load_tokenizer` read a local `save_pretrained` directory. A name
  that is not a local directory (a hub id) is fetched only with `allow_network=True`;
  `trust_remote_code` stays off unless asked.
- Weights must be safetensors: a directory that holds only `pytorch_model.bin` / `*.pt`
  (pickle, which can run code when loaded) is refused with the command to convert it.
- `ValueModel` is the critic: a backbone (`AutoModel`) and a linear value head.
- `save_model_atomic` writes a temp directory next to the target, then renames it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

# A hub repository id: "name" or "owner/name" of letters, digits, "-", "_", "."; not "." or ".." parts.
_HUB_NAME = re.compile(r"^(?!\.)[\w.-]+(/(?!\.)[\w.-]+)?$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_CONFIG_FILE = "value_model.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ADAPTER_CONFIG = "adapter_config.json"  # peft's names: PeftModel.from_pretrained reads these
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what peft's saved adapter keys start with


class ModelLoadError(ValueError):
    """A model path cannot be loaded; the message says why and what to do."""


class LoraSetupError(ValueError):
    """LoRA cannot be set up as configured, or saved adapters do not fit; the message says what to change."""


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype '{name}' is unknown; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _convert_hint(path: str) -> str:
    return (
        f"convert it once, in a trusted environment, with: python -c \"from transformers import "
        f"AutoModelForCausalLM as M; M.from_pretrained('{path}', use_safetensors=False)"
        f".save_pretrained('{path}-safetensors')\" and point the config at the new directory")


def check_model_source(path: str, allow_network: bool = False) -> str:
    """Return `path` as a local dir with safetensors weights, or a hub name if allowed.

    Raises `ModelLoadError` for a missing/remote path without `allow_network`, or a
    directory whose weights are pickle files only.
    """
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    if os.path.isdir(path):
        names = os.listdir(path)
        if any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
            return path
        pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise ModelLoadError(
                f"model directory '{path}' holds only pickle weights ({', '.join(pickles)}); only "
                f"safetensors are loaded, because unpickling can run arbitrary code; {_convert_hint(path)}")
        raise ModelLoadError(f"model directory '{path}' has no *.safetensors weights; save the model "
                             f"with save_pretrained(dir) first")
    if os.path.exists(path):
        raise ModelLoadError(f"model path '{path}' is a file; pass the save_pretrained directory holding it")
    if not _HUB_NAME.match(path):  # a local path (absolute, relative, ~), never a hub repository name
        raise ModelLoadError(f"model path '{path}' is not a local directory: nothing is there; check the path "
                             "(a directory written by save_pretrained, or a GGUF file)")
    if not allow_network:
        raise ModelLoadError(
            f"model path '{path}' is not a local directory; download it first (e.g. `hf download "
            f"{path} --local-dir DIR`) and pass DIR, or set model.allow_network=true to fetch it from the hub")
    return path


class _custom_code_refused:
    """Turn transformers' refusal to run a checkpoint's own code (without `trust_remote_code`)
    into a `ModelLoadError` that names the setting."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, e, tb) -> None:
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise ModelLoadError(
                f"'{self.path}' needs model code shipped inside the checkpoint (auto_map in its config), which "
                "is not run unless model.trust_remote_code=true; set it only for a checkpoint whose code you "
                "have read, or use a model class that transformers provides") from e


def load_causal_lm(path: str, dtype: str | torch.dtype = "float32", trust_remote_code: bool = False,
                   allow_network: bool = False, device: str | torch.device | None = None):
    """A causal LM from a local safetensors directory (or a hub name with `allow_network`).
    Code inside the checkpoint runs only with `trust_remote_code`."""
    from transformers import AutoModelForCausalLM

    source = check_model_source(path, allow_network)
    if is_adapter_dir(source):  # LoRA adapters (a checkpoint's actor/): the base they point at, merged
        return merge_saved_adapters(load_causal_lm(adapter_base(source), dtype, trust_remote_code, allow_network,
                                                   device), source)
    with _custom_code_refused(path):
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
            use_safetensors=True, local_files_only=not allow_network)
    return model.to(device) if device is not None else model


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds LoRA adapters in peft's layout (a LoRA run's checkpoint `actor/`)."""
    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


def read_adapter_config(path: str | Path) -> dict:
    f = Path(path) / ADAPTER_CONFIG
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise LoraSetupError(f"'{path}' holds no readable {ADAPTER_CONFIG} ({e}); it is not a LoRA adapter "
                             "directory") from e


def merge_saved_adapters(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Add the adapters saved in `adapter_dir` to the plain `model` (their base) in place,
    `W += (lora_alpha / r) B A` per adapted layer; returns `model`."""
    from safetensors.torch import load_file

    c = read_adapter_config(adapter_dir)
    scaling = c["lora_alpha"] / c["r"]
    saved = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, a in saved.items():
            if not k.endswith(".lora_A.weight"):
                continue
            w = params.get(k[len(PEFT_PREFIX):-len(".lora_A.weight")] + ".weight")
            if w is None:
                raise LoraSetupError(f"{adapter_dir}: adapter '{k}' names no layer of its base model")
            delta = (saved[k.replace(".lora_A.", ".lora_B.")].float() @ a.float()) * scaling  # (out, r) @ (r, in)
            w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
    return model


def adapter_base(adapter_dir: str) -> str:
    """The base model directory an adapter directory points at (peft's `base_model_name_or_path`)."""
    base = read_adapter_config(adapter_dir).get("base_model_name_or_path") or ""
    if not os.path.isdir(base):
        raise ModelLoadError(f"'{adapter_dir}' holds LoRA adapters of the base model '{base}', which is not a "
                             "directory here; load that base and apply the adapters with peft "
                             "(PeftModel.from_pretrained), or write the merged model with trainer.save_merged=true")
    return base


def load_tokenizer(path: str, trust_remote_code: bool = False, allow_network: bool = False):
    """The tokenizer saved beside a model; a missing pad token falls back to EOS."""
    from transformers import AutoTokenizer

    path = str(path).removeprefix("file://")
    if not os.path.isdir(path) and not allow_network:
        raise ModelLoadError(f"tokenizer path '{path}' is not a local directory; download it first or set "
                             f"model.allow_network=true")
    with _custom_code_refused(path):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                            local_files_only=not allow_network)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_safetensors_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint directory."""
    from safetensors.torch import load_file

    check_model_source(model_dir)
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors") and n != VALUE_HEAD_FILE)
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(model_dir, name)))
    return state


def load_weights_into(model: nn.Module, model_dir: str) -> None:
    """Copy a safetensors checkpoint into `model` in place (its dtype and device are kept).

    Keys missing from the file are allowed only for weights tied to others (`lm_head`
    tied to the embedding); unexpected keys raise.
    """
    state = load_safetensors_state_dict(model_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(_tied_keys(model))
    bad_missing = [k for k in missing if k not in tied]
    if unexpected or bad_missing:
        raise ModelLoadError(
            f"weights in '{model_dir}' do not fit the model: missing {bad_missing[:5]}, unexpected "
            f"{unexpected[:5]}; was it saved from the same architecture?")


def _tied_keys(model: nn.Module) -> list[str]:
    """Parameter names that share storage with an earlier parameter."""
    seen: dict[int, str] = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        else:
            seen[id(p)] = name
    return tied


def save_model_atomic(model, tokenizer, out_dir: str, extra_files: dict[str, str] | None = None) -> str:
    """`save_pretrained` into a temp dir beside `out_dir` (plus `extra_files`, name -> text),
    then swap it in by rename.

    A reader never sees a half-written directory; an existing `out_dir` is replaced.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            Path(tmp, name).write_text(text, encoding="utf-8")
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _swap_in(tmp: str, out_dir: str) -> None:
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    os.rmdir(old)
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_options(model_cfg) -> dict:
    """The loaders' keyword arguments that `model.trust_remote_code` and `model.allow_network` set."""
    return {"trust_remote_code": model_cfg.trust_remote_code, "allow_network": model_cfg.allow_network}


def frozen_reference(source, dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                     **load_kwargs) -> nn.Module:
    """The reference policy: a copy (of a module) or a load (of a dir), in eval mode, no grads."""
    if isinstance(source, nn.Module):
        ref = copy.deepcopy(source)
    else:
        ref = load_causal_lm(source, dtype=dtype, **load_kwargs)
    if device is not None:
        ref = ref.to(device)
    ref.eval()
    ref.requires_grad_(False)
    return ref


class ValueModel(nn.Module):
    """Critic: a transformer backbone and a linear head giving one value per token.

    `forward(input_ids (B, T), attention_mask (B, T), position_ids (B, T)) -> values (B, T)`
    in float32. Packed sequences go in as `input_ids (1, T_total)` with `position_ids`
    restarting at 0 per sequence; the KV cache is off so packing is honoured.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)  # an untrained critic predicts 0
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        hidden = out.last_hidden_state.float()  # (B, T, H)
        return self.value_head(hidden).squeeze(-1)  # (B, T)

    @classmethod
    def from_causal_lm_dir(cls, path: str, dtype: str | torch.dtype = "float32", trust_remote_code: bool = False,
                           allow_network: bool = False) -> "ValueModel":
        """Backbone weights from a causal-LM checkpoint (its LM head dropped); a fresh value head."""
        from transformers import AutoModel

        source = check_model_source(path, allow_network)
        with _custom_code_refused(path):
            backbone = AutoModel.from_pretrained(source, dtype=torch_dtype(dtype),
                                                 trust_remote_code=trust_remote_code, use_safetensors=True,
                                                 local_files_only=not allow_network)
        return cls(backbone)

    def save_pretrained(self, out_dir: str, **kwargs) -> None:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        self.backbone.save_pretrained(out_dir, **kwargs)
        head = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(head, os.path.join(out_dir, VALUE_HEAD_FILE))
        with open(os.path.join(out_dir, VALUE_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump({"value_head": VALUE_HEAD_FILE, "hidden_size": self.config.hidden_size}, f)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str | torch.dtype = "float32", trust_remote_code: bool = False,
                        allow_network: bool = False) -> "ValueModel":
        """A critic saved by `save_pretrained` (backbone + `value_head.safetensors`)."""
        from safetensors.torch import load_file

        model = cls.from_causal_lm_dir(path, dtype, trust_remote_code, allow_network)
        head_file = os.path.join(str(path), VALUE_HEAD_FILE)
        if not os.path.exists(head_file):
            raise ModelLoadError(f"'{path}' has no {VALUE_HEAD_FILE}; it is not a saved ValueModel "
                                 f"(use ValueModel.from_causal_lm_dir for a fresh head)")
        model.value_head.load_state_dict(load_file(head_file))
        return model
