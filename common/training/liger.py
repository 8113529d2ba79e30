"""--use_liger_kernel: liger-kernel's fused Triton kernels patched into a loaded causal LM.

OpenRLHF loads the policy through `AutoLigerKernelForCausalLM`, which patches the model class
before loading. Here the loaded instance is patched instead (`_apply_liger_kernel_to_instance`,
liger-kernel's API for a model that exists already), so ZeRO-3 partitioned loading and our own
loaders are unchanged. The kernels are Triton (GPU only); liger-kernel is an optional dependency
(`pip install -e .[gpu]`), never imported unless the flag is on.
"""
from __future__ import annotations


def apply_liger(model, device) -> str:
    """Patch `model` in place on a CUDA device where liger-kernel is installed; returns the banner note."""
    if getattr(device, "type", str(device)) != "cuda":
        return "--use_liger_kernel: liger-kernel's Triton kernels need a GPU; not used on the CPU"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError:
        return "--use_liger_kernel: liger-kernel is not installed (pip install -e .[gpu]); not used"
    kind = getattr(model.config, "model_type", None)
    if kind not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"--use_liger_kernel: liger-kernel has no kernels for model type '{kind}'; not used"
    # The fused linear + cross-entropy forward only replaces the logits when labels are passed; our
    # losses take the logits, so that path is never taken and the logits stay exact.
    _apply_liger_kernel_to_instance(model=model)
    return f"--use_liger_kernel: liger-kernel's kernels patched into the {kind} policy"
