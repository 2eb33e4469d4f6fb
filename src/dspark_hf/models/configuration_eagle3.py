"""Configuration of an EAGLE-3-style drafter, the autoregressive baseline DSpark is compared with.

EAGLE-3 (Li et al., 2025) drafts token by token with one decoder layer that reads `[embed(x_t) ; g_t]`, where `g_t`
fuses low, middle and high target layers for positions the target has run and is the drafter's own previous output
for positions it drafted itself. It shares the target fingerprint, backbone shapes and block size with DSpark
(`DrafterConfig`); drafting γ tokens costs γ sequential forwards.
"""

from huggingface_hub.dataclasses import strict

from .configuration_dspark import DrafterConfig


@strict
class Eagle3Config(DrafterConfig):
    r"""
    Configuration for [`Eagle3DraftModel`]: the fields of [`DrafterConfig`] (target fingerprint, backbone shapes)
    with EAGLE-3's defaults:

        num_hidden_layers (`int`): 1, the only value EAGLE-3 uses (its layer reads `2 · hidden_size` inputs).
        target_layer_ids (`list[int]`): three target layers spread from 1 to L-3 (low, middle, high).
        block_size (`int`): γ, tokens drafted per round (γ sequential forwards); any value works at inference.
    """

    model_type = "dspark_eagle3"
    default_num_target_features = 3  # low, middle and high layers

    num_hidden_layers: int = 1

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers  # causal, as in Llama

    def validate_architecture(self):
        """The shared checks, plus EAGLE-3's single layer."""
        super().validate_architecture()
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"An EAGLE-3 drafter has exactly one decoder layer, got num_hidden_layers={self.num_hidden_layers}. "
                "Drop the setting (or compare deeper drafters with DSparkConfig, sequential_head='none' for DFlash)."
            )


__all__ = ["Eagle3Config"]
