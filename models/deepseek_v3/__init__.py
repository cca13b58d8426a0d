"""DeepSeek-V3 (and Kimi K2's layout; model_type `deepseek_v3`): a family folder
(models/family_folders.py). Multi-head latent attention (models/mla.py), dense first layers,
DeepSeek MoE layers (sigmoid routing with the expert bias, group-limited, scaled; shared
experts), multi-token prediction; the Hugging Face adapter maps `DeepseekV3ForCausalLM`."""
