"""vLLM's Idefics3 over vLLM's Mixtral: the test tooling's MoE vision-language model (``vlm_moe``).

vLLM 0.32 builds Idefics3's text model as ``LlamaModel`` whatever the config's ``text_config`` says, and the
architectures that take any text model (LLaVA and its kin) import torchvision, which has no CPU build here
(docs/images.md). This class is vLLM's own ``Idefics3ForConditionalGeneration`` (vision tower, connector,
multimodal processor, weight loading) with vLLM's own ``MixtralModel`` where it names ``LlamaModel``; nothing
else is ours. It runs inside the engine venv only: ``devtools.vllm_server`` puts this directory on the
engine's ``PYTHONPATH`` and registers the class under the architecture the checkpoint names."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models import idefics3
from vllm.model_executor.models.mixtral import MixtralModel


class Idefics3MoeForConditionalGeneration(idefics3.Idefics3ForConditionalGeneration):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        llama = idefics3.LlamaModel
        idefics3.LlamaModel = MixtralModel  # read by the parent's __init__ and Idefics3Model's, at call time
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            idefics3.LlamaModel = llama
