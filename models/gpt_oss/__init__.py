"""gpt-oss (transformers' `GptOssForCausalLM`, model_type `gpt_oss`): a family folder
(models/family_folders.py). Its layers in spec terms (models/spec.py): alternating sliding and
full attention with learned attention sinks (`attention_sinks`), q, k, v and o biased (`bias`),
YaRN rotary positions, every layer a mixture of experts with a biased router
(`moe_router_bias`, top-k logits then softmax over them), biased experts and the clamped SwiGLU
(`activation="swiglu_clamped"`, `swiglu_alpha`, `swiglu_limit`)."""
