"""LoRA adapters (peft) on the actor and the critic, with verl's keys and meanings.

`model.lora_rank` > 0 (verl's `actor_rollout_ref.model.lora_rank`) injects LoRA layers
into the actor with `lora_alpha`, `target_modules` (`all-linear`: every linear layer but
the LM head) and `exclude_modules`, as verl's FSDP engine does (`LoraConfig(r, lora_alpha,
target_modules, exclude_modules, bias="none")`, adapters in the base weights' dtype);
`critic.lora_rank` > 0 does the same to the critic's backbone, its value head trained in
full. Everything else is frozen, so the DeepSpeed engines hold optimizer state for the
adapters (and the value head) only.

The adapters are injected in place (`peft.inject_adapter_in_model`): the trainer, the
packed forward passes and the HF rollout engines see the same transformers module as
without LoRA, its linear layers computing `W x + (alpha / r) B A x`.

- The reference policy is that module with its adapters switched off (`BaseView`): no
  third copy of the weights, as verl's `ref_in_actor`.
- `merged_state_dict` turns a (gathered) state dict into the plain model's, `W + (alpha /
  r) B A` per adapted layer, for rollout engines that load weights (vLLM) and for serving.
- `adapter_state_dict` / `load_adapter_state_dict` translate between the live module's
  keys and peft's saved layout (`adapter_model.safetensors`, loadable by
  `peft.PeftModel.from_pretrained` on the base model).

peft is an optional dependency (`pip install .[lora]`); it is imported only when LoRA is on.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from rlhf.models.load import (  # noqa: F401  (read from here too)
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoraSetupError, is_adapter_dir, read_adapter_config)

ADAPTER_NAME = "default"
_LORA_KEY = re.compile(rf"\.lora_(A|B)\.{ADAPTER_NAME}\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """One model's LoRA settings (verl's meanings); `rank` 0 means no adapters."""

    rank: int = 0
    alpha: int = 16
    target_modules: tuple[str, ...] = ("all-linear",)
    exclude_modules: Optional[str] = None
    prefix: str = "model"  # the config section, named in errors

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_config(self):
        from peft import LoraConfig  # optional dependency

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=peft_targets(self), bias="none",
                          exclude_modules=self.exclude_modules, lora_dropout=0.0)


def actor_spec(cfg) -> LoraSpec:
    m = cfg.model
    return LoraSpec(m.lora_rank, m.lora_alpha, tuple(m.target_modules), m.exclude_modules, "model")


def critic_spec(cfg) -> LoraSpec:
    c = cfg.critic
    return LoraSpec(c.lora_rank, c.lora_alpha, tuple(c.target_modules), c.exclude_modules, "critic")


_REGEX_CHARS = set("*+?[](){}|^$\\")


def peft_targets(spec: LoraSpec):
    """peft's `target_modules`: the string "all-linear", or the list of module names."""
    names = list(spec.target_modules)
    if not names:
        raise LoraSetupError(f"{spec.prefix}.target_modules is empty; give all-linear or module names")
    if names == ["all-linear"]:
        return "all-linear"
    if "all-linear" in names:
        raise LoraSetupError(f"{spec.prefix}.target_modules={names}: all-linear stands alone; give it or names")
    odd = [n for n in names if _REGEX_CHARS & set(n)]
    if odd:
        raise LoraSetupError(f"{spec.prefix}.target_modules {odd} look like regular expressions; give module names "
                             "(peft matches a name or a suffix such as q_proj), or all-linear")
    return names


def require_peft() -> None:
    try:
        import peft  # noqa: F401  (imported only to see that it is installed)
    except ImportError as e:
        raise LoraSetupError("lora_rank > 0 needs peft: pip install 'flyte-rlhf[lora]' (or peft==0.21.2)") from e


# -- adding and switching adapters ---------------------------------------------------------


def add_adapters(model: nn.Module, spec: LoraSpec, base_path: str = "") -> nn.Module:
    """Inject `spec`'s LoRA layers into `model` in place and freeze every other parameter
    of it; returns `model`. `base_path` (the base weights' directory) goes into the
    adapter config, as peft's `base_model_name_or_path`."""
    require_peft()
    from peft import inject_adapter_in_model

    config = spec.peft_config()
    config.base_model_name_or_path = base_path or None
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise LoraSetupError(f"{spec.prefix}.target_modules={list(spec.target_modules)} / exclude_modules="
                             f"{spec.exclude_modules!r} select no layer of this model to adapt ({e})") from e
    return model


def lora_root(module: nn.Module) -> Optional[nn.Module]:
    """The transformers module holding adapters: `module` itself (a causal LM) or its
    `backbone` (the critic); None without adapters."""
    for m in (module, getattr(module, "backbone", None)):
        if m is not None and isinstance(getattr(m, "peft_config", None), dict) and ADAPTER_NAME in m.peft_config:
            return m
    return None


