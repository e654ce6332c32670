"""Stage `lm`: end-to-end next-token loss, optionally plus KL to the original model.

Trainable sets: `mixers` (everything else frozen), `mixers+lora` (mixers plus LoRA adapters
on the attention and MLP projections, merged into the weights at the end; needs `peft`)
and `all`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ConfigError

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LMObjective:
    """Cross-entropy on packed text, plus `distill_weight * T^2 * KL(teacher || student)`.

    Args:
        trainable: `mixers`, `mixers+lora` or `all`.
        teacher: the original model (needed when `distill_weight > 0`).
        distill_weight, temperature: the distillation term.
        lora_rank: rank of the LoRA adapters (alpha = 2 * rank).
    """

    def __init__(
        self,
        trainable: str = "mixers",
        teacher: nn.Module | None = None,
        distill_weight: float = 0.0,
        temperature: float = 1.0,
        lora_rank: int = 8,
    ):
        if distill_weight > 0 and teacher is None:
            raise ConfigError("--distill-weight > 0 needs the original model as teacher")
        self.trainable, self.distill_weight, self.temperature, self.lora_rank = trainable, distill_weight, temperature, lora_rank
        self.teacher = None if teacher is None else teacher.eval().requires_grad_(False)
        self.peft = False

    def prepare(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(self.trainable == "all")
        if self.trainable == "mixers+lora":
            try:  # optional dependency (recurformer[lora]), needed only for this trainable set
                from peft import LoraConfig, get_peft_model
            except ImportError:
                raise ConfigError("--trainable mixers+lora needs the 'peft' package (pip install recurformer[lora])") from None
            present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            config = LoraConfig(r=self.lora_rank, lora_alpha=2 * self.lora_rank, lora_dropout=0.0,
                                target_modules=[t for t in LORA_TARGETS if t in present])
            model = get_peft_model(model, config)
            self.peft = True
        for name, p in model.named_parameters():
            if ".mixer." in name:
                p.requires_grad_(True)
        return model.train()

    def loss(self, model: nn.Module, input_ids: Tensor, labels: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """Next-token loss on `labels` `[b, T]` (default: every token of `input_ids` `[b, T]`)."""
        out = model(input_ids=input_ids, labels=input_ids if labels is None else labels, use_cache=False)
        metrics = {"ce": out.loss.item()}
        if self.distill_weight == 0:
            return out.loss, metrics
        with torch.no_grad():
            target = self.teacher(input_ids, use_cache=False).logits.float()
        t = self.temperature
        kl = F.kl_div(
            F.log_softmax(out.logits.float() / t, dim=-1).flatten(0, 1),
            F.log_softmax(target / t, dim=-1).flatten(0, 1),
            log_target=True, reduction="batchmean",
        ) * t * t
        metrics["kl"] = kl.item()
        return out.loss + self.distill_weight * kl, metrics

    def finish(self, module: nn.Module) -> None:
        """Merge LoRA adapters into the weights, leaving a plain RecurFormer model."""
        if self.peft:
            module.merge_and_unload()
