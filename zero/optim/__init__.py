"""The optimizer side: Adam's arithmetic (adam_math.py, the C kernel adam_kernel.c), the standalone CPUAdam
(cpu_adam.py), the driver that steps sub-groups through the tiers (driver.py), the gradient path
(gradients.py), the param groups handed to the user (param_groups.py), the step on a thread (overlapped_step.py),
fp16 loss scaling (loss_scaler.py) and DeepSpeed's LR schedules (lr_schedules.py)."""
