"""Stand-in for ``apex.optimizers``: ``FusedAdam`` and ``FusedLAMB`` on the CPU.

Same constructor signatures, ``defaults``, per-group ``step`` counter and
``zero_grad(self)`` (no ``set_to_none`` argument: apex overrides it and frees
gradients itself when ``set_grad_none=True``) as NVIDIA apex at
``6424da3b4faa6c8f062da4a48c424fff3f02d42d``; the fused CUDA kernels
(``amp_C.multi_tensor_adam``, ``amp_C.multi_tensor_lamb``) are written out in
plain fp32 torch ops, element for element. This is a stand-in for tests on a
machine without CUDA, not apex.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adam_update(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    adam_w_mode: bool,
    weight_decay: float,
    grad_scale: float | torch.Tensor = 1.0,
) -> None:
    """One Adam step in place, as apex's ``multi_tensor_adam`` / ``multi_tensor_fused_adam`` kernels compute it.

    L2 mode adds ``weight_decay * p`` to the (scaled) gradient; AdamW mode adds
    it to the update. ``grad_scale`` multiplies the gradient first (the
    distributed optimizer's clipping and loss-scale factor).
    """
    c1 = 1 - beta1**step if bias_correction else 1.0
    c2 = 1 - beta2**step if bias_correction else 1.0
    g = g.float() * grad_scale
    if not adam_w_mode:
        g = g + weight_decay * p
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = (m / c1) / ((v / c2).sqrt() + eps)
    if adam_w_mode:
        update = update + weight_decay * p
    p.sub_(lr * update)


class FusedAdam(torch.optim.Optimizer):
    """``apex.optimizers.FusedAdam``'s interface over a CPU Adam (see the module docstring)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or master_weights:
            raise NotImplementedError("apex stand-in: capturable / master_weights (CUDA graphs) are not modelled")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights

    def zero_grad(self):  # apex's signature: no set_to_none
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        if any(p is not None for p in [grads, output_params, scale, grad_norms]):
            raise RuntimeError(
                "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, "
                "and call step() with no arguments."
            )
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            # apex counts steps per group, not per parameter.
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                adam_update(
                    p,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    p.grad,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    step=group["step"],
                    bias_correction=bool(group["bias_correction"]),
                    adam_w_mode=bool(self.adam_w_mode),
                    weight_decay=group["weight_decay"],
                )
        return loss


class FusedLAMB(torch.optim.Optimizer):
    """``apex.optimizers.FusedLAMB``'s interface over a CPU LAMB (``multi_tensor_lamb`` stage 1 and 2).

    As in apex, the global gradient norm is taken over the gradients this
    optimizer holds and clipped at ``max_grad_norm`` inside the step, and the
    update is written into ``p.grad`` before it is applied.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        amsgrad=False,
        adam_w_mode=True,
        grad_averaging=True,
        set_grad_none=True,
        max_grad_norm=1.0,
        use_nvlamb=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self):  # apex's signature: no set_to_none
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.grad is not None and p.dtype not in (torch.float32, torch.float16):
                raise RuntimeError("FusedLAMB only support fp16 and fp32.")
        norms = [g.float().norm() for g in grads]
        global_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        max_grad_norm = self.defaults["max_grad_norm"]
        clipped = global_norm / max_grad_norm if global_norm > max_grad_norm else torch.ones(())
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            step, decay = group["step"], group["weight_decay"]
            c1 = 1 - beta1**step if group["bias_correction"] else 1.0
            c2 = 1 - beta2**step if group["bias_correction"] else 1.0
            beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                param_norm = p.float().norm()
                g = p.grad.float() / clipped
                r_p = p.float() if decay != 0 else torch.zeros_like(p, dtype=torch.float32)
                if not self.adam_w_mode:
                    g = g + decay * r_p
                m.mul_(beta1).add_(beta3 * g)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + decay * r_p
                p.grad.copy_(update)  # stage 1 writes the update into the gradient
                ratio = group["lr"]
                if self.use_nvlamb or decay != 0.0:
                    update_norm = p.grad.float().norm()
                    if update_norm != 0 and param_norm != 0:
                        ratio = group["lr"] * float(param_norm / update_norm)
                p.sub_(ratio * p.grad)
        return loss
