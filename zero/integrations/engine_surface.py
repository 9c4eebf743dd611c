"""DeepSpeedEngine's methods that zero-tiering's engine does not provide. Asked of our engine, each is one error naming
it (an AttributeError too, so `hasattr` stays False), where the lookup that falls through to the wrapped model used to
say the user's module has no such attribute. The names are DeepSpeed 0.19's DeepSpeedEngine public methods less ours
and nn.Module's."""
from __future__ import annotations

from .unsupported import UnsupportedFeatureError

UNPROVIDED = frozenset("""
    active_timers aio_config all_gather_scalar allreduce_and_copy allreduce_bucket allreduce_gradients
    allreduce_no_retain amp_enabled amp_params autotp_size autotuning_enabled autotuning_end_profile_step
    autotuning_metric autotuning_metric_path autotuning_model_info_path autotuning_profile_model_info
    autotuning_start_profile_step bf16_master_weights_and_gradients bf16_optimizer_states
    buffered_allreduce_fallback checkpoint_serialization_enabled checkpoint_tag_validation_enabled
    checkpoint_tag_validation_fail checkpoint_writer_enabled clip_fp32_gradients coalesce_grad_reduction
    communication_data_type compile_autosp compile_autotp compile_zero_optimization_stage cpuadam_cores_perc
    curriculum_enabled_legacy curriculum_learning_config curriculum_learning_enabled curriculum_params_legacy
    data_efficiency_config data_efficiency_enabled data_sampling_config data_sampling_enabled
    dataloader_drop_last deepspeed_io dump_state dynamic_loss_scale dynamic_loss_scale_args eigenvalue_enabled
    eigenvalue_gas_boundary_resolution eigenvalue_layer_name eigenvalue_layer_num eigenvalue_max_iter
    eigenvalue_stability eigenvalue_tol eigenvalue_verbose elasticity_enabled empty_partition_cache
    flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file
    flops_profiler_profile_step flops_profiler_recompute_fwd_factor flops_profiler_top_modules fp16_auto_cast
    fp16_master_weights_and_gradients get_autosp_backend get_autotp_backend get_batch_info get_compile_time
    get_data_parallel_rank get_data_types get_deepcompile_backend get_deepspeed_compile_backend
    get_model_parallel_rank get_mom get_pld_theta get_sequence_parallel_group get_tensor_parallel_rank get_type
    get_wall_clock_timers gradient_clipping gradient_predivide_factor graph_harvesting initial_dynamic_scale
    is_compiled is_deepcompile_active is_deepcompile_enabled is_elastic_model_parallel_supported
    is_first_weights_partition_group is_iterable_style_dataset is_map_style_dataset is_sanity_checks_enabled
    load_module_state_dict load_moe_state_dict load_universal_checkpoint log_level loss_scale
    managed_gradient_accumulation memory_breakdown mics_shard_size optimizer_legacy_fusion
    optimizer_name optimizer_params pld_enabled pld_gamma pld_params pld_theta postscale_gradients
    print_forward_breakdown quantize_training random_ltd_config random_ltd_enabled random_ltd_initialize
    register_compile_pass save_fp16_model scheduler_name scheduler_params
    set_custom_curriculum_learning_schedule set_data_post_process_func set_train_batch_size
    set_train_micro_batch_size sparse_all_gather sparse_allreduce sparse_allreduce_bucket
    sparse_allreduce_no_retain sparse_gradients_enabled steps_per_print super_offload swap_tensor_config
    tensor_parallel_config use_node_local_storage uses_parallelization_pass_only
    wall_clock_breakdown was_step_applied zenflow_config zero_allgather_bucket_size zero_allgather_partitions
    zero_allgather_sequential zero_allow_untested_optimizer zero_contiguous_gradients zero_cpu_offload
    zero_elastic_checkpoint zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_grad_hooks
    zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
    zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance
    zero_model_persistence_threshold zero_module_granularity_threshold zero_multi_rank_bucket_allreduce
    zero_nvme_offload_optimizer zero_offload_optimizer zero_offload_param zero_optimization
    zero_optimization_partition_gradients zero_optimization_partition_weights zero_overlap_comm
    zero_param_persistence_threshold zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients
    zero_quantized_nontrainable_weights zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter
    zero_round_robin_gradients zero_save_muon_momentum_buffer_in_memory zero_sub_group_size
    zero_use_cpu_optimizer zeropp_loco_param
""".split())


class UnprovidedEngineMethod(UnsupportedFeatureError, AttributeError):
    def __init__(self, name: str):
        super().__init__(f"DeepSpeedEngine.{name}", "the README's \"Using it from a training script\" lists what "
                                                    "the engine answers")
