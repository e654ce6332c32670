"""Stage `lm`: end-to-end next-token loss, optionally plus KL to the original model.

Trainable sets: `mixers` (everything else frozen), `mixers+lora` (mixers plus LoRA adapters
on the attention and MLP projections, merged into the weights at the end; needs `peft`),
`tail` (only the recurrent branch and gate of `window+*` mixers: their window's
projections stay as the heads had them), `tail+q` (the tails and the kept heads' query
projections, so that the heads that still attend to every token can learn to find what the
replaced ones found: issue 44) and `all`.

[ours] Memory. With a 49,152-token vocabulary, the logits of one 2,048-token sequence are
400 MB in fp32, and a plain KL keeps about five such tensors (student and teacher logits,
their log-softmaxes, the gradient). The loss here never holds more than `chunk` rows of
logits: the models return their last hidden states, and `head_losses` computes the logits,
the loss terms and their gradients one chunk of tokens at a time, keeping only the
gradient with respect to the hidden states `[N, hidden]` for the backward pass. And the
student's decoder layers are recomputed in the backward pass (`recompute_layers`): the
forward keeps each layer's input `[b, T, hidden]` only, not the activations of all its
attention heads, mixer and MLP (measured on SmolLM2-135M, docs/training.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..attention import HybridAttention
from ..config import ConfigError
from ..mixers import MIXERS, Mixer

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHUNK = 512  # rows of logits computed at once


def kept_query_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The query projections (weight and bias) of every layer's kept heads."""
    return [p for module in model.modules() if isinstance(module, HybridAttention) and module.has_attention
            for p in module.q_proj.parameters()]


def tail_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The recurrent branches and gates of the model's `window+*` mixers (an error if none)."""
    found = [p for module in model.modules() if isinstance(module, Mixer) for p in module.tail_parameters()]
    if not found:
        kinds = ", ".join(kind for kind, mixer in MIXERS.items() if mixer.tail_parameters is not Mixer.tail_parameters)
        raise ConfigError(f"--trainable tail needs mixers with a tail ({kinds}); this model has none")
    return found


class _HeadLosses(torch.autograd.Function):
    """Cross-entropy and KL of a linear head's logits, chunk by chunk; see `head_losses`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, teacher_hidden, teacher_weight, ce_weight, kl_weight,
                temperature, chunk):
        w = row_weights.float()  # [N]
        total = w.sum()
        scored = w[targets >= 0].sum().clamp(min=1e-12)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        ce_sum, kl_sum = hidden.new_zeros((), dtype=torch.float32), hidden.new_zeros((), dtype=torch.float32)
        t = temperature
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            h = hidden[part]
            logits = (h @ weight.T).float()  # [c, V]
            grad = torch.zeros_like(logits)
            target, w_part = targets[part], w[part, None]  # [c], [c, 1]
            scored_rows = (target >= 0).nonzero(as_tuple=True)[0]
            w_scored = w_part[scored_rows]
            # [c, V] tensors go as soon as they are used, and the KL's in place: at most five at once
            log_probs = logits.log_softmax(-1)
            ce_sum -= (log_probs[scored_rows, target[scored_rows]] * w_scored[:, 0]).sum()  # logged even when not trained
            if ce_weight:
                grad[scored_rows] += log_probs[scored_rows].exp() * (w_scored * (ce_weight / scored))
                grad[scored_rows, target[scored_rows]] -= w_scored[:, 0] * (ce_weight / scored)
            del log_probs
            if kl_weight:
                teacher_log = ((teacher_hidden[part] @ teacher_weight.T).float() / t).log_softmax(-1)
                student_log = (logits / t).log_softmax(-1)
                teacher_probs = teacher_log.exp()
                kl_sum += (teacher_log.sub_(student_log).mul_(teacher_probs).sum(-1) * w_part[:, 0]).sum()  # [c] weighted
                del teacher_log
                # d/dlogits of t^2 KL(teacher || softmax(logits / t)) = t (student - teacher)
                grad += student_log.exp_().sub_(teacher_probs).mul_(w_part * (kl_weight * t / total))
                del student_log, teacher_probs
            del logits
            grad_hidden[part] = grad @ weight.float()
            if grad_weight is not None:
                grad_weight += grad.T @ h.float()
        ce = ce_sum / scored
        kl = kl_sum * t * t / total
        ctx.save_for_backward(grad_hidden.to(hidden.dtype), None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(ce, kl)
        return ce_weight * ce + kl_weight * kl, ce, kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kl):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss,
            None if grad_weight is None else grad_weight * grad_loss,
            None, None, None, None, None, None, None, None,
        )


def head_losses(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    ce_weight: float = 1.0,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
    chunk: int = CHUNK,
    row_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`ce_weight * CE + kl_weight * t^2 * KL(teacher || student)` of the logits `hidden @ weight.T`.

    Args:
        hidden `[N, d]`: the student's last hidden states (after the final norm), one row per
            position; weight `[V, d]`: its output head.
        targets `[N]`: the token each row predicts, -100 for none (CE is their mean).
        teacher_hidden `[N, d]`, teacher_weight `[V, d]`: the teacher's (needed if kl_weight).
        temperature: t of the KL (softmaxes of logits / t); the KL is averaged over all rows.
        row_weights `[N]`: each row's weight in both means (default: all 1, the plain means).

    Returns (loss, ce, kl): the loss with gradients for `hidden` (and `weight` if it requires
    them), computed in chunks of `chunk` rows; ce and kl are detached.
    """
    if kl_weight and teacher_hidden is None:
        raise ConfigError("a KL term needs the teacher's hidden states")
    if row_weights is None:
        row_weights = hidden.new_ones(hidden.shape[0], dtype=torch.float32)
    return _HeadLosses.apply(hidden, weight, targets, row_weights, teacher_hidden, teacher_weight, ce_weight, kl_weight,
                             temperature, chunk)


