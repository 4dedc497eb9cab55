"""Which checks cover each feature of README's feature table.

One entry per row of README's table (keyed by the row's first words); each
names the checks that fail when the feature breaks:
  "tests/test_x.py"                 a whole test file
  "tests/test_x.py::test_name"      one test of it
  "checks_module.check_name"        one check of a multi-rank worker module
                                    (tests/workers/checks_module.py)
tools/gen_feature_index.py renders this as docs/testing.md's feature index,
and tests/test_tiers.py fails when a README row has no entry, an entry names
a check that does not exist, or the index is out of date.
"""

FEATURES = [
    ("`PerseusStrategy` for Keras 3.0 to 3.15", [
        "tests/test_strategy.py",
        "checks_strategy.check_fit_equals_single_process_sgd",
        "checks_strategy.check_custom_training_loop_equals_single_process",
        "checks_strategy.check_mixed_precision_overflow_on_one_rank_skips_step_everywhere",
        "checks_strategy.check_model_saved_by_rank_0_alone_is_whole_and_quick",
        "checks_strategy.check_keras_patches_in_order_found_and_undone",
        "tests/test_keras_versions.py",
        "tests/test_model_matrix.py",
        "tests/test_backup_restore.py",
    ]),
    ("sharded optimizer state", [
        "tests/test_shard.py",
        "checks_shard.check_adam_amsgrad",
        "checks_shard.check_adafactor_and_its_factored_state_saved_whole",
        "checks_shard.check_saved_sharded_loads_unsharded_and_the_reverse",
        "checks_strategy.check_sharded_optimizer_state_equals_unsharded",
        "checks_shard.check_shim_sharded_equals_the_shims_allreduce",
        "checks_ops.check_shard_reducescatter_reads_pieces_at_their_offsets",
    ]),
    ("Horovod drop-in", [
        "tests/test_horovod.py",
        "checks_horovod_keras.check_fit_matches_single_process_training",
        "checks_horovod_keras.check_backward_passes_equal_a_k_times_larger_batch",
        "tests/test_horovod_examples.py",
        "tests/test_keras_support.py",
    ]),
    ("fused allreduce, offline negotiation", [
        "checks_core.check_fusion_counters",
        "checks_core.check_offline_plan_zero_control_bytes_replan_and_divergence",
        "checks_compression.check_gradient_steps_match_the_numpy_model",
        "checks_compression.check_compression_is_what_the_settings_say",
        "checks_compression.check_topk_residuals_deliver_everything_eventually",
        "tests/test_compression.py",
        "tests/test_core.py::test_plan_check_names_the_tensor_where_plans_differ",
        "tests/test_cc_unit.py::test_cc_unit_tests_pass",
        "tests/test_cc_unit.py::test_the_controller_negotiates_runs_stops_and_fails_over_fakes",
    ]),
    ("hierarchical allreduce, several streams", [
        "checks_compression.check_two_level_allreduce_equals_flat",
        "checks_multihost.check_c_hierarchical_allreduce_is_used",
        "checks_core.check_shared_memory_allreduce_when_one_host",
        "checks_core.check_many_tensors_enqueued_in_different_orders",
        "checks_core.check_small_buckets_cross_hosts_by_recursive_doubling",
        "tests/test_cc_unit.py::test_recursive_doubling_and_bruck_allgather_on_every_world_size",
        "checks_core.check_raw_allgather_by_bruck_equals_the_ring",
        "checks_core.check_the_cost_model_draws_one_line_on_every_rank",
        "checks_compression.check_two_levels_where_the_cost_model_says",
    ]),
    ("local gradient accumulation", [
        "checks_strategy.check_accumulation_equals_a_larger_batch",
        "checks_horovod_keras.check_backward_passes_equal_a_k_times_larger_batch",
    ]),
    ("`perseusrun` over ssh", [
        "tests/test_runner.py",
        "tests/test_multihost.py::test_perseusrun_over_ssh_two_hosts",
        "tests/test_multihost.py::test_perseusrun_mpi_two_hosts",
        "tests/test_multihost.py::test_plain_mpirun_two_hosts",
        "tests/test_multihost.py::test_kubernetes_contracts_by_hand",
        "tests/test_slurm.py",
        "tests/test_ray.py",
        "tests/test_contracts.py",
    ]),
    ("elastic jobs", [
        "tests/test_elastic.py",
        "tests/test_preemption.py",
    ]),
    ("a job never waits forever", [
        "tests/test_faults.py",
        "tests/test_bounded.py",
        "tests/test_failures.py",
        "tests/test_multihost.py::test_a_partition_is_named_on_both_sides_within_the_timeout",
        "tests/test_multihost.py::test_killed_remote_rank_ends_the_job_naming_rank_and_host",
        "checks_faults.check_c_grouped_calls_of_different_sizes_fail_on_every_rank",
        "checks_bounded.check_a_stall_timeout_fails_on_time_naming_the_ranks",
        "tests/test_cc_unit.py::test_the_health_monitor_names_ranks_and_fails_rounds_over_a_fake_store",
    ]),
    ("timeline traces and the slow-rank check", [
        "tests/test_operability.py",
    ]),
    ("GPUs", [
        "tests/test_gpu.py",
        "tests/test_cuda.py",
        "checks_core.check_staged_collectives_copy_through_pinned_memory",
        "checks_core.check_steady_steps_create_no_cuda_events",
    ]),
]
