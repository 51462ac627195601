"""del_megatron.megatron.register on a tiny real GPTModel (CPU, gloo) at TP = 1 and 2."""

import json

import pytest

from . import megatron_workers
from .megatron_workers.training_curves import train_curve

HOOK_CHECKS = [
    "hook_equals_numerical_lm_loss",
    "parallel_output_false",
    "mtp_goes_through_del",
    "register_cycle",
    "config_fields_and_fusion_modes",
    "a_cross_entropy_cached_at_build_is_replaced",
    "logits_free_equals_materialised",
    "logits_free_refusals",
    "logits_free_from_the_model_config",
    "refused_when_the_hook_first_sees_the_model",
    "fp32_logits_take_their_gradient_in_place",
]
CP_CHECKS = ["hook_passes_the_cp_group", "packed_seq_params_reach_the_hook", "logits_free_under_cp"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("check", HOOK_CHECKS)
def test_hook_on_real_gpt_model(gloo, tp, check):
    gloo(tp, tensor_model_parallel_size=tp).run(getattr(megatron_workers, f"check_{check}"), tp)


def test_every_model_class_taking_packed_seq_params_is_wrapped_or_refused(gloo):
    gloo(1, tensor_model_parallel_size=1).run(
        megatron_workers.check_model_classes_taking_packed_seq_params
    )


@pytest.mark.parametrize("check", CP_CHECKS)
def test_hook_under_context_parallel_and_packed_sequences(gloo, check):
    workers = gloo(2, tensor_model_parallel_size=1, context_parallel_size=2)
    workers.run(getattr(megatron_workers, f"check_{check}"))


def test_training_curve_is_the_same_at_tp1_and_tp2_with_sequence_parallel(gloo, tmp_path):
    curves = {}
    for tp, sp in ((1, False), (2, True)):
        path = tmp_path / f"tp{tp}.json"
        gloo(tp, tensor_model_parallel_size=tp).run(train_curve, tp, sp, 30, str(path))
        curves[tp] = json.loads(path.read_text())
    assert len(curves[1]) == 30
    assert curves[1] == pytest.approx(curves[2], rel=1e-5, abs=1e-5)
    first, last = sum(curves[1][:3]) / 3, sum(curves[1][-3:]) / 3
    assert last < 0.7 * first, curves[1]


def test_pipeline_parallel_2_and_virtual_stages_match_pp1_through_megatron_schedules(
    gloo, tmp_path
):
    from .megatron_workers.training_curves import pipeline_curve

    reports = {}
    layouts = {
        (1, None): {"tensor_model_parallel_size": 1},
        (2, None): {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2},
        (2, 2): {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
        },
    }
    for (pp, vp), layout in layouts.items():
        path = tmp_path / f"pp{pp}-vp{vp}.json"
        gloo(pp, **layout).run(pipeline_curve, 3, str(path), vp or 1)
        reports[pp, vp] = json.loads(path.read_text())
    assert len(reports[1, None]) == 3
    for one, two, interleaved in zip(
        reports[1, None], reports[2, None], reports[2, 2], strict=True
    ):
        assert set(one) == {
            "lm loss",
            "ce loss",
            "del term",
            "del weight",
            "digit acc",
            "digit entropy",
            "digit target prob",
            "digit distance",
            "digit tokens",
            "digit share",
        }
        for key in one:
            assert one[key] == pytest.approx(two[key], rel=1e-5), key
            assert one[key] == pytest.approx(interleaved[key], rel=1e-5), key
    lm = [r["lm loss"][0] / r["lm loss"][1] for r in reports[1, None]]
    assert lm[-1] < lm[0]
