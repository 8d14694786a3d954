"""Tiny random-weight checkpoints (llama, qwen3, gemma3) with a small byte-level BPE tokenizer.

Everything is built offline in a few seconds, seeded, fp32, CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen3", "gemma3")

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "Question: what is 12 plus 30? Answer: 42.",
    "Write a haiku about GPUs. Silicon rivers, warm.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few lines; ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(arch: str, vocab_size: int, **overrides):
    """A 2-4 layer config of the given architecture."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)
    elif arch == "gemma3":
        common["num_hidden_layers"] = 4
        cfg = Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_hf_model(arch: str, vocab_size: int = 320, seed: int = 0, **overrides):
    """A random-weight AutoModelForCausalLM (fp32, eval). Weights scaled up so outputs are not near-uniform."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = make_config(arch, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(4.0)  # peaked next-token distributions, few near-ties
    return model


def make_target(
    arch: str = "llama",
    vocab_size: int = 320,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    row_invariant: bool = False,
    packed: bool = False,
    weights: str | None = None,
    activations: str = "int8",
    **overrides,
):
    """A TargetModel over a tiny random model with the tiny tokenizer (optionally bf16 + row-invariant, fp32 on
    byblock's packed GEMM as load_model sets it up, or with weights "int8" / "int4" on the quantized kernels,
    taking "int8" or "fp32" activations)."""
    from byblock.kernels.invariant import enable_row_invariance
    from byblock.models.adapter import TargetModel

    tok = make_tokenizer(vocab_size)
    model = make_hf_model(arch, len(tok), seed, **overrides).to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    if row_invariant:
        enable_row_invariance(model)
    if packed:
        from byblock.kernels.packed_gemm import load_kernel, pack_linears

        kernel = load_kernel()
        if kernel is None:
            import pytest

            pytest.skip("byblock's packed GEMM does not build here (no g++ or no AVX2)")
        pack_linears(model, kernel)
        from byblock.kernels.gqa_sdpa import enable_gqa_sdpa

        enable_gqa_sdpa(model)  # load_model's fp32 attention, and the one packed (batched) forwards split per sequence
    if weights is not None:
        from byblock.kernels.gqa_sdpa import enable_gqa_sdpa
        from byblock.kernels.quant_gemm import load_quant_kernel, quantize_linears

        kernel = load_quant_kernel(activations=activations)
        if kernel is None:
            import pytest

            pytest.skip("byblock's quantized GEMM does not build here (no g++ or no AVX2)")
        quantize_linears(model, {"int8": 8, "int4": 4}[weights], kernel)
        enable_gqa_sdpa(model)
    return TargetModel(model, tok, name=f"tiny-{arch}", weights=weights)


def save_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    """Write a tiny checkpoint directory (config, safetensors, tokenizer) that load_model can open."""
    target = make_target(arch, seed=seed)
    target.hf.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def make_dflash(target, block: int = 4, num_layers: int = 2, seed: int = 0):
    """A random DFlash drafter for a tiny target (norm weights perturbed so every norm path matters)."""
    from byblock.drafters.dflash_model import DFlashConfig, DFlashDraftModel

    n = target.num_layers
    cfg = DFlashConfig(
        hidden_size=target.hidden_size,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=block,
        mask_token_id=target.vocab_size - 1,
        target_layer_ids=(0, n - 1),
        num_target_layers=n,
        vocab_size=target.vocab_size,
        rope_theta=10_000.0,
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()


def make_diffusion_gemma(canvas: int = 8, seed: int = 0):
    """A tiny random DiffusionGemmaForBlockDiffusion (4 layers, hidden 64, vocab 320; MoE and vision tower tiny).

    The vision tower is always built (None would give the full-size default) and every layer carries an MoE
    branch, so both are configured small; full-attention layers get their own (small) head dim.
    """
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig

    text = DiffusionGemmaTextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=32,
        num_global_key_value_heads=1,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=64,
    )
    torch.manual_seed(seed)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas)
    return DiffusionGemmaForBlockDiffusion(cfg).eval()


def make_eagle3(target, draft_vocab: torch.Tensor | None = None, seed: int = 0, layer_ids: tuple[int, ...] = ()):
    """A random EAGLE-3 head for a tiny target (norm weights perturbed so every norm path matters)."""
    from byblock.drafters.eagle3_model import Eagle3Config, Eagle3DraftModel

    n = target.num_layers
    vocab = draft_vocab if draft_vocab is not None else torch.arange(target.vocab_size)
    cfg = Eagle3Config(
        hidden_size=target.hidden_size,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=target.vocab_size,
        draft_vocab_size=len(vocab),
        target_layer_ids=layer_ids or tuple(sorted({0, n // 2, n - 1})),
        num_target_layers=n,
        rope_theta=10_000.0,
    )
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    model.set_draft_vocab(vocab)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()
