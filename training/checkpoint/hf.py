"""Hugging Face folders <-> megazoo checkpoints of any layout.

Import reads `config.json` (a multimodal release's language model, or Kimi K2's as DeepSeek-V3's:
hf_releases.py) and the weights (`model.safetensors`, `pytorch_model.bin`, or their
sharded `*.index.json` forms; `.bin` files with `torch.load(weights_only=True)`, so nothing
arbitrary is unpickled; an FP8 release's block-scaled tensors dequantized: hf_fp8.py; an MXFP4
one's: hf_mxfp4.py), maps
them to megazoo's full tensors with the family's `from_hf_state_dict` (GPT-2's Conv1D transposes and [q|k|v] -> per-head QKV order live there)
and writes a weights-only checkpoint for the target (tp, pp, vpp). Tokenizer files are copied
into the checkpoint's `tokenizer/` folder with the special-token ids of config.json and
generation_config.json.

Export gathers full tensors from a checkpoint of any layout (vocabulary padding trimmed,
replicas checked equal), maps them back with `to_hf_state_dict` and writes `config.json`,
`model.safetensors` (in the checkpoint's dtype, an imported model's own, or `--dtype`) and the
tokenizer files, which `from_pretrained` loads offline. The tokenizer and the model's special-token
ids travel in the checkpoint's `tokenizer/` folder (training/checkpoint/tokenizer.py).
"""
from __future__ import annotations

import json
import logging
import os
import pickle

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megazoo.models import peft_format
from megazoo.models.lora import apply_lora
from megazoo.models.lora_targets import LoRASettings
from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import WORD_EMBEDDINGS
from megazoo.models.registry import FAMILIES, build_model, family
from megazoo.parallel.layout import ParallelConfig

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.hf_fp8 import dequantize, read_quantization
from megazoo.training.checkpoint.hf_mxfp4 import dequantize as dequantize_mxfp4
from megazoo.training.checkpoint.hf_releases import alias_config, is_wrapped, text_config, text_weights
from megazoo.training.checkpoint.tokenizer import TOKEN_IDS, copy_tokenizer, hf_token_record, read_record
from megazoo.training.checkpoint.tokenizer import tokenizer_dir as checkpoint_tokenizer_dir
from megazoo.training.checkpoint.tokenizer import write_record
from megazoo.training.checkpoint.layout_writer import write_layout
from megazoo.training.checkpoint.reshard import FullState, load_weights, read_full_state

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")


class ConversionError(ValueError):
    """A folder that cannot be converted; the message names the file and the fix."""


