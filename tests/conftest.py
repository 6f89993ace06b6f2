"""The suite's tiers: `make test` runs everything but the `bench` and `long` tiers (what CI runs, within its 30
minutes on 2 cores); `make test-fast` leaves out the `slow`, `elastic`, `bench` and `long` tiers for the inner loop of a
change; `make test-bench` runs the `bench` tier, `make test-all` every tier (before a release).

- `slow`: the modules that run whole jobs end to end (the main job, Trainers on several processes, the built wheel,
  the benchmarks' smoke runs, subprocess launches) and a few engine tests of a minute or more. A module is slow by its
  name below, so a new end-to-end module joins the tier by adding one line here.
- `elastic`: workers under a torchft Lighthouse; skipped, saying why, where torchft is not installed (the `elastic`
  extra).
- `bench`: measurements and sweeps, run with `make test-bench` before stored results or pinned releases change: the
  quick runs of the benchmark scripts that take 20 s or more each (they check the scripts that write BENCHMARKS.md,
  not the package a user runs), the tests that time a run (a slowed site's share of the waiting: speed is what the
  benchmarks measure, and 2 loaded cores make such a test's timing its neighbours'), and the sweep of every
  transformers model family through the pipeline stages (it changes with the pinned transformers, not with this
  package). The other `test_bench_*` modules (every module's `--help`, the formulas, the plots) stay in `make test`.
- `long`: end-to-end scenarios of 40 s or more whose rule a faster test in `make test` checks too (each named below
  with that test): a second overlap mode under the same drop and join, a store cut past its bound through the main
  job, three sites of two ranks each, a pipeline site losing a rank beside the FSDP one, a site breaking mid-exchange,
  a site alone after serving a heal.
- `gpu`: needs CUDA (registered in pyproject.toml); each such test skips with its reason where none is present.
"""

from __future__ import annotations

import importlib.util

import pytest

SLOW_MODULES = {
    "test_buffers",
    "test_clear_answers",
    "test_cli",
    "test_docs_site",
    "test_dropin",
    "test_engine_faults",
    "test_faults",
    "test_launch",
    "test_peft",
    "test_pipeline_families",
    "test_pipeline_trainer",
    "test_plugin",
    "test_pretrain_script",
    "test_readme_snippet",
    "test_sharded_stages",
    "test_sharded_sync",
    "test_sharded_workers",
    "test_store_pretrain",
    "test_store_sites",
    "test_trainer",
    "test_trainer_fsdp",
    "test_trainer_guards",
    "test_trl",
    "test_wheel",
}
# Every benchmark's smoke run (`tests/test_bench_*.py`) is slow too, and so are these multi-process tests (a name, or
# a name with its parameters for one case of several): each is 8 s or more on 2 quiet cores, waits out a timeout by
# design, or repeats for a third worker or another variant what a faster sibling checks in the fast tier.
SLOW_PREFIXES = ("test_bench_",)
SLOW_TESTS = {
    "test_streaming_matches_reference",
    "test_plain_diloco_matches_reference",
    "test_all_gather_exchange_matches_reference_and_keeps_workers_identical",
    # `round_policy: balanced` through the Trainer and the plugin on 2 processes (the engine's tests stay fast).
    "test_the_trainer_counts_the_runs_position_and_resumes_a_balanced_run_bitwise",
    "test_a_plugin_loop_ends_at_a_round_and_resumes_from_a_round_bitwise",
    "test_a_balanced_run_resumed_mid_round_continues_bitwise",
    # Timeouts and delays waited out on purpose.
    "test_a_peer_that_stops_answering_gives_a_clear_error_not_a_hang",
    "test_delays_that_fit_in_tau_do_not_slow_inner_steps",
    "test_barrier_names_the_missing_rank_within_the_bound",
    # Third workers and further variants.
    "test_the_average_written_into_out_is_the_fresh_average_bit_for_bit[3]",
    "test_entropy_coding_is_lossless_and_sends_what_deflate_makes_of_each_payload[3]",
    "test_all_gather_pattern_quantizes_each_contribution_once[3]",
    "test_quantized_average_and_bytes_on_the_wire[3]",
    "test_delayed_and_eager_match_reference[eager-fitted-3]",
    "test_delayed_and_eager_resume_bitwise_from_a_mid_round_state[eager-strided-extra3]",
    "test_delayed_and_eager_resume_bitwise_from_a_mid_round_state[eager-strided-extra4]",
    "test_error_feedback_loses_nothing_with_one_quantization[all_gather]",
    "test_streaming_fp4_with_entropy_coding_trains_bitwise_like_without_and_sends_fewer_bytes",
    "test_robust_clip_leaves_a_joining_workers_zeros_out_of_the_median",
    "test_close_keeps_every_error_feedback_residual",
    "test_engine_lowrank_and_adaptive_on_two_workers",
    "test_pipeline_composes_with_data_parallel",
    # Whole runs beside a unit test of the same piece in the fast tier: the engine with split low rank (the split
    # itself is checked against the reference there), a DiLoCoTrainer with Muon (its steps are checked against
    # torch's optimizers), two workers under an outer schedule (its factors against the formula).
    "test_engine_split_low_rank_keeps_replicas_and_workers_identical_and_resumes_bitwise",
    "test_a_diloco_trainer_trains_with_muon_and_resumes_bitwise",
    "test_two_workers_step_each_fragment_at_the_scheduled_rates_like_the_reference",
    # The GPU check script's CPU dry run: a subprocess launch of the whole script.
    "test_cpu_dry_run_of_two_workers_writes_passing_json",
    # Elastic sites of two DDP ranks each, one lost and restarted (four torchrun ranks and their restarts).
    "test_a_site_of_two_ranks_lost_and_restarted_heals_both_ranks_and_ends_identical",
    "test_a_site_that_breaks_mid_exchange_leaves_whole_and_the_other_site_trains_on",
    "test_two_trainer_sites_of_two_ranks_each_end_with_the_same_global_model",
    # `hf-diloco pretrain` from a planned YAML (a subprocess run of the main job).
    "test_the_plan_starts_hf_diloco_pretrain_on_a_tiny_model",
    # The main job on 2 processes with secrets, and a second job refused by its lock.
    "test_no_secret_reaches_a_file_or_a_message_and_the_lock_is_the_owners",
}
ELASTIC_MODULES = {
    "test_elastic",
    "test_elastic_balanced",
    "test_readme_elastic",
    "test_heal_trust",
    "test_elastic_sites",
    "test_elastic_trust",
    "test_elastic_ddp_sites",
    "test_elastic_plugin",
    "test_elastic_pretrain",
    "test_elastic_apart",
}


