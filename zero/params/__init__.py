"""How parameters are held: units (flat_unit.py, unit.py), which modules become units (wrap_policy.py), real
values for a model built on meta (materialize.py), and the placements (placement.py: resident.py for stages
0-2, partitioned.py for stage 3)."""
