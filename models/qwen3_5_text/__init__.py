"""Qwen3.5 text as a megazoo family (model_type `qwen3_5_text`, transformers'
`Qwen3_5ForCausalLM`): the family folder (models/family_folders.py) of the trainable stack. The
single-device model with transformers' names, its config checks and published sizes live in
models/qwen3_5/ (model.py, hf.py, presets.py), which this folder builds on."""
