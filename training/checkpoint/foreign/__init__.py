"""Checkpoints of other frameworks (Megatron-LM, Megatron-core's torch_dist, DeepSpeed) read into
and written from megazoo's full tensors (`training/checkpoint/reshard.py`), so any layout goes in
and any layout comes out. `safe_load.py` unpickles their files without running code; `names.py`
holds the one table of Megatron-core tensor names and how each is split over tensor parallelism."""
