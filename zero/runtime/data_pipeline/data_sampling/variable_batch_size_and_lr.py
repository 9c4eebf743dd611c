"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr`: batches of variable size
with the learning rate scaled to each; its functions import, and raise UnsupportedFeatureError when called."""
from ....integrations.unsupported import DATA_EFFICIENCY_INSTEAD, stand_ins_getattr

NAMES = ("get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
         "get_dataloader_and_lr_scheduler_for_variable_batch_size", "batch_by_seqlens", "scale_lr",
         "VariableBatchSizeLR", "dataloader_for_variable_batch_size", "lr_scheduler_for_variable_batch_size")

__getattr__ = stand_ins_getattr(__name__, "deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr",
                                dict.fromkeys(NAMES, DATA_EFFICIENCY_INSTEAD))