def recompute_layers(model: nn.Module, on: bool = True) -> None:
    """Recompute each decoder layer of `model` (`model.get_decoder().layers`) in the backward
    pass instead of keeping its activations (`torch.utils.checkpoint`, non-reentrant): the
    same gradients, for one more forward pass of the layers. `on=False` undoes it."""
    for layer in model.get_decoder().layers:
        if on:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        elif "forward" in vars(layer):
            del layer.forward


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (PEFT wrappers forward attributes)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def _last_hidden(model: nn.Module, input_ids: Tensor) -> Tensor:
    """The final-norm hidden states `[b, T, d]`, without computing the logits of every position."""
    out = model(input_ids=input_ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


class LMObjective:
    """`ce_weight` * cross-entropy on packed text, plus `distill_weight * T^2 * KL(teacher || student)`.

    Args:
        trainable: `mixers`, `mixers+lora`, `tail`, `tail+q` or `all`.
        teacher: the original model (needed when `distill_weight > 0`).
        distill_weight, temperature: the distillation term.
        lora_rank: rank of the LoRA adapters (alpha = 2 * rank).
        ce_weight: weight of the next-token cross-entropy; 0 trains on the KL alone, which
            recovers the original model rather than adapting to the training text.
        recompute: recompute the decoder layers in the backward pass (`recompute_layers`):
            the same gradients in less memory.
    """

    def __init__(
        self,
        trainable: str = "mixers",
        teacher: nn.Module | None = None,
        distill_weight: float = 0.0,
        temperature: float = 1.0,
        lora_rank: int = 8,
        ce_weight: float = 1.0,
        recompute: bool = True,
    ):
        if distill_weight > 0 and teacher is None:
            raise ConfigError("--distill-weight > 0 needs the original model as teacher")
        if ce_weight == 0 and distill_weight == 0:
            raise ConfigError("--ce-weight 0 needs --distill-weight > 0: the loss would be zero")
        self.trainable, self.distill_weight, self.temperature, self.lora_rank = trainable, distill_weight, temperature, lora_rank
        self.ce_weight, self.recompute = ce_weight, recompute
        self.student: nn.Module | None = None
        self.teacher = None if teacher is None else teacher.eval().requires_grad_(False)
        self.peft = False

    def prepare(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(self.trainable == "all")
        if self.recompute:
            recompute_layers(model)
            self.student = model
        if self.trainable in ("tail", "tail+q"):
            chosen = tail_parameters(model) + (kept_query_parameters(model) if self.trainable == "tail+q" else [])
            for p in chosen:
                p.requires_grad_(True)
            return model.train()
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

    def loss(self, model: nn.Module, input_ids: Tensor, labels: Tensor | None = None,
             weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """Loss on `labels` `[b, T]` (default: every next token of `input_ids` `[b, T]`);
        `weights` `[b, T]`: each position's weight in the means (default: all 1)."""
        labels = input_ids if labels is None else labels
        targets = F.pad(labels[:, 1:], (0, 1), value=-100).flatten()  # position t predicts label t + 1
        hidden = _last_hidden(model, input_ids).flatten(0, 1)
        head = _unwrapped(model).get_output_embeddings().weight
        teacher_hidden = teacher_head = None
        if self.distill_weight:
            with torch.no_grad():
                teacher_hidden = _last_hidden(self.teacher, input_ids).flatten(0, 1)
            teacher_head = self.teacher.get_output_embeddings().weight
        loss, ce, kl = head_losses(hidden, head, targets, teacher_hidden, teacher_head,
                                   self.ce_weight, self.distill_weight, self.temperature,
                                   row_weights=None if weights is None else weights.flatten())
        metrics = {"ce": ce.item()}
        if self.distill_weight:
            metrics["kl"] = kl.item()
        return loss, metrics

    def finish(self, module: nn.Module) -> None:
        """Merge LoRA adapters into the weights, leaving a plain RecurFormer model (whose
        layers no longer recompute)."""
        if self.student is not None:
            recompute_layers(self.student, on=False)
        if self.peft:
            module.merge_and_unload()
