"""Stage `transfer` [ours]: each mixer learns to reproduce the heads it replaced.

The base model is frozen. For every converted layer, the original (teacher) model's
normalized hidden states at that layer (with the rotary position embeddings its attention
received) are the mixer's input and the original heads' pre-`o_proj` outputs (the replaced
query heads' channels) are its target; the loss is the
mean over layers of their MSE. Layer-local and cheap: the teacher runs without gradients
and nothing backpropagates through the model, only through each mixer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..surgery import LayerPlan
from .lm import tail_parameters


class MixerBank(nn.Module):
    """The converted layers' mixers as one module (so DDP sees a single forward)."""

    def __init__(self, mixers: list[nn.Module]):
        super().__init__()
        self.mixers = nn.ModuleList(mixers)

    def forward(self, inputs: list[Tensor], position_embeddings: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """Each mixer on its layer's input `[B, T, hidden]` with that layer's rotary `(cos, sin)`."""
        return [mixer(x, position_embeddings=pe) for mixer, x, pe in zip(self.mixers, inputs, position_embeddings)]


class TransferObjective:
    """MSE between each mixer's output and the replaced heads' outputs in the teacher.

    Args:
        teacher: the original model the student was converted from.
        student: the `RecurFormerForCausalLM` whose mixers train.
        trainable: `mixers` (all of each mixer) or `tail` (only the recurrent branch and
            gate of `window+*` mixers: on sequences longer than the window they learn what
            the full heads see and the window does not).
    """

    def __init__(self, teacher: nn.Module, student: nn.Module, trainable: str = "mixers"):
        self.trainable = trainable
        self.teacher = teacher.eval().requires_grad_(False)
        text = student.config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        group = text.num_attention_heads // text.num_key_value_heads
        spec = student.spec
        self.layers = [l for l in range(spec.num_layers) if spec.replaced_heads(l)]
        self.rows = {l: LayerPlan.build(l, spec, group, head_dim).replaced_q_rows for l in self.layers}
        self.mixers = [student.model.layers[l].self_attn.mixer for l in self.layers]
        self._inputs: dict[int, Tensor] = {}
        self._positions: dict[int, tuple[Tensor, Tensor]] = {}
        self._targets: dict[int, Tensor] = {}
        self._hooks = []
        for l in self.layers:
            layer = self.teacher.model.layers[l]
            self._hooks.append(layer.input_layernorm.register_forward_hook(self._keep_input(l)))
            self._hooks.append(layer.self_attn.register_forward_pre_hook(self._keep_positions(l), with_kwargs=True))
            self._hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(self._keep_target(l)))

    def _keep_input(self, layer: int):
        def hook(module, args, output):
            self._inputs[layer] = output

        return hook

    def _keep_positions(self, layer: int):
        """The rotary (cos, sin) the teacher's attention receives: mixers with positions
        (the window mixer) need the same ones."""

        def hook(module, args, kwargs):
            self._positions[layer] = kwargs["position_embeddings"]

        return hook

    def _keep_target(self, layer: int):
        def hook(module, args):
            self._targets[layer] = args[0][..., self.rows[layer]]

        return hook

    def prepare(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(False)
        bank = MixerBank(self.mixers)
        bank.requires_grad_(self.trainable != "tail").train()
        if self.trainable == "tail":
            for p in tail_parameters(bank):
                p.requires_grad_(True)
        return bank

    def loss(self, bank: nn.Module, input_ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        with torch.no_grad():
            self.teacher(input_ids, use_cache=False)
        outputs = bank([self._inputs[l] for l in self.layers], [self._positions[l] for l in self.layers])
        losses = [F.mse_loss(out.float(), self._targets[l].float()) for l, out in zip(self.layers, outputs)]
        # Relative error: MSE over the target's mean square, comparable across layers.
        relative = [
            (loss.detach() / self._targets[l].float().square().mean().clamp_min(1e-12)).item()
            for l, loss in zip(self.layers, losses)
        ]
        self._inputs.clear()
        self._positions.clear()
        self._targets.clear()
        return torch.stack(losses).mean(), {"relative_mse": sum(relative) / len(relative)}

    def finish(self, module: nn.Module) -> None:
        """The mixers trained in place inside the student; only the teacher's hooks go."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