def read_hf_config(folder: str):
    """(model_type, family adapter, transformers config) of a folder's config.json; a
    multimodal release's text model or a remote-code alias read through its family
    (hf_releases.py)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{path} is missing; pass a Hugging Face model folder "
                              f"(save_pretrained output)")
    from transformers import AutoConfig
    try:
        raw = json.load(open(path))
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, OSError, AttributeError) as e:
        raise ConversionError(f"{path}: unreadable config ({e})") from None
    try:
        module = family(model_type, path).adapter
    except ValueError as e:
        module, unsupported = None, str(e)
        if "text_config" not in raw and alias_config(raw) is None:
            raise ConversionError(unsupported) from None
    try:
        quantized = read_quantization(folder)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    try:
        aliased = alias_config(raw) if module is None else None
        hf = aliased[1] if aliased else AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError) as e:
        raise ConversionError(f"{path}: unreadable config ({e})") from None
    if quantized is not None and hasattr(hf, "quantization_config"):
        del hf.quantization_config  # the weights are dequantized as they are read
    if module is None:
        found = aliased or text_config(hf, FAMILIES)
        if found is None:
            text = getattr(getattr(hf, "text_config", None), "model_type", None)
            raise ConversionError(unsupported if text is None else
                                  f"{unsupported} (a multimodal model whose language model, "
                                  f"{text!r}, is not a megazoo family either)")
        model_type, hf = found
        module = family(model_type, path).adapter
    return model_type, module, hf


def _weight_files(folder: str) -> list[str]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            try:
                files = sorted(set(json.load(open(path))["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ConversionError(f"{path}: not a weight index ({e})") from None
            return [os.path.join(folder, f) for f in files]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
    raise ConversionError(f"{folder}: no model.safetensors, pytorch_model.bin or *.index.json; "
                          f"pass a folder written by save_pretrained")


def read_hf_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's weight files; an FP8 release's dequantized (hf_fp8.py)."""
    sd = {}
    for path in _weight_files(folder):
        if not os.path.isfile(path):
            raise ConversionError(f"{path} is missing (named by the weight index); copy all shards")
        try:
            if path.endswith(".safetensors"):
                sd.update(load_file(path))
            else:  # weights_only: tensors and plain containers only, never arbitrary objects
                sd.update(torch.load(path, map_location="cpu", weights_only=True))
        except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError,
                ValueError) as e:
            raise ConversionError(f"{path}: corrupt, truncated or not a weights file "
                                  f"({str(e).splitlines()[0][:200]}); download it again") from None
    try:
        quantized = read_quantization(folder)
        if quantized is None:
            return sd
        if quantized["quant_method"] == "mxfp4":
            return dequantize_mxfp4(sd, folder)
        return dequantize(sd, quantized, folder)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def hf_to_full(folder: str, parsed: tuple | None = None) -> tuple[str, TransformerConfig, FullState]:
    """A Hugging Face folder as (family name, megazoo config, full fp32 tensors); `parsed` is
    read_hf_config's answer when the caller has it already."""
    model_type, module, hf = parsed or read_hf_config(folder)
    config = module.config_from_hf(hf)
    sd = read_hf_weights(folder)
    if is_wrapped(sd):
        sd = text_weights(sd, folder)
    config, record = _without_missing_depths(module, config, sd, folder)
    try:
        full = module.from_hf_state_dict(sd, config)
        if config.tie_word_embeddings and "lm_head.weight" in sd and \
                not torch.equal(sd["lm_head.weight"], full[WORD_EMBEDDINGS]):
            # transformers 5 unties such a model rather than drop the trained head; so do we
            logger.info("%s: config.json ties the embeddings but the weights hold a different "
                        "lm_head.weight; importing it untied (as transformers does)", folder)
            config = config.replace(tie_word_embeddings=False)
            full = module.from_hf_state_dict(sd, config)
    except KeyError as e:
        raise ConversionError(f"{folder}: the weights lack {e}; they do not match config.json "
                              f"({model_type}) or are incomplete") from None
    check_all_used(sd, full, module.to_hf_state_dict(full, config), f"{folder} ({model_type})")
    dtype = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32")
    meta = dict(consumed_samples=0, skipped_steps=0,
                hf_config={**hf_token_record(folder, hf), **record,
                           "dtype": dtype.removeprefix("torch.")})
    return model_type, config, FullState(meta, {k: v.float() for k, v in full.items()})


# meta.json's hf_config key: prediction depths config.json named without their weights
MTP_WITHOUT_WEIGHTS = "mtp_depths_without_weights"


def _without_missing_depths(adapter, config: TransformerConfig, sd: dict, folder: str):
    """(config, record): a folder whose config.json names multi-token prediction depths its
    weights lack (transformers saves DeepSeek-V3 so: it keeps num_nextn_predict_layers, drops the
    depths) imports as the main model without them, said once; the record lets export write the
    field back, so the folder round-trips unchanged."""
    present = getattr(adapter, "mtp_weights_present", None)
    if not config.mtp_num_layers or present is None or present(sd, config):
        return config, {}
    logger.warning("%s: config.json names %d multi-token prediction depth(s) (%s) but the weights "
                   "hold none (as transformers saves them); importing the model without them "
                   "(export writes %s back)", folder, config.mtp_num_layers, adapter.MTP_FIELD,
                   adapter.MTP_FIELD)
    return config.replace(mtp_num_layers=0), {MTP_WITHOUT_WEIGHTS: config.mtp_num_layers}


# Buffers some HF weight files carry that are no parameters (rotary frequencies, GPT-2's causal
# masks): recomputed by every model, never imported.
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _bare(name: str) -> str:
    """An HF tensor name without the base model's prefix (files are written with or without it)."""
    return name.removeprefix("model.").removeprefix("transformer.")


def check_all_used(sd: dict, full: dict, written: dict, where: str) -> None:
    """Refuse weights that hold more than config.json describes (a Llama config.json over Qwen2
    weights: the q/k/v biases would be dropped), naming the unused tensors. `written` is `full`
    mapped back to HF names (with the copies a file form holds twice: DeepSeek-V3's prediction
    depths' embedding and head); a tensor form other than the file one (transformers 5's fused
    experts) holds the same elements, so the element counts decide and the names explain."""
    params = {k: v for k, v in sd.items() if not k.endswith(_BUFFERS)}
    if "lm_head.weight" in params and "lm_head.weight" not in written:  # a tied copy, compared
        del params["lm_head.weight"]
    if sum(v.numel() for v in params.values()) > sum(v.numel() for v in written.values()):
        known = {_bare(w) for w in written}
        unused = sorted(k for k in params if _bare(k) not in known)
        raise ConversionError(f"{where}: the weights hold {len(unused)} tensor(s) config.json "
                              f"has no place for ({', '.join(unused[:4])}"
                              f"{', ...' if len(unused) > 4 else ''}); they belong to another "
                              f"model type: fix config.json")


