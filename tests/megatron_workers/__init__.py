"""Bodies of the Megatron-Core integration tests; each runs on every rank of a gloo group. One
module a feature; the checks by name (tests/test_megatron_hook.py looks them up here)."""

from .config_fields import (
    check_a_cross_entropy_cached_at_build_is_replaced,
    check_config_fields_and_fusion_modes,
)
from .context_parallel import check_hook_passes_the_cp_group
from .first_sight_refusals import check_refused_when_the_hook_first_sees_the_model
from .hook import (
    check_hook_equals_numerical_lm_loss,
    check_mtp_goes_through_del,
    check_parallel_output_false,
    check_register_cycle,
)
from .inplace_gradient import check_fp32_logits_take_their_gradient_in_place
from .logits_free import (
    check_logits_free_equals_materialised,
    check_logits_free_from_the_model_config,
    check_logits_free_refusals,
    check_logits_free_under_cp,
)
from .packed_sequences import (
    check_model_classes_taking_packed_seq_params,
    check_packed_seq_params_reach_the_hook,
)

__all__ = [
    "check_a_cross_entropy_cached_at_build_is_replaced",
    "check_config_fields_and_fusion_modes",
    "check_fp32_logits_take_their_gradient_in_place",
    "check_hook_equals_numerical_lm_loss",
    "check_hook_passes_the_cp_group",
    "check_logits_free_equals_materialised",
    "check_logits_free_from_the_model_config",
    "check_logits_free_refusals",
    "check_logits_free_under_cp",
    "check_model_classes_taking_packed_seq_params",
    "check_mtp_goes_through_del",
    "check_packed_seq_params_reach_the_hook",
    "check_parallel_output_false",
    "check_refused_when_the_hook_first_sees_the_model",
    "check_register_cycle",
]
