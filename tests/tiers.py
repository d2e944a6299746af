"""Which tests run in which tier, in one place (tests/conftest.py applies it when it collects).

- ``make test`` (``pytest tests``): every test.
- ``make test-quick`` (``pytest --tier quick``): all but SLOW, for a change in progress. A test
  that starts a process while running in this tier fails, naming this file.
- ``make test-next`` (``pytest --tier next``, on the newest JAX): only NEXT, the surface whose
  behaviour depends on JAX's version (docs/tests.md says why the rest does not).

An entry is a test id without ``tests/``: a whole file (``test_x.py``), a test with all its
parametrizations (``test_x.py::test_y``) or one of them (``test_x.py::test_y[a-b]``). Every entry
must name a test that exists: the full collection (``pytest tests``) fails on one that does not.
"""

# Not in the quick tier: subprocesses (a fresh JAX each), end-to-end runs and trained models,
# Pallas kernels in interpret mode, lm_eval, and the few compiles of whole train steps that take
# more than ~10 s each.
SLOW = {
    # processes
    "test_readme_commands.py::test_printed_command_runs": "every printed command, a process each",
    "test_checkpoints.py::test_stop_on_signal_test_holds_when_started_with_sigint_ignored":
        "runs pytest in a background shell",
    "test_cluster.py::test_a_cluster_launch_needs_no_flags_and_trains_as_one_run[slurm]":
        "2 processes",
    "test_cluster.py::test_a_host_that_never_arrives_ends_the_run_in_one_line": "train.py",
    "test_cluster.py::test_one_run_per_run_directory_and_a_dead_run_leaves_no_lock": "train.py",
    "test_cluster.py::test_two_process_launcher_trains_and_processes_agree": "2 processes",
    "test_cluster.py::test_launch_local_gives_each_gpu_process_its_share": "launch_local.py",
    "test_cluster.py::test_an_evaluation_script_launched_as_several_processes_stops_in_one_line":
        "generate.py",
    "test_command_line.py": "a process per command line",
    "test_eval_passkey.py::test_cli_grid_table_json_and_heatmap": "eval_passkey.py",
    "test_faults.py": "train.py runs with faults",
    "test_generate_eval.py": "generate.py and eval.py on a trained run",
    "test_gpu_compile.py": "Triton compiles in a process",
    "test_harness.py": "lm_eval on a trained run",
    "test_hf_convert.py::test_train_from_an_import_then_export_to_transformers": "train.py",
    "test_hf_convert.py::test_eval_and_passkey_read_an_import_as_it_is": "eval.py, eval_passkey.py",
    "test_kernels.py::test_bench_kernels_runs_and_agrees": "bench_kernels.py",
    "test_kernels.py::test_train_with_the_pallas_kernel_matches_xla": "train.py",
    "test_multiprocess.py": "several processes, one run",
    "test_plan.py::test_a_mesh_or_config_that_does_not_divide_gives_one_line": "plan.py",
    "test_resume.py": "train.py runs, stopped and resumed",
    "test_train_e2e.py": "train.py",
    "test_validate.py::test_cli_prints_one_line_and_no_traceback": "train.py",
    # Pallas in interpret mode
    "test_kernels.py::test_fused_ring_matches_reference": "Pallas interpret mode",
    "test_kernels.py::test_unordered_positions_stay_exact": "Pallas interpret mode",
    "test_kernels.py::test_non_causal_matches_reference": "Pallas interpret mode (some cases)",
    "test_kernels.py::test_group_of_7_query_heads_per_kv_head_in_every_strategy_and_kernel":
        "Pallas interpret mode (some cases)",
    "test_kernels.py::test_rows_with_no_visible_key_and_empty_rounds": "Pallas interpret mode",
    "test_kernels.py::test_dense_impl_uses_the_fused_kernel": "Pallas interpret mode",
    "test_window.py::test_window_in_the_fused_kernels": "Pallas interpret mode",
    # trained models and whole train steps
    "test_eval_passkey.py::test_cli_user_errors_are_one_line": "on the suite's trained run",
    "test_eval_passkey.py::test_layout_path_matches_one_device_dense": "compiles the scorer twice",
    "test_hf_convert.py::test_greedy_generation_gives_transformers_tokens": "generation, ~7 s",
    "test_data_tfds.py::test_tfds_source": "builds a TFDS dataset",
    "test_eval_passkey.py::test_a_model_trained_on_passkeys_retrieves_them_and_an_untrained_one_does_not":
        "600+ training steps",
    "test_state.py": "train steps on several meshes, microbatches, 12 bf16 steps",
    "test_plan.py::test_chunked_loss_and_microbatches_lower_the_compiled_memory": "4 train steps compiled",
    "test_remat.py::test_less_recompute_needs_more_memory": "3 train steps compiled",
    "test_profile.py::test_profile_of_a_cpu_step_adds_up_to_the_step": "a traced train step",
    "test_kv_cache.py::test_cached_greedy_tokens_equal_recomputing_the_window":
        "every layout and strategy, generating",
}

# The surface whose behaviour depends on JAX's version, for `make test-next`: Pallas (interpret
# mode and its Mosaic/Triton lowerings), exports for cuda, shard_map/ppermute/all_to_all and the
# typed-varying values of every strategy, the Flax NNX model and its layer scan, orbax save,
# restore and reshard, jax.distributed start-up, the compiled program's memory, the profiler's
# trace, and one tiny end-to-end train, resume and generate.
NEXT = {
}