BENCH_MODULES = {
    "test_pipeline_families",
    "test_bench_goodput",
    "test_bench_store_link",
    "test_bench_unequal_sites",
    "test_bench_wan_smoke",
    "test_bench_peers",
    "test_bench_comm_specs",
    "test_bench_eager_estimate",
}
LONG_TESTS = {
    # test_each_overlap_mode_with_a_lossy_codec_under_a_drop_and_a_join[streaming] stays, and the background
    # exchange lost in flight (test_a_worker_lost_with_a_background_exchange_in_flight_matches_the_reference).
    "test_each_overlap_mode_with_a_lossy_codec_under_a_drop_and_a_join[streaming_tau1]",
    "test_each_overlap_mode_with_a_lossy_codec_under_a_drop_and_a_join[eager]",
    "test_each_overlap_mode_with_a_lossy_codec_under_a_drop_and_a_join[delayed_clipped]",
    # test_store.py::test_a_store_down_longer_than_the_bound_stops_the_call_naming_the_store_and_back_within_it_goes_on
    "test_a_store_cut_off_past_its_bound_stops_the_site_saved_and_the_same_command_resumes_it",
    # test_elastic_ddp_sites.py::test_a_site_of_two_ranks_lost_and_restarted_heals_both_ranks_and_ends_identical and
    # test_elastic_sites.py::test_a_site_that_loses_one_rank_leaves_whole_and_heals_both_ranks_when_restarted
    "test_three_pretrain_sites_of_two_ranks_survive_a_lost_site_and_heal_it",
    # test_elastic_sites.py::test_a_site_that_loses_one_rank_leaves_whole_and_heals_both_ranks_when_restarted[fsdp]
    # and test_two_trainer_sites_of_two_ranks_each_end_with_the_same_global_model[pipeline]
    "test_a_site_that_loses_one_rank_leaves_whole_and_heals_both_ranks_when_restarted[pipeline]",
    # test_elastic_ddp_sites.py::test_a_site_of_two_ranks_lost_and_restarted_heals_both_ranks_and_ends_identical
    "test_a_site_that_breaks_mid_exchange_leaves_whole_and_the_other_site_trains_on",
    # test_elastic_apart.py::test_a_site_paused_while_its_peer_finished_and_the_peer_both_say_they_trained_alone and
    # test_the_main_job_says_it_in_its_log_results_card_and_exit_status: the same sentences, rounds and exit status
    "test_a_site_paused_after_serving_a_heal_and_the_healed_site_both_say_they_trained_alone",
}
BENCH_TESTS = {
    "test_pretrain_with_a_site_at_half_a_cpu_keeps_the_other_busy",
    "test_elastic_balanced_rounds_follow_speed_and_weight_the_average_by_steps",
    "test_a_slow_worker_lost_under_balanced_rejoins_and_is_measured_again",
    "test_balanced_rounds_keep_the_fast_worker_busy_and_weight_the_average_by_steps",
}


# The exchange through an object store reaches it with obstore (the `store` extra).
STORE_MODULES = {"test_store", "test_store_sites", "test_store_pretrain"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: runs whole jobs end to end; left out by `make test-fast`")
    config.addinivalue_line("markers", "elastic: workers under a torchft Lighthouse (the `elastic` extra)")
    config.addinivalue_line("markers", "long: end-to-end scenarios a faster test checks too; `make test-all`")
    config.addinivalue_line(
        "markers", "bench: measurements and sweeps (benchmark scripts, timed runs, model families); `make test-bench`"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    without_torchft = importlib.util.find_spec("torchft") is None
    without_obstore = importlib.util.find_spec("obstore") is None
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if (
            module in SLOW_MODULES
            or module.startswith(SLOW_PREFIXES)
            or (item.originalname in SLOW_TESTS or item.name in SLOW_TESTS)
        ):
            item.add_marker(pytest.mark.slow)
        if module in BENCH_MODULES or item.originalname in BENCH_TESTS:
            item.add_marker(pytest.mark.bench)
        if item.name in LONG_TESTS or item.originalname in LONG_TESTS:
            item.add_marker(pytest.mark.long)
        if module in STORE_MODULES and without_obstore:
            item.add_marker(pytest.mark.skip(reason="a store is reached with obstore: pip install 'hf_diloco[store]'"))
        if module in ELASTIC_MODULES:
            item.add_marker(pytest.mark.elastic)
            if without_torchft:
                item.add_marker(
                    pytest.mark.skip(reason="elastic workers need torchft: pip install 'hf_diloco[elastic]'")
                )
