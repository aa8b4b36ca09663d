"""Habits on two gloo ranks: a model whose modules read other modules' parameters
(nn.TransformerEncoder) trains like one process on the full batch; module.state_dict()
gathers (every rank calls it); a read of a parameter another rank keeps names
gathered_parameters(), which gathers and writes back on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core._models import CASES, ModelCase, assert_losses_close, train_reference
from tests.core.runtime.test_param_access import _encoder_loss, _seq_batch, build_encoder

from ._habits_worker import ACCUM, ACCUM_STEPS, AUTO_STEPS, COMPILED_STEPS, STEPS, habits
from ._spawn import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("habits")
    results = run_ranks(habits, out)
    assert len(results) == 2 and all("error" not in r for r in results), results
    return results, out


def test_transformer_encoder_on_two_ranks_matches_one_process(results: tuple[list[dict[str, Any]], Path]) -> None:
    want = train_reference(ModelCase("encoder", build_encoder, _seq_batch, _encoder_loss), STEPS)
    for r in results[0]:
        assert_losses_close(r["encoder_losses"], want, 1e-5, f"encoder, rank {r['rank']}")
        assert r["encoder_moves"] > 0


def test_module_state_dict_is_a_collective_with_the_masters(results: tuple[list[dict[str, Any]], Path]) -> None:
    ranks, out = results
    assert all(r["module_sd_equals_engine_sd"] for r in ranks), ranks
    sd = torch.load(out / "module_sd.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())


def test_reads_of_another_ranks_parameter_name_gathered_parameters(results: tuple[list[dict[str, Any]], Path]) -> None:
    for r in results[0]:
        assert "kept by another rank" in r["foreign_read"] and "gathered_parameters" in r["foreign_read"], r


def test_gathered_parameters_gathers_and_writes_back_on_every_rank(results: tuple[list[dict[str, Any]], Path]) -> None:
    for r in results[0]:
        assert r["gathered_equal"] and r["written_back"], r


def test_compiled_blocks_on_two_ranks_match_one_process(results: tuple[list[dict[str, Any]], Path]) -> None:
    want = train_reference(CASES["gpt2"], COMPILED_STEPS)
    for r in results[0]:
        assert_losses_close(r["compiled_losses"], want, 1e-5, f"compiled GPT-2, rank {r['rank']}")
        assert r["compiled_calls"] == 4 * (COMPILED_STEPS - 1), r  # four blocks, compiled from the second warm-up pass
        assert r["compiled_moves"] > 0, r


def test_gradient_accumulation_on_two_ranks_matches_one_process(results: tuple[list[dict[str, Any]], Path]) -> None:
    want = train_reference(CASES["gpt2"], ACCUM_STEPS, accum=ACCUM)
    for r in results[0]:
        assert_losses_close(r["accum_losses"], want, 1e-5, f"accumulated GPT-2, rank {r['rank']}")
        assert r["accum_moves"] > 0, r


def test_several_backwards_before_one_step_on_two_ranks_sum_as_one_process(results: tuple[list[dict[str, Any]], Path]) -> None:
    want = train_reference(CASES["gpt2"], ACCUM_STEPS, accum=ACCUM)
    for r in results[0]:
        assert_losses_close([ACCUM * x for x in r["kept_losses"]], want, 1e-5, f"two backwards per step, rank {r['rank']}")
        assert r["kept_forwards"] == ACCUM_STEPS * (ACCUM - 1) and r["kept_moves"] > 0, r


def test_a_parameter_missing_from_the_last_micro_batch_is_refused_on_every_rank(
    results: tuple[list[dict[str, Any]], Path],
) -> None:
    for r in results[0]:
        assert "earlier micro-batches but not in the last one" in r["branch_error"] and "side.weight" in r["branch_error"], r


def test_the_budget_a_too_small_one_names_trains_on_two_ranks(results: tuple[list[dict[str, Any]], Path]) -> None:
    for r in results[0]:
        assert r["named_minimum_trains"] is True, r["named_minimum_trains"]


@pytest.mark.parametrize("policy", ["checkpoint", "offload"])
def test_activation_policies_on_two_ranks_match_one_process(results: tuple[list[dict[str, Any]], Path], policy: str) -> None:
    want = train_reference(CASES["gpt2"], STEPS)
    for r in results[0]:
        assert_losses_close(r[f"{policy}_losses"], want, 1e-5, f"GPT-2, {policy}, rank {r['rank']}")
        assert r[f"{policy}_calls"] == 4 * STEPS and r[f"{policy}_moves"] > 0, r


def test_auto_plans_alike_on_two_ranks_and_matches_one_process(results: tuple[list[dict[str, Any]], Path]) -> None:
    want = train_reference(CASES["gpt2"], AUTO_STEPS)
    for r in results[0]:
        assert "error" not in r, r.get("error")
        assert_losses_close(r["auto_losses"], want, 1e-5, f"GPT-2, auto, rank {r['rank']}")
        assert r["auto_measuring"] is False and r["auto_timed"] is True  # planned again on a frozen step's agreed times
    plans = [r["auto_plan"] for r in results[0]]
    assert plans[0] == plans[1] and len(plans[0]) == 4, plans
