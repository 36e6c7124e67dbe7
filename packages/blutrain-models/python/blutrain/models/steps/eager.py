"""EagerStep: forward, backward, clipping and AdamW as eager blutrain.tensor ops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..gpt2 import gemm_autotune
from ..optim import AdamW, grad_norm_and_clip_coef
from .base import Batch, Step, StepOutput


class EagerStep(Step):
    """The step as eager ops: each micro-batch's forward and backward (the loss alone: on CUDA
    the head and the loss run in chunks and the logits never exist whole), then the global
    gradient norm and clip coefficient on the device, and AdamW's multi-tensor kernel, which
    applies the coefficient to the gradients as it reads them (they are never rewritten)."""

    name = "eager"

    def __init__(self, model: Any, config: Any, device: str, group: Any) -> None:
        super().__init__(model, config, device, group)
        self.optimizer = AdamW(
            model.named_parameters(),
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            weight_decay=config.weight_decay,
        )
        self.params = list(model.parameters())

    def __call__(self, batches: Sequence[Batch], lr: float) -> StepOutput:
        self.optimizer.set_lr(lr)
        return self.run(batches)

    def run(self, batches: Sequence[Batch]) -> StepOutput:
        """Forward and backward of `batches`, clipping, AdamW at the optimizer's current lr."""
        cfg = self.config
        n = len(batches)
        losses = []
        with gemm_autotune(cfg.gemm_autotune, self.device):  # the first step times the GEMMs
            for x, y in batches:
                loss = self.model(x, y, return_logits=False)[1]
                (loss / n if n > 1 else loss).backward()
                losses.append(loss.detach())
        norm, coef = grad_norm_and_clip_coef(self.params, cfg.grad_clip)
        self.optimizer.step(grad_scale=coef)
        self.optimizer.zero_grad()
        return StepOutput(losses, norm)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
