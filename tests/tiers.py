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
    # processes, and whole runs
    "test_readme_commands.py::test_printed_command_runs": "every printed command, a process each",
    "test_bench_step.py::test_both_sides_take_the_same_model_and_tokens_and_the_profile_adds_up":
        "a train step compiled, traced, and transformers' model on torch",
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
    "test_get_smollm2.py": "a real 135M model: downloaded once, imported, beside transformers",
    "test_gguf_file.py::test_an_import_gives_transformers_logits_greedy_tokens_and_tokenizer":
        "generate.py's main(), its programs compiled",
    "test_hf_convert.py::test_train_from_an_import_then_export_to_transformers":
        "a whole run (train.py's entry, in process)",
    "test_hf_convert.py::test_eval_and_passkey_read_an_import_as_it_is":
        "eval.py and eval_passkey.py main(), their programs compiled",
    "test_kernels.py::test_bench_kernels_runs_and_agrees": "bench_kernels.py main(), its compiles",
    "test_kernels.py::test_train_with_the_pallas_kernel_matches_xla":
        "a whole run in Pallas interpret mode (train.py's entry, in process)",
    "test_multiprocess.py": "several processes, one run",
    "test_plan.py::test_a_mesh_or_config_that_does_not_divide_gives_one_line"
    "[args0-model.num_heads=4 is not divisible by mesh.tensor=3]": "plan.py (the other cases: its main())",
    "test_resume.py": "train.py runs, stopped and resumed",
    "test_default_codegen.py": "a pytest process: compiled-program checks under XLA's defaults",
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
    "test_sinks.py::test_sinks_in_every_kernel_layout_and_strategy[pallas_gpu]":
        "Pallas interpret mode",
    "test_sinks.py::test_sinks_in_every_kernel_layout_and_strategy[pallas_tpu]":
        "Pallas interpret mode",
    # trained models and whole train steps
    "test_eval_passkey.py::test_cli_user_errors_are_one_line": "on the suite's trained run",
    "test_eval_passkey.py::test_layout_path_matches_one_device_dense": "compiles the scorer twice",
    "test_hf_convert.py::test_greedy_generation_gives_transformers_tokens": "generation",
    "test_data_tfds.py::test_tfds_source": "builds a TFDS dataset",
    "test_host_devices.py::test_deciding_imports_no_jax": "a Python process",
    "test_data_tokenizer.py::test_fingerprint_is_stable_across_copies_and_processes":
        "a Python process",
    # compiles of more than ~6 s each (their behaviour has lighter checks in the quick tier)
    "test_plan.py::test_json_has_the_fields_scripts_read": "the tiny plan compiled",
    "test_plan.py::test_tiny_plan_memory_within_2x_of_the_real_run": "the tiny plan run",
    "test_plan.py::test_doubling_sequence_axis_halves_activation_memory": "a step compiled",
    "test_plan.py::test_memory_grows_linearly_with_sequence_length": "a step compiled",
    "test_plan.py::test_strategies_in_the_plan": "the tiny plan compiled",
    "test_remat.py::test_each_budget_picks_the_least_recompute_that_fits": "3 steps compiled",
    "test_remat.py::test_nothing_fits_is_one_line": "a step compiled",
    "test_remat.py::test_the_run_keeps_auto_and_the_trainer_gets_the_policy": "steps compiled",
    "test_kv_cache.py::test_sampling_follows_the_seed_as_without_a_cache": "generating, twice",
    "test_kv_cache.py::test_sliding_window_and_eos_and_a_stop_rule": "generating",
    "test_kv_cache.py::test_a_sharded_batch_and_the_tensor_axis": "generating on a 2x2x2 mesh",
    "test_attention.py::test_no_quadratic_residuals_under_remat_scan_grad": "2 layer scans compiled",
    "test_attention.py::test_explicit_mesh_under_scan_and_grad": "a layer scan compiled",
    "test_cudnn.py::test_cudnn_ring_matches_reference": "the stand-in's rings",
    "test_cudnn.py::test_cudnn_ring_with_a_window": "the stand-in's ring",
    "test_cudnn.py::test_cudnn_in_every_strategy": "the stand-in through each strategy",
    "test_window.py::test_window_matches_reference_in_every_layout": "early-stop and full rings",
    "test_window.py::test_window_in_every_strategy": "early-stop rings",
    "test_hf_convert.py::test_qwen2_greedy_generation_gives_transformers_tokens": "generation",
    # the costlier cases of exactness tests whose other cases stay in the quick tier
    "test_attention.py::test_ring_matches_reference_in_every_layout[4-gqa4-causal-bfloat16]":
        "4 cases stay",
    "test_attention.py::test_ring_matches_reference_in_every_layout[2-mha-packed-bfloat16]":
        "4 cases stay",
    "test_attention.py::test_smallest_length_per_device[zigzag-16]": "contiguous stays",
    "test_usp.py::test_usp_matches_reference[u4-ring2-gqa2-packed]":
        "usp stays in test_model's usp-4 and test_usp_with_heads_over_tensor",
    "test_loss.py::test_chunked_equals_full_in_float64[mesh0-6-False]": "5 cases stay",
    "test_model.py::test_offload_input_keeps_only_the_layer_inputs_and_on_the_host":
        "a remat scan's memory, compiled",
    "test_kernels.py::test_a_new_kernel_is_one_module_and_one_registry_entry": "a ring compiled",
    "test_hf_convert.py::test_mistral_greedy_generation_gives_transformers_tokens": "generation",
    "test_hf_families.py::test_greedy_generation_gives_transformers_tokens":
        "generation, a program pair per family",
    "test_hf_moe.py::test_greedy_generation_gives_transformers_tokens":
        "generation, a program pair per family",
    "test_hf_gpt_oss.py::test_greedy_generation_gives_transformers_tokens":
        "generation with sinks, windows and gpt-oss's experts",
    "test_eval_passkey.py::test_a_model_trained_on_passkeys_retrieves_them_and_an_untrained_one_does_not":
        "600+ training steps",
    "test_state.py": "train steps on several meshes, microbatches, 12 bf16 steps",
    "test_moe.py::test_the_same_step_with_the_experts_split_over_the_ring_or_fsdp":
        "gpt-oss's train step on one device and on two meshes of 8",
    "test_moe.py::test_two_microbatches_weight_each_ones_aux_loss_by_its_real_tokens":
        "an MoE's train step in 2 microbatches",
    "test_moe.py::test_the_per_sequence_loss_is_the_steps_and_exact_over_8_devices_and_microbatches":
        "an MoE's train step on 8 devices and in microbatches (the float64 check: quick tier)",
    "test_preference.py::test_dpo_on_a_mixture_of_experts_starts_at_ln2_plus_the_policys_aux_terms_and_steps":
        "an MoE's DPO step compiled (8 CPU s)",
    "test_sft.py::test_sft_on_a_mixture_of_experts_adds_its_aux_terms_to_the_first_steps_loss":
        "an MoE's SFT loss compiled (5 CPU s)",
    "test_hf_moe.py::test_qwen3_moe_dense_layers_import_and_export_as_transformers_builds_them":
        "an MoE with dense layers: a step and generation compiled (7 CPU s)",
    "test_plan.py::test_a_moe_plan_holds_every_expert_and_counts_the_active_flops":
        "an MoE's step compiled for 8 devices",
    "test_plan.py::test_chunked_loss_and_microbatches_lower_the_compiled_memory": "3 train steps compiled",
    "test_remat.py::test_less_recompute_needs_more_memory": "3 train steps compiled",
    "test_profile.py::test_profile_of_a_cpu_step_adds_up_to_the_step": "a traced train step",
    "test_kv_cache.py::test_cached_greedy_tokens_equal_recomputing_the_window":
        "every layout and strategy, generating",
    "test_kv_cache.py::test_a_layer_pattern_reads_each_layer_under_its_own_window_and_rope":
        "a 7-layer pattern's prefill and decode compiled",
    "test_pattern.py::test_mixed_stack_in_every_layout_strategy_and_kernel":
        "a mixed stack's forward and backward per strategy, Pallas interpret mode",
    "test_pattern.py::test_remat_and_the_chunked_mlp_keep_the_mixed_stack_exact":
        "two stacks' forward and backward",
    "test_pattern.py::test_a_train_step_reads_and_writes_the_weight_stack_in_place":
        "2 train steps compiled (test_the_stack_is_one_scan_over_its_layers stays)",
    "test_sft.py::test_the_same_step_on_any_mesh_layout_strategy_and_microbatching":
        "a train step per mesh (the first step's loss against transformers stays)",
    "test_sft.py::test_a_chat_run_trains_the_assistant_tokens_resumes_exactly_and_exports":
        "three chat runs (train.py's entry, in process) and an export",
    "test_sft.py::test_generate_chat_gives_transformers_greedy_reply": "generate.py's main()",
    "test_preference.py::test_the_same_step_on_any_mesh_layout_strategy_and_microbatching":
        "a train step per mesh (the losses' float64 formulas stay)",
    "test_preference.py::test_side_log_probs_are_transformers_and_the_first_step_is_ln2":
        "a DPO train step compiled (8 CPU s)",
    "test_loop.py::test_tokens_per_s_counts_each_interval_once_when_dispatch_blocks":
        "a train step compiled (about 5 CPU s; test_faults.py's program)",
    "test_preference.py::test_a_dpo_run_learns_the_pairs_resumes_exactly_and_exports":
        "three DPO runs (train.py's entry, in process) and an export",
    # LoRA (the refusals, the dropout masks and step 0 as the base stay in the quick tier)
    "test_lora.py::test_the_same_step_on_any_mesh_layout_strategy_and_microbatching":
        "a LoRA step on one device and two meshes of 8, with dropout",
    "test_lora.py::test_training_leaves_the_base_bitwise_and_keeps_state_for_the_trained_only":
        "LoRA train steps compiled, fp32 and bf16 bases",
    "test_lora_peft.py": "PEFT on torch beside exports, imports and a step",
    "test_sft.py::test_a_lora_run_starts_at_the_base_trains_its_adapters_alone_and_resumes_exactly":
        "two LoRA chat runs (train.py's entry, in process)",
    "test_preference.py::test_dpo_with_adapters_starts_at_ln2_steps_and_its_reference_is_the_base":
        "a LoRA DPO step compiled and two reference passes",
    "test_plan.py::test_a_lora_plan_holds_optimizer_state_for_the_trained_parameters_only":
        "a LoRA step compiled for 8 devices",
}