def hf_model_config(folder: str) -> TransformerConfig:
    """The model a Hugging Face folder holds, from its config.json alone (unmodelled fields
    refused before any weight is read)."""
    parsed = read_hf_config(folder)
    return parsed[1].config_from_hf(parsed[2])


def save_tokenizer(folder: str, save: str, meta: dict) -> list:
    """Copy a Hugging Face folder's tokenizer files into checkpoint `save`'s tokenizer/ folder
    with the model's special-token ids (`meta`: hf_to_full's); returns the files copied."""
    copied = copy_tokenizer(folder, checkpoint_tokenizer_dir(save))
    record = {k: v for k, v in meta["hf_config"].items() if k != "dtype"}
    write_record(checkpoint_tokenizer_dir(save), {"tokenizer_type": "HuggingFaceTokenizer", **record}
                 if copied else record)
    return copied


def import_hf(folder: str, save: str, *, parallel: ParallelConfig | None = None, dp: int = 1,
              make_vocab_size_divisible_by: int | None = None, **sizes) -> str:
    """Convert a Hugging Face folder into a weights-only megazoo checkpoint for the layout
    `parallel` (or its `sizes`, e.g. tp=2; default: unsharded) x `dp`."""
    parallel = ParallelConfig.of(parallel, **sizes)
    parsed = read_hf_config(folder)
    config = parsed[1].config_from_hf(parsed[2])  # refuses unmodelled fields before weights are read
    # one line each (tp 0, vpp without pp, heads tp does not divide ...) before any work
    parallel.validate(parallel.tp * parallel.pp * parallel.cp * dp)
    config.check_layout(parallel)
    model_type, config, full = hf_to_full(folder, parsed)
    if make_vocab_size_divisible_by:
        config = config.replace(make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    out = write_layout(full, save, config=config, parallel=parallel, dp=dp, weights_only=True)
    copied = save_tokenizer(folder, save, full.meta)
    logger.info("imported %s (%s) into %s at %s; tokenizer files: %s", folder, model_type, out,
                parallel, copied or "none")
    return out


def checkpoint_config(folder: str) -> tuple[dict, TransformerConfig]:
    """(meta, config) of a checkpoint folder, with clear errors."""
    meta = ckpt.read_meta(folder)
    if "model" not in meta:
        raise ckpt.CheckpointError(f"{folder}/meta.json records no model; not a megazoo checkpoint")
    return meta, TransformerConfig.from_saved(meta["model"])


def load_model_chunks(folder: str, topo) -> tuple[TransformerConfig, list]:
    """This rank's model chunks for `topo` (eval mode), with a checkpoint's weights of any layout."""
    meta, config = checkpoint_config(folder)
    chunks = [build_model(config, topo, **spec.kwargs()).eval()
              for spec in topo.config.chunk_specs(config.num_layers, topo.pp_rank)]
    if meta.get("lora") is not None:  # the adapters too (a LoRA run's checkpoint)
        apply_lora(chunks, LoRASettings.from_record(meta["lora"]), config, topo, None, 0)
    load_weights(folder, chunks, topo)
    return config, chunks


def _valid_ids(value, vocab_size: int):
    """A token id (or list of ids) inside the vocabulary, else None."""
    ids = [v for v in (value if isinstance(value, list) else [value])
           if isinstance(v, int) and 0 <= v < vocab_size]
    if not ids:
        return None
    return ids if isinstance(value, list) else ids[0]


def check_complete(adapter, config: TransformerConfig, hf, weights: dict, sd: dict,
                   where: str) -> None:
    """Refuse an export that would lose part of the model: the HF config must read back as the
    same model (`TransformerConfig.computed_fields`) and the HF tensors must map back onto every megazoo tensor
    (`weights`: megazoo's full tensors, `sd`: the HF ones made of them). One line naming the
    field or the tensors."""
    back = adapter.config_from_hf(hf)
    want, got = config.computed_fields(), back.computed_fields()
    for name in want:
        if got.get(name) != want[name]:
            raise ConversionError(f"{where}: HF {type(hf).__name__} cannot record {name}="
                                  f"{want[name]!r} (it reads back {got.get(name)!r}); export "
                                  f"another family")
    try:
        lost = sorted(set(weights) - set(adapter.from_hf_state_dict(sd, back)))
    except KeyError as e:
        raise ConversionError(f"{where}: the HF tensors lack {e}; the adapter would write an "
                              f"incomplete model") from None
    if lost:
        raise ConversionError(f"{where}: HF {type(hf).__name__} has no place for {len(lost)} "
                              f"tensor(s) ({', '.join(lost[:4])}"
                              f"{', ...' if len(lost) > 4 else ''})")


def _split_lora(weights: dict, meta: dict, merge_lora: bool, adapter_dir: str | None,
                folder: str) -> dict:
    """The LoRA adapter tensors taken out of `weights` (empty without LoRA); a LoRA checkpoint
    needs --merge-lora or --lora-adapter-dir, and those need one."""
    lora = {k: weights.pop(k) for k in [k for k in weights if ".lora." in k]}
    if lora and not (merge_lora or adapter_dir):
        raise ConversionError(f"{folder} holds LoRA adapters: add --merge-lora (folded into the "
                              f"weights) or --lora-adapter-dir DIR (PEFT's adapter folder)")
    if (merge_lora or adapter_dir) and not lora:
        raise ConversionError(f"{folder} holds no LoRA adapters; drop --merge-lora / "
                              f"--lora-adapter-dir")
    if merge_lora and adapter_dir:
        raise ConversionError("--merge-lora and --lora-adapter-dir exclude each other: the merged "
                              "model already holds the adapters")
    if lora and meta.get("lora") is None:
        raise ConversionError(f"{folder}/meta.json records no LoRA settings for its adapters")
    return lora


def export_hf(load: str, save: str, *, tokenizer_dir: str | None = None,
              dtype: str | None = None, merge_lora: bool = False,
              adapter_dir: str | None = None) -> str:
    """Write a checkpoint (`--load` root or an iter_* folder) as a Hugging Face folder, in the
    checkpoint's dtype (an imported model's own) unless `dtype` is given. A LoRA checkpoint's
    adapters are folded in (`merge_lora`) or written in PEFT's format to `adapter_dir`."""
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not supported; choose one of {_DTYPES}")
    folder = ckpt.require_verified(ckpt.resolve(load))
    meta, config = checkpoint_config(folder)
    try:
        module = family(config.family, f"{folder}/meta.json").adapter
    except ValueError as e:
        raise ConversionError(f"{e}: it has no Hugging Face form") from None
    full = read_full_state(folder)  # the fp32 masters when present: the copy a resume continues
    weights = {**full.weights, **full.master}
    lora = _split_lora(weights, meta, merge_lora, adapter_dir, folder)
    hf = module.hf_config(config)
    sd = module.to_hf_state_dict(weights, config)
    check_complete(module, config, hf, weights, sd, f"{folder} as {config.family}")
    if lora and merge_lora:
        peft_format.merge_into(sd, meta["lora"], lora, config)
    # the model's special tokens, recorded at import and carried by the tokenizer folder
    recorded = {**(meta.get("hf_config") or {}), **read_record(checkpoint_tokenizer_dir(folder))}
    for k in TOKEN_IDS:  # ids outside the vocabulary are dropped
        setattr(hf, k, _valid_ids(recorded.get(k, getattr(hf, k, None)), config.vocab_size))
    if recorded.get(MTP_WITHOUT_WEIGHTS) and not config.mtp_num_layers:
        setattr(hf, module.MTP_FIELD, recorded[MTP_WITHOUT_WEIGHTS])  # as the imported folder said
    dtype = dtype or (meta.get("hf_config") or {}).get("dtype") or config.params_dtype
    hf.dtype = dtype
    os.makedirs(save, exist_ok=True)
    hf.save_pretrained(save)
    save_file({k: v.detach().to(getattr(torch, dtype)).clone().contiguous() for k, v in sd.items()},
              os.path.join(save, "model.safetensors"), metadata={"format": "pt"})
    ckpt.honour_umask(os.path.join(save, "model.safetensors"))
    tok_src = tokenizer_dir or checkpoint_tokenizer_dir(folder)
    copied = copy_tokenizer(tok_src, save)
    logger.info("exported %s to %s (%d tensors; tokenizer files: %s)", folder, save, len(sd),
                copied or "none")
    if lora and adapter_dir:
        peft_format.write_adapter(adapter_dir, meta["lora"], lora, config,
                                  getattr(torch, dtype), base=os.path.abspath(save))
        logger.info("LoRA adapters of %s written to %s (PEFT's format)", folder, adapter_dir)
    return save
