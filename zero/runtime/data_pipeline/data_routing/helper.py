"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing.helper`: random-LTD's model conversions import, and
raise UnsupportedFeatureError when called."""
from ....integrations.unsupported import DATA_EFFICIENCY_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.runtime.data_pipeline.data_routing.helper", dict.fromkeys(
    ("convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict"), DATA_EFFICIENCY_INSTEAD))
