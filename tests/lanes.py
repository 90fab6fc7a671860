"""The two test lanes: ``python3 -m pytest`` runs everything (what CI runs, ~20 minutes on two
cores), ``python3 -m pytest -m "not slow"`` the fast lane (a few minutes) while working.

Its collection hook (a plugin conftest.py registers) marks ``slow``, so that a new test is
classified by what it uses: every test that loads the built-in models (marker ``real_model``),
every real-browser module (``test_browser*.py``), and the tests named below, each measured
over ~3 s on two busy CPU cores: kernels built from scratch, the CLI or a worker in a
subprocess, long statistical, training or memory runs. The fast lane still runs at least one
test of every module under localspec/ (checked with coverage when this list changes).
"""

from __future__ import annotations

import pytest

# A whole module.
SLOW_MODULES = frozenset({
    "test_kernels_build.py",  # compiles the kernels from scratch, again and again
})

# "module::test" (all its parameters) or "module::test[ids]" (one case).
SLOW_TESTS = frozenset({
    "test_auto.py::test_mixed_check_has_power",
    "test_auto.py::test_mixed_drafters_sample_the_targets_distribution",
    "test_check.py::test_run_checks_passes_and_its_negative_control_fails",
    "test_cli.py::test_subprocess_stderr_has_no_traceback",
    "test_cli_input.py::test_output_that_is_not_unicode_is_escaped_not_a_crash",
    "test_cli_input.py::test_real_process_with_a_prompt_that_is_not_utf8",
    "test_drafter_finder.py::test_make_preset_writes_a_preset_the_app_and_generate_find",
    "test_engine.py::test_static_graphed_runners_equal_plain",
    "test_engine_sampling.py::test_a_chain_that_ends_itself_keeps_the_target_distribution",
    "test_engine_sampling.py::test_sampled_first_two_tokens_match_target_distribution",
    "test_engine_sampling.py::test_statistical_check_has_power",
    "test_grammar_sampling.py::test_constrained_sampling_through_the_engine_is_exact",
    "test_gpucheck.py::test_tiny_run_writes_the_report",
    "test_hub_download.py::test_an_interrupted_download_resumes_in_the_next_add",
    "test_memory.py::test_w8a8_linear_memory_flat_over_many_prompt_lengths",
    "test_runner.py::test_compile_graphs_compiles_every_bucket_before_the_first_answer",
    "test_suffix.py::test_sampled_first_two_tokens_follow_the_target",
    "test_suffix.py::test_the_sampling_check_has_power",
    "test_runner.py::test_graphed_runner_pads_to_its_buckets_and_equals_eager",
    "test_train_drafter.py::test_heads_trained_on_a_predictable_target_are_accepted[eagle3-cycle]",
    "test_train_drafter.py::test_heads_trained_on_a_predictable_target_are_accepted"
    "[eagle3-cycle-w8a8]",
    "test_train_parts.py::test_corpus_requests_file_and_interleaved_sources",
    "test_verify.py::test_monte_carlo_k2_first_token_and_pair",
})


def _names(item: pytest.Item) -> tuple[str, str]:
    """The keys SLOW_TESTS may name ``item`` by: without and with its parameters."""
    base = item.originalname if isinstance(item, pytest.Function) else item.name
    return f"{item.path.name}::{base}", f"{item.path.name}::{item.name}"


def is_slow(item: pytest.Item) -> bool:
    module = item.path.name
    return (item.get_closest_marker("real_model") is not None
            or module.startswith("test_browser") or module in SLOW_MODULES
            or not SLOW_TESTS.isdisjoint(_names(item)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the slow ``items``. A name in SLOW_TESTS that its module, collected, no longer has
    is an error: a renamed slow test must not slip into the fast lane unseen."""
    seen = set()
    for item in items:
        seen.update(_names(item))
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
    modules = {key.split("::")[0] for key in seen}
    stale = sorted(k for k in SLOW_TESTS if k.split("::")[0] in modules and k not in seen)
    if stale:
        raise pytest.UsageError(f"tests/lanes.py names tests that are not there: {stale}")