# The surface whose behaviour depends on JAX's version, for `make test-next`: Pallas (interpret
# mode and its Mosaic/Triton lowerings), exports for cuda, shard_map/ppermute/all_to_all and the
# typed-varying values of every strategy, the Flax NNX model and its layer scan, orbax save,
# restore and reshard, jax.distributed start-up, the compiled program's memory, the profiler's
# trace, and one tiny end-to-end train, resume and generate.
NEXT = {
    # Pallas: interpret mode (Triton and Mosaic semantics), the Mosaic lowering, Triton's cubins
    "test_kernels.py::test_fused_ring_matches_reference[pallas_gpu-2-mha-causal-float32]": "Triton",
    "test_kernels.py::test_fused_ring_matches_reference[pallas_tpu-1-mha-causal-bfloat16]": "Mosaic",
    "test_kernels.py::test_group_of_7_query_heads_per_kv_head_in_every_strategy_and_kernel"
    "[ulysses-pallas_gpu]": "Pallas under all_to_all",
    "test_kernels.py::test_tpu_kernels_lower_to_mosaic": "Mosaic lowering",
    "test_kernels.py::test_dense_impl_uses_the_fused_kernel": "the kernel registry on a jit",
    "test_window.py::test_window_in_the_fused_kernels": "the window in both Pallas kernels",
    "test_gpu_compile.py::test_default_gpu_kernels_compile_clean": "Triton cubins for sm_80/sm_90",
    "test_gpu_compile.py::test_tpu_kernels_lower_and_fit_vmem": "Mosaic's VMEM",
    # exports for cuda (custom calls: cuDNN)
    "test_cudnn.py::test_the_ring_exports_for_cuda_with_one_cudnn_call_per_case": "jax.export",
    "test_cudnn.py::test_a_window_exports_as_sliding_window_length": "jax.export",
    "test_cudnn.py::test_cudnn_in_every_strategy[ring-2-kw1-False]": "the stand-in in a ring",
    # shard_map, ppermute, all_to_all, all_gather/reduce-scatter, typed varying values
    "test_attention.py::test_ring_matches_reference_in_every_layout[2-gqa4-causal-float32]":
        "the ring, every layout, forward and backward",
    "test_attention.py::test_ring_traffic": "ppermute counts in the compiled program",
    "test_attention.py::test_explicit_mesh_under_scan_and_grad": "jax.set_mesh, scan, grad",
    "test_attention.py::test_the_ring_is_traced_once_under_scan_and_grad":
        "JAX's trace cache under linearize's replay (its abstract-mesh context)",
    "test_usp.py::test_usp_matches_reference[u4-ring2-gqa2-packed]": "all_to_all inside a ring",
    "test_usp.py::test_ulysses_matches_reference[n4-mha-causal]": "all_to_all",
    "test_usp.py::test_usp_traffic": "collectives in the compiled program",
    "test_allgather.py::test_allgather_with_reduce_scatter": "all_gather and reduce-scatter",
    "test_allgather.py::test_allgather_traffic": "collectives in the compiled program",
    "test_window.py::test_early_stop_sends_fewer_hops": "the early-stopped ring's ppermutes",
    "test_window.py::test_window_in_every_strategy[allgather-4-None-heads1]": "a windowed gather",
    # a mixture of experts: ragged_dot, the block scan, its shard_map (all_gather of the
    # stored experts, psum of the router statistics) in a ring, usp and tensor parallelism
    "test_moe.py::test_router_dispatch_and_experts_are_the_dense_float64_reference":
        "ragged_dot, top_k and the remat'd block scan",
    "test_moe.py::test_the_same_step_with_the_experts_split_over_the_ring_or_fsdp":
        "the MoE's shard_map on three meshes",
    # the Flax NNX model, its layer scan, remat and host offload; the sharded train step
    "test_model.py::test_shapes_and_dtype": "NNX modules and the scanned stack",
    "test_model.py::test_layout_permutation_is_invisible[striped-2]": "the model on a mesh",
    "test_model.py::test_offload_input_keeps_only_the_layer_inputs_and_on_the_host":
        "remat policies and memory kinds",
    "test_model.py::test_every_context_parallel_impl_gives_the_dense_logits[usp-4]": "usp model",
    "test_loss.py::test_chunked_equals_full_in_float64[mesh1-8-False]": "the chunked loss's scan",
    "test_state.py::test_sharded_step_equals_single_device_step[ring-striped-mesh1-chunks1]":
        "a sharded train step against one device",
    "test_plan.py::test_compiled_program_does_not_grow_with_depth": "XLA's memory analysis",
    # orbax: save, restore, reshard onto another mesh
    "test_checkpoints.py::test_restore_newest_and_its_data_state": "orbax save and restore",
    "test_checkpoints.py::test_keeps_the_newest_and_the_milestones": "orbax's manager",
    "test_checkpoints.py::test_every_checkpoint_unreadable_is_one_error_and_nothing_moves":
        "orbax's read errors",
    "test_checkpoints.py::test_a_shape_mismatch_is_a_user_error_not_damage": "orbax's errors",
    "test_checkpoints.py::test_a_non_finite_checkpoint_is_skipped_in_one_line_and_set_aside":
        "orbax restore",
    "test_checkpoints.py::test_orphaned_read_errors_of_a_skipped_checkpoint_are_dropped_and_nothing_else":
        "orbax's asyncio futures",
    "test_resume.py::test_restore_onto_four_devices_contiguous": "orbax reshards",
    # one tiny end-to-end train (the shared reference run), stop, resume and generate
    "test_resume.py::test_sigterm_finishes_the_step_saves_and_exits_zero": "train.py, SIGTERM",
    "test_resume.py::test_resume_after_sigterm_continues_bit_for_bit": "resume",
    "test_generate_eval.py::test_generate_greedy_matches_the_model_and_json_alone_prints_one_object":
        "generate.py",
    # jax.distributed start-up (gloo), and its timeout
    "test_multiprocess.py::test_launcher_stops_everyone_when_one_process_fails":
        "2 processes join over jax.distributed",
    "test_cluster.py::test_a_host_that_never_arrives_ends_the_run_in_one_line":
        "jax.distributed's timeout",
    # the profiler's trace
    "test_profile.py::test_profile_of_a_cpu_step_adds_up_to_the_step": "jax.profiler's trace",
    "test_profile.py::test_a_real_cpu_trace_runs_an_eigen_dot_until_its_consumer":
        "the CPU runtime's events of an asynchronous dot",
    "test_profile.py::test_the_gpu_trace_options_are_options_this_jax_knows":
        "XLA's compiler options",
    # the loop's clock against a dispatch that blocks (a GPU's)
    "test_loop.py": "jax.block_until_ready and dispatch",
    # a chat batch's step on a striped ring against one device
    # a preference loss's sides gathered by segment (jax.ops.segment_sum) and its gradient
    "test_preference.py::test_sides_are_read_by_segment_in_any_order": "segment sums",
    "test_preference.py::test_losses_and_their_gradients_are_the_float64_formulas":
        "the DPO losses' gradients",
}

# The files that take minutes of one worker in `make test`, costliest first (scripts/test_times.py
# on a full run): tests/conftest.py collects them first, so that none is handed out last.
FIRST = ["test_readme_commands.py", "test_kernels.py", "test_get_smollm2.py", "test_multiprocess.py",
         "test_hf_convert.py", "test_hf_families.py",
         "test_state.py", "test_harness.py", "test_plan.py", "test_kv_cache.py", "test_resume.py",
         "test_attention.py", "test_pattern.py", "test_default_codegen.py"]
