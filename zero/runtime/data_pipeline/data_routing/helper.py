"""DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing.helper`. Saving a model's weights without random-LTD's
layer names works as DeepSpeed's (its data-efficiency example saves through it with random-LTD off);
`convert_to_random_ltd` imports and raises UnsupportedFeatureError when called."""
from ....integrations.unsupported import DATA_EFFICIENCY_INSTEAD, stand_ins_getattr

__getattr__ = stand_ins_getattr(__name__, "deepspeed.runtime.data_pipeline.data_routing.helper",
                                {"convert_to_random_ltd": DATA_EFFICIENCY_INSTEAD})


def remove_random_ltd_state_dict(state_dict: dict) -> dict:
    """`state_dict` with random-LTD's wrapper (`.random_ltd_layer`) taken out of every name."""
    return {"".join(key.split(".random_ltd_layer")): value for key, value in state_dict.items()}


def save_without_random_ltd(model) -> dict:
    """The model's weights (an engine's gathered whole, at every stage) under random-LTD-free names."""
    from ....engine import ZeroEngine

    state = model.module_state_dict() if isinstance(model, ZeroEngine) else model.state_dict()
    return remove_random_ltd_state_dict(state)
