"""Generation settings a session pins: a plugin may not set them in ``create()``.

The seed's rule (GenerationConfig belongs to the sample or the job), plus the other
settings that would change the distribution the trainer assumes it sampled from.
"""

from __future__ import annotations

#: The base model's policy name: a session's policy unless it names a LoRA policy (docs/policies.md), and the
#: policy of a version span that names none (spans recorded before policies, and the base's own).
BASE_POLICY = "base"

PINNED_GENERATION_PARAMETERS: tuple[str, ...] = (
    "n",
    "max_tokens",
    "max_completion_tokens",
    "max_new_tokens",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "thinking",
    "reasoning_effort",
    "reasoning",
    "seed",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "chat_template_kwargs",
)