def has_adapters(module: nn.Module) -> bool:
    return lora_root(module) is not None


def lora_scaling(module: nn.Module) -> float:
    """alpha / r of the adapters of `module`."""
    config = lora_root(module).peft_config[ADAPTER_NAME]
    return config.lora_alpha / config.r


def _tuner_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """`module` computes with its base weights only (every LoRA layer off), in eval mode;
    both restored on exit."""
    layers = _tuner_layers(module)
    was_training = module.training
    module.eval()
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # also gives the adapters back their requires_grad
        module.train(was_training)


class BaseView(nn.Module):
    """The reference policy of a LoRA actor: the actor's own module with its adapters
    switched off for each call. It holds no weights (the actor is not a submodule, so
    `.to()`, `.eval()` and `.parameters()` leave the actor alone); the trainer's forward
    passes reach the transformer through `base_model` and the LM head through
    `get_output_embeddings`, as they do on a plain model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.__dict__["_model"] = model  # not registered: no shared parameters, no second .to()

    @property
    def config(self):
        return self._model.config

    @property
    def base_model(self) -> nn.Module:
        inner = self._model.base_model
        return self if inner is self._model else BaseView(inner)

    def get_output_embeddings(self):
        return self._model.get_output_embeddings()

    def forward(self, *args, **kwargs):
        with adapters_disabled(self._model):
            return self._model(*args, **kwargs)


# -- state dicts --------------------------------------------------------------------------


def is_lora_key(key: str) -> bool:
    return _LORA_KEY.search(key) is not None


def adapter_state_dict(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The adapter tensors of a module's state dict in peft's saved layout
    (`base_model.model.<path>.lora_A.weight`); `prefix` ("backbone.") is cut first."""
    out = {}
    for k, v in state_dict.items():
        if is_lora_key(k) and k.startswith(prefix):
            out[PEFT_PREFIX + k[len(prefix):].replace(f".{ADAPTER_NAME}.weight", ".weight")] = v
    return out


def load_adapter_state_dict(root: nn.Module, saved: dict[str, torch.Tensor], where: str) -> None:
    """Copy adapters saved by `adapter_state_dict` into `root` (the module holding them).
    Every adapter of `root` must be in `saved`, and nothing else."""
    live = {k for k in root.state_dict() if is_lora_key(k)}
    mapped = {}
    for k, v in saved.items():
        if not (k.startswith(PEFT_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise LoraSetupError(f"{where}: '{k}' is not a LoRA adapter weight in peft's layout")
        mapped[k[len(PEFT_PREFIX):-len(".weight")] + f".{ADAPTER_NAME}.weight"] = v
    missing, unexpected = sorted(live - set(mapped)), sorted(set(mapped) - live)
    if missing or unexpected:
        raise LoraSetupError(f"{where} does not fit this model's adapters: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}; lora_rank, target_modules and exclude_modules must be the ones "
                             "it was trained with")
    with torch.no_grad():
        params = dict(root.named_parameters())
        for k, v in mapped.items():
            if params[k].shape != v.shape:
                raise LoraSetupError(f"{where}: '{k}' has shape {tuple(v.shape)}, the model's adapter "
                                     f"{tuple(params[k].shape)} (another lora_rank?)")
            params[k].copy_(v)


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The plain model's state dict from an adapted one: each adapted layer's weight
    `W + scaling B A` (computed in float32, stored in W's dtype) under the layer's own
    name; the adapter tensors dropped. Works on a gathered state dict (ZeRO-3)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        if is_lora_key(k):
            continue
        if ".base_layer." not in k:
            out[k] = v
            continue
        layer, leaf = k.split(".base_layer.", 1)
        name = f"{layer}.{leaf}"
        a = state_dict.get(f"{layer}.lora_A.{ADAPTER_NAME}.weight")
        b = state_dict.get(f"{layer}.lora_B.{ADAPTER_NAME}.weight")
        if leaf != "weight" or a is None or b is None:
            out[name] = v
            continue
        delta = (b.float() @ a.float()) * scaling  # (out, r) @ (r, in)
        out[name] = (v.float() + delta.to(v.device)).to(v.dtype)
    return out


def adapter_config_json(root: nn.Module, base_path: str, extra: Optional[dict] = None) -> str:
    """peft's `adapter_config.json` for the adapters of `root`, pointing at `base_path`."""
    config = root.peft_config[ADAPTER_NAME]
    d = config.to_dict()
    d["base_model_name_or_path"] = base_path
    for k, v in list(d.items()):
        if isinstance(v, set):
            d[k] = sorted(v)
    d.update(extra or {})
    return json.dumps(d, indent=1, sort_keys=True, default=str)
