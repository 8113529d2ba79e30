"""One optimizer update when a loss or gradient is not finite, and the ZeRO-0 optimizer's own step.

A non-finite loss or gradient must never reach the weights: the update is skipped on every rank
alike, counted, and stops the run unless --skip_nonfinite_updates. DeepSpeed's ZeRO-1/2/3 and bf16
optimizers do the skipping; a plain torch optimizer under ZeRO-0 gets it from `SkipNonfinite`.
"""
from __future__ import annotations

import math

import torch

from common.errors import TrainingError


class SkipNonfinite:
    """Mixed into the optimizer under ZeRO-0, the one case where DeepSpeed steps it with non-finite
    gradients (fp32: clipping by a NaN norm, then AdamW writes NaN into every weight).

    DeepSpeed's ZeRO-1/2/3 and bf16 optimizers skip such an update themselves and set `overflow`,
    which the engine reads after each step: it then counts the step in `skipped_steps`, answers
    `was_step_applied()` with False and holds the LR scheduler back. This gives a plain optimizer the
    same behaviour: weights and moments stay as they were. The gradients are all-reduced by then, so
    every rank decides alike. (Under bf16 ZeRO-0 DeepSpeed has checked already; this finds nothing.)

    It also clips where DeepSpeed leaves that to it (`common.training.ds`), keeping the norm before clipping as
    `_global_grad_norm`, which the engine reads after each step: DeepSpeed's own clipping of a plain
    optimizer keeps no norm, so train/grad_norm was None under ZeRO-0.
    """

    overflow = False
    max_norm = 0.0

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return super().step(closure)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        self._global_grad_norm = norm.item()
        self.overflow = not math.isfinite(self._global_grad_norm)  # a NaN or inf anywhere makes the norm so
        if self.overflow:
            return None
        if self.max_norm > 0 and self._global_grad_norm > self.max_norm:  # as DeepSpeed's clip_grad_norm_
            torch._foreach_mul_(grads, self.max_norm / (self._global_grad_norm + 1e-6))
        return super().step(closure)


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """The loss to backpropagate so that a non-finite loss skips the update it belongs to.

    An infinite loss can still have finite gradients (inf + f(w)), which the optimizer would apply;
    times NaN, every gradient it reaches is NaN, so the update is skipped (DeepSpeed's gradient-norm
    check, or `SkipNonfinite` under ZeRO-0), on every rank alike since both see all-reduced gradients.
    """
    return loss if torch.isfinite(loss) else loss * float("nan")


def update_skipped(engine, *, allow: bool, who: str, fix: str) -> bool:
    """After `engine.step()` closed an optimizer step: True when DeepSpeed skipped the update because
    its gradients were not finite (weights, moments and schedule untouched). Unless `allow`
    (--skip_nonfinite_updates) that stops the run: `who` names the step and model, `fix` what to try."""
    if engine.was_step_applied():
        return False
    if not allow:
        raise TrainingError(f"{who} loss is finite but its gradients are not; the update was skipped, so the weights "
                            f"are unchanged. {fix}, or pass --skip_nonfinite_updates to continue past such steps")
    return True
