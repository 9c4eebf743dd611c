"""`python -m zero.plan`: for a model and a machine, what each placement costs (bytes per tier, peak RSS,
device peak, nvme bytes and step time) and the fastest one that fits, as a ds_config.json. model_source.py
builds the model on meta, machine.py measures and reads the machine, predict.py holds the cost model."""
